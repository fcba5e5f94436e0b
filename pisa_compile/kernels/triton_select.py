"""Fused coarse-to-fine block selection in Triton (DESIGN.md "Coarse-to-fine selection").

One program per (query tile, batch * kv head) walks the pyramid from its top level down to the
leaves with a bounded pool of ``P`` nodes held in registers, and writes only
``block_indices [B, Hkv, T, M]`` and ``block_counts [B, Hkv, T]``: no ``Nq x Nk`` or
``Nq x L`` tensor is ever built.

Per level (same rules as :func:`pisa_compile.kernels.reference.select_blocks`):

* leaf states are analytic (no explicit mask): causal leaves are CLEAN ``[0, A)``, PARTIAL
  ``[A, Bn)``, NONE ``[Bn, D0)``, DEAD ``[D0, L)``; without causality every leaf is CLEAN. A
  node is visible if it holds a leaf below ``Bn`` and "bad" if it holds one in ``[A, D0)``.
* forced ancestors (of the sink leaves and of the tile's local leaves) and bad visible nodes
  are expanded; visible, non-expanded nodes are scored;
* internal score ``s_r(a) = LSE_c(scale q_r . mu_c + log n_c)``, leaf score
  ``scale q_r . mu + log n`` (or, with ``leaf_scoring="exact"``, the LSE over the leaf's
  visible keys);
* tile score ``S(a) = sum_r softmax_pool(s_r)(a)`` over valid rows, accumulated over row
  chunks of ``RB`` rows (rows ``r = query * G + head``);
* keep the best ``beam`` (leaves: ``top_k``), ties to the lower node index: a packed int64
  key ``(bits(S) + 1) << 32 | (2^31 - 1 - node)`` ranked by an all-pairs count, which is
  exact and cheap for ``P <= 128``;
* the next pool is the children of kept and expanded nodes, in ascending node order.

Pool bound: without an explicit mask a "bad" visible node is always a forced ancestor (the
PARTIAL leaves are the tile's own local leaves, ``local_blocks >= 1`` for causal), so at most
``n_forced = sink + max_local_blocks`` nodes are expanded per level, and
``P = pow2(g * (beam + n_forced))`` is exact: nothing is ever dropped.

Explicit ``attn_mask`` (and causal with ``local_blocks == 0``, and float64) fall back to the
reference selection, which is exact but runs in PyTorch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..config import PisaConfig
from . import reference
from .triton_pyramid import level_sizes, n_levels, pyramid_buffers



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
def _top_mask(S, node, cand, n):
    """``cand`` entries among the best ``n`` by ``S``; ties to the lower node index."""
    bits = S.to(tl.int32, bitcast=True).to(tl.int64) + 1  # S >= 0: bits are monotone
    key = tl.where(cand, (bits << 32) | (2147483647 - node).to(tl.int64), 0)
    greater = (key[None, :] > key[:, None]).to(tl.int32)  # [a, b]: b beats a
    rank = tl.sum(greater, axis=1)
    return cand & (rank < n)


@triton.jit
def _compact_pos(node, sel):
    """Rank of each selected node among the selected ones, by node index."""
    less = (node[None, :] < node[:, None]) & sel[None, :]
    return tl.sum(less.to(tl.int32), axis=1)


@triton.jit
def _children(node, parent, n_child, P: tl.constexpr, GB: tl.constexpr):
    """Next pool: children of ``parent`` nodes, ascending, -1 padded."""
    pos = _compact_pos(node, parent)
    s = tl.arange(0, P)
    match = parent[None, :] & (pos[None, :] == (s // GB)[:, None])  # [slot, a]
    par = tl.sum(tl.where(match, node[None, :], 0), axis=1)
    has = tl.sum(match.to(tl.int32), axis=1) > 0
    kid = par * GB + s % GB
    return tl.where(has & (kid < n_child), kid, -1)


@triton.jit
def _store_compact(out_ptr, node, sel, width, W: tl.constexpr):
    """Store the selected nodes ascending into ``out[0:width]``, -1 padded."""
    pos = _compact_pos(node, sel)
    s = tl.arange(0, W)
    match = sel[None, :] & (pos[None, :] == s[:, None])
    val = tl.sum(tl.where(match, node[None, :] + 1, 0), axis=1) - 1
    tl.store(out_ptr + s, val, mask=s < width)


@triton.jit
def _pool_share(s, cand, row_ok):
    """``sum over valid rows of softmax over candidates`` of per-row scores ``s [RB, P]``."""
    s = tl.where(cand[None, :], s, float("-inf"))
    z = tl.max(s, axis=1)
    zs = tl.where(z == float("-inf"), 0.0, z)
    e = tl.exp(s - zs[:, None])
    den = tl.sum(e, axis=1)
    w = tl.where(row_ok & (den > 0), 1.0 / tl.where(den > 0, den, 1.0), 0.0)
    return tl.sum(e * w[:, None], axis=0)


@triton.jit
def _select_kernel(
    q_ptr, k_ptr, mu_ptr, cnt_ptr, idx_ptr, bcnt_ptr, trace_ptr,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd,
    Hkv, Nq, Nk, L, total, T, M, D,
    n_sink, local_blocks, offset, scale,
    G: tl.constexpr, TQ: tl.constexpr, C: tl.constexpr, KC: tl.constexpr, BD: tl.constexpr,
    GB: tl.constexpr, BEAM: tl.constexpr, TOPK: tl.constexpr, P: tl.constexpr,
    RB: tl.constexpr, MP: tl.constexpr, TW: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_LOCAL: tl.constexpr, EXACT: tl.constexpr,
    LOWP: tl.constexpr, TRACE: tl.constexpr, PROF: tl.constexpr = 0,
):
    # PROF (timing experiments only; wrong results): 1 = no summary loads, 2 = no scoring.
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv

    # -- per-tile leaf ranges (reference.leaf_states / _forced_ranges, analytically) --------
    q_first = t * TQ
    q_last = tl.minimum(q_first + TQ, Nq) - 1
    if CAUSAL:
        q0 = tl.minimum(q_first, Nq - 1)
        mlive = tl.minimum(Nk, Nq)  # causal keys at or past Nq are seen by no query
        D0 = (mlive + C - 1) // C
        A = tl.where(mlive - 1 <= q0, D0, tl.minimum((q0 + 1) // C, D0))
        Bn = tl.maximum(A, tl.minimum(q_last // C + 1, D0))
    else:
        D0 = L
        A = L
        Bn = L
    if HAS_LOCAL:
        p0 = tl.minimum(q_first + offset, Nk - 1)
        p1 = tl.minimum(q_last + offset, Nk - 1)
        hi = p1 // C
        lo = tl.maximum(p0 // C - (local_blocks - 1), 0)
    else:
        hi = -1
        lo = L + 1

    # -- rows: r = query * G + head, so the live rows of a short last tile come first ------
    n_rows = (q_last - q_first + 1) * G
    n_chunks = (n_rows + RB - 1) // RB
    if PROF == 2:
        n_chunks = 0
    rr = tl.arange(0, RB)
    d = tl.arange(0, BD)
    dm = d < D
    qbase = q_ptr + b.to(tl.int64) * sqb + (h * G).to(tl.int64) * sqh
    kbase = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    mbase = bh.to(tl.int64) * total

    n_lev = n_levels(L, GB, GB * BEAM)
    top = n_lev - 1
    n_top = _level_size(L, GB, top)
    span = 1
    for _ in range(top):
        span *= GB
    ar = tl.arange(0, P)
    pool = tl.where(ar < n_top, ar, -1)
    tbase = trace_ptr + (bh.to(tl.int64) * T + t) * n_lev * TW

    # -- internal levels ----------------------------------------------------------------------
    for it in range(top):
        lev = top - it
        n_child = _level_size(L, GB, lev - 1)
        off_child = _level_offset(L, GB, lev - 1)
        valid = pool >= 0
        first = pool * span
        last = first + span - 1
        forced = valid & ((first < n_sink) | ((last >= lo) & (first <= hi)))
        vis = first < Bn
        bad = tl.maximum(first, A) <= tl.minimum(last, D0 - 1)
        expand = valid & (forced | (vis & bad))
        cand = valid & (~expand) & vis
        S = tl.zeros([P], dtype=tl.float32)
        for c in range(n_chunks):
            r = c * RB + rr
            qi = r // G
            row_ok = r < n_rows
            qv = tl.load(qbase + (r % G).to(tl.int64)[:, None] * sqh
                         + (q_first + qi).to(tl.int64)[:, None] * sqn + d[None, :] * sqd,
                         mask=row_ok[:, None] & dm[None, :], other=0.0)
            m = tl.full([RB, P], float("-inf"), tl.float32)
            acc = tl.zeros([RB, P], dtype=tl.float32)
            for j in tl.static_range(GB):
                kid = pool * GB + j
                kok = valid & (kid < n_child)
                kidx = mbase + off_child + kid
                if PROF == 1:
                    mu = tl.zeros([P, BD], dtype=tl.float32) + kidx[:, None].to(tl.float32)
                else:
                    mu = tl.load(mu_ptr + kidx.to(tl.int64)[:, None] * D + d[None, :],
                                 mask=kok[:, None] & dm[None, :], other=0.0)
                cn = tl.load(cnt_ptr + kidx, mask=kok, other=0.0)
                if LOWP:
                    dot = tl.dot(qv, tl.trans(mu.to(qv.dtype)))
                else:
                    dot = tl.dot(qv.to(tl.float32), tl.trans(mu), input_precision="ieee")
                sj = dot * scale + tl.log(cn)[None, :]
                m_new = tl.maximum(m, sj)
                ms = tl.where(m_new == float("-inf"), 0.0, m_new)
                acc = acc * tl.exp(m - ms) + tl.exp(sj - ms)
                m = m_new
            ms = tl.where(m == float("-inf"), 0.0, m)
            lse = tl.where(acc > 0, ms + tl.log(tl.where(acc > 0, acc, 1.0)), float("-inf"))
            S += _pool_share(lse, cand, row_ok)
        kept = _top_mask(S, pool, cand, BEAM)
        if TRACE:
            _store_compact(tbase + lev * TW, pool, kept, BEAM, TW)
        pool = _children(pool, kept | expand, n_child, P, GB)
        span = span // GB

    # -- leaves ---------------------------------------------------------------------------------
    valid = pool >= 0
    forced = valid & ((pool < n_sink) | ((pool >= lo) & (pool <= hi)))
    cand = valid & (~forced) & (pool < Bn)
    S = tl.zeros([P], dtype=tl.float32)
    for c in range(n_chunks):
        r = c * RB + rr
        qi = r // G
        row_ok = r < n_rows
        qpos = q_first + qi
        qv = tl.load(qbase + (r % G).to(tl.int64)[:, None] * sqh
                     + qpos.to(tl.int64)[:, None] * sqn + d[None, :] * sqd,
                     mask=row_ok[:, None] & dm[None, :], other=0.0)
        if EXACT:
            s = tl.full([RB, P], float("-inf"), tl.float32)
            kc = tl.arange(0, KC)
            for pi in range(P):
                leaf = tl.sum(tl.where(ar == pi, pool, 0), axis=0)
                is_c = tl.sum(tl.where((ar == pi) & cand, 1, 0), axis=0) > 0
                if is_c:
                    lm = tl.full([RB], float("-inf"), tl.float32)
                    la = tl.zeros([RB], dtype=tl.float32)
                    for c0 in tl.static_range(0, C, KC):
                        kp = leaf * C + c0 + kc
                        kin = (kp < Nk) & (c0 + kc < C)
                        kk = tl.load(kbase + kp.to(tl.int64)[:, None] * skn + d[None, :] * skd,
                                     mask=kin[:, None] & dm[None, :], other=0.0)
                        if LOWP:
                            sk = tl.dot(qv, tl.trans(kk.to(qv.dtype)))
                        else:
                            sk = tl.dot(qv.to(tl.float32), tl.trans(kk.to(tl.float32)),
                                        input_precision="ieee")
                        seen = kin[None, :] & row_ok[:, None]
                        if CAUSAL:
                            seen = seen & (kp[None, :] <= qpos[:, None])
                        sk = tl.where(seen, sk * scale, float("-inf"))
                        mn = tl.maximum(lm, tl.max(sk, axis=1))
                        mns = tl.where(mn == float("-inf"), 0.0, mn)
                        la = la * tl.exp(lm - mns) + tl.sum(tl.exp(sk - mns[:, None]), axis=1)
                        lm = mn
                    lms = tl.where(lm == float("-inf"), 0.0, lm)
                    ex = tl.where(la > 0, lms + tl.log(tl.where(la > 0, la, 1.0)),
                                  float("-inf"))
                    s = tl.where((ar == pi)[None, :], ex[:, None], s)
        else:
            lidx = mbase + pool
            mu = tl.load(mu_ptr + lidx.to(tl.int64)[:, None] * D + d[None, :],
                         mask=valid[:, None] & dm[None, :], other=0.0)
            cn = tl.load(cnt_ptr + lidx, mask=valid, other=0.0)
            if LOWP:
                dot = tl.dot(qv, tl.trans(mu.to(qv.dtype)))
            else:
                dot = tl.dot(qv.to(tl.float32), tl.trans(mu), input_precision="ieee")
            s = dot * scale + tl.log(cn)[None, :]
        S += _pool_share(s, cand, row_ok)
    picked = _top_mask(S, pool, cand, TOPK)
    if TRACE:
        _store_compact(tbase, pool, picked, TOPK, TW)
    chosen = picked | forced
    tile = bh.to(tl.int64) * T + t
    _store_compact(idx_ptr + tile * M, pool, chosen, M, MP)
    tl.store(bcnt_ptr + tile, tl.sum(chosen.to(tl.int32), axis=0))


def _supported(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
               config: PisaConfig) -> Optional[str]:
    """``None`` if the kernel handles the call, else why the reference selection is used."""
    if attn_mask is not None:
        return "explicit attn_mask (leaf states need the mask; reference selection is exact)"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype}"
    if is_causal and config.local_blocks == 0:
        return "causal with local_blocks=0 (PARTIAL candidates need masked exact scores)"
    if q.shape[2] == 0 or k.shape[2] == 0 or q.shape[0] == 0 or k.shape[1] == 0:
        return "empty input"
    if q.shape[1] % k.shape[1] != 0:
        return "Hq not a multiple of Hkv"
    return None


def pool_size(config: PisaConfig, n_sink: int) -> int:
    """Pool width: ``pow2(g * (beam + n_forced))`` (at least 16 for ``tl.dot``)."""
    n_forced = n_sink + reference.max_local_blocks(config)
    return max(16, triton.next_power_of_2(config.branching * (config.effective_beam + n_forced)))


def select_blocks(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                  scale: float, config: PisaConfig, row_block: Optional[int] = None,
                  trace: Optional[Tensor] = None,
                  num_warps: Optional[int] = None, _prof: int = 0) -> tuple[Tensor, Tensor]:
    """Triton coarse-to-fine selection; same contract as ``reference.select_blocks``.

    Args:
        q: ``[B, Hq, Nq, D]`` fp16/bf16/fp32; k: ``[B, Hkv, Nk, D]``; attn_mask: None (an
            explicit mask falls back to the reference); is_causal: SDPA's top-left rule;
            scale: softmax scale; config: PISA options.
        row_block: rows per scoring chunk (power of two >= 16); default ``min(64, pow2(R))``.
        num_warps: launch option (tuning); default 8 for large chunks, else 4.
        trace: tests only: int32 ``[B, Hkv, T, n_levels, TW]`` receives the kept nodes per
            level (level 0: the picked leaves), ascending, -1 padded.

    Returns:
        ``block_indices`` int32 ``[B, Hkv, T, M]`` (ascending, -1 padded, forced leaves
        included) and ``block_counts`` int32 ``[B, Hkv, T]``.
    """
    from .dispatch import max_blocks

    why = _supported(q, k, attn_mask, is_causal, config)
    if why is not None:
        return reference.select_blocks(q, k, attn_mask, is_causal, scale, config)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    C, Tq = config.block_size, config.query_tile
    T = triton.cdiv(Nq, Tq)
    from .dispatch import stage_range
    with stage_range("pisa.pyramid", k):
        mu, cnt, total = pyramid_buffers(k, config, live_limit=Nq if is_causal else None)
    L = (Nk + C - 1) // C
    M = max_blocks(Nq, Nk, config)
    n_sink = min(config.sink_blocks, L)
    if is_causal:
        offset = 0
    elif Nq <= Nk:
        offset = Nk - Nq
    else:
        offset = None  # cross-attention: no local blocks
    has_local = offset is not None and config.local_blocks > 0
    P = pool_size(config, n_sink)
    R = G * Tq
    # 64-row chunks measured fastest on H200 (128K causal: 17.7 ms vs 20.3 ms at 128 rows).
    RB = row_block or min(64, max(16, triton.next_power_of_2(min(R, G * Nq))))
    BD = max(16, triton.next_power_of_2(D))
    TW = triton.next_power_of_2(config.effective_beam)
    idx = torch.empty(B, Hkv, T, M, dtype=torch.int32, device=q.device)
    counts = torch.empty(B, Hkv, T, dtype=torch.int32, device=q.device)
    if trace is None:
        trace_arg = counts  # unused
    else:
        n_lev = len(level_sizes(Nk, config))
        assert trace.shape == (B, Hkv, T, n_lev, TW) and trace.is_contiguous()
        trace_arg = trace
    lowp = q.dtype != torch.float32
    torch.library.wrap_triton(_select_kernel)[(T, B * Hkv)](
        q, k, mu, cnt, idx, counts, trace_arg,
        *q.stride(), *k.stride(),
        Hkv, Nq, Nk, L, total, T, M, D,
        n_sink, config.local_blocks, offset if offset is not None else 0, float(scale),
        G=G, TQ=Tq, C=C, KC=max(16, min(C, 64)), BD=BD, GB=config.branching,
        BEAM=config.effective_beam, TOPK=config.top_k, P=P, RB=RB,
        MP=max(16, triton.next_power_of_2(M)), TW=TW,
        CAUSAL=bool(is_causal), HAS_LOCAL=has_local, EXACT=config.leaf_scoring == "exact",
        LOWP=lowp, TRACE=trace is not None, PROF=_prof,
        num_warps=num_warps or (8 if RB * P >= 8192 else 4))  # RB=64, P=64: 4 warps
    return idx, counts


def trace_width(config: PisaConfig) -> int:
    """Last dimension of the ``trace`` buffer of :func:`select_blocks`."""
    return triton.next_power_of_2(config.effective_beam)
