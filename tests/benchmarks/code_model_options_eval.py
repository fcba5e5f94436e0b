"""GPU: the shipped PISA code model evaluated under wider exact-leaf beams than it trained with,
and with dense attention, side by side (bits per byte and planted retrieval).

    PYTHONPATH=. python3 tests/benchmarks/code_model_options_eval.py OUT.json

Each row adds its options to the checkpoint's own (``model.pisa_options``); ``dense`` runs the
same weights with Inductor's dense attention. Bits per byte over 8 held-out windows of 16K
bytes spread over 1 MiB; retrieval at 4K, 8K and 16K, 10 examples per cell.
"""

import json
import sys

from pisa_compile import PisaConfig
from pisa_compile import code_model as cm



def main(path: str) -> int:
    model = cm.load_checkpoint(device="cuda")
    k = PisaConfig.from_options(model.pisa_options).top_k
    rows = [("trained options", {}), ("beam=2k", {"beam": 2 * k}), ("beam=4k", {"beam": 4 * k}),
            ("dense", None)]
    held = cm.load_bytes("heldout", 64 * 16384 + 1)  # 8 windows, far apart
    out = {}
    for name, extra in rows:
        try:
            r = cm.evaluate(model, "dense" if extra is None else "pisa", held, 16384, 8,
                            [4096, 8192, 16384], 10, "cuda",
                            {**model.pisa_options, **(extra or {})})
            out[name] = r
            print(name, json.dumps(r), flush=True)
        except Exception as e:  # report, keep the other rows
            print(name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
