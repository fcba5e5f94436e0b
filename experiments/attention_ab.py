"""The Triton attention forward against a baseline copy of its module, side by side in one
process (GPU experiment, not part of the package).

The calls whose speed issue #14 measures, at the op level (bf16, H200): the sliding-window path
of a Mistral-shaped layer (32K, window 4096, head dim 64) with an all-ones key mask (what
``attention_mask=ones`` becomes) and without; the ``"fast"`` preset's blocks at 16K, batch 4,
with left padding of 0/1K/3K/7K (Llama-1B-shaped: 32 query / 8 KV heads of 64); and the
defaults' blocks on the standard shape at 32K (32 / 8 heads of 128) with an all-ones key mask
and without. Each call is timed for both modules (``triton.testing.do_bench``, medians),
alternating, and their outputs are diffed.

    git show REV:pisa_compile/kernels/triton_attention.py > /tmp/attention_base.py
    PYTHONPATH=. python -m experiments.attention_ab --baseline /tmp/attention_base.py \\
        --json $OUT/attention_ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch


def _load(path: str):
    # Named inside the package, so the copy's relative imports resolve to the package's.
    spec = importlib.util.spec_from_file_location("pisa_compile.kernels._ab_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cases(dev):
    from pisa_compile import PisaConfig
    from pisa_compile.kernels import triton_select as ts
    from pisa_compile.kernels.window import WINDOW_QUERY_TILE, window_blocks

    g = torch.Generator(device=dev).manual_seed(0)

    def qkv(B, Hq, Hkv, n, D):
        return tuple(torch.randn(B, h, n, D, device=dev, dtype=torch.bfloat16, generator=g)
                     for h in (Hq, Hkv, Hkv))

    n, w = 32768, 4096
    q, k, v = qkv(1, 32, 8, n, 64)
    bi, bc = window_blocks(n, n, w, 0, 64, WINDOW_QUERY_TILE, q.device)
    bi, bc = bi.expand(1, 8, *bi.shape), bc.expand(1, 8, *bc.shape)
    ones = torch.ones(1, n, dtype=torch.bool, device=dev)
    win = dict(block_size=64, query_tile=WINDOW_QUERY_TILE, window=w)
    yield "window 4096, 32K, D=64, key mask ones", (q, k, v, bi, bc), dict(win, key_mask=ones)
    yield "window 4096, 32K, D=64, no key mask", (q, k, v, bi, bc), dict(win)
    q, k, v = qkv(2, 32, 8, n, 64)
    km = torch.ones(2, n, dtype=torch.bool, device=dev)
    km[1, :3072] = False  # left padding: row 1's first windows hold masked keys
    yield ("window 4096, 32K, B=2, D=64, left padding 0/3K", (q, k, v, bi.expand(2, -1, -1, -1),
           bc.expand(2, -1, -1)), dict(win, key_mask=km))

    n, B = 16384, 4
    q, k, v = qkv(B, 32, 8, n, 64)
    km = torch.ones(B, n, dtype=torch.bool, device=dev)
    for b, pad in enumerate((0, 1024, 3072, 7168)):
        km[b, :pad] = False
    cfg = PisaConfig.preset("fast")
    bi, bc = ts.select_blocks(q, k, True, 0.125, **cfg.selection_options(), key_mask=km)
    yield ("fast preset, 16K, B=4, left padding 0/1K/3K/7K", (q, k, v, bi, bc),
           dict(cfg.attention_options(), key_mask=km))

    n = 32768
    q, k, v = qkv(1, 32, 8, n, 128)
    cfg = PisaConfig()
    bi, bc = ts.select_blocks(q, k, True, 128 ** -0.5, **cfg.selection_options())
    ones = torch.ones(1, n, dtype=torch.bool, device=dev)
    yield ("defaults' blocks, 32K, D=128, key mask ones", (q, k, v, bi, bc),
           dict(cfg.attention_options(), key_mask=ones))
    yield ("defaults' blocks, 32K, D=128, no key mask", (q, k, v, bi, bc),
           dict(cfg.attention_options()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a copy of triton_attention.py")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    from triton.testing import do_bench

    from pisa_compile.kernels import triton_attention as new

    old = _load(args.baseline)
    rows = []
    for name, (q, k, v, bi, bc), kw in _cases("cuda"):
        scale = q.shape[-1] ** -0.5

        def call(mod):
            return mod.sparse_attention(q, k, v, None, True, scale, bi, bc, **kw)[0]

        out_new, out_old = call(new), call(old)
        ms = {"baseline": [], "new": []}
        for _ in range(3):  # alternate, so drift hits both alike
            ms["baseline"].append(do_bench(lambda: call(old)))
            ms["new"].append(do_bench(lambda: call(new)))
        row = dict(case=name, **{key: round(sorted(x)[1], 4) for key, x in ms.items()},
                   max_abs_diff=(out_new.float() - out_old.float()).abs().max().item())
        row["speedup"] = round(row["baseline"] / row["new"], 3)
        rows.append(row)
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
