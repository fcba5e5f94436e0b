"""Selection speed: PISA pyramid + fused coarse-to-fine selection vs flat block scoring.

Flat baseline (MoBA-style): mean-pool each leaf's keys, score every query against every leaf
of its KV head (``q @ mu^T``, causal blocks masked), ``topk`` per query. Both run side by side
in one process on the same inputs (GPU only).

    python -m benchmarks.bench_select                  # selection ms at 8K..256K
    python -m benchmarks.bench_select --sizes 131072 --tune   # launch-option sweep
    python -m benchmarks.bench_select --sizes 32768 --tune-rescore   # exact rescoring's
    python -m benchmarks.bench_select --out profiles/select_gpu.json
    python -m benchmarks.bench_select --preset quality --sizes 32768 --tune --tune-rescore
    python -m benchmarks.bench_select --preset quality --sizes 32768 --tune-flat --no-flat
    python -m pytest benchmarks/bench_select.py --benchmark-enable

Shape: B=1, Hq=32, Hkv=8, D=128, bf16, causal; options: the ``"fast"`` preset (block_size=64,
top_k=16, query_tile=64), or ``--preset`` (the sweeps then tune that preset's kernels; the
kernels' registers and spills are recorded by warps, stages and register cap).
"""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch

from pisa_compile import PisaConfig
from pisa_compile.kernels import triton_pyramid as tp
from pisa_compile.kernels import triton_select as ts

CFG = PisaConfig.preset("fast", min_seq_len=0)
SIZES = [8192, 16384, 32768, 65536, 131072, 262144]
# --tune: launch options of the selection kernel (rows per chunk, warps, pipelining stages,
# register cap). Default: 64 rows, 4 warps, Triton's stages, no cap (~255 registers).
TUNE = {
    "rolled": dict(unroll=False),  # the default before unrolling one-chunk tiles
    "rb64_w4": dict(row_block=64, num_warps=4),
    "rb64_w4_s1_r168": dict(row_block=64, num_warps=4, num_stages=1, maxnreg=168),
    "rb64_w4_s2": dict(row_block=64, num_warps=4, num_stages=2),
    "rb64_w4_s2_r168": dict(row_block=64, num_warps=4, num_stages=2, maxnreg=168),
    "rb128_w8": dict(row_block=128, num_warps=8),
    "rb32_w4": dict(row_block=32, num_warps=4),
    "rb32_w2": dict(row_block=32, num_warps=2),
    "rb256_w8": dict(row_block=256, num_warps=8),
    "rb64_w4_unroll": dict(row_block=64, num_warps=4, unroll=True),
    "rb64_w4_unroll_r168": dict(row_block=64, num_warps=4, unroll=True, maxnreg=168),
    "rb128_w8_unroll": dict(row_block=128, num_warps=8, unroll=True),
    # 16-query tiles (the defaults): one 64-row chunk per tile.
    "rb64_w8": dict(row_block=64, num_warps=8),
    "rb64_w8_s1": dict(row_block=64, num_warps=8, num_stages=1),
    "rb64_w8_unroll": dict(row_block=64, num_warps=8, unroll=True),
    "rb32_w4_unroll": dict(row_block=32, num_warps=4, unroll=True),
    "rb16_w4": dict(row_block=16, num_warps=4),
    # each child's summaries loaded right before its dots: 64 KiB of shared memory instead of
    # 144 (benchmarks/kernel_resources.py), two 4-warp programs per SM
    "rb64_w4_late": dict(row_block=64, num_warps=4, late_loads=True),  # bounds' default
    "early": dict(late_loads=False),  # bounds' default before late loads (8 warps at 32K)
    "rb64_w8_late": dict(row_block=64, num_warps=8, late_loads=True),
}

