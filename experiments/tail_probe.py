"""What the dense tail costs (GPU): the tail's dense call on its own, in the ways it could be
computed, and the public op with and without a tail, side by side in one process.

    PYTHONPATH=. python -m experiments.tail_probe [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def main(argv=None) -> int:
    import triton.testing
    from torch.nn.attention.bias import causal_lower_right

    from pisa_compile import PisaConfig, pisa_attention
    from pisa_compile.ops import _dense

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    bench = lambda f: triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median")  # noqa: E731
    rows = {}
    for name, (hq, hkv, d) in {"qwen": (14, 2, 64), "standard": (32, 8, 128)}.items():
        for n in (8192, 30000, 65536):
            g = torch.Generator(device="cuda").manual_seed(0)
            mk = lambda h: torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                       generator=g)
            q, k, v = mk(hq), mk(hkv), mk(hkv)
            T = 80
            qt = q[:, :, n - T:]
            km = torch.ones(1, n, dtype=torch.bool, device="cuda")
            fns = {
                "tail _dense, no key mask": lambda: _dense(qt, k, v, None, None, True, n - T, None,
                                                     d ** -0.5, True),
                "tail _dense, key mask": lambda: _dense(qt, k, v, None, km, True, n - T, None,
                                                         d ** -0.5, True),
                "tail sdpa no mask (floor)": lambda: F.scaled_dot_product_attention(
                    qt, k, v, enable_gqa=True),
                "tail causal_lower_right": lambda: F.scaled_dot_product_attention(
                    qt, k, v, attn_mask=causal_lower_right(T, n), enable_gqa=True),
            }
            cfg = PisaConfig(min_seq_len=0)
            for tail in (0, 64):
                c = cfg.replace(dense_tail=tail)
                fns[f"op dense_tail={tail}"] = lambda c=c: pisa_attention(
                    q, k, v, is_causal=True, enable_gqa=True, config=c)
            for key, f in fns.items():
                try:
                    ms = bench(f)
                except Exception as e:  # report, keep the other rows
                    ms = f"{type(e).__name__}: {str(e)[:160]}"
                rows[f"{name} N={n} {key}"] = ms
                print(f"{name} N={n} {key:30s} {ms}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "ms": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
