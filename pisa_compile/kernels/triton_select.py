"""Fused coarse-to-fine block selection in Triton (DESIGN.md "Coarse-to-fine selection").

One program per (query tile, batch * kv head) walks the pyramid from its top level down to the
leaves with a bounded pool of ``P`` nodes held in registers, and writes only
``block_indices [B, Hkv, T, M]`` and ``block_counts [B, Hkv, T]``: no ``Nq x Nk`` tensor is
ever built. With ``leaf_scoring="exact"`` a second kernel (:func:`_rescore_kernel`) scores
the leaf shortlist the walk wrote (an index array of at most ``max(P, shortlist)`` leaves per
tile) exactly, as a tensor-core pass over their keys, and picks. Up to ``flat_leaves`` leaves
the pool is every leaf, wider than registers hold: :func:`_flat_kernel` ranks it instead of
the walk, one streaming pass over the boxes and one over the rows' rough leaf scores, kept
in a scratch of ``(row_block + 1) * pow2(L)`` floats per persistent program (33.5 MiB on
132 SMs at 32K keys, whatever the batch; bounded by ``flat_leaves``).

Per level (same rules as :func:`pisa_compile.kernels.reference.select_blocks`):

* leaf states are analytic (no explicit mask): causal leaves are CLEAN in
  ``[0, clean_end)``, PARTIAL in ``[clean_end, partial_end)``, UNSEEN in
  ``[partial_end, live_end)`` and DEAD past ``live_end``; without causality every leaf is
  CLEAN. A node is visible if it holds a leaf below ``partial_end`` and mixed if it holds
  one in ``[clean_end, live_end)``.
* forced ancestors (of the sink leaves and of the tile's local leaves) and mixed visible
  nodes are expanded; visible, non-expanded nodes are scored;
* internal score ``s_r(a) = LSE_c(scale q_r . mu_c + log n_c)``, leaf score
  ``scale q_r . mu + log n`` (or, with ``leaf_scoring="exact"``, the LSE over the leaf's
  visible keys); with ``bound_block = S`` every rough score takes the box bound
  ``scale (q+ . hi + q- . lo)`` of the keys' channel max/min in place of ``scale q . mu``
  (internal: per child; leaves: the LSE over the leaf's ``S``-key sub-blocks), the boxes
  built on the host (:func:`box_buffers`);
* tile score ``S(a) = sum_r softmax_pool(s_r)(a)`` over valid rows, accumulated over row
  chunks of ``RB`` rows (rows ``r = query * G + head``); a node whose summary is not finite
  (a NaN or infinite key) gets ``S(a) = +inf`` and a row whose query is not finite votes
  for nothing (as in ``reference._top``);
* keep the best ``beam`` (leaves: ``top_k``), ties to the lower node index, by an all-pairs
  rank count (exact and cheap for ``P <= 128``);
* the next pool is the children of kept and expanded nodes, in ascending node order.

How the scores are computed (the cost is here; same values as above up to fp32 rounding):

* ``exp(s_r(a)) = sum_c n_c exp(scale q_r . mu_c)``, so the softmax over the pool of the
  children's LSE is a softmax over all candidate children, summed per parent. The kernel works
  in base 2 (``qk_scale = scale * log2(e)``, ``log2 n`` precomputed once per node) with a
  running row max over the ``g`` children: one ``exp2`` per child score, no ``log``.
  Non-candidates get a ``-inf`` bias instead of a mask.
* Per level, the children's summaries are loaded once (in q's dtype, cast once per call on
  the host) as the dots' B operands and reused by every row chunk; each chunk adds its rows'
  normalised shares into a ``[RB, P]`` register accumulator, reduced over rows once per level.
* Pool bookkeeping avoids ``[P, P]`` matches where it can: ranks among selected nodes are a
  prefix count (the pool is ascending), and the next pool is compacted through a small
  per-program scratch row in global memory.

Pool bound: without an explicit mask a mixed visible node is always a forced ancestor (the
PARTIAL leaves are the tile's own local leaves, ``local_blocks >= 1`` for causal), so at most
``n_forced = sink + geometry.local_bound`` nodes are expanded per level, and
``P = pow2(g * (beam + n_forced))`` is exact: nothing is ever dropped.

Structured masks are read analytically too: a causal offset (query ``i`` at key position
``i + offset``: a KV cache) moves the leaf ranges, and a key mask ``[B, Nk]`` (padding) is
left out of the pyramid's summaries (its keys count 0) and of exact leaf scores. Calls with
an explicit ``attn_mask``, causal calls with ``local_blocks == 0`` and float64 run the
reference selection instead (``dispatch.plan`` decides and says why).
"""

from __future__ import annotations

import functools

from typing import Mapping, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import reference
from .geometry import (block_width, cdiv, flat_beam, level_sizes, local_bound,
                       positive_scale, query_offset, sink_start)
from .runtime import launcher, multiprocessors, stage_range
from .persistent import BoxPyramid
from .triton_pyramid import n_levels, pyramid_buffers
from .triton_util import LOG2E


@triton.jit
def _device_offset(len_ptr, Nq):
    """``DEV_LEN``'s causal offset: the live key count at ``len_ptr`` minus ``Nq`` (a static
    cache's decode: no host length)."""
    return tl.load(len_ptr).to(tl.int32) - Nq


@triton.jit
def _level_size(L, GB: tl.constexpr, lev):
    n = L
    for _ in range(lev):
        n = (n + GB - 1) // GB
    return n


@triton.jit
def _level_offset(L, GB: tl.constexpr, lev):
    n = L
    off = L * 0
    for _ in range(lev):
        off += n
        n = (n + GB - 1) // GB
    return off


@triton.jit
def _top_mask(S, cand, n, P: tl.constexpr):
    """``cand`` entries among the best ``n`` by ``S``; ties to the lower node index.

    The pool is ascending by node (valid nodes first), so the lower slot is the lower node:
    slot ``b`` beats slot ``a`` if ``S_b > S_a``, or ``S_b == S_a`` and ``b < a``. An all-pairs
    count in int32/fp32 compares, exact and cheap for ``P <= 128``.
    """
    a = tl.arange(0, P)
    Sa = S[:, None]
    Sb = S[None, :]
    beats = cand[None, :] & tl.where(a[None, :] < a[:, None], Sb >= Sa, Sb > Sa)  # [a, b]
    rank = tl.sum(beats.to(tl.int32), axis=1)
    return cand & (rank < n)


@triton.jit
def _compact_pos(sel):
    """Rank of each selected entry among the selected ones (an exclusive prefix count: the
    pool is ascending, so this is the rank by node index), and how many are selected."""
    si = sel.to(tl.int32)
    return tl.cumsum(si, axis=0) - si, tl.sum(si, axis=0)


@triton.jit
def _children(scr, node, parent, n_child, P: tl.constexpr, GB: tl.constexpr):
    """Next pool: children of ``parent`` nodes, ascending, -1 padded.

    A compaction through a per-program scratch row ``scr[0:P]`` (global memory, L1/L2
    resident): each parent writes its children at ``GB * rank``, then every slot reads back.
    Cheaper than an all-pairs match in registers. The caller alternates two scratch rows
    between levels, so one barrier (before the reads) orders everything: the writes of level
    ``l + 2`` come after every thread passed level ``l + 1``'s barrier, hence after level
    ``l``'s reads of the same row.
    """
    pos, n_sel = _compact_pos(parent)
    for j in tl.static_range(GB):
        kid = node * GB + j
        slot = pos * GB + j
        # Slots past P would be dropped (never happens without a mask: see the pool bound).
        tl.store(scr + slot, tl.where(kid < n_child, kid, -1), mask=parent & (slot < P))
    tl.debug_barrier()
    s = tl.arange(0, P)
    return tl.load(scr + s, mask=s < n_sel * GB, other=-1)


@triton.jit
def _store_compact(out_ptr, node, sel, width, W: tl.constexpr):
    """Store the selected nodes ascending into ``out[0:width]``, -1 padded (a scatter: the
    selected nodes go to their ranks, the -1 padding to the disjoint slots after them)."""
    pos, n_sel = _compact_pos(sel)
    tl.store(out_ptr + pos, node, mask=sel & (pos < width))
    s = tl.arange(0, W)
    tl.store(out_ptr + s, tl.full([W], -1, tl.int32), mask=(s >= n_sel) & (s < width))


@triton.jit
def _prioritise(S, bad, cand):
    """A candidate whose summary is not finite (it holds a NaN or infinite key) ranks above
    every finite tile score, as long as some row voted (``reference._top``): dense attention
    lets such keys reach the output, so the selection must not drop them."""
    # Each voting row adds shares summing to 1. (A scalar in a where, not in a bool-vector &:
    # the interpreter turns bool-vector & bool-scalar into int32.)
    first = tl.where(tl.sum(S, axis=0) > 0, float("inf"), 0.0)
    return tl.where(bad & cand, tl.maximum(S, first), S)


@triton.jit
def _pool_share2(s, cand, row_ok):
    """``sum over voting rows of softmax over candidates`` of per-row base-2 scores
    ``s [RB, W]`` (the exact leaf scores of the rescoring kernel)."""
    s = tl.where(cand[None, :], s, float("-inf"))
    z = tl.max(s, axis=1)
    zs = tl.where(z == float("-inf"), 0.0, z)
    return tl.sum(_row_share(tl.exp2(s - zs[:, None]), row_ok), axis=0)


@triton.jit
def _load_summaries(mu_ptr, lcnt_ptr, idx, ok, d, D: tl.constexpr, BD: tl.constexpr):
    """Summaries ``[P, BD]`` of nodes ``idx`` (already in the dot's input dtype: the B
    operand), their base-2 log counts (precomputed; ``-inf`` for empty nodes, as the
    reference's ``log 0``), ``-inf`` where ``ok`` is false: such columns score nothing; and
    which summaries are not finite. The pyramid zeroed those and marked their log count
    ``+inf`` (``triton_pyramid``): they score nothing either and are kept first
    (:func:`_prioritise`).
    """
    if BD == D:  # no column mask: full-width vector loads
        msk = ok[:, None]
    else:
        msk = ok[:, None] & (d < D)[None, :]
    mu = tl.load(mu_ptr + idx.to(tl.int64)[:, None] * D + d[None, :], mask=msk, other=0.0)
    lc = tl.load(lcnt_ptr + idx, mask=ok, other=float("-inf"))
    bad = lc == float("inf")
    return mu, tl.where(bad, float("-inf"), lc), bad


