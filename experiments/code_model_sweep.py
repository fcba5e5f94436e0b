"""GPU: which PISA options keep a dense-trained code model's quality, then train with the best.

    python -m experiments.code_model_sweep --steps 4000 --out DIR

1. Trains the code model with dense attention (``--steps``; seed, data and schedule of
   ``python -m experiments.code_model``) and evaluates it: held-out bits per byte and planted
   retrieval.
2. Evaluates that same dense-trained model with PISA attention under each candidate option set
   (bits per byte on 8 held-out windows, retrieval at 4K-16K): the options that lose least
   against dense are the ones whose selection keeps the context the model uses.
3. Trains with PISA under the options of lowest bits per byte (same steps) and evaluates it.

Writes ``DIR/code_model.json`` (the ``experiments.code_model`` format, plus ``sweep``) and the PISA
checkpoint ``DIR/code_model_pisa.pt``.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from experiments import code_model as cm

# Options over the "fast" preset (the defaults these runs were made with).
CANDIDATES = {
    "default": {"preset": "fast"},
    "local_blocks=8": {"preset": "fast", "local_blocks": 8},
    "exact leaves": {"preset": "fast", "leaf_scoring": "exact"},
    "query_tile=16": {"preset": "fast", "query_tile": 16},
    "local_blocks=8, exact, query_tile=16": {"preset": "fast", "local_blocks": 8,
                                             "leaf_scoring": "exact", "query_tile": 16},
    "block 32, top_k 32, local_blocks=16": {"preset": "fast", "block_size": 32, "top_k": 32,
                                            "local_blocks": 16},
}
def evaluate_options(model, candidates: dict, held, length: int, lengths: list, device: str,
                     log, rows: dict, on_row=lambda: None, budget: Optional[float] = None) -> dict:
    """``cm.evaluate`` of ``model`` under each named option set (``None``: dense attention):
    bits per byte on 8 windows of ``length`` bytes, retrieval at ``lengths`` with 10 per cell.
    Each result (options included) goes into ``rows[name]``, then ``on_row()`` runs; a failing
    set is recorded as an error, not raised; past ``budget`` seconds the rest are skipped."""
    t0 = time.perf_counter()
    for name, options in candidates.items():
        if budget is not None and time.perf_counter() - t0 > budget:
            log(f"sweep: out of time, {name} skipped")
            continue
        try:
            r = cm.evaluate(model, "dense" if options is None else "pisa", held, length, 8,
                            lengths, 10, device, options)
        except Exception as e:  # one broken candidate must not lose the run
            rows[name] = dict(options=options, error=repr(e))
            log(f"sweep {name}: failed: {e!r}")
            continue
        r["options"] = options
        rows[name] = r
        log(f"sweep {name}: bpb {r['bits_per_byte']:.4f} {r['retrieval']}")
        on_row()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--eval-lengths", default="4096,8192,16384,32768")
    ap.add_argument("--sweep-budget", type=float, default=150.0,
                    help="seconds after which the remaining candidates are skipped")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.eval_lengths.split(",")]
    dev = args.device
    train = cm.load_bytes("train", 64 << 20)
    held = cm.load_bytes("heldout", 32 * args.length + 1)
    result = dict(config=vars(cm.CodeModelConfig()), runs={}, sweep={},
                  torch=torch.__version__,
                  device=torch.cuda.get_device_name() if dev == "cuda" else dev,
                  command=" ".join(sys.argv))
    path = args.out / "code_model.json"

    def log(msg):
        print(msg, flush=True)

    def run(attention, options):
        t0 = time.perf_counter()
        model, rec = cm.train(attention, train, args.steps, None, args.length, 2, 2e-3, 0,
                              dev, log=log, options=options)
        rec["train_wall_s"] = time.perf_counter() - t0
        rec["options"] = options
        rec["n_params"] = sum(p.numel() for p in model.parameters())
        model.eval()
        result["runs"][attention] = rec
        path.write_text(json.dumps(result, indent=1))
        if attention == "pisa":  # before the evaluation: a timeout then loses only that
            cm.save_checkpoint(model, args.out / "code_model_pisa.pt", options)
        rec.update(cm.evaluate(model, attention, held, args.length, 32, lengths, 20, dev,
                               options))
        log(f"{attention} {options}: bpb {rec['bits_per_byte']:.4f} {rec['retrieval']}")
        result["runs"][attention] = rec
        path.write_text(json.dumps(result, indent=1))
        return model

    dense = run("dense", None)
    evaluate_options(dense, CANDIDATES, held, args.length, lengths[:3], dev, log,
                     result["sweep"], on_row=lambda: path.write_text(json.dumps(result, indent=1)),
                     budget=args.sweep_budget)
    best = min((n for n in result["sweep"] if "bits_per_byte" in result["sweep"][n]),
               key=lambda n: result["sweep"][n]["bits_per_byte"])
    result["chosen"] = best
    log(f"chosen: {best}")
    run("pisa", CANDIDATES[best])
    return 0


if __name__ == "__main__":
    sys.exit(main())
