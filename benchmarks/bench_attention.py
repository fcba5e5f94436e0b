"""PISA block-sparse attention vs SDPA on one GPU (pytest-benchmark; skipped without CUDA).

The standard shape: bf16, B=1, Hq=32, Hkv=8, D=128, causal, block_size=64, top_k=16 (plus
1 sink and the local leaves: 20 leaves per 64-query tile), N = 8K..128K. Compared side by side
in one process: PISA's Triton attention kernels (forward; forward + backward), SDPA with the
default backend choice and ``enable_gqa=True``, and SDPA forced to the FLASH backend.

What is timed for PISA is the attention itself over a fixed, synthetic PISA-shaped selection
(sink + local + ``top_k`` random earlier leaves per tile); block selection is the selection
kernels' benchmark.

    python -m pytest benchmarks/bench_attention.py --benchmark-enable --benchmark-json=out.json
    python -m benchmarks.bench_attention --json profiles/attention_gpu.json  # do_bench table
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU benchmark: needs CUDA", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from pisa_compile import PisaConfig  # noqa: E402
from pisa_compile.kernels import triton_attention as ta  # noqa: E402
from pisa_compile.kernels.geometry import block_width  # noqa: E402
from tests.selections import synthetic_selection  # noqa: E402

B, HQ, HKV, D = 1, 32, 8, 128
CFG = PisaConfig.preset("fast", min_seq_len=0)
SHAPE = dict(block_size=CFG.block_size, query_tile=CFG.query_tile)
N_LIST = [8192, 32768, 65536, 131072]
IMPLS = ["pisa", "sdpa_default", "sdpa_flash"]
MODES = ["fwd", "fwd_bwd"]


_CACHE: dict = {}


def problem(N):
    if N not in _CACHE:
        _CACHE.clear()
        torch.cuda.empty_cache()
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, HQ, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, HKV, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, HKV, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
        go = torch.randn_like(q)
        _CACHE[N] = (q, k, v, go) + synthetic_selection(B, HKV, N, N, CFG)
    return _CACHE[N]


def make_fn(impl, N, mode):
    """A zero-argument callable that runs one step (no sync)."""
    q, k, v, go, bi, bc = problem(N)
    scale = D ** -0.5
    if impl == "pisa":
        def fwd():
            return ta.sparse_attention(q, k, v, None, True, scale, bi, bc, **SHAPE)
        if mode == "fwd":
            return fwd

        def fwd_bwd():
            o, lse = fwd()
            return ta.sparse_attention_backward(go, q, k, v, None, o, lse, bi, bc, True, scale,
                                                **SHAPE)
        return fwd_bwd
    backends = None if impl == "sdpa_default" else [SDPBackend.FLASH_ATTENTION]
    qg, kg, vg = (x.detach().requires_grad_(mode == "fwd_bwd") for x in (q, k, v))

    def sdpa():
        if backends is None:
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
        else:
            with sdpa_kernel(backends):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
        if mode == "fwd_bwd":
            o.backward(go)
        return o
    if mode == "fwd":
        def sdpa_fwd():
            with torch.no_grad():
                return sdpa()
        return sdpa_fwd
    return sdpa


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("N", N_LIST, ids=lambda n: f"N{n // 1024}K")
@pytest.mark.parametrize("impl", IMPLS)
def test_attention_speed(benchmark, impl, N, mode):
    benchmark.group = f"{mode} N={N // 1024}K"
    benchmark.extra_info.update(impl=impl, N=N, mode=mode, dtype="bf16", B=B, Hq=HQ, Hkv=HKV, D=D,
                                block_size=CFG.block_size, top_k=CFG.top_k,
                                query_tile=CFG.query_tile)
    try:
        fn = make_fn(impl, N, mode)
        fn()
        torch.cuda.synchronize()
    except (RuntimeError, torch.OutOfMemoryError) as e:  # e.g. a backend that refuses GQA
        pytest.skip(f"{impl} unavailable here: {str(e).splitlines()[0]}")

    def step():
        fn()
        torch.cuda.synchronize()

    rounds = 20 if N <= 32768 else 5
    benchmark.pedantic(step, rounds=rounds, warmup_rounds=2, iterations=1)


def _do_bench_table(path):
    """Median ms of every (impl, N, mode) with ``triton.testing.do_bench``, as JSON."""
    import triton
    rows = []
    for N in N_LIST:
        for mode in MODES:
            for impl in IMPLS:
                try:
                    fn = make_fn(impl, N, mode)
                    ms = triton.testing.do_bench(fn, warmup=50, rep=300)
                except (RuntimeError, torch.OutOfMemoryError) as e:
                    ms = None
                    print(f"{impl} {N} {mode}: {str(e).splitlines()[0]}", file=sys.stderr)
                rows.append(dict(impl=impl, N=N, mode=mode, ms=ms))
                print(f"N={N:6d} {mode:8s} {impl:13s} {ms}", flush=True)
    out = dict(command=" ".join(sys.argv), device=torch.cuda.get_device_name(),
               torch=torch.__version__, setting=dict(dtype="bf16", B=B, Hq=HQ, Hkv=HKV, D=D,
               causal=True, block_size=CFG.block_size, top_k=CFG.top_k,
               query_tile=CFG.query_tile, blocks_per_tile=block_width(8192, CFG.block_size,
                                                                      CFG.top_k, CFG.sink_blocks,
                                                          CFG.local_blocks, CFG.query_tile),
               selection="synthetic (attention only)"), results=rows)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    _do_bench_table(sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv
                    else "attention_gpu.json")
