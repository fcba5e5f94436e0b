"""Triton pyramid and selection on the GPU (bf16/fp16) against the reference selection.

Skipped without CUDA. Keys have a per-leaf structure so that tile scores are well separated;
tiles decided by a near-tie (bf16 rounding of the summaries) are checked by their tile score
``S`` at the first differing level (``tests/select_check.py``).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from pisa_compile import PisaConfig  # noqa: E402
from pisa_compile.kernels import triton_select as ts  # noqa: E402
from tests.select_check import check_pyramid, check_selection  # noqa: E402

pytestmark = pytest.mark.gpu


def _fast(**kw):
    """The cases' base: the "fast" preset (pooled leaves, 64-query tiles, beam = top_k), so
    each case's keys name everything it changes; the defaults' options are spelled out."""
    return PisaConfig.preset("fast", **kw)


def _qk(B, Hkv, G, Nq, Nk, D, dtype, C, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hkv * G, Nq, D, device="cuda", generator=g)
    n_leaf = -(-Nk // C)
    centre = torch.randn(B, Hkv, n_leaf, D, device="cuda", generator=g) * 1.5
    k = centre.repeat_interleave(C, 2)[:, :, :Nk] + torch.randn(B, Hkv, Nk, D, device="cuda",
                                                                 generator=g)
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("Nk", [1000, 32768])
def test_pyramid(Nk):
    cfg = _fast()
    k = torch.randn(1, 4, Nk, 128, device="cuda", dtype=torch.bfloat16)
    live = (torch.arange(Nk, device="cuda") < Nk - 37).view(1, 1, Nk)
    check_pyramid(k, live, cfg)


CASES = [
    # (B, Hkv, G, Nq, Nk, dtype, causal, config kwargs)
    (1, 2, 4, 4096, 4096, torch.bfloat16, True, {}),
    (1, 2, 4, 4096, 4096, torch.float16, False, {}),
    (2, 2, 4, 3001, 3001, torch.bfloat16, True, {}),
    (1, 2, 6, 2999, 2999, torch.float16, True, dict(branching=3)),
    (1, 1, 4, 16, 8192, torch.bfloat16, False, {}),  # decode-like
    (1, 2, 1, 1024, 5000, torch.float16, False, dict(query_tile=1)),
    (1, 2, 4, 2048, 2048, torch.float16, True, dict(block_size=32, top_k=8, leaf_scoring="exact")),
    (1, 2, 4, 32768, 32768, torch.bfloat16, True, {}),
    (1, 1, 4, 32768, 32768, torch.float16, False, dict(top_k=8, query_tile=32)),
    # a wide pooled pool of which only a shortlist is scored exactly
    (1, 2, 7, 8192, 8192, torch.float16, True, dict(leaf_scoring="exact", beam=64,
                                                    shortlist=32)),
    # box bounds (bound_block) for the internal levels and the shortlist
    (1, 2, 7, 8192, 8192, torch.bfloat16, True, dict(leaf_scoring="exact", beam=32,
                                                     shortlist=16, bound_block=16)),
    # the defaults ("quality"), and the rescoring kernel on a 128-wide pool: every candidate,
    # or a bound-ranked shortlist
    (1, 2, 4, 32768, 32768, torch.bfloat16, True, dict(leaf_scoring="exact", beam=60,
                                                       query_tile=16, shortlist=64,
                                                       bound_block=16)),
    (1, 2, 4, 8192, 8192, torch.bfloat16, True, dict(leaf_scoring="exact", beam=60)),
    (2, 2, 7, 6000, 6000, torch.bfloat16, True, dict(leaf_scoring="exact", beam=60,
                                                     shortlist=32, bound_block=16)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}G{c[2]}q{c[3]}k{c[4]}"
                         f"{'c' if c[6] else 'n'}{str(c[5])[-2:]}")
def test_select_matches_reference(case):
    B, Hkv, G, Nq, Nk, dtype, causal, kw = case
    cfg = _fast(min_seq_len=0, kernel="triton", **kw)
    q, k = _qk(B, Hkv, G, Nq, Nk, 128, dtype, cfg.block_size)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    ties = check_selection(q, k, causal, 128 ** -0.5, cfg, tol=tol, max_tie_frac=0.1)
    print(f"near-tie tiles: {ties}")


def test_left_padded_rows_select_like_the_reference():
    """A key mask with left padding: sinks at each row's first real leaf, padding never
    summarised, on the GPU as in the reference."""
    cfg = _fast(min_seq_len=0, kernel="triton")
    q, k = _qk(3, 2, 4, 4096, 4096, 128, torch.bfloat16, cfg.block_size, seed=5)
    km = torch.arange(4096, device="cuda")[None, :] >= torch.tensor([0, 1024, 1500],
                                                                     device="cuda")[:, None]
    ties = check_selection(q, k, True, 128 ** -0.5, cfg, tol=2e-2, max_tie_frac=0.1,
                           key_mask=km)
    print(f"near-tie tiles: {ties}")


@pytest.mark.parametrize("rb", [32, 64, 256])
def test_row_block_does_not_change_selection(rb):
    cfg = _fast(min_seq_len=0)
    q, k = _qk(1, 2, 4, 4096, 4096, 128, torch.float16, 64, seed=3)
    a = ts.select_blocks(q, k, True, 0.1, **cfg.selection_options())
    b = ts.select_blocks(q, k, True, 0.1, **cfg.selection_options(), tuning=dict(row_block=rb))
    # Row chunking only reorders an fp32 sum: allow rare near-tie flips.
    assert (a[0] != b[0]).any(-1).float().mean() < 0.01
    assert torch.equal(a[1], b[1])


def test_cuda_graph_capture():
    cfg = _fast(min_seq_len=0)
    q, k = _qk(1, 2, 4, 4096, 4096, 128, torch.bfloat16, 64)
    out = ts.select_blocks(q, k, True, 0.1, **cfg.selection_options())  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = ts.select_blocks(q, k, True, 0.1, **cfg.selection_options())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(res[0], out[0]) and torch.equal(res[1], out[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
# More than 120 leaves of 64 keys: past the walk's one-level pool (2 * beam), so flat_leaves
# raises the beam and the flat kernel runs.
@pytest.mark.parametrize("causal,N,G,pad", [(True, 8192, 4, 0), (True, 12000, 7, 700),
                                            (False, 10000, 2, 0)])
def test_flat_kernel_matches_reference(causal, N, G, pad, dtype, monkeypatch):
    """The defaults up to ``flat_leaves`` leaves: every leaf in a one-level pool (the flat
    kernel), its 128-leaf shortlist rescored exactly, against the reference tile by tile."""
    launched = []
    real = ts.launcher
    monkeypatch.setattr(ts, "launcher", lambda fn, x: launched.append(fn) or real(fn, x))
    cfg = PisaConfig(block_size=64, min_seq_len=0, kernel="triton")
    g = torch.Generator(device="cuda").manual_seed(N)
    q = torch.randn(1, 2 * G, N, 64, device="cuda", generator=g).to(dtype)
    k = torch.randn(1, 2, N, 64, device="cuda", generator=g).to(dtype)
    km = None
    if pad:
        km = torch.ones(1, N, dtype=torch.bool, device="cuda")
        km[:, :pad] = False
    check_selection(q, k, causal, 0.125, cfg, key_mask=km)
    assert ts._flat_kernel in launched


@pytest.mark.xfail(strict=True, reason="fp8 rescoring with per-(batch, KV head) scales "
                   "changed 27.1% (8K) / 44.8% (32K) of tiles' blocks on the H200 (5 December "
                   "2026): RESCORE_TUNING['fp8'] stays off until finer scales pass this bar")
@pytest.mark.parametrize("N", [8192, 32768])
def test_fp8_rescoring_on_the_gpu(N):
    """``RESCORE_TUNING["fp8"]`` on Hopper's float8 tensor cores: the defaults' selection
    (flat ranking, 128-leaf exact shortlist) picks nearly what the bf16 rescoring picks: float8
    rounding flips near-ties only, at most 10% of tiles differ (the interpreter tests check
    the exact scores against the dequantised operands)."""
    cfg = PisaConfig(min_seq_len=0)
    opts = cfg.selection_options()
    q, k = _qk(1, 8, 4, N, N, 128, torch.bfloat16, 64, seed=N)
    calls = []
    real = ts.fp8_operands
    ts.fp8_operands = lambda *a: calls.append(1) or real(*a)  # the fp8 branch ran
    try:
        fp8 = ts.select_blocks(q, k, True, 128 ** -0.5, **opts,
                               tuning={"rescore": {"fp8": True}})
    finally:
        ts.fp8_operands = real
    assert calls
    bf16 = ts.select_blocks(q, k, True, 128 ** -0.5, **opts)
    assert torch.equal(fp8[1], bf16[1])
    assert float((fp8[0] != bf16[0]).any(-1).float().mean()) < 0.10
