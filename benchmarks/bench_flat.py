"""The flat scan against the walk: forward time of the public op and of its selection alone,
with the walk (``flat_leaves=0``) and with every leaf in a one-level pool (``flat_leaves``
past the length), each at shortlists of 64 and 128 leaves, beside dense SDPA in one process.

    python -m benchmarks.bench_flat [--sizes 32768 65536] [--json profiles/bench_flat.json]

Shape: B=1, Hq=32, Hkv=8, D=128, bf16, causal; the defaults otherwise (``min_seq_len`` 0).
GPU only.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pisa_compile import PisaConfig, pisa_attention
from pisa_compile.config import MAX_FLAT_LEAVES
from pisa_compile.ops import select_blocks

OPTIONS = {
    "walk_s64": dict(flat_leaves=0, shortlist=64),
    "walk_s128": dict(flat_leaves=0, shortlist=128),
    "flat_s64": dict(flat_leaves=MAX_FLAT_LEAVES, shortlist=64),
    "flat_s128": dict(flat_leaves=MAX_FLAT_LEAVES, shortlist=128),
}


def main(argv=None) -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[32768, 65536])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "shape": "B=1 Hq=32 Hkv=8 D=128 bf16 causal", "options": OPTIONS, "ms": {}}
    for n in args.sizes:
        q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
        cfgs = {name: PisaConfig(min_seq_len=0, **kw) for name, kw in OPTIONS.items()}
        row = {"dense": triton.testing.do_bench(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), warmup=50, rep=300)}
        for name, c in cfgs.items():
            row[name] = triton.testing.do_bench(lambda: pisa_attention(
                q, k, v, is_causal=True, enable_gqa=True, config=c), warmup=20, rep=300)
        for name, c in cfgs.items():
            row["select_" + name] = triton.testing.do_bench(lambda: select_blocks(
                q, k, is_causal=True, enable_gqa=True, config=c), warmup=10, rep=200)
        res["ms"][n] = row
        print(n, {key: round(ms, 2) for key, ms in row.items()}, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
