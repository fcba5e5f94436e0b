"""What PISA's quality options cost: forward and forward+backward time of the public op under
each option set of ``eval_llm.CANDIDATES``, against dense SDPA, side by side in one process.

    python -m benchmarks.bench_options [--sizes 16384 32768 65536]
        [--json profiles/bench_options.json]

Shape: B=1, Hq=32, Hkv=8, D=128, bf16, causal, block_size=64, top_k=16 (``bench_pisa.py``'s).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from benchmarks.bench_pisa import B, D, HKV, HQ, inputs
from benchmarks.eval_llm import CANDIDATES, candidate_config

from pisa_compile import pisa_attention

# The option sets of the real-model evaluation, so that quality and cost line up by name.
OPTIONS = CANDIDATES


def add_options_arg(ap: argparse.ArgumentParser, default: list) -> None:
    """``--options NAME ...``: option sets among ``eval_llm.CANDIDATES``; ``--key-mask``: also
    each set with an all-ones ``key_mask`` (what a tokenizer's ``attention_mask`` becomes)."""
    ap.add_argument("--options", nargs="*", default=default,
                    help=f"option sets among {list(OPTIONS)}")
    ap.add_argument("--key-mask", action="store_true",
                    help="also run each option set with an all-ones key_mask [B, N]")


def option_calls(ap: argparse.ArgumentParser, names: list, q, k, v,
                 key_mask: bool = False) -> dict:
    """Dense SDPA (its default backend, ``enable_gqa``) and ``pisa_attention`` under each
    option set in ``names`` (``min_seq_len`` 0), as callables by name; with ``key_mask``
    each set also as ``"NAME +key_mask"`` with an all-ones ``[B, N]`` key mask. An unknown
    name is a usage error."""
    unknown = [o for o in names if o not in OPTIONS]
    if unknown:
        ap.error(f"--options: unknown {unknown}; expected some of {list(OPTIONS)}")
    fns = {"dense SDPA (default backend)": lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True)}
    for name in names:
        cfg = candidate_config(name).replace(min_seq_len=0)
        fns[name] = lambda cfg=cfg: pisa_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                   config=cfg)
        if key_mask:
            ones = torch.ones(q.shape[0], k.shape[2], dtype=torch.bool, device=q.device)
            fns[f"{name} +key_mask"] = lambda cfg=cfg, m=ones: pisa_attention(
                q, k, v, is_causal=True, enable_gqa=True, config=cfg, key_mask=m)
    return fns


def main(argv=None) -> int:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[16384, 32768, 65536])
    add_options_arg(ap, list(OPTIONS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ms: dict = {}
    for n in args.sizes:
        q, k, v = inputs(n, grad=True)
        do = torch.randn_like(q)
        for name, f in option_calls(ap, args.options, q, k, v, args.key_mask).items():
            row = {}
            try:
                with torch.no_grad():
                    row["fwd_ms"] = triton.testing.do_bench(f, warmup=25, rep=200,
                                                            return_mode="median")
                row["fwd_bwd_ms"] = triton.testing.do_bench(
                    lambda: f().backward(do), warmup=10, rep=200, grad_to_none=[q, k, v],
                    return_mode="median")
            except Exception as e:  # report, keep the other rows
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            ms[f"N={n // 1024}K {name}"] = row
            print(f"N={n // 1024}K {name:55s} {row}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": dict(B=B, Hq=HQ, Hkv=HKV, D=D, dtype="bfloat16", causal=True),
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "options": {o: OPTIONS[o] for o in args.options}, "ms": ms,
                       "sdpa_backend_note": "SDPA picks its backend; with enable_gqa=True on "
                                            "bf16 CUDA that may not be FlashAttention"}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
