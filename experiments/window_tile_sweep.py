"""Sweep the Triton attention kernel's launch tiles on the sliding-window path (issue #14):
a Mistral-shaped call (bf16, Hq=32, Hkv=8, window 4096, 32K, an all-ones key mask, which is
what ``attention_mask=ones`` becomes) at head dims 64 and 128, forward only, beside
FlexAttention over the same window (the path a call without a key mask takes).

``ATTENTION_TILES`` was swept at head dim 128; at 64 the window forward took 18.2 ms over 4
layers against FlexAttention's 12.5 (``profiles/bench_masks_window_kernels.json``).

    PYTHONPATH=. python -m experiments.window_tile_sweep --json $OUT/window_tiles.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.n < 1 or args.window < 1:
        p.error("--n and --window must be >= 1")
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    from triton.testing import do_bench

    from pisa_compile.kernels.triton_attention import ATTENTION_TILES, sparse_attention
    from pisa_compile.kernels.window import WINDOW_QUERY_TILE, window_attention, window_blocks

    n, w = args.n, args.window
    rows = []
    for D in args.dims:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, h, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (32, 8, 8))
        km = torch.ones(1, n, dtype=torch.bool, device="cuda")
        bi, bc = window_blocks(n, n, w, 0, 64, WINDOW_QUERY_TILE, q.device)
        bi = bi.expand(1, 8, *bi.shape)
        bc = bc.expand(1, 8, *bc.shape)

        def triton_call(tuning):
            return sparse_attention(q, k, v, None, True, D ** -0.5, bi, bc, block_size=64,
                                    query_tile=WINDOW_QUERY_TILE, key_mask=km, window=w,
                                    tuning=tuning)[0]

        flex = window_attention(q, k, v, window=w, causal_offset=0, key_mask=None,
                                scale=D ** -0.5, enable_gqa=True)
        flex_ms = do_bench(lambda: window_attention(q, k, v, window=w, causal_offset=0,
                                                    key_mask=None, scale=D ** -0.5,
                                                    enable_gqa=True))
        rows.append(dict(D=D, path="flex (no key mask)", ms=round(flex_ms, 4)))
        print(rows[-1], flush=True)
        base = triton_call(None)
        rows.append(dict(D=D, path="triton, ATTENTION_TILES['half']",
                         tiles=ATTENTION_TILES["half"],
                         ms=round(do_bench(lambda: triton_call(None)), 4),
                         max_abs_vs_flex=(base.float() - flex.float()).abs().max().item()))
        print(rows[-1], flush=True)
        for bm, bn, nw, ns in itertools.product((64, 128), (32, 64), (4, 8), (2, 3)):
            tuning = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
            try:
                out = triton_call(tuning)
                ms = do_bench(lambda: triton_call(tuning))
                err = (out.float() - base.float()).abs().max().item()
            except Exception as e:  # out of shared memory or registers: record and go on
                rows.append(dict(D=D, path="triton", tiles=tuning, error=str(e)[:200]))
                print(rows[-1], flush=True)
                continue
            rows.append(dict(D=D, path="triton", tiles=tuning, ms=round(ms, 4),
                             max_abs_vs_default=err))
            print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           n=n, window=w, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
