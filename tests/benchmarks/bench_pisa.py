"""End-to-end PISA (selection + attention, the public op) against dense SDPA, side by side.

The issue's setting: H200, bf16, B=1, Hq=32, Hkv=8, D=128, causal, block_size=64, top_k=16.
Dense baseline: SDPA with its default backend choice and ``enable_gqa=True`` (what a user
gets); FLASH forced (K/V expanded) beside it.

    make bench                                             # pytest-benchmark, all suites
    python tests/benchmarks/bench_pisa.py --json profiles/bench_pisa.json   # ratio table
"""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU benchmark: needs CUDA", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from pisa_compile import PisaConfig, pisa_attention, select_blocks  # noqa: E402

B, HQ, HKV, D = 1, 32, 8, 128
CFG = PisaConfig(block_size=64, top_k=16, query_tile=64, min_seq_len=0)


def inputs(n: int, grad: bool = False, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(B, h, n, D, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                               generator=g).requires_grad_(grad)
    return mk(HQ), mk(HKV), mk(HKV)


def run(impl: str, q, k, v):
    if impl == "pisa":
        return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=CFG)
    if impl == "pisa_select":
        return select_blocks(q, k, is_causal=True, enable_gqa=True, config=CFG)
    if impl == "sdpa_default":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if impl == "sdpa_flash":
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            k2, v2 = (t.repeat_interleave(HQ // HKV, 1) for t in (k, v))
            return F.scaled_dot_product_attention(q, k2, v2, is_causal=True)
    if impl == "flat_select":
        return flat_select(q, k)
    raise ValueError(impl)


def flat_select(q, k):
    """MoBA/NSA-style flat scoring: every query against every mean-pooled leaf, top-k."""
    C = CFG.block_size
    L = k.shape[2] // C
    mu = k.view(B, HKV, L, C, D).float().mean(3).to(q.dtype).repeat_interleave(HQ // HKV, 1)
    out = []
    for h in range(HQ):  # one head at a time, as a memory-aware implementation would
        s = q[:, h:h + 1] @ mu[:, h:h + 1].transpose(-1, -2)
        qb = torch.arange(q.shape[2], device=q.device) // C
        s = s.masked_fill(torch.arange(L, device=q.device)[None, :] > qb[:, None], float("-inf"))
        out.append(s.topk(CFG.top_k, -1).indices)
    return out


def step(impl: str, n: int, mode: str):
    q, k, v = inputs(n, grad=mode == "fwd_bwd")
    go = torch.randn(B, HQ, n, D, device="cuda", dtype=torch.bfloat16)

    def f():
        out = run(impl, q, k, v)
        if mode == "fwd_bwd":
            torch.autograd.grad(out, (q, k, v), go)
    return f


CASES = ([(i, n, "fwd") for n in (8192, 32768, 65536, 131072)
          for i in ("pisa", "sdpa_default", "sdpa_flash")]
         + [(i, n, "fwd_bwd") for n in (8192, 32768, 65536)
            for i in ("pisa", "sdpa_default", "sdpa_flash")]
         + [(i, n, "fwd") for n in (131072, 262144) for i in ("pisa_select", "flat_select")])


@pytest.mark.parametrize("impl, n, mode", CASES)
def test_pisa_vs_dense(benchmark, impl, n, mode):
    f = step(impl, n, mode)
    f()

    def timed():
        f()
        torch.cuda.synchronize()
    benchmark.pedantic(timed, rounds=5, warmup_rounds=1)


def main(argv=None) -> int:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ms = {}
    for impl, n, mode in CASES:
        f = step(impl, n, mode)
        ms[f"{impl} {mode} N={n // 1024}K"] = triton.testing.do_bench(
            f, warmup=50, rep=300, return_mode="median")
        torch.cuda.empty_cache()
        print(f"{impl:13s} {mode:8s} N={n // 1024:4d}K  {ms[f'{impl} {mode} N={n // 1024}K']:9.3f} ms",
              flush=True)
    g = lambda i, m, n: ms[f"{i} {m} N={n}K"]  # noqa: E731
    ratios = {
        "pisa_fwd / dense_fwd @128K (target <= 1/25 = 0.04)":
            g("pisa", "fwd", 128) / g("sdpa_default", "fwd", 128),
        "selection / pisa_fwd @128K (target <= 0.20)":
            g("pisa_select", "fwd", 128) / g("pisa", "fwd", 128),
        "selection 256K / 128K (target <= 2.3)":
            g("pisa_select", "fwd", 256) / g("pisa_select", "fwd", 128),
        "flat / selection @128K (target >= 10)":
            g("flat_select", "fwd", 128) / g("pisa_select", "fwd", 128),
        "pisa_fwd_bwd / dense_fwd_bwd @64K (target <= 1/8 = 0.125)":
            g("pisa", "fwd_bwd", 64) / g("sdpa_default", "fwd_bwd", 64),
    }
    for k_, v_ in ratios.items():
        print(f"{k_}: {v_:.4f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "setting": "bf16 B=1 Hq=32 Hkv=8 D=128 causal block_size=64 top_k=16 "
                                  "query_tile=64; median ms (triton.testing.do_bench)",
                       "median_ms": ms, "ratios": ratios}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
