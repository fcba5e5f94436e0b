"""Triton pyramid and selection kernels against the reference, in Triton's interpreter (CPU).

fp32 and fp16 only: bf16 ``tl.dot`` is broken in the interpreter. Selections must equal
``reference.select_blocks`` tile by tile, except for exact near-ties (see
``tests/select_check.py``: at the first differing level the two kept sets must have the same
tile scores ``S`` within a tolerance, and at most a few tiles may be decided that way).
"""

from __future__ import annotations

import os

import pytest

from tests.interpreter import use_interpreter

use_interpreter()

import torch  # noqa: E402

pytest.importorskip("triton")

from hypothesis import given, settings, strategies as st  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pisa_compile import PisaConfig  # noqa: E402
from pisa_compile.ops import _plan, plan  # noqa: E402
from pisa_compile.kernels import reference as ref  # noqa: E402
from pisa_compile.kernels.geometry import local_bound  # noqa: E402
from pisa_compile.kernels import triton_select as ts  # noqa: E402
from tests.select_check import (alone_and_right_padded, check_pyramid,  # noqa: E402
                                check_selection)

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET is not 1", allow_module_level=True)

# log(0) = -inf is intended (empty children); numpy warns about it in the interpreter.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _fast(**kw):
    """The cases' base: the "fast" preset (pooled leaves, 64-query tiles, beam = top_k), so
    each case's keys name everything it changes; the defaults' options are spelled out."""
    return PisaConfig.preset("fast", **kw)


def _qk(B, Hkv, G, Nq, Nk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    # A shared direction makes scores differ by more than rounding (fewer near-ties).
    return q, k


@pytest.mark.parametrize("g", [2, 3])
@pytest.mark.parametrize("Nk,use_live", [(203, True), (64, False), (7, False)])
def test_pyramid_matches_reference(g, Nk, use_live):
    cfg = _fast(block_size=4, top_k=2, branching=g, min_seq_len=0)
    k = torch.randn(2, 3, Nk, 20)
    live = torch.rand(2, 1, Nk) > 0.3 if use_live else torch.ones(1, 1, Nk, dtype=torch.bool)
    check_pyramid(k, live, cfg)


CASES = [
    # (B, Hkv, G, Nq, Nk, D, dtype, causal, config kwargs)
    (1, 2, 1, 203, 203, 16, torch.float32, True, dict(block_size=4, top_k=2)),
    (1, 1, 4, 203, 203, 16, torch.float32, False, dict(block_size=4, top_k=2)),
    (1, 1, 6, 150, 150, 24, torch.float32, True, dict(block_size=4, top_k=2, branching=3)),
    (2, 1, 4, 77, 77, 16, torch.float16, True, dict(block_size=8, top_k=3, query_tile=8)),
    (1, 2, 1, 130, 130, 16, torch.float16, False, dict(block_size=4, top_k=3, beam=5,
                                                      sink_blocks=2, local_blocks=3)),
    # cross-attention (no local blocks) and a KV cache (queries are the last positions)
    (1, 1, 2, 40, 150, 16, torch.float32, False, dict(block_size=4, top_k=2)),
    (1, 1, 2, 150, 61, 16, torch.float32, False, dict(block_size=4, top_k=2, branching=3)),
    (1, 1, 2, 150, 61, 16, torch.float32, True, dict(block_size=4, top_k=2)),
    (1, 1, 2, 40, 150, 16, torch.float32, True, dict(block_size=4, top_k=2)),
    # query tiles larger than a block, and per-token tiles
    (1, 1, 2, 100, 100, 16, torch.float32, True, dict(block_size=4, top_k=2, query_tile=16)),
    (1, 1, 1, 60, 60, 16, torch.float32, True, dict(block_size=4, top_k=2, query_tile=1)),
    # exact leaf scoring
    (1, 1, 2, 90, 90, 16, torch.float32, True, dict(block_size=4, top_k=2, leaf_scoring="exact")),
    (1, 1, 3, 70, 70, 16, torch.float16, False, dict(block_size=8, top_k=2, branching=3,
                                                     leaf_scoring="exact")),
    # a wide pool, scored pooled, of which only a shortlist is scored exactly
    (1, 1, 2, 203, 203, 16, torch.float32, True, dict(block_size=4, top_k=2, beam=8,
                                                     leaf_scoring="exact", shortlist=3)),
    (1, 2, 3, 130, 130, 16, torch.float16, False, dict(block_size=4, top_k=2, beam=6,
                                                      branching=3, leaf_scoring="exact",
                                                      shortlist=4)),
    # the rescoring kernel: G = 7 over two row chunks; leaves of two key chunks each
    (1, 1, 7, 150, 150, 16, torch.float16, True, dict(block_size=4, top_k=2, beam=6,
                                                     query_tile=16, leaf_scoring="exact",
                                                     shortlist=4)),
    (1, 1, 2, 200, 1100, 16, torch.float32, False, dict(block_size=128, top_k=2,
                                                       leaf_scoring="exact")),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}G{c[2]}q{c[3]}k{c[4]}"
                         f"{'c' if c[7] else 'n'}{str(c[6])[-2:]}")
def test_select_matches_reference(case):
    B, Hkv, G, Nq, Nk, D, dtype, causal, kw = case
    cfg = _fast(min_seq_len=0, kernel="triton", **{"query_tile": 4, **kw})
    q, k = _qk(B, Hkv, G, Nq, Nk, D, dtype)
    check_selection(q, k, causal, D ** -0.5, cfg, tol=1e-5 if dtype == torch.float32 else 2e-3)