@triton.jit
def _q_rows(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, D: tl.constexpr,
            BD: tl.constexpr, G: tl.constexpr, RB: tl.constexpr):
    """Rows ``c * RB + rr`` of the tile, ``[RB, BD]``, and which of them exist."""
    r = c * RB + rr
    row_ok = r < n_rows
    if RB % G == 0:
        # Chunk c's rows are chunk 0's, c * RB / G queries later: only a scalar changes.
        off = qoff0 + tl.cast(c * (RB // G), tl.int64) * sqn
    else:
        off = (r % G).to(tl.int64) * sqh + (q_first + r // G).to(tl.int64) * sqn
    if BD == D:
        msk = row_ok[:, None]
    else:
        msk = row_ok[:, None] & (d < D)[None, :]
    return tl.load(qbase + off[:, None] + d[None, :] * sqd, mask=msk, other=0.0), row_ok


@triton.jit
def _scores2(qv, mu, bias, qk_scale, LOWP: tl.constexpr):
    """Scores in base 2, ``log2(e) * (scale q.mu + log n) = qk_scale q.mu + log2 n``: [RB, P]."""
    if LOWP:
        dot = tl.dot(qv, tl.trans(mu))
    else:
        dot = tl.dot(qv, tl.trans(mu), input_precision="ieee")
    return dot * qk_scale + bias[None, :]


@triton.jit
def _split_q(qv):
    """The query rows' positive and negative parts ``(q+, q-)`` for :func:`_bound2`, once per
    row chunk (not per box tile). ``where``, not maximum/minimum: a NaN query stays NaN in
    both halves, so its row votes for nothing (as the reference's clamp)."""
    return (tl.where(qv < 0, 0.0, qv).to(qv.dtype), tl.where(qv > 0, 0.0, qv).to(qv.dtype))


@triton.jit
def _bound2(qp, qn, hi, lo, bias, qk_scale, LOWP: tl.constexpr):
    """Box bounds in base 2, ``qk_scale (q+ . hi + q- . lo) + log2 n``: [RB, P] (the bound
    of ``reference._bound_scores``: the largest ``q . k`` over the box)."""
    if LOWP:
        dot = tl.dot(qp, tl.trans(hi))
        dot = tl.dot(qn, tl.trans(lo), acc=dot)
    else:
        dot = tl.dot(qp, tl.trans(hi), input_precision="ieee")
        dot = tl.dot(qn, tl.trans(lo), acc=dot, input_precision="ieee")
    return dot * qk_scale + bias[None, :]


@triton.jit
def _load_lo(lo_ptr, idx, ok, d, D: tl.constexpr, BD: tl.constexpr):
    """Box minima ``[P, BD]`` of nodes ``idx`` (the maxima and flags come from
    :func:`_load_summaries` on the ``hi`` buffer); 0 where ``ok`` is false."""
    if BD == D:
        msk = ok[:, None]
    else:
        msk = ok[:, None] & (d < D)[None, :]
    return tl.load(lo_ptr + idx.to(tl.int64)[:, None] * D + d[None, :], mask=msk, other=0.0)


@triton.jit
def _online(s, m, e, FIRST: tl.constexpr):
    """One child's scores ``s`` into a running row max ``m`` (-inf: none finite yet) and
    ``e = sum over children of 2^(s - max(m, 0 if m is -inf))`` per (row, pool node).

    Summing ``2^s`` over the children and then over the pool is the same as the reference's
    LSE over children followed by a softmax over the pool (both are sums of ``exp`` of the
    child scores), but needs one ``exp2`` per child score and no ``log``.
    """
    if FIRST:
        m_new = tl.max(s, axis=1)
        ms = tl.where(m_new == float("-inf"), 0.0, m_new)
        e_new = tl.exp2(s - ms[:, None])
    else:
        m_new = tl.maximum(m, tl.max(s, axis=1))
        ms = tl.where(m_new == float("-inf"), 0.0, m_new)
        # m - ms with the unsubstituted m: -inf while no score was finite, so alpha is 0, never
        # 2^(0 - ms) (which overflows for very negative scores and makes 0 * inf).
        e_new = e * tl.exp2(m - ms)[:, None] + tl.exp2(s - ms[:, None])
    return m_new, e_new


@triton.jit
def _row_share(e, row_ok):
    """Each voting row's normalised share ``e / rowsum(e)``, 0 elsewhere. A row votes if it is
    valid and its sum is positive and finite: a non-finite query or scale makes it NaN (with
    finite summaries), so such a row votes for nothing (as ``reference.tile_scores``)."""
    den = tl.sum(e, axis=1)
    voting = row_ok & (den > 0) & (den < float("inf"))
    w = tl.where(voting, 1.0 / tl.where(voting, den, 1.0), 0.0)
    return tl.where(voting[:, None], e * w[:, None], 0.0)


@triton.jit
def _internal_chunk(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, mu0, b0, mu1, b1,
                    lo0, lo1, mu_ptr, lcnt_ptr, lo_ptr, cbase, kid, cand, n_child, qk_scale,
                    D: tl.constexpr, BD: tl.constexpr, G: tl.constexpr, RB: tl.constexpr,
                    GB: tl.constexpr, LOWP: tl.constexpr, BOUND: tl.constexpr,
                    LATE: tl.constexpr):
    """One row chunk of an internal level: its rows' normalised shares ``[RB, P]``. With
    ``BOUND``, ``mu*`` are the children's box maxima and ``lo*`` their minima; with ``LATE``
    they are unused and every child is loaded here (``scored`` as ``cand``)."""
    qv, row_ok = _q_rows(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, D, BD, G, RB)
    qp, qn = _split_q(qv)  # (dead code without BOUND)
    if not LATE:
        if BOUND:
            m, e = _online(_bound2(qp, qn, mu0, lo0, b0, qk_scale, LOWP), 0.0, 0.0, True)
            m, e = _online(_bound2(qp, qn, mu1, lo1, b1, qk_scale, LOWP), m, e, False)
        else:
            m, e = _online(_scores2(qv, mu0, b0, qk_scale, LOWP), 0.0, 0.0, True)
            m, e = _online(_scores2(qv, mu1, b1, qk_scale, LOWP), m, e, False)
    # Children loaded here (every child with LATE, else those past the default branching of
    # 2, whose loads are loop-invariant: the compiler's LICM hoists them in the rolled loop).
    for j in tl.static_range(0 if LATE else 2, GB):
        okj = cand & (kid + j < n_child)
        muj, bj, _ = _load_summaries(mu_ptr, lcnt_ptr, cbase + j, okj, d, D, BD)
        if BOUND:
            sj = _bound2(qp, qn, muj, _load_lo(lo_ptr, cbase + j, okj, d, D, BD), bj, qk_scale,
                         LOWP)
        else:
            sj = _scores2(qv, muj, bj, qk_scale, LOWP)
        if LATE and j == 0:
            m, e = _online(sj, 0.0, 0.0, True)
        else:
            m, e = _online(sj, m, e, False)
    return _row_share(e, row_ok)


@triton.jit
def _leaf_chunk(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, mu, b, qk_scale,
                D: tl.constexpr, BD: tl.constexpr, G: tl.constexpr, RB: tl.constexpr,
                LOWP: tl.constexpr):
    """One row chunk of the (pooled) leaf level: its rows' normalised shares ``[RB, P]``."""
    qv, row_ok = _q_rows(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, D, BD, G, RB)
    m, e = _online(_scores2(qv, mu, b, qk_scale, LOWP), 0.0, 0.0, True)
    return _row_share(e, row_ok)


@triton.jit
def _leaf_bound_chunk(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, shi_ptr, slo_ptr,
                      slc_ptr, sub0, cand, qk_scale, D: tl.constexpr, BD: tl.constexpr,
                      G: tl.constexpr, RB: tl.constexpr, NS: tl.constexpr, LOWP: tl.constexpr):
    """One row chunk of the leaf level with box bounds (``bound_block``): a leaf's rough score
    is the LSE over its ``NS`` sub-blocks of their bounds, accumulated like an internal node's
    children (``sub0 [P]``: the flat index of each leaf's first sub-block; ``cand``: the
    leaves scored, without those whose box is not finite)."""
    qv, row_ok = _q_rows(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, D, BD, G, RB)
    hi, b, _ = _load_summaries(shi_ptr, slc_ptr, sub0, cand, d, D, BD)
    lo = _load_lo(slo_ptr, sub0, cand, d, D, BD)
    qp, qn = _split_q(qv)
    m, e = _online(_bound2(qp, qn, hi, lo, b, qk_scale, LOWP), 0.0, 0.0, True)
    # A rolled, unpipelined loop: the other sub-blocks are reloaded per row chunk (from L2).
    # Hoisted or multi-buffered, their box tiles [P, D] need more shared memory than an SM
    # has (P=128, D=128: 64 KB per sub-block).
    for u in tl.range(1, NS, num_stages=1):
        hi, b, _ = _load_summaries(shi_ptr, slc_ptr, sub0 + u, cand, d, D, BD)
        lo = _load_lo(slo_ptr, sub0 + u, cand, d, D, BD)
        m, e = _online(_bound2(qp, qn, hi, lo, b, qk_scale, LOWP), m, e, False)
    return _row_share(e, row_ok)


@triton.jit
def _leaf_rough_chunk(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, mu, b, shi_ptr,
                      slo_ptr, slc_ptr, sub0, cand, qk_scale, D: tl.constexpr, BD: tl.constexpr,
                      G: tl.constexpr, RB: tl.constexpr, NS: tl.constexpr, LOWP: tl.constexpr,
                      BOUND: tl.constexpr):
    """One row chunk's shares of the leaf level's rough scores: box bounds of the sub-blocks
    with ``BOUND`` (:func:`_leaf_bound_chunk`), else pooled (:func:`_leaf_chunk`)."""
    if BOUND:
        return _leaf_bound_chunk(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d,
                                 shi_ptr, slo_ptr, slc_ptr, sub0, cand, qk_scale, D, BD, G, RB,
                                 NS, LOWP)
    else:
        return _leaf_chunk(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, mu, b,
                           qk_scale, D, BD, G, RB, LOWP)


@triton.jit
def _leaf_ranges(t, Nq, Nk, L, offset, local_blocks, TQ: tl.constexpr, C: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_LOCAL: tl.constexpr):
    """Tile ``t``'s queries and its leaf ranges (``reference.leaf_states`` and
    ``geometry.forced_ranges``, analytically).

    Leaves ``[0, clean_end)`` are seen whole by every row, ``[clean_end, partial_end)`` in
    part, ``[partial_end, live_end)`` by no row, and past ``live_end`` hold no live key; the
    tile's local leaves are ``[lo, hi]`` (``lo > hi``: none). Causal: query ``i`` sits at key
    position ``i + offset`` (``offset >= 0``, the causal offset).
    """
    q_first = t * TQ
    q_last = tl.minimum(q_first + TQ, Nq) - 1
    if CAUSAL:
        p0 = tl.minimum(q_first, Nq - 1) + offset
        n_live = tl.minimum(Nk, Nq + offset)  # keys past the last query's position: unseen
        live_end = (n_live + C - 1) // C
        clean_end = tl.where(n_live - 1 <= p0, live_end, tl.minimum((p0 + 1) // C, live_end))
        partial_end = tl.maximum(clean_end, tl.minimum((q_last + offset) // C + 1, live_end))
    else:
        live_end = L
        clean_end = L
        partial_end = L
    if HAS_LOCAL:
        hi = tl.minimum(q_last + offset, Nk - 1) // C
        lo = tl.maximum(tl.minimum(q_first + offset, Nk - 1) // C - (local_blocks - 1), 0)
    else:
        hi = -1
        lo = L + 1
    return q_first, q_last, clean_end, partial_end, live_end, lo, hi


@triton.jit
def _internal_level(pool, span, lev, L, Lcap, mbase, mu_ptr, lcnt_ptr, lo_ptr, scr, trace,
                    qbase, qoff0, rr, d, n_rows, n_chunks, q_first, sqh, sqn, sqd, qk_scale,
                    s0, s1, lo, hi, clean_end, partial_end, live_end,
                    D: tl.constexpr, BD: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr,
                    RB: tl.constexpr, GB: tl.constexpr, BEAM: tl.constexpr, P: tl.constexpr,
                    TW: tl.constexpr, LOWP: tl.constexpr, TRACE: tl.constexpr,
                    UNROLL: tl.constexpr, BOUND: tl.constexpr, LATE: tl.constexpr):
    """One internal level: score the pool's candidates, keep the best ``BEAM``, and return
    the next pool (the children of kept and expanded nodes); like the fused-attention
    tutorial's ``_attn_fwd_inner``, the loop body of the kernel.

    The children's summaries (already in the dot dtype) are loaded once, as the dots' B
    operands, and reused by every row chunk; each chunk adds its rows' normalised shares into
    a register accumulator that is reduced over rows once per level. With ``BOUND`` the
    summaries are the children's boxes (``mu_ptr``: maxima, ``lo_ptr``: minima, ``lcnt_ptr``:
    log counts, ``+inf`` for a non-finite box).
    """
    n_child = _level_size(L, GB, lev - 1)
    valid = pool >= 0
    first = pool * span
    last = first + span - 1
    forced = valid & (((last >= s0) & (first < s1)) | ((last >= lo) & (first <= hi)))
    visible = first < partial_end
    mixed = tl.maximum(first, clean_end) <= tl.minimum(last, live_end - 1)
    expand = valid & (forced | (visible & mixed))
    cand = valid & (~expand) & visible
    # Only candidates are scored: other columns get a -inf bias (the reference masks them
    # before its softmax over the pool, so they change nothing).
    kid = pool * GB
    cbase = mbase + _level_offset(Lcap, GB, lev - 1) + kid
    if LATE:
        # Only the flags here: the chunks load each child's summaries right before its dots,
        # so a level holds one child's tiles at a time (less shared memory per program).
        bad = tl.zeros([P], dtype=tl.int1)
        for j in tl.static_range(0, GB):
            bad = bad | (tl.load(lcnt_ptr + cbase + j, mask=cand & (kid + j < n_child),
                                 other=0.0) == float("inf"))
        mu0 = tl.zeros([P, BD], dtype=mu_ptr.dtype.element_ty)  # unused
        b0 = tl.zeros([P], dtype=tl.float32)
        mu1, b1, lo0, lo1 = mu0, b0, mu0, mu0
        # Children of a node with a non-finite box score nothing (as b = -inf below).
        scored = cand & ~bad if BOUND else cand
    else:
        mu0, b0, bad = _load_summaries(mu_ptr, lcnt_ptr, cbase, cand & (kid < n_child), d, D,
                                       BD)
        mu1, b1, bad1 = _load_summaries(mu_ptr, lcnt_ptr, cbase + 1,
                                        cand & (kid + 1 < n_child), d, D, BD)
        bad = bad | bad1
        if BOUND:
            lo0 = _load_lo(lo_ptr, cbase, cand & (kid < n_child), d, D, BD)
            lo1 = _load_lo(lo_ptr, cbase + 1, cand & (kid + 1 < n_child), d, D, BD)
            # A node with a non-finite box is out of every row's softmax
            # (reference.tile_scores), its finite children too.
            b0 = tl.where(bad, float("-inf"), b0)
            b1 = tl.where(bad, float("-inf"), b1)
            scored = cand & ~bad
        else:
            lo0 = mu0  # unused
            lo1 = mu1
            scored = cand
        for j in tl.static_range(2, GB):  # branching > 2: the other children's flags
            _, _, badj = _load_summaries(mu_ptr, lcnt_ptr, cbase + j,
                                         cand & (kid + j < n_child), d, D, BD)
            bad = bad | badj
    acc = tl.zeros([RB, P], dtype=tl.float32)
    if UNROLL:  # all rows, masked past n_rows (see select_blocks' tuning)
        for c in tl.static_range((G * TQ + RB - 1) // RB):
            acc += _internal_chunk(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d,
                                   mu0, b0, mu1, b1, lo0, lo1, mu_ptr, lcnt_ptr, lo_ptr,
                                   cbase, kid, scored, n_child, qk_scale, D, BD, G, RB, GB,
                                   LOWP, BOUND, LATE)
    else:
        for c in range(n_chunks):
            acc += _internal_chunk(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d,
                                   mu0, b0, mu1, b1, lo0, lo1, mu_ptr, lcnt_ptr, lo_ptr,
                                   cbase, kid, scored, n_child, qk_scale, D, BD, G, RB, GB,
                                   LOWP, BOUND, LATE)
    kept = _top_mask(_prioritise(tl.sum(acc, axis=0), bad, cand), cand, BEAM, P)
    if TRACE:
        _store_compact(trace + lev * TW, pool, kept, BEAM, TW)
    return _children(scr, pool, kept | expand, n_child, P, GB)


@triton.jit
def _select_kernel(
    q_ptr, sink_ptr, mu_ptr, lcnt_ptr, lo_ptr, shi_ptr, slo_ptr, slc_ptr,
    idx_ptr, bcnt_ptr, short_ptr, trace_ptr, scr_ptr,
    sqb, sqh, sqn, sqd,
    Hkv, Nq, Nk, L, Lcap, sub_stride, total, T, M, n_sink, local_blocks, offset, scale, len_ptr,
    D: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr, C: tl.constexpr,
    BD: tl.constexpr, GB: tl.constexpr, BEAM: tl.constexpr, TOPK: tl.constexpr, P: tl.constexpr,
    RB: tl.constexpr, MP: tl.constexpr, TW: tl.constexpr, W: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_LOCAL: tl.constexpr, EXACT: tl.constexpr, SHORT: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, LOWP: tl.constexpr, TRACE: tl.constexpr, UNROLL: tl.constexpr,
    BOUND: tl.constexpr, NS: tl.constexpr, LATE: tl.constexpr, DEV_LEN: tl.constexpr,
):
    """One program per (query tile, batch * KV head): the pyramid walk, top level to leaves.

    ``mu_ptr``/``lcnt_ptr``: the nodes' pooled means and base-2 log counts, or with ``BOUND``
    (``bound_block``) their box maxima and log counts (``+inf``: a non-finite box), the minima
    at ``lo_ptr``; ``shi_ptr``/``slo_ptr``/``slc_ptr``: the same per sub-block of ``C / NS``
    keys (``BOUND`` only).

    With ``EXACT`` the kernel stops before the pick: it writes the leaves to score exactly
    (the ``SHORT`` best by rough score, or every candidate) to ``short_ptr`` ``[.., W]`` and
    only the forced leaves to ``idx_ptr``/``bcnt_ptr``; :func:`_rescore_kernel` picks.
    ``DEV_LEN``: the causal offset is ``len_ptr``'s live key count minus ``Nq`` (a static
    cache's decode: no host length)."""
    scale = tl.cast(scale, tl.float32)  # Inductor may pass Python floats as fp64 scalars
    if DEV_LEN:
        offset = _device_offset(len_ptr, Nq)
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    q_first, q_last, clean_end, partial_end, live_end, lo, hi = _leaf_ranges(
        t, Nq, Nk, L, offset, local_blocks, TQ, C, CAUSAL, HAS_LOCAL)

    # Rows: r = query * G + head, so the live rows of a short last tile come first.
    n_rows = (q_last - q_first + 1) * G
    n_chunks = (n_rows + RB - 1) // RB
    rr = tl.arange(0, RB)
    d = tl.arange(0, BD)
    qoff0 = (rr % G).to(tl.int64) * sqh + (q_first + rr // G).to(tl.int64) * sqn
    qbase = q_ptr + b.to(tl.int64) * sqb + (h * G).to(tl.int64) * sqh
    mbase = bh.to(tl.int64) * total
    qk_scale = scale * LOG2E  # scores are kept in base 2 for exp2
    tile = bh.to(tl.int64) * T + t
    # Sinks: the first n_sink leaves from the row's first live key (left padding skipped).
    s0 = 0
    if HAS_KEY_MASK:
        s0 = tl.load(sink_ptr + b)
    s1 = s0 + n_sink

    top = n_levels(L, GB, GB * BEAM) - 1
    span = 1
    for _ in range(top):
        span *= GB
    ar = tl.arange(0, P)
    pool = tl.where(ar < _level_size(L, GB, top), ar, -1)
    trace = trace_ptr + tile * (top + 1) * TW
    for it in range(top):
        # Two scratch rows, alternating between levels (see _children).
        pool = _internal_level(pool, span, top - it, L, Lcap, mbase, mu_ptr, lcnt_ptr, lo_ptr,
                               scr_ptr + tile * (2 * P) + (it % 2) * P, trace,
                               qbase, qoff0, rr, d, n_rows, n_chunks, q_first, sqh, sqn, sqd,
                               qk_scale, s0, s1, lo, hi, clean_end, partial_end, live_end,
                               D, BD, G, TQ, RB, GB, BEAM, P, TW, LOWP, TRACE, UNROLL,
                               BOUND, LATE)
        span = span // GB

    # Leaves: candidates are visible leaves that are not forced.
    valid = pool >= 0
    forced = valid & (((pool >= s0) & (pool < s1)) | ((pool >= lo) & (pool <= hi)))
    cand = valid & (~forced) & (pool < partial_end)
    if BOUND:
        # A leaf's box is not finite iff one of its sub-blocks' is: flags from the leaf level.
        bad = tl.load(lcnt_ptr + mbase + pool, mask=cand, other=0.0) == float("inf")
        sub0 = bh.to(tl.int64) * sub_stride + pool * NS
        mul = sub0  # unused
        bl = sub0
    else:
        mul, bl, bad = _load_summaries(mu_ptr, lcnt_ptr, mbase + pool, cand, d, D, BD)
        sub0 = pool  # unused
    if (not EXACT) or SHORT > 0:  # rough tile scores: the pick, or the shortlist
        acc = tl.zeros([RB, P], dtype=tl.float32)
        if UNROLL:
            for c in tl.static_range((G * TQ + RB - 1) // RB):
                acc += _leaf_rough_chunk(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d,
                                         mul, bl, shi_ptr, slo_ptr, slc_ptr, sub0, cand & ~bad,
                                         qk_scale, D, BD, G, RB, NS, LOWP, BOUND)
        else:
            for c in range(n_chunks):
                acc += _leaf_rough_chunk(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d,
                                         mul, bl, shi_ptr, slo_ptr, slc_ptr, sub0, cand & ~bad,
                                         qk_scale, D, BD, G, RB, NS, LOWP, BOUND)
        S = tl.sum(acc, axis=0)
    if EXACT:
        # The exact scores are a flash-style pass over the candidates' keys: its own kernel
        # (its own tiles and pipelining), fed the shortlist through an index array.
        if SHORT > 0:
            cand = cand & _top_mask(_prioritise(S, bad, cand), cand, SHORT, P)
        _store_compact(short_ptr + tile * W, pool, cand, W, W)
        chosen = forced
    else:
        picked = _top_mask(_prioritise(S, bad, cand), cand, TOPK, P)
        if TRACE:
            _store_compact(trace, pool, picked, TOPK, TW)
        chosen = picked | forced
    _store_compact(idx_ptr + tile * M, pool, chosen, M, MP)
    tl.store(bcnt_ptr + tile, tl.sum(chosen.to(tl.int32), axis=0))


@triton.jit
def _leaf_lse2(qv, qpos, kbase, skn, skd, km_row, skmn, leaf, Nk, q_first, offset, qk_scale, d,
               D: tl.constexpr, C: tl.constexpr, KC: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_KEY_MASK: tl.constexpr, LOWP: tl.constexpr):
    """Base-2 LSE ``[RB]`` of each row's scores over leaf ``leaf``'s visible keys (``-inf``:
    none), in key chunks of ``KC`` with an online max, as flash attention's row statistics.
    Rows that do not exist score as zero queries (the caller's ``_pool_share2`` drops their
    votes).

    Few operations per score (the kernel is bound by them, not by the dot): a key's validity
    (in range, and live under a key mask) is an additive ``0 / -inf`` per key, applied with
    the scale in one FMA; an invalid key loads as 0, so a masked key's NaN never reaches its
    score (it replaced a select under a key mask, about 1 ms of 38.6 over 4 layers at 32K,
    ``profiles/bench_masks_keymask_split.json``); the causal comparison runs only for a key
    chunk with keys past the position ``q_first + offset`` of the tile's first query. A
    safety net: a shortlisted leaf is clean (a tile's partial leaves are its forced local
    leaves, which the selection kernels keep out of the shortlist), so it runs for none at
    ``block_size >= 16``."""
    kc = tl.arange(0, KC)
    dm = d < D
    row_max = tl.full(qpos.shape, float("-inf"), tl.float32)
    row_sum = tl.zeros(qpos.shape, dtype=tl.float32)
    for c0 in tl.static_range(0, C, KC):
        kp = leaf * C + c0 + kc
        kin = (kp < Nk) & (c0 + kc < C)
        if HAS_KEY_MASK:
            kin = kin & (tl.load(km_row + kp.to(tl.int64) * skmn, mask=kin, other=0) != 0)
        # Out-of-range and masked keys load as 0 (a masked key may hold NaN or inf), so their
        # scores are finite and take a -inf term, in one FMA with the scale.
        kk = tl.load(kbase + kp.to(tl.int64)[:, None] * skn + d[None, :] * skd,
                     mask=kin[:, None] & dm[None, :], other=0.0)
        if LOWP:
            sk = tl.dot(qv, tl.trans(kk.to(qv.dtype)))
        else:
            sk = tl.dot(qv.to(tl.float32), tl.trans(kk.to(tl.float32)), input_precision="ieee")
        sk = sk * qk_scale + tl.where(kin, 0.0, float("-inf"))[None, :]
        if CAUSAL:
            if leaf * C + c0 + KC - 1 > q_first + offset:  # some row cannot see all of it
                sk = tl.where(kp[None, :] <= qpos[:, None] + offset, sk, float("-inf"))
        m_new = tl.maximum(row_max, tl.max(sk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        row_sum = row_sum * tl.exp2(row_max - m_use) + tl.sum(tl.exp2(sk - m_use[:, None]), axis=1)
        row_max = m_new
    m_use = tl.where(row_max == float("-inf"), 0.0, row_max)
    return tl.where(row_sum > 0, m_use + tl.log2(tl.where(row_sum > 0, row_sum, 1.0)),
                    float("-inf"))


@triton.jit
def _clean_leaf_lse2(qv, kleaf, koff, skn, qk_scale, D: tl.constexpr, BD: tl.constexpr,
                     C: tl.constexpr, KC: tl.constexpr, LOWP: tl.constexpr):
    """:func:`_leaf_lse2` for a clean leaf, whose first key is at ``kleaf``: each of its ``C``
    keys exists, is live, and is visible to every row of the tile, so no key needs a
    validity term or a causal compare. The max is taken on the raw dots and the scale and
    shift join in one FMA per score (``qk_scale > 0``): about four operations per score where
    the general function takes six, the difference between the package's leaf LSE and the
    lean core in ``profiles/rescore_real.json`` (5.55 against 5.15 ms at 32K). ``koff``
    ``[KC, BD]``: the key tile's offsets from its first key, computed once per tile (per leaf,
    64-bit products per address took a quarter of the loop's instructions, sm90 SASS)."""
    kc = tl.arange(0, KC)
    row_max = tl.full([qv.shape[0]], float("-inf"), tl.float32)
    row_sum = tl.zeros([qv.shape[0]], dtype=tl.float32)
    for c0 in tl.static_range(0, C, KC):
        if KC > C:  # tl.dot's 16-key minimum past a smaller leaf: the extra keys are not its
            kk = tl.load(kleaf + koff, mask=(kc < C)[:, None] & (koff >= 0), other=0.0)
        elif BD == D:  # no mask: full-width vector loads
            kk = tl.load(kleaf + c0 * skn + koff)
        else:
            kk = tl.load(kleaf + c0 * skn + koff, mask=koff >= 0, other=0.0)
        if LOWP:
            sk = tl.dot(qv, tl.trans(kk.to(qv.dtype)))
        else:
            sk = tl.dot(qv.to(tl.float32), tl.trans(kk.to(tl.float32)), input_precision="ieee")
        if KC > C:
            sk = tl.where((kc < C)[None, :], sk, float("-inf"))
        m_new = tl.maximum(row_max, tl.max(sk, axis=1))
        ms = m_new * qk_scale
        # (row_max - m_new) is -inf before the first chunk: its factor is 0 (row_sum is 0).
        row_sum = row_sum * tl.exp2((row_max - m_new) * qk_scale) + tl.sum(
            tl.exp2(sk * qk_scale - ms[:, None]), axis=1)
        row_max = m_new
    return row_max * qk_scale + tl.log2(row_sum)


@triton.jit
def _rescore_kernel(
    q_ptr, k_ptr, km_ptr, lcnt_ptr, short_ptr, fidx_ptr, fcnt_ptr, idx_ptr, bcnt_ptr, trace_ptr,
    scr_ptr, perm_ptr, lse_ptr, dq_ptr, sqb, sqh, sqn, sqd, skb, skh, skn, skd, skmb, skmn,
    Hkv, Nq, Nk, total, T, n_tiles, M, offset, scale, trace_stride, len_ptr,
    D: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr, C: tl.constexpr, KC: tl.constexpr,
    BD: tl.constexpr, TOPK: tl.constexpr, W: tl.constexpr, RB: tl.constexpr, MP: tl.constexpr,
    TW: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, LOWP: tl.constexpr,
    TRACE: tl.constexpr, SPLIT: tl.constexpr, FULL_BY_COUNT: tl.constexpr,
    DEV_LEN: tl.constexpr, FP8: tl.constexpr, LEAN: tl.constexpr,
):
    """Persistent programs over the ``n_tiles = B * Hkv * T`` (query tile, batch * KV head)
    pairs, tile-major within a head so that concurrent programs share the head's keys in L2:
    per tile, the exact leaf scores (LSE over each shortlisted leaf's visible keys) of every
    row, the tile score ``sum_r softmax(.)`` over the shortlist, the ``TOPK`` best picked (a
    shortlisted leaf whose keys are not finite first), merged ascending with the forced leaves
    ``fidx_ptr``/``fcnt_ptr`` into ``idx_ptr``/``bcnt_ptr``.

    Rows go in chunks of ``RB`` (``r = query * G + head``, as the select kernel); for each chunk
    the leaves are visited in turn, one ``[RB, D] x [D, KC]`` tensor-core dot per key chunk.
    Their per-row LSE go to the program's own ``[W, RB]`` row of ``scr_ptr``, read back as a
    ``[RB, W]`` tile after the chunk: a register tile would need a select over all of it per
    leaf, which cost 17.1 against 15.2 ms of selection at 32K
    (``profiles/select_rescore_tune.json``).

    Under a key mask the leaves whose keys are all live (the pyramid's count is ``C``) are
    scored first, without the mask: its load would sit between each leaf's index and its keys
    (37.6 against 30.4 ms of rescoring over 4 layers at 32K with ``attention_mask=ones``;
    31.1 with this order, ``profiles/bench_masks_keymask_split.json``).
    The program's ``[2, W]`` row of ``perm_ptr`` lists the slots in that order (leaf, slot).
    ``FULL_BY_COUNT``: ``lcnt_ptr`` counts the keys live under this call's key mask (not a
    persistent pyramid's, counted under the cache's own mask); otherwise every leaf is
    scored under the mask.

    With ``SPLIT`` (few tiles of at most ``RB`` rows: decode) the scores were computed by
    :func:`_rescore_split_kernel`, many programs per tile, into ``lse_ptr`` ``[tiles, W, RB]``;
    this kernel only reads them and picks. ``DEV_LEN``: as :func:`_select_kernel`.

    ``FP8``: ``q_ptr``/``k_ptr`` hold float8 copies scaled per batch * KV head
    (:func:`fp8_operands`), whose dequantisation factor ``dq_ptr[bh]`` joins the scale: the
    dots run at twice bf16's tensor-core rate on half the key bytes.
    """
    scale = tl.cast(scale, tl.float32)
    if DEV_LEN:
        offset = _device_offset(len_ptr, Nq)
    scr = scr_ptr + tl.program_id(0).to(tl.int64) * (W * RB)
    perm = perm_ptr + tl.program_id(0).to(tl.int64) * (2 * W)
    for tid in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        _rescore_tile(tid % T, tid // T, q_ptr, k_ptr, km_ptr, lcnt_ptr, short_ptr, fidx_ptr,
                      fcnt_ptr, idx_ptr, bcnt_ptr, trace_ptr, scr, perm, lse_ptr, dq_ptr, sqb,
                      sqh, sqn, sqd,
                      skb, skh, skn, skd, skmb, skmn, Hkv, Nq, Nk, total, T, M, offset, scale,
                      trace_stride, D, G, TQ, C, KC, BD, TOPK, W, RB, MP, TW, CAUSAL,
                      HAS_KEY_MASK, LOWP, TRACE, SPLIT, FULL_BY_COUNT, FP8, LEAN)


@triton.jit
def _rescore_split_kernel(
    q_ptr, k_ptr, km_ptr, short_ptr, lse_ptr, sqb, sqh, sqn, sqd, skb, skh, skn, skd, skmb,
    skmn, Hkv, Nq, Nk, T, offset, scale, len_ptr,
    D: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr, C: tl.constexpr, KC: tl.constexpr,
    BD: tl.constexpr, W: tl.constexpr, RB: tl.constexpr, PER: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, LOWP: tl.constexpr,
    DEV_LEN: tl.constexpr,
):
    """The exact leaf scores of one tile's shortlist slots ``[PER * program_id(1), +PER)``
    (tile ``program_id(0)``, at most ``RB`` rows) into ``lse_ptr [tiles, W, RB]``: a decode
    tile's shortlist is spread over ``W / PER`` programs instead of one walking it leaf by
    leaf (bound by the latency of each leaf's loads: 183 of a 250 us step at 128K, B=8).
    ``DEV_LEN``: as :func:`_select_kernel`."""
    scale = tl.cast(scale, tl.float32)
    if DEV_LEN:
        offset = _device_offset(len_ptr, Nq)
    tile = tl.program_id(0)
    t = tile % T
    bh = tile // T
    b = bh // Hkv
    h = bh % Hkv
    q_first = t * TQ
    n_rows = (tl.minimum(q_first + TQ, Nq) - q_first) * G
    rr = tl.arange(0, RB)
    d = tl.arange(0, BD)
    qoff0 = (rr % G).to(tl.int64) * sqh + (q_first + rr // G).to(tl.int64) * sqn
    qbase = q_ptr + b.to(tl.int64) * sqb + (h * G).to(tl.int64) * sqh
    qv, _ = _q_rows(qbase, qoff0, 0, rr, n_rows, q_first, sqh, sqn, sqd, d, D, BD, G, RB)
    qpos = q_first + rr // G
    kbase = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    km_row = km_ptr + b.to(tl.int64) * skmb
    short_row = short_ptr + tile.to(tl.int64) * W
    out = lse_ptr + tile.to(tl.int64) * (W * RB)
    for jj in range(PER):
        j = tl.program_id(1) * PER + jj
        leaf = tl.load(short_row + j, mask=j < W, other=-1)
        if leaf >= 0:  # the shortlist is compact: -1 past its last slot
            lse = _leaf_lse2(qv, qpos, kbase, skn, skd, km_row, skmn, leaf, Nk, q_first,
                             offset, scale * LOG2E, d, D, C, KC, CAUSAL, HAS_KEY_MASK, LOWP)
            tl.store(out + j * RB + rr, lse)


@triton.jit
def _rescore_tile(
    t, bh, q_ptr, k_ptr, km_ptr, lcnt_ptr, short_ptr, fidx_ptr, fcnt_ptr, idx_ptr, bcnt_ptr,
    trace_ptr, scr, perm, lse_ptr, dq_ptr, sqb, sqh, sqn, sqd, skb, skh, skn, skd, skmb, skmn,
    Hkv, Nq, Nk, total, T, M, offset, scale, trace_stride,
    D: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr, C: tl.constexpr, KC: tl.constexpr,
    BD: tl.constexpr, TOPK: tl.constexpr, W: tl.constexpr, RB: tl.constexpr, MP: tl.constexpr,
    TW: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, LOWP: tl.constexpr,
    TRACE: tl.constexpr, SPLIT: tl.constexpr, FULL_BY_COUNT: tl.constexpr, FP8: tl.constexpr,
    LEAN: tl.constexpr,
):
    """One tile of :func:`_rescore_kernel`: query tile ``t`` of batch * KV head ``bh``."""
    b = bh // Hkv
    h = bh % Hkv
    tile = bh.to(tl.int64) * T + t
    q_first = t * TQ
    n_rows = (tl.minimum(q_first + TQ, Nq) - q_first) * G
    ws = tl.arange(0, W)
    short_row = short_ptr + tile * W
    ids = tl.load(short_row + ws)
    ok = ids >= 0
    # The pyramid's leaf log count is +inf for a leaf holding a non-finite key.
    lc = tl.load(lcnt_ptr + bh.to(tl.int64) * total + ids, mask=ok, other=0.0)
    bad = ok & (lc == float("inf"))
    n_ok = tl.sum(ok.to(tl.int32), axis=0)
    S = tl.zeros([W], dtype=tl.float32)
    if n_ok > TOPK:  # otherwise every shortlisted leaf is picked
        rr = tl.arange(0, RB)
        d = tl.arange(0, BD)
        qoff0 = (rr % G).to(tl.int64) * sqh + (q_first + rr // G).to(tl.int64) * sqn
        qbase = q_ptr + b.to(tl.int64) * sqb + (h * G).to(tl.int64) * sqh
        kbase = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
        km_row = km_ptr + b.to(tl.int64) * skmb
        qk_scale = scale * LOG2E
        kcol = tl.arange(0, KC)
        # A clean leaf's key tile offsets; -1 marks head-dim padding columns (BD > D).
        koff = kcol[:, None] * skn + d[None, :] * skd
        if BD > D:
            koff = tl.where((d < D)[None, :], koff, -1)
        if FP8:
            qk_scale = qk_scale * tl.load(dq_ptr + bh)
        # Clean leaves (every key in range, live, and visible to the tile's first row, so to
        # all of its rows) are visited first and take the lean score; the rest the general one.
        lim = Nk // C
        if CAUSAL:
            lim = tl.minimum(lim, (q_first + offset + 1) // C)
        # Only for qk_scale > 0 in fp32: the lean score's max on raw dots is wrong for a
        # scale <= 0 or NaN, and a positive scale below fp32's range (or an fp8 factor
        # flushed to 0) makes its first rescale (-inf) * 0 = NaN. (A scalar in a where: see
        # _prioritise.)
        clean = ok & (ids < tl.where(qk_scale > 0, lim, 0))
        if not LEAN:  # RESCORE_TUNING["lean"] off: every leaf takes the general score
            clean = ok & (ids < 0)
        leaves = short_row
        slots = ws  # unused without a key mask: the visit order is the slot order
        if HAS_KEY_MASK:
            if FULL_BY_COUNT:
                # All C keys live: a count above C - 1/2 (an approximate log2 count).
                clean = clean & ~bad & (tl.exp2(lc) > C - 0.5)
            else:  # counts of another key mask (a persistent pyramid's): trust none
                clean = ok & (ids < 0)
            f_pos, n_first = _compact_pos(clean)
            p_pos, _ = _compact_pos(ok & ~clean)
            order = tl.where(clean, f_pos, n_first + p_pos)
            tl.store(perm + order, ids, mask=ok)
            tl.store(perm + W + order, ws, mask=ok)
            tl.debug_barrier()  # every thread reads the whole order back
            leaves = perm
            slots = perm + W
        else:  # the shortlist is ascending, so its clean leaves lead: visit the leading run
            n_first = tl.minimum(tl.min(tl.where(ok & ~clean, ws, W), axis=0), n_ok)
        if SPLIT:  # one row chunk, its scores already in lse_ptr
            _, row_ok = _q_rows(qbase, qoff0, 0, rr, n_rows, q_first, sqh, sqn, sqd, d, D, BD,
                                G, RB)
            s = tl.load(lse_ptr + tile * (W * RB) + ws[None, :] * RB + rr[:, None],
                        mask=(ws < n_ok)[None, :], other=float("-inf"))
            S += _pool_share2(s, ok & ~bad, row_ok)
        for c in range(0 if SPLIT else (n_rows + RB - 1) // RB):
            qv, row_ok = _q_rows(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, D, BD,
                                 G, RB)
            qpos = q_first + (c * RB + rr) // G
            for j in range(n_first):  # the shortlist is compact: slots [0, n_ok)
                leaf = tl.load(leaves + j)
                lse = _clean_leaf_lse2(qv, kbase + (leaf * C).to(tl.int64) * skn, koff, skn,
                                       qk_scale, D, BD, C, KC, LOWP)
                if HAS_KEY_MASK:
                    tl.store(scr + tl.load(slots + j) * RB + rr, lse)
                else:
                    tl.store(scr + j * RB + rr, lse)
            for j in range(n_first, n_ok):  # leaves with a masked, missing or future key
                leaf = tl.load(leaves + j)
                lse = _leaf_lse2(qv, qpos, kbase, skn, skd, km_row, skmn, leaf, Nk, q_first,
                                 offset, qk_scale, d, D, C, KC, CAUSAL, HAS_KEY_MASK, LOWP)
                if HAS_KEY_MASK:
                    tl.store(scr + tl.load(slots + j) * RB + rr, lse)
                else:
                    tl.store(scr + j * RB + rr, lse)
            tl.debug_barrier()  # the chunk's stores, visible to all of the program's threads
            s = tl.load(scr + ws[None, :] * RB + rr[:, None], mask=(ws < n_ok)[None, :],
                        other=float("-inf"))
            tl.debug_barrier()  # read before the next chunk or tile writes again
            S += _pool_share2(s, ok & ~bad, row_ok)
    picked = _top_mask(_prioritise(S, bad, ok), ok, TOPK, W)
    if TRACE:
        _store_compact(trace_ptr + tile * trace_stride, ids, picked, TOPK, TW)
    # Merge with the forced leaves (disjoint, both ascending): each entry's rank in the union.
    fs = tl.arange(0, MP)
    n_f = tl.load(fcnt_ptr + tile)
    f_ok = fs < n_f
    fid = tl.load(fidx_ptr + tile * M + fs, mask=f_ok, other=-1)
    p_pos, n_p = _compact_pos(picked)
    pos_p = p_pos + tl.sum((f_ok[None, :] & (fid[None, :] < ids[:, None])).to(tl.int32), axis=1)
    pos_f = fs + tl.sum((picked[None, :] & (ids[None, :] < fid[:, None])).to(tl.int32), axis=1)
    out = idx_ptr + tile * M
    tl.store(out + pos_p, ids, mask=picked & (pos_p < M))
    tl.store(out + pos_f, fid, mask=f_ok & (pos_f < M))
    tl.store(out + fs, tl.full([MP], -1, tl.int32), mask=(fs >= n_p + n_f) & (fs < M))
    tl.store(bcnt_ptr + tile, n_p + n_f)


@triton.jit
def _flat_chunk(qp, qn, j, sb, partial_end, s0, s1, lo, hi, lcnt_ptr, lbase, shi_ptr, slo_ptr,
                slc_ptr, sbase, qk_scale, d, D: tl.constexpr, BD: tl.constexpr,
                LB: tl.constexpr, NS: tl.constexpr, LOWP: tl.constexpr):
    """Base-2 box bounds ``[RB, LB * NS]`` of leaf chunk ``j``'s sub-blocks (``sb``: their
    offsets in the chunk), ``-inf`` for sub-blocks of leaves that are not candidates (past
    ``partial_end``, forced, or with a non-finite box)."""
    leaf = j * LB + sb // NS
    ok = (leaf < partial_end) & ~((leaf >= s0) & (leaf < s1)) & ~((leaf >= lo) & (leaf <= hi))
    ok = ok & (tl.load(lcnt_ptr + lbase + leaf, mask=ok, other=0.0) != float("inf"))
    sidx = sbase + j * (LB * NS) + sb
    hi_box, b, _ = _load_summaries(shi_ptr, slc_ptr, sidx, ok, d, D, BD)
    return _bound2(qp, qn, hi_box, _load_lo(slo_ptr, sidx, ok, d, D, BD), b, qk_scale, LOWP)


@triton.jit
def _top_n_mask(S, cand, n, LP: tl.constexpr):
    """``cand`` entries among the best ``n`` by ``S >= 0`` (``+inf`` allowed), ties to the
    lower index, as :func:`_top_mask` but for wide vectors: the ``n``-th best value is found
    by a bisection over the fp32 bit patterns (which order as the values for ``S >= 0``),
    31 reductions of ``LP`` entries instead of an ``LP x LP`` count."""
    bits = tl.where(cand, tl.where(S > 0, S, 0.0).to(tl.int32, bitcast=True), -1)
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.full([], 0x7F800000, tl.int32)
    for _ in tl.static_range(31):  # the largest thr with at least n entries >= thr
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((bits >= mid).to(tl.int32), axis=0) >= n
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = bits > lo
    eq = (bits == lo).to(tl.int32)
    room = n - tl.sum(above.to(tl.int32), axis=0)
    keep = cand & (above | ((eq != 0) & (tl.cumsum(eq, axis=0) - eq < room)))
    # (a scalar in a where: see _prioritise)
    return tl.where(tl.sum(cand.to(tl.int32), axis=0) <= n, cand, keep)


@triton.jit
def _flat_kernel(
    q_ptr, sink_ptr, lcnt_ptr, shi_ptr, slo_ptr, slc_ptr, idx_ptr, bcnt_ptr, short_ptr, scr_ptr,
    sqb, sqh, sqn, sqd,
    Hkv, Nq, Nk, L, sub_stride, total, T, n_tiles, M, n_sink, local_blocks, offset, scale,
    len_ptr,
    D: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr, C: tl.constexpr, BD: tl.constexpr,
    RB: tl.constexpr, LB: tl.constexpr, NS: tl.constexpr, MP: tl.constexpr, W: tl.constexpr,
    SHORT: tl.constexpr, LP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LOCAL: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, LOWP: tl.constexpr, DEV_LEN: tl.constexpr,
):
    """Persistent programs over the ``n_tiles = B * Hkv * T`` (query tile, batch * KV head)
    pairs: the single-level walk (every visible leaf in the pool, ``flat_leaves``) without an
    ``L``-wide register pool.

    Same result as :func:`_select_kernel` with ``BOUND``, ``EXACT`` and ``SHORT`` at the leaf
    level: each row's rough leaf score is the LSE of its ``NS`` sub-blocks' box bounds, the
    tile vote the sum over rows of each row's softmax over the candidates, and the ``SHORT``
    best go to ``short_ptr`` for :func:`_rescore_kernel`; the forced leaves to
    ``idx_ptr``/``bcnt_ptr``. The leaves stream through in chunks of ``LB`` (``LB * NS``
    sub-blocks per ``[RB, D] x [D, LB * NS]`` dot pair) once per row chunk, which keeps each
    row's softmax normaliser (online, as flash attention's row statistics) and writes the
    rows' rough leaf scores to the program's ``[RB, LP]`` scratch rows; a second pass over
    those scores (not over the boxes again: that was half the kernel's time) adds the rows'
    shares into the program's vote row (``[LP]`` after them), from which :func:`_top_n_mask`
    picks. The sub-blocks of batch * KV head ``bh`` start at row ``bh * sub_stride`` (``L *
    NS`` for the call's own buffers; a persistent pyramid's leaf level, ``NS = 1``, at ``bh *
    total``). ``DEV_LEN``: as :func:`_select_kernel`.
    """
    scale = tl.cast(scale, tl.float32)
    if DEV_LEN:
        offset = _device_offset(len_ptr, Nq)
    qk_scale = scale * LOG2E
    rr = tl.arange(0, RB)
    d = tl.arange(0, BD)
    sb = tl.arange(0, LB * NS)
    lb = tl.arange(0, LB)
    ar = tl.arange(0, LP)
    scr = scr_ptr + tl.program_id(0).to(tl.int64) * ((RB + 1) * LP)
    vrow = scr + RB * LP
    for tid in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        t = tid % T
        bh = tid // T
        b = bh // Hkv
        h = bh % Hkv
        q_first, q_last, clean_end, partial_end, live_end, lo, hi = _leaf_ranges(
            t, Nq, Nk, L, offset, local_blocks, TQ, C, CAUSAL, HAS_LOCAL)
        n_rows = (q_last - q_first + 1) * G
        qoff0 = (rr % G).to(tl.int64) * sqh + (q_first + rr // G).to(tl.int64) * sqn
        qbase = q_ptr + b.to(tl.int64) * sqb + (h * G).to(tl.int64) * sqh
        tile = bh.to(tl.int64) * T + t
        s0 = 0
        if HAS_KEY_MASK:
            s0 = tl.load(sink_ptr + b)
        s1 = s0 + n_sink
        lbase = bh.to(tl.int64) * total  # the leaf level comes first in the pyramid's buffers
        sbase = bh.to(tl.int64) * sub_stride
        n_lc = (partial_end + LB - 1) // LB  # candidates lie below partial_end
        for c in range((n_rows + RB - 1) // RB):
            qv, row_ok = _q_rows(qbase, qoff0, c, rr, n_rows, q_first, sqh, sqn, sqd, d, D,
                                 BD, G, RB)
            qp, qn = _split_q(qv)
            m = tl.full([RB], float("-inf"), tl.float32)
            den = tl.zeros([RB], dtype=tl.float32)
            for j in range(n_lc):  # each row's max and sum, and its rough leaf scores
                s = _flat_chunk(qp, qn, j, sb, partial_end, s0, s1, lo, hi, lcnt_ptr, lbase,
                                shi_ptr, slo_ptr, slc_ptr, sbase, qk_scale, d, D, BD, LB, NS,
                                LOWP)
                m_new = tl.maximum(m, tl.max(s, axis=1))
                ms = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - ms[:, None])
                den = den * tl.exp2(m - ms) + tl.sum(p, axis=1)
                m = m_new
                # A leaf's rough score, LSE of its sub-blocks: ms + log2(sum of their p); its
                # share below, exp2(that - norm), is the sum of exp2(s - norm) over them.
                a = tl.sum(tl.reshape(p, [RB, LB, NS]), axis=2)
                tl.store(scr + rr[:, None] * LP + (j * LB + lb)[None, :],
                         ms[:, None] + tl.log2(a))
            # A row votes if valid with a positive, finite sum (as _row_share). Its share is
            # exp2(r - norm) with norm = max + log2(sum); a row that does not vote adds 0.
            voting = row_ok & (den > 0) & (den < float("inf"))
            norm = tl.where(voting, m + tl.log2(tl.where(voting, den, 1.0)), float("inf"))
            tl.debug_barrier()  # the scores were written by other threads
            for j in range(n_lc):  # the shares, summed over rows
                r = tl.load(scr + rr[:, None] * LP + (j * LB + lb)[None, :])
                e = tl.where(voting[:, None], tl.exp2(r - norm[:, None]), 0.0)
                v = tl.sum(e, axis=0)
                if c > 0:
                    v += tl.load(vrow + j * LB + lb)
                tl.store(vrow + j * LB + lb, v)
            tl.debug_barrier()  # the next chunk (and the pick) reads what other threads wrote
        valid = ar < L
        forced = valid & (((ar >= s0) & (ar < s1)) | ((ar >= lo) & (ar <= hi)))
        cand = valid & (~forced) & (ar < partial_end)
        bad = tl.load(lcnt_ptr + lbase + ar, mask=cand, other=0.0) == float("inf")
        S = tl.load(vrow + ar, mask=cand, other=0.0)
        picked = _top_n_mask(_prioritise(S, bad, cand), cand, SHORT, LP)
        _store_compact(short_ptr + tile * W, ar, picked, W, W)
        _store_compact(idx_ptr + tile * M, ar, forced, M, MP)
        tl.store(bcnt_ptr + tile, tl.sum(forced.to(tl.int32), axis=0))
        tl.debug_barrier()  # the vote row is read before the next tile writes it


# Launch settings of the select kernel, measured on the H200 (benchmarks/bench_select.py
# --tune sweeps them):
# - row_block: rows per scoring chunk. 64 = one warpgroup's wgmma M: 4 warps, about 255
#   registers, no spills (128K causal: 17.7 ms against 20.3 ms at 128 rows);
# - num_warps: None = 4, or 8 when a chunk's [row_block, pool] scores reach 8192 entries
#   and the summaries are loaded up front;
# - num_stages, maxnreg: None = Triton's defaults. The default pipelines the per-chunk q loads
#   (cp.async) at about 255 registers, 2 programs per SM; num_stages=1, maxnreg=168 trades the
#   prefetch for a third program per SM;
# - unroll: unroll the row-chunk loop of tiles with at most this many chunks (True: 16, False:
#   never). Each level's summaries then go to shared memory once instead of once per chunk, at
#   the price of no cp.async prefetch of q. 1: the defaults' 16-query tiles at G = 4 (one
#   chunk) select in 14.0 ms instead of 16.2 at 32K and 67.5 instead of 78.9 at 128K (pyramid,
#   boxes, walk and rescoring; standard shape); two chunks (G = 7, Qwen's heads) gained
#   nothing (5.36 against 5.27 ms at 32K). profiles/select_tune.json.
# - late_loads: each internal level loads a child's summaries right before its dots instead
#   of all children up front: 64 KB of shared memory per program instead of 144 KB (defaults,
#   D = 128, compiled offline for sm90 by benchmarks/kernel_resources.py), so two 4-warp
#   programs fit an SM, at more spilled registers. None = on for box-bound walks (whose
#   children's boxes are what fills shared memory), with 4 warps: the defaults (then: the walk
#   at 32K, 64-leaf shortlist) select in 11.65 ms instead of 14.0 (8 warps, loads up front) at
#   32K, the same blocks.
#   profiles/select_tune.json, run d.
SELECT_TUNING = dict(row_block=64, num_warps=None, num_stages=None, maxnreg=None, unroll=1,
                     late_loads=None)

# Launch settings of the exact rescoring kernel (``leaf_scoring="exact"``): rows per chunk
# (capped so that the [rows, shortlist] fp32 scores read back from scratch fit in registers),
# keys per dot, persistent programs per multiprocessor (which bounds the scratch; 2 to 16 time
# the same at 32K, profiles/select_rescore_tune.json).
# Two or four leaves per dot ([2C or 4C, D] key tiles) spilled 438-510 registers and took 31-49
# ms instead of 19.3 at 32K (defaults, 128-leaf shortlist; profiles/select_flat_tune.json).
# split: None (auto: tiles of one row chunk, fewer than two per multiprocessor, as in decode),
# True or False; split_leaves: shortlist slots per program of the split scores (2: 0.112 ms
# per decode step at 128K, B=8, against 0.123 with 8 and 0.136 with 32,
# profiles/decode_probe.json).
# lean: clean shortlisted leaves (every key in range, live and visible to the whole tile; all
# of them without a key mask at block_size >= 16) take :func:`_clean_leaf_lse2`, without a
# validity term or causal compare per score (selection 11.63 against 12.51 ms at 32K, 45.52
# against 48.97 at 128K, the same blocks; profiles/select_lean.json). False: every leaf takes
# :func:`_leaf_lse2`.
# maxnreg: a register cap per thread (None: Triton's choice). Uncapped the kernel takes 233
# registers on the H200, so two 4-warp programs share an SM; at 128 (56 spilled) four do, and
# selection at 32K takes 12.93 ms instead of 15.15 (128K: 48.94 against 57.91; the same
# blocks; 168 with three programs per SM: 13.26; profiles/select_rescore_regs.json).
# fp8: the exact scores' dots on float8 copies of q and k (:func:`fp8_operands`; calls
# without a persistent pyramid, not split): twice bf16's tensor-core rate on half the key
# bytes, at float8's rounding of the scores. Off until measured on the H200 (speed:
# bench_select.py --tune-rescore; quality: eval_llm on the Qwen model); the interpreter
# tests check it scores the dequantised operands.
RESCORE_TUNING = dict(row_block=64, key_block=64, num_warps=4, num_stages=None,
                      programs_per_sm=4, split=None, split_leaves=2, maxnreg=128, fp8=False,
                      lean=True)

# Launch settings of the flat kernel (one-level pools wider than the walk's): rows per chunk,
# leaves per chunk (leaf_block * block_size / bound_block sub-blocks per dot), warps. At 32K
# (defaults, standard shape) 16 leaves select in 17.9 ms, 32 in 19.3 (8 warps: 21.4); 64 need
# more shared memory than an SM has (profiles/select_flat_tune.json).
FLAT_TUNING = dict(row_block=64, leaf_block=16, num_warps=4, programs_per_sm=2)
# Widest one-level pool the walk kernel holds in registers; past it, the flat kernel.
WALK_MAX_POOL = 128


def pool_size(branching: int, beam: int, n_forced: int) -> int:
    """Pool width: ``pow2(g * (beam + n_forced))`` (at least 16 for ``tl.dot``)."""
    return max(16, triton.next_power_of_2(branching * (beam + n_forced)))


def trace_width(beam: int) -> int:
    """Last dimension of the ``trace`` buffer of :func:`select_blocks`."""
    return triton.next_power_of_2(beam)


def box_buffers(k: Tensor, cnt: Tensor, total: int, block_size: int, bound_block: int,
                branching: int, beam: int, dtype: torch.dtype,
                live_limit: Optional[int] = None, key_live: Optional[Tensor] = None):
    """Per-channel key boxes for ``bound_block`` (``reference.build_boxes``), laid out like the
    pyramid's flat buffers, built with torch ops (``O(Nk * D)``, once per call).

    Args:
        k: ``[B, Hkv, Nk, D]``; cnt: the pyramid's live keys per node, float32
            ``[B, Hkv, total]`` (:func:`pyramid_buffers`); total: its row count.
        block_size, bound_block, branching, beam: ``C``, ``S``, ``g`` and the resolved beam.
        dtype: the dots' input dtype (q's).
        live_limit, key_live: the liveness :func:`pyramid_buffers` was given (keys at or past
            ``live_limit`` and keys where ``key_live`` [B, 1, Nk] is 0 are not live).

    Returns:
        ``hi, lo`` ``dtype`` ``[B, Hkv, total, D]``: channel max/min of each node's live keys,
        and ``lc`` float32 ``[B, Hkv, total]``: ``log2 n`` (``-inf`` empty); then ``shi, slo``
        ``[B, Hkv, L * C / S, D]`` and ``slc`` ``[B, Hkv, L * C / S]``, the same per
        sub-block of ``S`` keys. Empty boxes are 0; a box holding a non-finite key is zeroed
        and its log count is ``+inf`` (kept first, like a non-finite pooled summary). Rows
        past the last level are unused.
    """
    B, Hkv, Nk, D = k.shape
    pos = torch.arange(Nk, device=k.device)
    live = (pos < (Nk if live_limit is None else live_limit)).view(1, 1, Nk)
    if key_live is not None:
        live = live & (key_live != 0)
    sizes = level_sizes(Nk, block_size, branching, beam)
    counts = list(cnt[:, :, :sum(sizes)].split(sizes, dim=2))
    boxes = reference.build_boxes(k, live, block_size, bound_block, branching, counts)

    def finish(h: Tensor, x: Tensor, n: Tensor):
        # Non-finite boxes: zeroed, log count +inf (kept first); empty ones are already 0.
        bad = (n > 0) & ~(torch.isfinite(h).all(-1) & torch.isfinite(x).all(-1))
        lc = torch.where(bad, float("inf"), torch.log2(n))
        return (h.masked_fill(bad[..., None], 0.0).to(dtype),
                x.masked_fill(bad[..., None], 0.0).to(dtype), lc)

    hi = torch.zeros(B, Hkv, total, D, dtype=dtype, device=k.device)
    lo = torch.zeros_like(hi)
    lc = torch.full((B, Hkv, total), float("-inf"), device=k.device)
    off = 0
    for h, x, n in zip(boxes.his, boxes.los, counts):
        n_l = n.shape[2]
        hi[:, :, off:off + n_l], lo[:, :, off:off + n_l], lc[:, :, off:off + n_l] = finish(h, x, n)
        off += n_l
    return (hi, lo, lc, *finish(boxes.sub_hi, boxes.sub_lo, boxes.sub_counts))


def select_launch(G: int, Nq: int, Nk: int, D: int, *, block_size: int, top_k: int,
                  branching: int, beam: int, sink_blocks: int, local_blocks: int,
                  query_tile: int, leaf_scoring: str, shortlist: int = 0,
                  bound_block: int = 0, flat_leaves: int = 0,
                  tuning: Optional[Mapping] = None) -> tuple[dict, dict]:
    """The select kernel's shape constexprs and launch options for ``G`` query heads per KV
    head, ``Nq`` queries, ``Nk`` keys and head dim ``D`` under the PISA options of
    :func:`select_blocks` (which launches with them, adding the per-call flags; so does
    ``benchmarks/kernel_resources.py``, which compiles the kernel offline).

    Returns:
        ``(constexprs, options)``: the kernel's constexpr arguments that depend only on the
        shape, options and tuning (and ``FLAT``, not an argument: whether the call runs on
        :func:`_flat_kernel` instead), and ``num_warps`` (plus ``num_stages``/``maxnreg`` where
        tuned).
    """
    tune = {**SELECT_TUNING, **(tuning or {})}
    C, Tq = block_size, query_tile
    L = cdiv(Nk, C)
    # At most L leaves to pick or shortlist: a larger top_k (beam, shortlist) would only size
    # the pool, shortlist and scratch buffers past every limit, for the same selection.
    top_k = min(top_k, L)
    beam = flat_beam(Nk, block_size, branching, beam, flat_leaves, leaf_scoring=leaf_scoring,
                     shortlist=shortlist, bound_block=bound_block)
    M = block_width(Nk, block_size, top_k, sink_blocks, local_blocks, query_tile)
    P = pool_size(branching, beam, min(sink_blocks, L)
                  + local_bound(local_blocks, query_tile, block_size))
    R = G * Tq
    RB = min(tune["row_block"], max(16, triton.next_power_of_2(min(R, G * Nq))))
    exact = leaf_scoring == "exact"
    # One level wider than the walk's registers hold: the flat kernel (exact leaves with a
    # shortlist and box bounds; other one-level pools stay on the walk kernel).
    one_level = len(level_sizes(Nk, C, branching, beam)) == 1
    flat = exact and int(shortlist) > 0 and bool(bound_block) and P > WALK_MAX_POOL and one_level
    if one_level and not flat:
        # The pool is the L leaves (no expanded nodes): its [P, P] rank fits Triton's tensor
        # size limit up to 1024 leaves, also where top_k >= L made beam = L.
        P = min(P, max(16, triton.next_power_of_2(L)))
    # A shortlist as wide as the pool is the whole pool: no rough pass (on the walk kernel;
    # the flat kernel always ranks, its candidates can be fewer than the shortlist).
    short = min(int(shortlist), L) if exact and (flat or int(shortlist) < P) else 0
    unroll = 16 if tune["unroll"] is True else int(tune["unroll"])
    meta = dict(D=D, G=G, TQ=Tq, C=C, BD=max(16, triton.next_power_of_2(D)), GB=branching,
                BEAM=beam, TOPK=top_k, P=P, RB=RB, MP=max(16, triton.next_power_of_2(M)),
                TW=trace_width(beam),
                # Exact scoring: the select kernel writes the shortlist (width W) and the
                # forced leaves, the rescoring kernel picks into idx/counts.
                W=max(16, triton.next_power_of_2(short)) if short else P,
                EXACT=exact, SHORT=short, UNROLL=cdiv(R, RB) <= min(16, unroll),
                BOUND=bool(bound_block), NS=block_size // bound_block if bound_block else 1,
                LATE=bool(bound_block) if tune["late_loads"] is None else bool(tune["late_loads"]))
    meta["FLAT"] = flat
    options = {key: tune[key] for key in ("num_stages", "maxnreg") if tune[key] is not None}
    options["num_warps"] = tune["num_warps"] or (4 if meta["LATE"] or RB * P < 8192 else 8)
    return meta, options


def runs_flat(n_keys: int, **options) -> bool:
    """Whether :func:`select_blocks` over ``n_keys`` keys ranks them in :func:`_flat_kernel`
    (after ``flat_leaves`` raised the beam, one pyramid level wider than the walk's
    registers) rather than on the walk. ``options``: :meth:`PisaConfig.selection_options`
    (``bound_block`` as the call has it: ``block_size`` for a persistent pyramid). The
    persistent pyramid's decode cost model reads it at every step, hence the cache (of
    WALK_MAX_POOL as it was at the first call for those options)."""
    return _runs_flat(n_keys, tuple(sorted(options.items())))


@functools.lru_cache(maxsize=4096)
def _runs_flat(n_keys: int, options: tuple) -> bool:
    meta, _ = select_launch(1, 1, n_keys, 16, **dict(options))
    return bool(meta["FLAT"])


def select_blocks(q: Tensor, k: Tensor, is_causal: bool, scale: float, *, block_size: int,
                  top_k: int, branching: int, beam: int, sink_blocks: int, local_blocks: int,
                  query_tile: int, leaf_scoring: str, shortlist: int = 0,
                  bound_block: int = 0, flat_leaves: int = 0,
                  key_mask: Optional[Tensor] = None, causal_offset: int = 0,
                  trace: Optional[Tensor] = None,
                  tuning: Optional[Mapping] = None,
                  pyramid: Optional[BoxPyramid] = None,
                  key_length: Optional[Tensor] = None,
                  summaries: Optional[tuple] = None) -> tuple[Tensor, Tensor]:
    """Triton coarse-to-fine selection; same contract as ``reference.select_blocks`` without
    an explicit ``attn_mask`` (``dispatch.plan`` sends those calls to the reference).

    Args:
        q: ``[B, Hq, Nq, D]`` fp16/bf16/fp32, ``Nq >= 1``; k: ``[B, Hkv, Nk, D]``, ``Nk >= 1``.
        is_causal: query ``i`` sees keys ``j <= i + causal_offset`` (``causal_offset >= 0``;
            needs ``local_blocks >= 1``); scale: softmax scale.
        key_mask: None or bool ``[B, Nk]``: False keys (padding) are left out of the leaf
            summaries and of exact leaf scores.
        block_size, top_k, branching, beam, sink_blocks, local_blocks, query_tile,
        leaf_scoring, shortlist: the PISA options of those names (``beam`` resolved,
        ``shortlist`` 0 for None).
        bound_block: 0, or ``S``: rough scores are box bounds (internal nodes: over their
            children's boxes; leaves: over their ``S``-key sub-blocks), see
            :func:`box_buffers`.
        flat_leaves: a call with at most this many leaves raises its beam to one pyramid
            level (:func:`geometry.flat_beam`); a pool wider than ``WALK_MAX_POOL`` then runs
            on :func:`_flat_kernel`.
        trace: tests only: int32 ``[B, Hkv, T, n_levels, trace_width(beam)]`` receives the
            kept nodes per level (level 0: the picked leaves), ascending, -1 padded, so a
            test can diff every level against the reference (``beam`` as raised by
            ``geometry.flat_beam``; one level when flat).
        tuning: overrides of :data:`SELECT_TUNING`, under ``"rescore"`` of
            :data:`RESCORE_TUNING` and under ``"flat"`` of :data:`FLAT_TUNING` (benchmark
            sweeps).
        pyramid: a persistent :class:`~.persistent.BoxPyramid` up to date for these
            ``Nk`` keys under this ``key_mask`` (a KV cache's, :mod:`pisa_compile.kv_cache`):
            nothing is built, so the call reads no key outside the shortlist. Its boxes are
            per leaf: ``bound_block`` is taken as ``block_size``; up to ``flat_leaves``
            leaves the flat kernel ranks every leaf box (the pyramid's leaf level), past it
            the walk (a pool wider than 128 nodes on the walk kernel). ``block_size``,
            ``branching`` and the resolved ``beam`` must be the pyramid's.
        key_length: with a causal ``pyramid`` only: the live keys, an int32/int64 tensor of
            one element on ``q``'s device (a static cache's length, never read on the host,
            so that the call can be captured in a CUDA graph); the causal offset is then
            ``key_length - Nq`` (``causal_offset`` is ignored), and keys past it must be
            masked by ``key_mask``, which the exact scores read.
        summaries: ``(mu, cnt, lcnt, total)`` as :func:`~.triton_pyramid.pyramid_buffers`
            returns them for these ``Nk`` keys (all live), or None to build them from ``k``.
            Only with pooled leaves and no ``bound_block``: the call then reads no key, and
            ``k`` may be a meta tensor of the keys' shape (context parallelism).

    Returns:
        ``block_indices`` int32 ``[B, Hkv, T, M]`` (ascending, -1 padded, forced leaves
        included) and ``block_counts`` int32 ``[B, Hkv, T]``. ``top_k``, ``beam`` and
        ``shortlist`` past the ``L = ceil(Nk / block_size)`` leaves select as if ``L``.

    Raises:
        ValueError: a ``pyramid`` laid out for other options, dtype, device, head dim or
            keys; a causal ``pyramid`` call whose keys outrun its queries; ``key_length``
            without a causal ``pyramid`` call and a ``key_mask``, or not one int32/int64 on
            ``q``'s device; a pool (the walk), shortlist or block list (exact scores) wider
            than 1024 nodes per tile (a Triton tensor holds at most 2**20 elements);
            ``summaries`` with other than pooled leaves, or with a ``bound_block``,
            ``pyramid`` or ``key_mask``.
    """
    q, scale = positive_scale(q, scale)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    C, Tq = block_size, query_tile
    T = cdiv(Nq, Tq)
    if summaries is not None and (leaf_scoring != "pooled" or bound_block or pyramid is not None
                                  or key_mask is not None):
        raise ValueError("summaries need leaf_scoring='pooled', bound_block=0, no pyramid and "
                         "no key_mask (the call then reads no key)")
    if pyramid is not None:
        bound_block = block_size
        if (pyramid.block_size, pyramid.branching, pyramid.beam) != (block_size, branching,
                                                                    beam):
            raise ValueError(
                f"pyramid was laid out for block_size={pyramid.block_size}, branching="
                f"{pyramid.branching}, beam={pyramid.beam}; the call has {block_size}, "
                f"{branching}, {beam}")
        if pyramid.hi.dtype != q.dtype or pyramid.hi.device != q.device or (
                pyramid.hi.shape[3] != D):
            raise ValueError(f"pyramid boxes are {pyramid.hi.dtype} on {pyramid.hi.device} of "
                             f"head dim {pyramid.hi.shape[3]}; q is {q.dtype} on {q.device}, "
                             f"head dim {D}")
        if key_length is not None:
            if not is_causal or key_mask is None or key_length.numel() != 1 or (
                    key_length.device != q.device) or key_length.dtype not in (torch.int32,
                                                                             torch.int64):
                raise ValueError("key_length needs a causal call with a key_mask, as one "
                                 f"int32/int64 on {q.device}")
            causal_offset = Nk - Nq  # host-side sizes only; the kernels read key_length
        elif is_causal and Nq + causal_offset < Nk:
            raise ValueError(f"a pyramid holds every key: a causal call needs Nq + "
                             f"causal_offset >= Nk, got {Nq} + {causal_offset} < {Nk}")
        if Nk > pyramid.capacity or pyramid.hi.shape[:2] != k.shape[:2]:
            raise ValueError(f"pyramid holds {pyramid.capacity} keys of "
                             f"{tuple(pyramid.hi.shape[:2])} (B, Hkv); k is {tuple(k.shape)}")
    beam = flat_beam(Nk, block_size, branching, beam, flat_leaves, leaf_scoring=leaf_scoring,
                     shortlist=shortlist, bound_block=bound_block)
    if key_length is not None and pyramid is None:
        raise ValueError("key_length needs a persistent pyramid")
    # Read as bytes: a value cast (Inductor cannot lower bool->uint8 views); q: never read.
    km = q if key_mask is None else key_mask.to(torch.uint8)
    len_arg = q if key_length is None else key_length  # q: never read without DEV_LEN
    live_limit = min(Nk, Nq + causal_offset) if is_causal else None
    key_live = None if key_mask is None else km[:, None, :]
    L = cdiv(Nk, C)
    if pyramid is not None:
        # Per-leaf boxes: the leaf level is its own sub-block level.
        total, Lcap = pyramid.total, pyramid.leaf_capacity
        boxes = (pyramid.hi, pyramid.lo, pyramid.lc, pyramid.hi, pyramid.lo, pyramid.lc)
        sub_stride = total
    elif summaries is not None:
        Lcap, sub_stride = L, L
        mu, cnt, lcnt, total = summaries
    else:
        Lcap = L
        sub_stride = L * (block_size // bound_block if bound_block else 1)
        with stage_range("pisa.pyramid", k):
            mu, cnt, lcnt, total = pyramid_buffers(k, block_size, branching, beam,
                                                   live_limit=live_limit, key_live=key_live)
            if bound_block:
                # The same liveness and counts as the pyramid, so boxes and terms agree.
                boxes = box_buffers(k, cnt, total, block_size, bound_block, branching, beam,
                                    q.dtype, live_limit=live_limit, key_live=key_live)
    M = block_width(Nk, block_size, top_k, sink_blocks, local_blocks, query_tile)
    offset = query_offset(Nq, Nk, is_causal, causal_offset)
    meta, launch = select_launch(G, Nq, Nk, D, block_size=block_size, top_k=top_k,
                                 branching=branching, beam=beam, sink_blocks=sink_blocks,
                                 local_blocks=local_blocks, query_tile=query_tile,
                                 leaf_scoring=leaf_scoring, shortlist=shortlist,
                                 bound_block=bound_block, tuning=tuning)

    # The walk takes any pool (past WALK_MAX_POOL with more registers than it likes) up to
    # its [P, P] rank; the rescoring ranks its shortlist ([W, W]) and merges it into the
    # block list ([W, MP]). A Triton tensor holds at most 2**20 elements.
    flat = meta.pop("FLAT")
    P, W, TW, exact = meta["P"], meta["W"], meta["TW"], meta["EXACT"]
    if (not flat and P > 1024) or (exact and W * max(W, meta["MP"]) > 2 ** 20):
        widths = ([] if flat else [f"a pool of {P}"]) + (
            [f"a shortlist of {W}", f"a block list of {meta['MP']}"] if exact else [])
        raise ValueError(
            f"the Triton selection ranks at most 1024 nodes per tile at once; at {L} leaves, "
            f"top_k={top_k}, beam={beam} and shortlist={shortlist} give "
            f"{', '.join(widths)}: use a smaller top_k, beam or shortlist, or a larger "
            f"block_size")
    idx = torch.empty(B, Hkv, T, M, dtype=torch.int32, device=q.device)
    counts = torch.empty(B, Hkv, T, dtype=torch.int32, device=q.device)
    if trace is not None:
        n_lev = len(level_sizes(Nk, block_size, branching, beam))
        if tuple(trace.shape) != (B, Hkv, T, n_lev, TW) or not trace.is_contiguous():
            raise ValueError(f"trace must be a contiguous [B, Hkv, T, n_levels, width] = "
                             f"{[B, Hkv, T, n_lev, TW]} buffer, got {tuple(trace.shape)}")
    # Once per node (O(Nk / C) elements) rather than once per use in the kernel: the summaries
    # in the dot's input dtype (the same rounding as a cast in the kernel, at half the bytes
    # and registers per load); the pyramid wrote base-2 log counts, +inf for a non-finite
    # summary (zeroed), which the kernel keeps first at the cost of one compare.
    if bound_block:  # the kernel reads the boxes' maxima and flags where the means would be
        mu_dot, lo, lcnt, shi, slo, slc = boxes
    else:
        mu_dot = mu.to(q.dtype)
        lo = shi = slo = slc = mu_dot  # unused
    sinks = sink_start(key_mask, block_size)
    short_idx = torch.empty(B * Hkv * T * W if exact else 1, dtype=torch.int32,
                            device=q.device)
    sel_idx, sel_counts = (torch.empty_like(idx), torch.empty_like(counts)) if exact else (
        idx, counts)
    if flat:
        ft = {**FLAT_TUNING, **(tuning or {}).get("flat", {})}
        LB = ft["leaf_block"]
        LP = max(LB, triton.next_power_of_2(L))
        RB = min(ft["row_block"], meta["RB"])
        n_tiles = B * Hkv * T
        n_prog = min(n_tiles, ft["programs_per_sm"] * multiprocessors(q.device))
        # Per program: RB rows of rough leaf scores and one vote row, LP floats each.
        scr = torch.empty(n_prog * (RB + 1) * LP, dtype=torch.float32, device=q.device)
        launcher(_flat_kernel, q)[(n_prog,)](
            q, counts if sinks is None else sinks, lcnt, shi, slo, slc, sel_idx, sel_counts,
            short_idx, scr, *q.stride(),
            Hkv, Nq, Nk, L, sub_stride, total, T, n_tiles, M, min(sink_blocks, L),
            local_blocks, 0 if offset is None else offset, float(scale), len_arg,
            D=D, G=G, TQ=Tq, C=C, BD=meta["BD"], RB=RB, LB=LB,
            NS=meta["NS"], MP=meta["MP"], W=W, SHORT=meta["SHORT"], LP=LP,
            CAUSAL=bool(is_causal), HAS_LOCAL=offset is not None and local_blocks > 0,
            HAS_KEY_MASK=key_mask is not None, LOWP=q.dtype != torch.float32,
            DEV_LEN=key_length is not None, num_warps=ft["num_warps"])
        return _rescore(q, k, km, lcnt, short_idx, sel_idx, sel_counts, idx, counts, trace,
                        key_mask, is_causal, offset, scale, total, T, M, meta, tuning,
                        pyramid is None, key_length)
    # Per program, two rows of P slots for the pool compaction (see _children).
    scratch = torch.empty(B * Hkv * T * 2 * P, dtype=torch.int32, device=q.device)
    launcher(_select_kernel, q)[(T, B * Hkv)](
        q, counts if sinks is None else sinks, mu_dot, lcnt, lo, shi, slo, slc, sel_idx,
        sel_counts, short_idx, counts if trace is None else trace, scratch,
        *q.stride(),
        Hkv, Nq, Nk, L, Lcap, sub_stride, total, T, M, min(sink_blocks, L), local_blocks,
        0 if offset is None else offset, float(scale), len_arg,
        CAUSAL=bool(is_causal), HAS_LOCAL=offset is not None and local_blocks > 0,
        HAS_KEY_MASK=key_mask is not None, LOWP=q.dtype != torch.float32,
        TRACE=trace is not None, DEV_LEN=key_length is not None, **meta, **launch)
    if exact:
        return _rescore(q, k, km, lcnt, short_idx, sel_idx, sel_counts, idx, counts, trace,
                        key_mask, is_causal, offset, scale, total, T, M, meta, tuning,
                        pyramid is None, key_length)
    return idx, counts


def fp8_operands(q: Tensor, k: Tensor, key_mask: Optional[Tensor] = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """float8 (e4m3) copies of ``q`` and ``k`` for the exact leaf scores, each scaled so that
    its largest finite magnitude per (batch, KV head) is float8's largest value, and the
    factor that undoes both scalings in a score.

    Args:
        q: ``[B, Hq, Nq, D]`` and k: ``[B, Hkv, Nk, D]``, fp16/bf16/fp32, ``Hq % Hkv == 0``.
        key_mask: None or bool ``[B, Nk]``: masked keys (which may hold anything) are left
            out of k's scale.

    Returns:
        ``q8`` ``[B, Hq, Nq, D]`` and ``k8`` ``[B, Hkv, Nk, D]`` float8_e4m3fn (non-finite
        values become NaN, as their scores are in q's dtype), and ``dq`` float32
        ``[B * Hkv]``: ``q . k = dq[b * Hkv + h] * (q8 . k8)``.

    float8 keeps 3 mantissa bits (a relative error of at most 2**-4 per element); scores are
    sums of D such products, so their error is about 2**-4 * |q| |k| / sqrt(D) where the
    rounding errors are independent. Per-tensor scaling as in FP8 attention kernels
    (FlashAttention-3, Shah et al. 2024), per KV head here, without their block rotation.
    """
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    f8 = torch.float8_e4m3fn
    top = torch.finfo(f8).max

    def amax(x: Tensor, keep: Optional[Tensor], dims) -> Tensor:
        a = torch.where(torch.isfinite(x), x.abs(), 0)
        if keep is not None:
            a = a.masked_fill(~keep, 0)
        # At least top / float32's largest: a zero (or fully masked) head's scale stays
        # finite, so its zeros stay zeros (0 * inf would be NaN).
        return a.amax(dim=dims).float().clamp_min(top / torch.finfo(torch.float32).max)

    aq = amax(q.view(B, Hkv, Hq // Hkv, Nq, D), None, (2, 3, 4))  # [B, Hkv]
    ak = amax(k, None if key_mask is None else key_mask.bool()[:, None, :, None], (2, 3))
    sq = (top / aq).repeat_interleave(Hq // Hkv, dim=1)[:, :, None, None]
    sk = (top / ak)[:, :, None, None]

    def cast(x: Tensor, s: Tensor) -> Tensor:
        # In fp32, clamped: a value past float8's largest (rounding, or a masked key's
        # garbage) would become NaN. A non-finite value becomes NaN, not a clamped finite one.
        y = (x.float() * s).clamp(-top, top)
        return torch.where(torch.isfinite(x), y, float("nan")).to(f8)

    q8, k8 = cast(q, sq), cast(k, sk)
    return q8, k8, (aq * ak / (top * top)).reshape(-1).contiguous()


def _rescore(q, k, km, lcnt, short_idx, sel_idx, sel_counts, idx, counts, trace, key_mask,
             is_causal, offset, scale, total, T, M, meta, tuning, full_by_count=False,
             key_length=None):
    """Launch :func:`_rescore_kernel` on the shortlist ``short_idx`` and the forced leaves
    ``sel_idx``/``sel_counts``, writing ``idx``/``counts``; returns them. ``full_by_count``:
    ``lcnt`` was counted under this call's key mask (see the kernel's ``FULL_BY_COUNT``;
    by default no count is trusted). ``key_length``: as :func:`select_blocks`."""
    len_arg = lcnt if key_length is None else key_length  # unused without DEV_LEN
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, Tq, W, TW = Hq // Hkv, meta["TQ"], meta["W"], meta["TW"]
    rt = {**RESCORE_TUNING, **(tuning or {}).get("rescore", {})}
    # [RB, W] fp32 scores stay in registers: fewer rows per chunk for a wide shortlist.
    RBx = min(rt["row_block"], max(16, 8192 // W),
              max(16, triton.next_power_of_2(min(G * Tq, G * Nq))))
    n_tiles = B * Hkv * T
    n_sm = multiprocessors(q.device)
    n_prog = min(n_tiles, rt["programs_per_sm"] * n_sm)
    # Few tiles of one row chunk each (decode): the shortlist's scores spread over programs.
    split = rt["split"]
    if split is None:
        split = G * min(Tq, Nq) <= RBx and n_tiles < 2 * n_sm
    per = rt["split_leaves"]
    if split:
        if G * min(Tq, Nq) > RBx:
            raise ValueError(f"a split rescoring needs at most {RBx} rows per tile, got "
                             f"{G * min(Tq, Nq)}")
        lse = torch.empty(n_tiles * W * RBx, dtype=torch.float32, device=q.device)
        launcher(_rescore_split_kernel, q)[(n_tiles, cdiv(W, per))](
            q, k, km, short_idx, lse, *q.stride(), *k.stride(),
            *((0, 0) if key_mask is None else km.stride()), Hkv, Nq, Nk, T,
            0 if offset is None else offset, float(scale), len_arg,
            D=D, G=G, TQ=Tq, C=meta["C"], KC=max(16, min(meta["C"], rt["key_block"])),
            BD=meta["BD"], W=W, RB=RBx, PER=per, CAUSAL=bool(is_causal),
            HAS_KEY_MASK=key_mask is not None, LOWP=q.dtype != torch.float32,
            DEV_LEN=key_length is not None, num_warps=rt["num_warps"])
    else:
        lse = counts  # unused
    scr = torch.empty(n_prog * W * RBx if not split else 1, dtype=torch.float32,
                      device=q.device)
    fp8 = bool(rt["fp8"]) and not split and full_by_count and q.dtype != torch.float32
    q_dot, k_dot, dq = (q, k, lcnt) if not fp8 else fp8_operands(q, k, key_mask)
    perm = torch.empty(n_prog * 2 * W if key_mask is not None else 1,
                       dtype=torch.int32, device=q.device)
    launcher(_rescore_kernel, q)[(n_prog,)](
        q_dot, k_dot, km, lcnt, short_idx, sel_idx, sel_counts, idx, counts,
        counts if trace is None else trace, scr, perm, lse, dq,
        *q_dot.stride(), *k_dot.stride(), *((0, 0) if key_mask is None else km.stride()),
        Hkv, Nq, Nk, total, T, n_tiles, M, 0 if offset is None else offset, float(scale),
        0 if trace is None else trace.shape[3] * TW, len_arg,
        D=D, G=G, TQ=Tq, C=meta["C"], KC=max(16, min(meta["C"], rt["key_block"])),
        BD=meta["BD"], TOPK=meta["TOPK"], W=W, RB=RBx, MP=meta["MP"], TW=TW,
        CAUSAL=bool(is_causal), HAS_KEY_MASK=key_mask is not None,
        LOWP=q.dtype != torch.float32, TRACE=trace is not None, SPLIT=bool(split),
        FULL_BY_COUNT=bool(full_by_count), DEV_LEN=key_length is not None, FP8=fp8,
        LEAN=bool(rt["lean"]), num_warps=rt["num_warps"],
        **{key: rt[key] for key in ("num_stages", "maxnreg") if rt[key] is not None})
    return idx, counts