# --tune-rescore: launch options of the exact rescoring kernel, on a 32-leaf shortlist (the
# setting the recorded sweep used; the defaults score 128 leaves per 16-query tile).
RESCORE_CFG = PisaConfig.preset("fast", min_seq_len=0, leaf_scoring="exact", beam=60,
                                 shortlist=32)
TUNE_RESCORE = {
    "rb64_w4": dict(row_block=64, num_warps=4),
    "rb64_w4_p2": dict(row_block=64, num_warps=4, programs_per_sm=2),
    "rb64_w4_p8": dict(row_block=64, num_warps=4, programs_per_sm=8),
    "rb64_w4_p16": dict(row_block=64, num_warps=4, programs_per_sm=16),
    "rb64_w8": dict(row_block=64, num_warps=8),
    "rb64_w4_s2": dict(row_block=64, num_warps=4, num_stages=2),
    "rb64_w4_s4": dict(row_block=64, num_warps=4, num_stages=4),
    "rb64_w4_kb32": dict(row_block=64, num_warps=4, key_block=32),
    "rb32_w4": dict(row_block=32, num_warps=4),
    # Register caps: about 225 registers without one (compiled offline for sm90), so two
    # 4-warp programs per SM; 168 lets three in, 128 four (the rest spills).
    "rb64_w4_r168": dict(row_block=64, num_warps=4, maxnreg=168),
    "rb64_w4_r168_p3": dict(row_block=64, num_warps=4, maxnreg=168, programs_per_sm=3),
    "rb64_w4_r128": dict(row_block=64, num_warps=4, maxnreg=128),
    "rb64_w4_r128_p8": dict(row_block=64, num_warps=4, maxnreg=128, programs_per_sm=8),
    "rb64_w4_r152": dict(row_block=64, num_warps=4, maxnreg=152),
    # Every leaf through the general leaf LSE (the package before the lean clean-leaf score).
    "rb64_w4_r128_nolean": dict(row_block=64, num_warps=4, maxnreg=128, lean=False),
    # The exact scores' dots on float8 copies of q and k (triton_select.fp8_operands).
    "rb64_w4_r128_fp8": dict(row_block=64, num_warps=4, maxnreg=128, fp8=True),
    "rb64_w4_r128_p6_fp8": dict(row_block=64, num_warps=4, maxnreg=128, programs_per_sm=6,
                                fp8=True),
}

# --tune-flat: launch options of the flat kernel (flat_leaves; the defaults up to 32K keys).
TUNE_FLAT = {
    "rb64_lb32_w4": dict(row_block=64, leaf_block=32, num_warps=4),
    "rb64_lb16_w4": dict(row_block=64, leaf_block=16, num_warps=4),
    "rb64_lb64_w4": dict(row_block=64, leaf_block=64, num_warps=4),
    "rb64_lb32_w8": dict(row_block=64, leaf_block=32, num_warps=8),
    "rb64_lb64_w8": dict(row_block=64, leaf_block=64, num_warps=8),
}


SHAPE = dict(Hq=32, Hkv=8, D=128)  # --shape rebinds it


