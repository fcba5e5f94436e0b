"""The calls users make, with masks, on a Llama-3.2-1B-shaped 4-layer stack (issue #14).

bf16, random init, hidden 2048, 32 query / 8 KV heads of 64, SwiGLU 8192. Side by side in
one process: ``torch.compile(backend="pisa")`` against ``torch.compile()`` (Inductor, dense
SDPA), for ``model(ids)`` and ``model(ids, attention_mask=...)``; forward ms (median of
``--reps`` after a warm-up), peak memory, and how many reference stages the PISA graphs
planned (``counters["pisa"]["reference_*"]``, must be 0).

    python -m benchmarks.bench_masks --json profiles/bench_masks.json
"""

from __future__ import annotations

import argparse
import json

import torch


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=140000)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def _time(f, reps):
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--reps", type=int, default=3, help="timed repeats per call")
    ap.add_argument("--lengths", default="32768", help="comma-separated sequence lengths")
    args = ap.parse_args(argv)
    from torch._dynamo.utils import counters
    model = _model()
    body = model.model  # hidden states: the LM head's logits would dominate memory
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(0, 32000, (1, n), device="cuda")
        ones = torch.ones(1, n, dtype=torch.long, device="cuda")
        for backend in ("pisa", "inductor"):
            torch._dynamo.reset()
            counters.clear()
            from pisa_compile.backend import pisa_backend  # works without the entry point
            f = torch.compile(body, backend=pisa_backend if backend == "pisa" else "inductor")
            for call, kw in (("model(ids)", {}), ("model(ids, attention_mask=ones)",
                                                  dict(attention_mask=ones))):
                with torch.no_grad():
                    torch.cuda.reset_peak_memory_stats()
                    ms = _time(lambda: f(ids, **kw), args.reps)
                    peak = torch.cuda.max_memory_allocated() / 2**30
                rows.append(dict(n=n, backend=backend, call=call, ms=round(ms, 2),
                                 peak_gib=round(peak, 2),
                                 reference_stages=int(sum(v for k, v in counters["pisa"].items()
                                                          if k.startswith("reference_")))))
                print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