def _left_padding(B, Nk, pads, seed=0):
    """``[B, Nk]`` bool key mask with ``pads[b]`` padding keys on the left of row ``b``."""
    return torch.arange(Nk)[None, :] >= torch.tensor(pads)[:, None]


STRUCTURED = [
    # (B, G, Nq, Nk, dtype, causal, causal_offset, left pads, config kwargs)
    (2, 2, 150, 150, torch.float32, True, 0, [0, 37], dict(block_size=4, top_k=2)),
    (2, 3, 70, 70, torch.float16, True, 0, [9, 64], dict(block_size=8, top_k=2, branching=3)),
    # a KV cache: Nq queries at the end of Nk keys (bottom-right), with and without padding
    (1, 2, 24, 150, torch.float32, True, 126, [0], dict(block_size=4, top_k=2)),
    (2, 2, 3, 157, torch.float32, True, 154, [5, 100], dict(block_size=4, top_k=3,
                                                          query_tile=16)),
    # an offset that leaves keys past the last query unseen
    (1, 2, 40, 150, torch.float32, True, 30, [3], dict(block_size=4, top_k=2)),
    # padding without causality, and exact leaf scores (padding inside the scored leaves)
    (2, 2, 60, 90, torch.float32, False, 0, [0, 21], dict(block_size=4, top_k=2)),
    (2, 2, 90, 90, torch.float32, True, 0, [6, 45], dict(block_size=4, top_k=2,
                                                       leaf_scoring="exact")),
    (2, 2, 120, 120, torch.float32, True, 0, [0, 33], dict(block_size=4, top_k=2, beam=6,
                                                         leaf_scoring="exact", shortlist=3)),
]


@pytest.mark.parametrize("case", STRUCTURED, ids=lambda c: f"B{c[0]}G{c[1]}q{c[2]}k{c[3]}"
                         f"{'c' if c[5] else 'n'}o{c[6]}p{c[7][-1]}")
def test_structured_masks_match_reference(case):
    """Causal offsets and key padding read analytically by the kernel select what the
    reference selects from the same structure."""
    B, G, Nq, Nk, dtype, causal, off, pads, kw = case
    cfg = _fast(min_seq_len=0, kernel="triton", **{"query_tile": 4, **kw})
    q, k = _qk(B, 1, G, Nq, Nk, 16, dtype, seed=Nq)
    km = _left_padding(B, Nk, pads)
    check_selection(q, k, causal, 0.25, cfg, tol=1e-5 if dtype == torch.float32 else 2e-3,
                    key_mask=km, causal_offset=off)


def test_padding_is_never_selected_over_real_keys():
    """A padded leaf counts 0 keys: with real leaves left to pick, none is chosen (the leak
    test of the selection)."""
    cfg = _fast(block_size=4, top_k=3, query_tile=4, local_blocks=1, min_seq_len=0)
    q, k = _qk(2, 1, 2, 96, 96, 16, torch.float32, seed=3)
    k[:, :, :40] *= 50  # loud padding keys: they would win if they were scored
    km = _left_padding(2, 96, [40, 40])
    idx, cnt = ts.select_blocks(q, k, True, 0.25, **cfg.selection_options(), key_mask=km)
    pad_leaves = (idx >= 0) & (idx < 10)
    # Tile t (queries 4t..4t+3) forces leaf t and the sink, leaf 10 (the first real keys, not
    # leaf 0: padding), and has leaves 11..t-1 of real keys to pick from: from t = 14 on, at
    # least top_k of them.
    enough = torch.arange(24)[None, None, :, None] >= 14
    assert bool(pad_leaves[:, :, :10].any())  # tiles that see only padding do pick it
    assert not bool((pad_leaves & enough).any())
    assert bool((idx[:, :, 10:] == 10).any(-1).all())  # the sink of every real tile


BOUND_CASES = [
    # (B, Hkv, G, Nq, Nk, dtype, causal, left pads or None, config kwargs): box bounds
    # (bound_block) for every rough score, pooled leaf picks and exact-scored shortlists
    (1, 1, 2, 150, 150, torch.float32, True, None, dict(block_size=8, top_k=2,
                                                        bound_block=2)),
    (1, 1, 7, 100, 100, torch.float32, False, None, dict(block_size=8, top_k=2, branching=3,
                                                         bound_block=4, beam=3,
                                                         leaf_scoring="exact", shortlist=3)),
    (1, 2, 2, 120, 120, torch.float16, True, None, dict(block_size=8, top_k=2, beam=5,
                                                        bound_block=2, leaf_scoring="exact",
                                                        shortlist=3)),
    (1, 1, 3, 90, 130, torch.float16, False, None, dict(block_size=8, top_k=3, branching=3,
                                                        bound_block=8)),
    (1, 1, 7, 96, 96, torch.float32, True, None, dict(block_size=4, top_k=2, bound_block=1)),
    # left padding: padding keys are left out of boxes and sub-block counts
    (2, 1, 2, 130, 130, torch.float32, True, [0, 41], dict(block_size=8, top_k=2,
                                                           bound_block=2)),
    (2, 1, 2, 110, 110, torch.float16, True, [7, 50], dict(block_size=8, top_k=2, beam=4,
                                                           bound_block=4,
                                                           leaf_scoring="exact",
                                                           shortlist=2)),
]


