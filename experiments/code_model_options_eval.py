"""GPU: the shipped PISA code model evaluated under wider exact-leaf beams than it trained with,
and with dense attention, side by side (bits per byte and planted retrieval).

    python -m experiments.code_model_options_eval OUT.json

Each row adds its options to the checkpoint's own (``model.pisa_options``); ``dense`` runs the
same weights with Inductor's dense attention. Bits per byte over 8 held-out windows of 16K
bytes spread over 1 MiB; retrieval at 4K, 8K and 16K, 10 examples per cell
(``code_model_sweep.evaluate_options``).
"""

import json
import sys

from pisa_compile import PisaConfig
from experiments import code_model as cm
from experiments.code_model_sweep import evaluate_options


def main(path: str) -> int:
    model = cm.load_checkpoint(device="cuda")
    base = model.pisa_options
    k = PisaConfig.from_options(base).top_k
    rows = {"trained options": base, "beam=2k": {**base, "beam": 2 * k},
            "beam=4k": {**base, "beam": 4 * k}, "dense": None}
    held = cm.load_bytes("heldout", 64 * 16384 + 1)  # 8 windows, far apart
    out: dict = {}

    def write():
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
    evaluate_options(model, rows, held, 16384, [4096, 8192, 16384], "cuda",
                     lambda m: print(m, flush=True), out, on_row=write)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
