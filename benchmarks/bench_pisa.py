"""End-to-end PISA (selection + attention, the public op) against dense SDPA, side by side.

The standard shape: H200, bf16, B=1, Hq=32, Hkv=8, D=128, causal, block_size=64, top_k=16.
Dense baseline: SDPA with its default backend choice and ``enable_gqa=True`` (what a user
gets); FLASH forced (K/V expanded) beside it.

    make bench                                             # pytest-benchmark, all suites
    python -m benchmarks.bench_pisa --json profiles/bench_pisa.json   # ratio table
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
CFG = PisaConfig.preset("fast", min_seq_len=0)


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


# -- the same selection through PISA's attention kernel and through FlexAttention ----------

def selection_problem(n: int):
    """Inputs and PISA's own selection for them (``block_indices``, ``block_counts``)."""
    q, k, v = inputs(n)
    bi, bc = select_blocks(q, k, is_causal=True, enable_gqa=True, config=CFG)
    return q, k, v, bi, bc


def pisa_attention_only(q, k, v, bi, bc):
    from pisa_compile.kernels import triton_attention as ta
    return lambda: ta.sparse_attention(q, k, v, None, True, D ** -0.5, bi, bc,
                                       block_size=CFG.block_size, query_tile=CFG.query_tile)


def computed_flops(bi, bc) -> float:
    """FLOPs of the blocks PISA computes: 4 * D per (query row, key) of every chosen block
    (diagonal blocks counted in full: the kernel computes them, then masks)."""
    rows = CFG.query_tile * (HQ // HKV)
    return 4.0 * D * rows * CFG.block_size * bc.sum().item()


def flex_block_mask(bi, bc, n: int):
    """PISA's selection as a FlexAttention ``BlockMask`` (64 x 64 blocks, per query head):
    blocks left of the diagonal are full, the diagonal block is causal (``mask_mod``)."""
    from torch.nn.attention.flex_attention import BlockMask
    assert CFG.block_size == CFG.query_tile
    G = HQ // HKV
    t = torch.arange(bi.shape[2], device=bi.device, dtype=bi.dtype)[:, None]
    valid = torch.arange(bi.shape[3], device=bi.device)[None, :] < bc[..., None]
    diag = ((bi == t) & valid).any(-1)
    full_counts = (bc - diag.int()).to(torch.int32)
    full_idx = torch.where(valid & (bi != t), bi, 0).to(torch.int32)
    part_counts = diag.int().to(torch.int32)
    part_idx = t.expand(*bi.shape[:3], 1).to(torch.int32)
    n_blocks = n // CFG.block_size  # Flex wants index rows as wide as the key-block count
    widen = lambda x: F.pad(x, (0, n_blocks - x.shape[-1]))  # noqa: E731
    rep = lambda x: x.repeat_interleave(G, 1).contiguous()  # noqa: E731
    full_idx, part_idx = widen(full_idx), widen(part_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return BlockMask.from_kv_blocks(rep(part_counts), rep(part_idx), rep(full_counts),
                                    rep(full_idx), BLOCK_SIZE=CFG.block_size, mask_mod=causal,
                                    seq_lengths=(n, n))


_FLEX = None


def flex_fn(q, k, v, block_mask):
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX = torch.compile(flex_attention, fullgraph=True)
    # 64 x 64 kernel tiles: Flex's tiles must divide the block mask's 64-key blocks.
    return lambda: _FLEX(q, k, v, block_mask=block_mask, enable_gqa=True,
                         kernel_options=dict(BLOCK_M=64, BLOCK_N=64))


def decode_fns(n: int, batch: int = 8):
    """One query per sequence over an ``n``-token cache: PISA (selection + split-K decode)
    and SDPA default."""
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(batch, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    return (lambda: pisa_attention(q, k, v, enable_gqa=True, config=CFG),
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def peak_extra_mib(fn) -> float:
    """Peak memory allocated while ``fn`` runs, above what was allocated before (MiB)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


CASES = ([(i, n, "fwd") for n in (8192, 32768, 65536, 131072)
          for i in ("pisa", "sdpa_default", "sdpa_flash")]
         + [(i, n, "fwd_bwd") for n in (8192, 32768, 65536)
            for i in ("pisa", "sdpa_default", "sdpa_flash")]
         + [(i, n, "fwd") for n in (8192, 32768, 65536, 131072, 262144)
            for i in ("pisa_select", "flat_select")])


@pytest.mark.parametrize("impl, n, mode", CASES)
def test_pisa_vs_dense(benchmark, impl, n, mode):
    f = step(impl, n, mode)
    f()

    def timed():
        f()
        torch.cuda.synchronize()
    benchmark.pedantic(timed, rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("impl", ["pisa_attention", "flex"])
def test_same_selection_vs_flex(benchmark, impl):
    q, k, v, bi, bc = selection_problem(131072)
    f = pisa_attention_only(q, k, v, bi, bc) if impl == "pisa_attention" else \
        flex_fn(q, k, v, flex_block_mask(bi, bc, 131072))
    f()
    benchmark.pedantic(lambda: (f(), torch.cuda.synchronize()), rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("impl", ["pisa", "sdpa_default"])
def test_decode_128k(benchmark, impl):
    pisa, dense = decode_fns(131072)
    f = pisa if impl == "pisa" else dense
    f()
    benchmark.pedantic(lambda: (f(), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)


def main(argv=None) -> int:
    import subprocess

    import triton
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    bench = lambda f: triton.testing.do_bench(f, warmup=50, rep=300, return_mode="median")  # noqa: E731
    ms = {}

    def record(name, f):
        ms[name] = bench(f)
        print(f"{name:36s} {ms[name]:9.3f} ms", flush=True)

    for impl, n, mode in CASES:
        record(f"{impl} {mode} N={n // 1024}K", step(impl, n, mode))
        torch.cuda.empty_cache()
    g = lambda i, m, n: ms[f"{i} {m} N={n}K"]  # noqa: E731

    # Same selection, two kernels (PISA attention alone vs FlexAttention), plus TFLOP/s.
    extra = {}
    for n in (8192, 32768, 131072):
        q, k, v, bi, bc = selection_problem(n)
        record(f"pisa_attention fwd N={n // 1024}K", pisa_attention_only(q, k, v, bi, bc))
        try:
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record()
            bm = flex_block_mask(bi, bc, n)
            t1.record()
            torch.cuda.synchronize()
            ms[f"flex_mask_build N={n // 1024}K (first call)"] = t0.elapsed_time(t1)
            record(f"flex_mask_build N={n // 1024}K", lambda bi=bi, bc=bc, n=n: flex_block_mask(bi, bc, n))
            record(f"flex fwd N={n // 1024}K", flex_fn(q, k, v, bm))
            o_p = pisa_attention_only(q, k, v, bi, bc)()[0].float()
            o_f = flex_fn(q, k, v, bm)().float()
            extra[f"flex vs pisa rel. error N={n // 1024}K"] = ((o_f - o_p).norm() / o_p.norm()).item()
        except Exception as e:  # report, keep the other figures
            extra[f"flex failed N={n // 1024}K"] = float("nan")
            print(f"flex N={n // 1024}K failed: {type(e).__name__}: {e}", flush=True)
        if n == 131072:
            extra["computed TFLOP/s: pisa attention @128K"] = (
                computed_flops(bi, bc) / g("pisa_attention", "fwd", 128) / 1e9)
            extra["mean keys per query row @128K"] = (
                bc.float().mean().item() * CFG.block_size)
        q = k = v = bi = bc = bm = None
        torch.cuda.empty_cache()
    dense_flops = 4.0 * B * HQ * D * 131072 * 131073 / 2
    extra["TFLOP/s: sdpa_default causal @128K"] = dense_flops / g("sdpa_default", "fwd", 128) / 1e9

    # Decode: B=8, one query over a 128K cache.
    pisa_dec, dense_dec = decode_fns(131072)
    record("pisa decode B=8 N=128K", pisa_dec)
    record("sdpa_default decode B=8 N=128K", dense_dec)
    del pisa_dec, dense_dec
    torch.cuda.empty_cache()

    # Peak extra memory of one forward at 128K (inputs excluded, output included).
    q, k, v = inputs(131072)
    with torch.no_grad():
        for impl in ("pisa", "sdpa_default"):
            extra[f"peak extra MiB: {impl} fwd @128K"] = peak_extra_mib(
                lambda impl=impl: run(impl, q, k, v))

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
        "pisa attention TFLOP/s / dense TFLOP/s @128K (target >= 0.60)":
            extra["computed TFLOP/s: pisa attention @128K"]
            / extra["TFLOP/s: sdpa_default causal @128K"],
        "peak extra memory pisa / dense @128K (target <= 1.10)":
            extra["peak extra MiB: pisa fwd @128K"] / extra["peak extra MiB: sdpa_default fwd @128K"],
        "dense decode / pisa decode, B=8 @128K (target >= 5)":
            ms["sdpa_default decode B=8 N=128K"] / ms["pisa decode B=8 N=128K"],
        "flex fwd / pisa attention fwd, same selection @128K (target >= 1.0)":
            ms.get("flex fwd N=128K", float("nan")) / g("pisa_attention", "fwd", 128),
    }
    for k_, v_ in {**extra, **ratios}.items():
        print(f"{k_}: {v_:.4f}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "commit": commit,
                       "command": "python -m benchmarks.bench_pisa --json "
                                  + args.json,
                       "setting": "bf16 B=1 Hq=32 Hkv=8 D=128 causal block_size=64 top_k=16 "
                                  "query_tile=64; median ms (triton.testing.do_bench); decode "
                                  "B=8 Nq=1",
                       "median_ms": ms, "derived": extra, "ratios": ratios}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