@pytest.mark.parametrize("case", BOUND_CASES, ids=lambda c: f"B{c[0]}H{c[1]}G{c[2]}q{c[3]}"
                         f"k{c[4]}{'c' if c[6] else 'n'}{str(c[5])[-2:]}S{c[8]['bound_block']}"
                         f"{'p' if c[7] else ''}")
def test_bound_block_matches_reference(case):
    B, Hkv, G, Nq, Nk, dtype, causal, pads, kw = case
    cfg = _fast(min_seq_len=0, kernel="triton", **{"query_tile": 4, **kw})
    q, k = _qk(B, Hkv, G, Nq, Nk, 16, dtype, seed=Nk)
    assert plan(q, k, k, None, causal, config=cfg).select == "triton"
    km = None if pads is None else _left_padding(B, Nk, pads)
    check_selection(q, k, causal, 0.25, cfg, tol=1e-5 if dtype == torch.float32 else 2e-3,
                    key_mask=km)


@pytest.mark.parametrize("kw", [dict(), dict(leaf_scoring="exact", shortlist=3),
                                dict(leaf_scoring="exact", shortlist=3, flat_leaves=64)],
                         ids=["pooled", "shortlist", "flat"])
def test_bound_block_keeps_non_finite_boxes_first(kw, monkeypatch):
    """A NaN key (in a node's box and in one leaf's sub-block) and an inf key: their boxes
    are not finite, so they rank first at every level (as non-finite pooled summaries do),
    and a NaN key nobody sees (padding) reaches no box."""
    cfg = _fast(min_seq_len=0, kernel="triton", block_size=8, top_k=2, query_tile=4,
                     beam=3, bound_block=2, **kw)
    q, k = _qk(2, 1, 2, 120, 120, 16, torch.float32, seed=5)
    k[0, 0, 45, 3] = float("nan")
    k[1, 0, 70, 0] = float("inf")
    k[1, 0, 2, 1] = float("nan")  # padding
    km = _left_padding(2, 120, [0, 9])
    monkeypatch.setattr(ts, "WALK_MAX_POOL", 0)  # with flat_leaves: the flat kernel
    check_selection(q, k, True, 0.25, cfg, key_mask=km)
    idx, _ = ts.select_blocks(q, k, True, 0.25, **cfg.selection_options(), key_mask=km)
    # Every tile past the bad key's leaf that does not force it picks it.
    assert bool((idx[0, 0, 12:] == 5).any(-1).all())
    assert bool((idx[1, 0, 18:] == 8).any(-1).all())


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("rescore", [False, True], ids=["every_candidate", "shortlist"])
def test_exact_scores_ignore_non_finite_masked_keys(value, rescore, monkeypatch):
    """A NaN or inf in a masked key (a hole in the key mask) inside a leaf with live keys:
    the leaf's exact score comes from its live keys only, so the tile that wants them picks
    it, as the reference does (the key mask may not reach a score, NaN included). The
    rescoring kernel scores every candidate or a box-ranked shortlist; either way the holed
    leaf 1 under the key mask and the whole leaf 2 without it."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 64, 16), torch.randn(1, 1, 64, 16) * 0.3
    k[0, 0, 24:32] += 2 * q[0, 0, 48:].mean(0)  # leaf 1's live keys: what tile 3 wants
    km = torch.ones(1, 64, dtype=torch.bool)
    km[0, 20:24] = False  # a hole in leaf 1
    k[0, 0, 21] = value
    opts = dict(block_size=16, top_k=1, branching=2, beam=8, sink_blocks=1, local_blocks=1,
                query_tile=16, leaf_scoring="exact", shortlist=2 if rescore else 0,
                bound_block=4 if rescore else 0, flat_leaves=0)
    launched = []
    real = ts.launcher
    monkeypatch.setattr(ts, "launcher", lambda fn, x: launched.append(fn) or real(fn, x))
    idx, cnt = ts.select_blocks(q, k, True, 0.25, key_mask=km, **opts)
    assert ts._rescore_kernel in launched
    ridx, rcnt = ref.select_blocks(q, k, None, True, 0.25, key_mask=km, **opts)
    assert idx[0, 0, 3, :cnt[0, 0, 3]].tolist() == [0, 1, 3]
    assert torch.equal(idx, ridx) and torch.equal(cnt, rcnt)


def test_rescoring_programs_do_not_change_the_selection():
    """The rescoring kernel's persistent programs (``programs_per_sm``; one multiprocessor in
    the interpreter) each loop over tiles with their own scratch row: one program for every
    tile, a few, or one per tile select the same blocks as the reference."""
    cfg = _fast(min_seq_len=0, kernel="triton", block_size=8, top_k=2, query_tile=4, beam=3,
                leaf_scoring="exact", shortlist=4, bound_block=2)
    q, k = _qk(2, 2, 2, 72, 90, 16, torch.float32, seed=3)
    km = _left_padding(2, 90, [0, 11])
    opts = cfg.selection_options()
    runs = [ts.select_blocks(q, k, True, 0.25, **opts, key_mask=km,
                             tuning={"rescore": {"programs_per_sm": n}}) for n in (1, 3, 10000)]
    for idx, cnt in runs[1:]:
        assert torch.equal(idx, runs[0][0]) and torch.equal(cnt, runs[0][1])
    check_selection(q, k, True, 0.25, cfg, key_mask=km)



@triton.jit
def _zero_lse(qv, kleaf, koff, skn, qk_scale, D: tl.constexpr, BD: tl.constexpr,
              C: tl.constexpr, KC: tl.constexpr, LOWP: tl.constexpr):
    """A broken ``_clean_leaf_lse2`` (every clean leaf scores 0): shows where it runs."""
    return tl.zeros([qv.shape[0]], dtype=tl.float32)


@pytest.mark.parametrize("block_size", [16, 8], ids=["C16", "C8_under_dot_min"])
@pytest.mark.parametrize("causal,pads", [(True, None), (True, [0, 21]), (False, [0, 21]),
                                         (False, None)])
def test_clean_leaves_take_the_lean_score(block_size, causal, pads, monkeypatch):
    """The rescoring's clean leaves (every key in range, live and visible to the whole tile)
    take ``_clean_leaf_lse2``, the others ``_leaf_lse2``: with the lean score on or off
    (``RESCORE_TUNING["lean"]``) the blocks equal the reference's, under causality, a key
    mask, a ragged last leaf and a head dim below the dot's width (D=24: BD=32). The lean
    function runs: scoring every clean leaf 0 changes the blocks."""
    cfg = _fast(min_seq_len=0, kernel="triton", block_size=block_size, top_k=2,
                query_tile=4, beam=4, leaf_scoring="exact", shortlist=6, bound_block=4)
    q, k = _qk(2, 2, 2, 90, 90 if causal else 121, 24, torch.float32, seed=5)
    km = None if pads is None else _left_padding(2, k.shape[2], pads)
    opts = cfg.selection_options()
    ridx, rcnt = ref.select_blocks(q, k, None, causal, 0.3, key_mask=km, **opts)

    def run():
        return [ts.select_blocks(q, k, causal, 0.3, key_mask=km, **opts,
                                 tuning={"rescore": {"lean": lean}}) for lean in (True, False)]
    for idx, cnt in run():
        assert torch.equal(idx, ridx) and torch.equal(cnt, rcnt)

    monkeypatch.setattr(ts, "_clean_leaf_lse2", _zero_lse)
    (lean_idx, _), (general_idx, _) = run()
    assert not torch.equal(lean_idx, ridx)
    assert torch.equal(general_idx, ridx)


def test_a_scale_that_is_zero_in_float32_keeps_the_lean_score_off():
    """A positive scale below float32's range is 0 in the kernel: the lean score's first
    rescale would be ``(-inf) * 0 = NaN`` and silence every row's vote, so that a leaf with an
    inf key lost its place first (a review's repro, scale 1e-46: blocks [0, 1, 2] against the
    reference's [0, 1, 6]). The kernel keeps such leaves on the general score."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 40, 16, generator=g), torch.randn(1, 1, 120, 16, generator=g)
    k[0, 0, 100, 3] = float("inf")  # leaf 6
    cfg = _fast(min_seq_len=0, kernel="triton", block_size=16, top_k=2, query_tile=16, beam=4,
                leaf_scoring="exact", shortlist=6, bound_block=4, local_blocks=1)
    opts = cfg.selection_options()
    for scale in (1e-46, 1e-30):
        ridx, rcnt = ref.select_blocks(q, k, None, False, scale, **opts)
        assert (ridx[0, 0, 0] == 6).any()
        for lean in (True, False):
            idx, cnt = ts.select_blocks(q, k, False, scale, **opts,
                                        tuning={"rescore": {"lean": lean}})
            assert torch.equal(idx, ridx) and torch.equal(cnt, rcnt), (scale, lean)


@pytest.mark.parametrize("causal", [True, False])
def test_a_negative_scale_selects_on_the_kernels_as_the_negated_queries(causal):
    """The Triton selection folds a negative scale into the queries (``positive_scale``), as
    the reference does: the blocks equal those of ``-q`` with ``|scale|`` and the reference's
    (without the fold, 11 of 16 tiles differed in a review, exact leaves with 4-key boxes)."""
    cfg = _fast(min_seq_len=0, kernel="triton", block_size=8, top_k=2, query_tile=4, beam=4,
                leaf_scoring="exact", shortlist=6, bound_block=4)
    q, k = _qk(1, 2, 2, 64, 64 if causal else 80, 16, torch.float32, seed=9)
    opts = cfg.selection_options()
    idx, cnt = ts.select_blocks(q, k, causal, -0.4, **opts)
    nidx, ncnt = ts.select_blocks(-q, k, causal, 0.4, **opts)
    assert torch.equal(idx, nidx) and torch.equal(cnt, ncnt)
    ridx, rcnt = ref.select_blocks(q, k, None, causal, -0.4, **opts)
    assert torch.equal(idx, ridx) and torch.equal(cnt, rcnt)
    # The sign matters here: |scale| on q itself picks other blocks.
    assert not torch.equal(ts.select_blocks(q, k, causal, 0.4, **opts)[0], idx)


def test_fp8_operands_keep_float8_precision():
    """:func:`ts.fp8_operands`: each (batch, KV head) scaled so that its largest finite
    magnitude is float8's largest; every finite value comes back within float8's relative
    precision (2**-4, or its smallest step near 0); non-finite values become NaN; masked
    keys (here 1e4 garbage) do not set the keys' scale."""
    torch.manual_seed(0)
    B, Hkv, G, N, D = 2, 2, 3, 40, 16
    q = torch.randn(B, Hkv * G, N, D).half()
    q[:, G:] *= 30  # the KV heads' query groups differ in magnitude
    k = torch.randn(B, Hkv, N, D).half()
    q[1, 4, 3, 5] = float("inf")
    k[0, 1, 7, 2] = float("nan")
    km = torch.ones(B, N, dtype=torch.bool)
    km[1, :5] = False
    k[1, :, :5] = 1e4
    q8, k8, dq = ts.fp8_operands(q, k, km)
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn and dq.shape == (B * Hkv,)
    top = torch.finfo(torch.float8_e4m3fn).max
    # Per (batch, KV head), over [group, position, channel]: q as [B, Hkv, G * N, D].
    groups = [(q.view(B, Hkv, G * N, D), q8.view(B, Hkv, G * N, D), None),
              (k, k8, km[:, None, :, None].expand_as(k))]
    scales = []
    for x, x8, keep in groups:
        fin = torch.isfinite(x) if keep is None else torch.isfinite(x) & keep
        a = torch.where(fin, x.float().abs(), 0).amax((2, 3))
        scales.append(a)
        back = x8.float() * (a / top)[:, :, None, None]
        assert bool(torch.isnan(back[~torch.isfinite(x)]).all())
        err = (back - x.float()).abs()[fin]
        step = (a / top)[:, :, None, None].expand_as(back)[fin] * 2.0**-9
        assert bool((err <= torch.maximum(x.float().abs()[fin] * 2.0**-4, step)).all())
        # The largest finite (kept) magnitude lands on float8's largest value.
        assert torch.equal(torch.where(fin, x8.float().abs(), 0).amax((2, 3)),
                           torch.full_like(a, top))
    assert torch.allclose(dq, (scales[0] * scales[1] / top**2).reshape(-1))
    assert float(k8[1, :, :5].float().abs().max()) <= top  # masked garbage: clamped, finite
    # A head of zeros, and a batch row whose keys are all masked, stay zeros (not NaN).
    q[:, :G] = 0
    k[:, 1] = 0
    q8, k8, dq = ts.fp8_operands(q, k, torch.zeros(B, N, dtype=torch.bool))
    assert torch.equal(q8[:, :G].float(), torch.zeros(B, G, N, D))
    assert torch.equal(k8[:, 1].float(), torch.zeros(B, N, D))
    assert bool(torch.isfinite(dq).all())


@pytest.mark.parametrize("pads", [None, [0, 21]], ids=["no_mask", "left_padding"])
def test_fp8_rescoring_scores_the_dequantised_operands(pads, monkeypatch):
    """``RESCORE_TUNING["fp8"]``: the rescoring kernel's float8 dots pick what the same
    kernel picks from the dequantised operands in fp32 (float8 products are exact in fp32),
    per (batch, KV head) scale included: the heads' magnitudes differ 5x, and the padded
    keys hold garbage that must not set a scale. The shortlist (flat kernel, on the fp16
    inputs) is the same in both runs."""
    cfg = PisaConfig(block_size=16, bound_block=4, top_k=4, shortlist=8, query_tile=16,
                     beam=4, flat_leaves=64, min_seq_len=0, kernel="triton")
    B, Hkv, G, N = 2, 2, 4, 300
    q, k = _qk(B, Hkv, G, N, N, 16, torch.float16, seed=11)
    k[:, 1] *= 5
    k[:, :, N // 3] *= 4  # a strong key: the tiles that see it should keep picking it
    km = None if pads is None else _left_padding(B, N, pads)
    if km is not None:
        k[1, :, :pads[1]] = 1e4
    monkeypatch.setattr(ts, "WALK_MAX_POOL", 0)
    opts = cfg.selection_options()
    fp8 = ts.select_blocks(q, k, True, 0.25, **opts, key_mask=km,
                           tuning={"rescore": {"fp8": True}})
    q8, k8, _ = ts.fp8_operands(q, k, km)
    top = torch.finfo(torch.float8_e4m3fn).max
    aq = q.float().view(B, Hkv, G, N, 16).abs().amax((2, 3, 4))
    keep = torch.ones(B, 1, N, 1) if km is None else km[:, None, :, None].float()
    ak = (k.float().abs() * keep).amax((2, 3))
    q_deq = q8.float() * (aq / top).repeat_interleave(G, 1)[:, :, None, None]
    k_deq = k8.float() * (ak / top)[:, :, None, None]
    real = ts._rescore
    monkeypatch.setattr(ts, "_rescore", lambda q_, k_, *a, **kw: real(q_deq, k_deq, *a, **kw))
    deq = ts.select_blocks(q, k, True, 0.25, **opts, key_mask=km)
    assert torch.equal(fp8[0], deq[0]) and torch.equal(fp8[1], deq[1])
    monkeypatch.setattr(ts, "_rescore", real)
    plain = ts.select_blocks(q, k, True, 0.25, **opts, key_mask=km)
    assert bool((fp8[0][:, :, N // 3 // 16 + 1:] == N // 3 // 16).any(-1).all())
    # Not a guarantee, a sanity bound: float8 rounding flips few of these picks.
    assert float((fp8[0] != plain[0]).any(-1).float().mean()) < 0.25

@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[9]],
                         ids=["g3_G6", "fp16_partial_tile", "tile16"])
def test_unrolled_row_chunks_match(case):
    # The unrolled chunk loop (a tuning option) runs the same arithmetic in the same order;
    # rows past the tile's end are masked, so the selection is identical.
    B, Hkv, G, Nq, Nk, D, dtype, causal, kw = case
    cfg = _fast(min_seq_len=0, kernel="triton", **{"query_tile": 4, **kw})
    q, k = _qk(B, Hkv, G, Nq, Nk, D, dtype)
    opts = cfg.selection_options()
    rolled = dict(row_block=16, unroll=False)
    a = ts.select_blocks(q, k, causal, D ** -0.5, **opts, tuning=rolled)
    b = ts.select_blocks(q, k, causal, D ** -0.5, **opts, tuning=dict(row_block=16, unroll=True))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    if case is CASES[3]:  # and with box bounds (sub-blocks at the leaves)
        opts = {**opts, "bound_block": 2}
        a = ts.select_blocks(q, k, causal, D ** -0.5, **opts, tuning=rolled)
        b = ts.select_blocks(q, k, causal, D ** -0.5, **opts,
                             tuning=dict(row_block=16, unroll=True))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[9]],
                         ids=["g3_G6", "fp16_partial_tile", "tile16"])
@pytest.mark.parametrize("bound", [False, True], ids=["pooled", "bounds"])
def test_late_loads_match(case, bound):
    """``late_loads`` (a tuning option: each child's summaries loaded right before its dots)
    scores the same children in the same order: the selection is identical, with pooled
    summaries and with box bounds (also where a box holds a NaN or inf key)."""
    B, Hkv, G, Nq, Nk, D, dtype, causal, kw = case
    cfg = _fast(min_seq_len=0, kernel="triton", **{"query_tile": 4, **kw})
    q, k = _qk(B, Hkv, G, Nq, Nk, D, dtype)
    opts = cfg.selection_options()
    if bound:
        opts = {**opts, "bound_block": 2}
        k[0, 0, Nk // 2, 1] = float("nan")
        k[-1, -1, Nk // 3, 0] = float("inf")
    a = ts.select_blocks(q, k, causal, D ** -0.5, **opts, tuning=dict(late_loads=False))
    b = ts.select_blocks(q, k, causal, D ** -0.5, **opts, tuning=dict(late_loads=True))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("Nq", [1, 3, 16])
@pytest.mark.parametrize("G", [1, 4])
def test_decode(Nq, G):
    cfg = _fast(block_size=4, top_k=3, query_tile=16, min_seq_len=0)
    q, k = _qk(1, 1, G, Nq, 157, 16, torch.float32, seed=Nq)
    check_selection(q, k, False, 0.25, cfg)
    check_selection(q, k, True, 0.25, cfg)


def test_exact_ties_go_to_lower_index():
    # Identical leaves: every score ties, so the lowest node indices must win at every level.
    cfg = _fast(block_size=4, top_k=2, query_tile=4, min_seq_len=0)
    k = torch.ones(1, 1, 96, 16)
    q = torch.randn(1, 2, 96, 16)
    idx, cnt = ts.select_blocks(q, k, True, 0.25, **cfg.selection_options())
    ridx, rcnt = ref.select_blocks(q, k, None, True, 0.25, **cfg.selection_options())
    assert torch.equal(idx, ridx) and torch.equal(cnt, rcnt)


def test_explicit_mask_plans_the_reference_selection():
    """An explicit mask that wants a gradient itself (a learned float bias) plans the
    reference selection; any other, with or without gradients for q, k and v, is read at run
    time (``tests/test_runtime_masks.py``)."""
    cfg = _fast(block_size=4, top_k=2, query_tile=4, min_seq_len=0, kernel="triton",
                dense_tail=0)
    q, k = _qk(1, 1, 2, 40, 40, 16, torch.float32)
    mask = torch.rand(1, 1, 40, 40) > 0.3
    bias = torch.zeros(1, 1, 40, 40).masked_fill(~mask, -torch.inf).requires_grad_()
    with pytest.raises(ValueError, match="attn_mask must not require grad"):
        plan(q.requires_grad_(), k, k, bias, False, config=cfg)  # as pisa_attention refuses it
    how = _plan(q, k, k, bias, False, config=cfg, window=None, causal_offset=0, key_mask=None)
    assert (how.select, how.attention) == ("reference", "triton")
    assert "attn_mask" in how.reason
    for qq in (q, q.detach()):
        how = plan(qq, k, k, mask, False, config=cfg)
        assert (how.select, how.attention) == (None, "runtime-mask") and "attn_mask" in how.reason
    assert plan(q, k, k, None, False, config=cfg) == ("triton", "triton", "")


def test_explicit_mask_on_cuda_plans_dense_sdpa(monkeypatch):
    """On CUDA (fake tensors here) with ``kernel="auto"`` an explicit mask plans dense SDPA
    under the mask, warned once and counted as no reference stage; ``select_blocks``' plan
    keeps the reference selection, the only one that reads such a mask. The rewrite's note
    says the same."""
    import warnings

    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pisa_compile.kernels import dispatch
    from pisa_compile.lowering.rewrite import _note
    monkeypatch.setattr(dispatch, "triton_targets_gpu", lambda index: True)
    dispatch._warned.clear()
    counters.clear()
    with FakeTensorMode():
        q = torch.empty(1, 4, 64, 16, device="cuda", dtype=torch.float16)
        k = torch.empty(1, 2, 64, 16, device="cuda", dtype=torch.float16)
        mask = torch.empty(1, 1, 64, 64, device="cuda", dtype=torch.bool)
        with pytest.warns(UserWarning, match="dense SDPA runs under the mask"):
            how = dispatch.plan(q, k, k, mask, False)
        assert (how.select, how.attention) == (None, "sdpa") and "attn_mask" in how.reason
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert dispatch.plan(q, k, k, mask, False) == how  # warned once only
        with pytest.warns(UserWarning, match="PyTorch reference runs instead"):
            sel = dispatch.plan(q, k, k, mask, False, selection_only=True)
        assert (sel.select, sel.attention) == ("reference", "triton")
        assert dispatch.plan(q, k, k, mask, False, kernel="triton").select == "reference"
        assert dispatch.plan(q, k, k, None, True) == ("triton", "triton", "")
    assert counters["pisa"]["reference_attention"] == 0
    cfg = PisaConfig(min_seq_len=0)
    assert "dense SDPA under the mask" in _note(64, True, cfg, torch.device("cuda"))
    assert "PyTorch reference" in _note(64, True, cfg, torch.device("cpu"))
    assert _note(64, False, cfg, torch.device("cuda")) == ""


def test_pool_bound_holds_without_mask():
    # Every expanded node is a forced ancestor, so the pool never drops one: the kernel's pool
    # width is g * (beam + n_forced) rounded up: 2 * (16 + 1 + 3) -> 64.
    cfg = _fast()
    n_forced = cfg.sink_blocks + local_bound(cfg.local_blocks, cfg.query_tile, cfg.block_size)
    assert n_forced == 4
    assert ts.pool_size(cfg.branching, cfg.effective_beam, n_forced) == 64
    assert ts.pool_size(3, cfg.effective_beam, n_forced) == 64
    # The defaults: beam 60 is the widest whose pool stays 128 wide: 2 * (60 + 1 + 3).
    cfg = PisaConfig()
    n_forced = cfg.sink_blocks + local_bound(cfg.local_blocks, cfg.query_tile, cfg.block_size)
    assert (n_forced, ts.pool_size(cfg.branching, cfg.effective_beam, n_forced)) == (4, 128)


@settings(max_examples=10, deadline=None)
@given(G=st.sampled_from([1, 3, 7]), Nk=st.integers(40, 260), extra_q=st.integers(0, 30),
       causal=st.booleans(), pad=st.integers(0, 35), shortlist=st.sampled_from([2, 5, 64]),
       bound_block=st.sampled_from([1, 2, 8]), flat=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_default_style_selection_matches_reference(G, Nk, extra_q, causal, pad, shortlist,
                                                   bound_block, flat, seed):
    """The defaults' kind of selection, scaled down: box-bound ranking through a wide beam (or,
    with ``flat``, every leaf in a one-level pool on the flat kernel), an exact-scored
    shortlist (the rescoring kernel) and 4-query tiles, over GQA groups up to 7, ragged
    lengths, a KV-cache offset (Nq < Nk) and left padding; level by level."""
    Nq = max(1, Nk - extra_q)
    cfg = PisaConfig(block_size=8, top_k=2, beam=5, query_tile=4, shortlist=shortlist,
                     bound_block=bound_block, flat_leaves=64 if flat else 0, min_seq_len=0,
                     kernel="triton")
    q, k = _qk(2, 1, G, Nq, Nk, 16, torch.float32, seed=seed % 1000)
    km = _left_padding(2, Nk, [0, min(pad, Nk - 1)])
    with pytest.MonkeyPatch.context() as mp:
        if flat:  # a one-level pool of any width: the flat kernel
            mp.setattr(ts, "WALK_MAX_POOL", 0)
        check_selection(q, k, causal, 0.25, cfg, key_mask=km,
                        causal_offset=Nk - Nq if causal else 0)


FLAT_CASES = [
    # (B, Hkv, G, Nq, Nk, dtype, causal, left pads or None, config kwargs): a one-level pool
    # on the flat kernel (flat_leaves), its shortlist exact-scored
    (1, 2, 2, 512, 512, torch.float32, True, None, dict()),
    (1, 1, 3, 384, 384, torch.float16, False, None, dict()),
    (2, 1, 2, 500, 500, torch.float16, True, [0, 40], dict()),
    (1, 1, 7, 200, 330, torch.float32, True, None, dict(top_k=3, shortlist=5)),  # KV cache
    (1, 2, 4, 300, 300, torch.float32, True, None, dict(branching=3, sink_blocks=2)),
    (1, 1, 2, 300, 200, torch.float32, False, None, dict()),  # Nq > Nk, no local leaves
    (1, 1, 2, 180, 400, torch.float32, True, None, dict(shortlist=40)),  # SHORT > candidates
]


@pytest.mark.parametrize("case", FLAT_CASES, ids=lambda c: f"B{c[0]}H{c[1]}G{c[2]}q{c[3]}"
                         f"k{c[4]}{'c' if c[6] else 'n'}{str(c[5])[-2:]}{'p' if c[7] else ''}")
def test_flat_kernel_matches_reference(case, monkeypatch):
    """``flat_leaves``: the flat kernel's shortlist, then the rescoring kernel's pick, equal
    the reference's one-level walk tile by tile."""
    B, Hkv, G, Nq, Nk, dtype, causal, pads, kw = case
    cfg = PisaConfig(**{**dict(block_size=16, bound_block=4, top_k=4, shortlist=8,
                               query_tile=16, beam=4, flat_leaves=64, min_seq_len=0,
                               kernel="triton"), **kw})
    L = -(-Nk // 16)
    assert cfg.effective_flat_leaves == 64 and L > cfg.branching * cfg.beam  # a raised beam
    monkeypatch.setattr(ts, "WALK_MAX_POOL", 0)
    launched = []
    real = ts.launcher
    monkeypatch.setattr(ts, "launcher", lambda fn, x: launched.append(fn) or real(fn, x))
    q, k = _qk(B, Hkv, G, Nq, Nk, 16, dtype, seed=Nk)
    k[:, :, Nk // 3] *= 6  # a key far above the rest: ranks first wherever it is seen
    km = None if pads is None else _left_padding(B, Nk, pads)
    check_selection(q, k, causal, 0.25, cfg, tol=1e-5 if dtype == torch.float32 else 2e-3,
                    key_mask=km, causal_offset=Nk - Nq if causal else 0)
    assert ts._flat_kernel in launched and ts._select_kernel not in launched


def test_top_k_past_the_leaf_count_plans_for_the_leaves():
    """With top_k >= L the launch is planned for the L leaves: top_k, beam and shortlist at
    most L, a one-level walk's pool ``pow2(L)`` (pooled leaves: a [512, 512] rank, not
    [2048, 2048], which Triton refused), the reference's selection; a tile that would rank
    more than 1024 leaves at once is a clear error, not one from inside Triton."""
    from pisa_compile.kernels.geometry import flat_beam
    opts = dict(leaf_scoring="exact", shortlist=128, bound_block=16)
    assert flat_beam(16 * 64, 64, 2, 2048, 512, **opts) == 16
    assert flat_beam(16 * 64, 64, 2, 2048, 0, **{**opts, "shortlist": 0}) == 16
    cfg = _fast(block_size=16, top_k=2048, min_seq_len=0)
    meta, _ = ts.select_launch(1, 16, 512 * 16, 16, **cfg.selection_options())
    assert (meta["TOPK"], meta["BEAM"], meta["P"], meta["FLAT"]) == (512, 512, 512, False)
    q, k = _qk(1, 1, 1, 16, 512 * 16, 16, torch.float32, seed=5)
    for causal in (False, True):  # causal: a KV cache, the 16 queries see every key
        kw = dict(cfg.selection_options(), causal_offset=512 * 16 - 16 if causal else 0)
        want = ref.select_blocks(q, k, None, causal, 0.25, **kw)
        got = ts.select_blocks(q, k, causal, 0.25, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[1].min() == 512  # every leaf
    exact = PisaConfig(block_size=16, top_k=10**9).selection_options()
    meta, _ = ts.select_launch(1, 16, 600 * 16, 16, **exact)
    assert (meta["TOPK"], meta["BEAM"], meta["SHORT"], meta["W"], meta["FLAT"]) == (
        600, 600, 600, 1024, True)
    q, k = _qk(1, 1, 1, 16, 2048 * 4, 16, torch.float32)
    for kw in (dict(top_k=4096), dict(top_k=4096, leaf_scoring="pooled", shortlist=None)):
        with pytest.raises(ValueError, match="at most 1024 nodes per tile .* 2048 leaves"):
            ts.select_blocks(q, k, False, 0.25,
                             **PisaConfig(block_size=4, **kw).selection_options())


def test_flat_leaves_bounds_the_flat_scan():
    """Past ``flat_leaves`` leaves the walk keeps its beam (O(N log N)); up to it the beam is
    raised to one level; options without exact leaves, a shortlist and bounds never flatten."""
    from pisa_compile.kernels.geometry import flat_beam, level_sizes
    opts = dict(leaf_scoring="exact", shortlist=128, bound_block=16)
    assert flat_beam(512 * 64, 64, 2, 60, 512, **opts) == 256
    assert len(level_sizes(512 * 64, 64, 2, 256)) == 1
    assert flat_beam(512 * 64 + 1, 64, 2, 60, 512, **opts) == 60  # 513 leaves: the walk
    assert flat_beam(100 * 64, 64, 2, 60, 512, **opts) == 60  # already one level
    assert flat_beam(512 * 64, 64, 2, 60, 0, **opts) == 60
    for no in (dict(leaf_scoring="pooled"), dict(shortlist=0), dict(bound_block=0)):
        assert flat_beam(512 * 64, 64, 2, 60, 512, **{**opts, **no}) == 60
    assert PisaConfig().effective_flat_leaves == 512
    for kw in (dict(leaf_scoring="pooled"), dict(shortlist=None), dict(bound_block=None)):
        assert PisaConfig(**kw).effective_flat_leaves == 0
    assert PisaConfig.preset("fast").selection_options()["flat_leaves"] == 0
    with pytest.raises(ValueError, match="flat_leaves"):
        PisaConfig(flat_leaves=-1)


@pytest.mark.parametrize("flat", [False, True], ids=["walk", "flat"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "causal"])
def test_padding_queries_vote_for_nothing_in_the_kernels(causal, flat, monkeypatch):
    """A sequence of 263 tokens alone, and right-padded to 300 with ``query_mask`` marking
    the padding queries: the Triton path's real rows are bit-identical (the padding rows
    reach the walk, the flat ranking and the exact rescoring as NaN, which votes for
    nothing; a constant fill would vote). Without ``query_mask`` they differ."""
    if flat:
        monkeypatch.setattr(ts, "WALK_MAX_POOL", 0)
    cfg = PisaConfig(min_seq_len=0, kernel="triton", block_size=16, top_k=2, query_tile=16,
                     dense_tail=0, flat_leaves=64 if flat else 0, shortlist=4, bound_block=4)
    alone, padded, unmarked = alone_and_right_padded(cfg, causal, L=263)
    assert torch.equal(padded, alone)
    assert not torch.equal(unmarked, alone)