def make(N, B=1, Hq=None, Hkv=None, D=None, dtype=torch.bfloat16, seed=0):
    Hq, Hkv, D = Hq or SHAPE["Hq"], Hkv or SHAPE["Hkv"], D or SHAPE["D"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def pisa_select(q, k, config=None, **tuning):
    config = config or CFG  # read at call time: --preset rebinds CFG
    return ts.select_blocks(q, k, True, q.shape[-1] ** -0.5, **config.selection_options(),
                            tuning=tuning)


def flat_select(q, k, config=None, chunk=8192):
    """Per-token flat scoring against mean-pooled leaf keys + topk (causal), in query chunks."""
    config = config or CFG
    B, Hq, N, D = q.shape
    Hkv, C = k.shape[1], config.block_size
    L = -(-N // C)
    kp = torch.nn.functional.pad(k, (0, 0, 0, L * C - N))
    mu = kp.view(B, Hkv, L, C, D).float().mean(3).to(q.dtype)
    mu = mu.repeat_interleave(Hq // Hkv, 1)  # [B, Hq, L, D]
    out = []
    leaf = torch.arange(L, device=q.device)
    for s in range(0, N, chunk):
        e = min(N, s + chunk)
        sc = torch.matmul(q[:, :, s:e], mu.transpose(-1, -2))  # [B, Hq, n, L]
        pos = torch.arange(s, e, device=q.device)
        sc = sc.masked_fill(leaf[None, :] * C > pos[:, None], float("-inf"))
        out.append(torch.topk(sc, min(config.top_k, L), dim=-1).indices)
    return torch.cat(out, 2)


def attention_forward(q, k, v, idx, cnt, config=None):
    config = config or CFG
    from pisa_compile.kernels import triton_attention as ta
    return ta.sparse_attention(q, k, v, None, True, q.shape[-1] ** -0.5, idx, cnt,
                               block_size=config.block_size, query_tile=config.query_tile)


def compiled_info(kernel) -> dict:
    """Registers, spills and shared memory of each variant of a Triton ``kernel`` compiled in
    this process (Triton's per-device kernel caches), keyed by warps, stages and register
    cap: variants that differ only in constexprs (row block, unrolling) share a key."""
    info = {}
    for cache in getattr(kernel, "device_caches", {}).values():
        for ck in cache[0].values():
            meta = ck.metadata
            key = f"w{meta.num_warps}_s{meta.num_stages}_r{getattr(meta, 'maxnreg', None)}"
            info.setdefault(key, []).append(dict(n_regs=getattr(ck, "n_regs", None),
                                                 n_spills=getattr(ck, "n_spills", None),
                                                 shared=meta.shared))
    return info


def _ms(fn):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def run(sizes, out_path=None, tune=False, tune_rescore=False, preset=None, only=None,
        shape=None, no_flat=False, tune_flat=False):
    global CFG, RESCORE_CFG
    if shape:
        SHAPE.update(zip(("Hq", "Hkv", "D"), shape))
    tunes = {k: v for k, v in TUNE.items() if not only or k in only}
    tunes_rescore = {k: v for k, v in TUNE_RESCORE.items() if not only or k in only}
    tunes_flat = {k: v for k, v in TUNE_FLAT.items() if not only or k in only}
    if preset is not None:
        CFG = PisaConfig.preset(preset, min_seq_len=0)
        if CFG.leaf_scoring == "exact":
            RESCORE_CFG = CFG
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__,
           "shape": "B=1 Hq={Hq} Hkv={Hkv} D={D} bf16 causal".format(**SHAPE),
           "config": dict(block_size=CFG.block_size, top_k=CFG.top_k, query_tile=CFG.query_tile,
                          branching=CFG.branching), "preset": preset or "fast",
           "options": CFG.selection_options(), "rows": []}
    for N in sizes:
        q, k, v = make(N)
        row = {"N": N}
        row["pisa_select_ms"] = _ms(lambda: pisa_select(q, k))
        if tune:
            row["pyramid_ms"] = _ms(lambda: tp.pyramid_buffers(
                k, CFG.block_size, CFG.branching, CFG.effective_beam, live_limit=N))
            ref_idx = pisa_select(q, k)[0]
            for name, kw in tunes.items():
                try:
                    row[f"select_{name}_ms"] = _ms(lambda: pisa_select(q, k, **kw))
                    # Share of tiles whose selection differs from the default launch (row
                    # chunking reorders fp32 sums: rare near-tie flips only).
                    diff = (pisa_select(q, k, **kw)[0] != ref_idx).any(-1).float().mean()
                    row[f"select_{name}_diff_frac"] = float(diff)
                except Exception as e:  # noqa: BLE001 (resource limits on some configs)
                    row[f"select_{name}_ms"] = repr(e)[:80]
        if tune_rescore:
            ref_idx = pisa_select(q, k, RESCORE_CFG)[0]
            for name, kw in tunes_rescore.items():
                try:
                    row[f"rescore_{name}_ms"] = _ms(
                        lambda: pisa_select(q, k, RESCORE_CFG, rescore=kw))
                    diff = (pisa_select(q, k, RESCORE_CFG, rescore=kw)[0] != ref_idx)
                    row[f"rescore_{name}_diff_frac"] = float(diff.any(-1).float().mean())
                except Exception as e:  # noqa: BLE001 (resource limits on some configs)
                    row[f"rescore_{name}_ms"] = repr(e)[:80]
        if tune_flat:
            ref_idx = pisa_select(q, k)[0]
            for name, kw in tunes_flat.items():
                try:
                    row[f"flat_{name}_ms"] = _ms(lambda: pisa_select(q, k, flat=kw))
                    diff = (pisa_select(q, k, flat=kw)[0] != ref_idx)
                    row[f"flat_{name}_diff_frac"] = float(diff.any(-1).float().mean())
                except Exception as e:  # noqa: BLE001 (resource limits on some configs)
                    row[f"flat_{name}_ms"] = repr(e)[:80]
        try:
            row["flat_select_ms"] = None if no_flat else _ms(lambda: flat_select(q, k))
        except torch.OutOfMemoryError:
            row["flat_select_ms"] = None
        torch.cuda.empty_cache()
        idx, cnt = pisa_select(q, k)
        try:
            row["attn_fwd_ms"] = _ms(lambda: attention_forward(q, k, v, idx, cnt))
            row["pisa_fwd_ms"] = row["pisa_select_ms"] + row["attn_fwd_ms"]
            row["select_share_of_fwd"] = row["pisa_select_ms"] / row["pisa_fwd_ms"]
        except Exception as e:  # noqa: BLE001 (the attention kernel is another module)
            row["attn_fwd_error"] = repr(e)[:200]
        if row.get("flat_select_ms"):
            row["speedup_vs_flat"] = row["flat_select_ms"] / row["pisa_select_ms"]
        if tune or tune_rescore or tune_flat:
            row["compiled"] = {"select": compiled_info(ts._select_kernel),
                               "flat": compiled_info(ts._flat_kernel),
                               "rescore": compiled_info(ts._rescore_kernel)}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        del q, k, v
        torch.cuda.empty_cache()
    by_n = {r["N"]: r["pisa_select_ms"] for r in res["rows"]}
    for n, ms in by_n.items():
        print(f"N={n // 1024}K: selection (pyramid + select) {ms:.2f} ms", flush=True)
    if 131072 in by_n and 262144 in by_n:
        res["ratio_256k_128k"] = by_n[262144] / by_n[131072]
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return res


# -- pytest-benchmark ------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("N", [8192, 32768, 131072])
@pytest.mark.parametrize("method", ["pisa", "flat"])
def test_bench_select(benchmark, method, N):
    q, k, _ = make(N)
    fn = (lambda: pisa_select(q, k)) if method == "pisa" else (lambda: flat_select(q, k))
    fn()
    torch.cuda.synchronize()

    def step():
        fn()
        torch.cuda.synchronize()
    benchmark(step)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=SIZES)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-rescore", action="store_true")
    ap.add_argument("--tune-flat", action="store_true")
    ap.add_argument("--preset", default=None, help="a PisaConfig preset (default: fast)")
    ap.add_argument("--only", nargs="*", help="run only these --tune/--tune-rescore settings")
    ap.add_argument("--shape", type=int, nargs=3, metavar=("HQ", "HKV", "D"),
                    help="heads and head dim (default 32 8 128)")
    ap.add_argument("--no-flat", action="store_true", help="skip the flat baseline")
    a = ap.parse_args()
    run(a.sizes, a.out, a.tune, a.tune_rescore, a.preset, a.only, a.shape, a.no_flat,
        a.tune_flat)
