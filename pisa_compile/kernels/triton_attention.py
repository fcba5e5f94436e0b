"""Triton block-sparse attention for PISA: forward, backward and the transposed block index.

The kernels follow FlashAttention-2 (Dao, 2023) and Triton's fused-attention tutorial (online
softmax in base 2, ``dS = P * (dP - rowsum(dO * O))``), restricted to the leaf blocks that PISA
selected per query tile (DESIGN.md "Attention"). They compute exactly what
:func:`pisa_compile.kernels.reference.sparse_attention` and
:func:`~pisa_compile.kernels.reference.sparse_attention_backward` compute.

Layout of one program's rows. A query tile ``t`` is ``Tq`` queries times the ``G`` query heads
of one KV head, so the kernel packs its rows as ``r = g * Tqe + i`` (head ``g``, query
``t * Tq + i``; ``Tqe = min(Tq, Nq)`` so a short decode batch wastes no rows). That makes the
``M`` side of every ``tl.dot`` ``G * Tqe`` rows sharing one K/V tile: the same trick as GQA-packed
FlashAttention. A tile with more than ``BLOCK_M`` (128) rows is split into row sub-blocks that
walk the same block list. Key tiles are ``BLOCK_N`` keys of one leaf (``BLOCK_N = C`` up to 32
for fp16/bf16, 64 otherwise; larger leaves are walked in chunks, leaves under 16 keys are packed
several to a tile).

Backward: ``dk, dv`` come from a transposed index (leaf -> tiles that chose it); a leaf chosen
by more than ``SEG_TILES`` tiles (the sink leaf is chosen by all) is split over several
programs whose fp32 partials are added in a fixed order, so the sums stay deterministic.

Masks are applied only where a key tile needs them: a causal tile whose keys all lie at or
before the sub-block's first query, and has no key past ``Nk`` and none key-masked, skips the
mask; a key mask's bytes are read only for leaves flagged as holding a masked key
(:func:`_key_mask_args`). An explicit ``attn_mask`` is read (through its strides; stride 0 for
broadcast dims) on every tile.

Dtypes: float16 and bfloat16 (``tl.dot`` in the input dtype, fp32 accumulation) and float32
(``tl.dot`` in full fp32 under ``torch.get_float32_matmul_precision() == "highest"``, PyTorch's
default; in TF32, about 1e-3 relative error, under ``"high"`` or ``"medium"``). float64 is
not supported (the dispatcher keeps it on the reference). Head dims up to 256 (64 and 128 are the
tuned ones); ``Dv`` may differ from ``D``.

Every launch goes through ``dispatch.launcher`` (``wrap_triton`` while traced) so callers can
wrap these functions in ``torch.library.triton_op``; nothing here syncs with the host or has
data-dependent shapes, so the functions can be captured in CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .geometry import cdiv
from .runtime import MAX_HEAD_DIM, launcher
from .triton_util import LN2, LOG2E, pow2

__all__ = ["sparse_attention", "sparse_attention_backward", "transposed_index", "tile_params",
           "dot_precision"]

# Most query tiles one dk/dv program walks for one leaf; longer lists are split (sink leaves).
SEG_TILES = 128

# -- device helpers ---------------------------------------------------------------------------

@triton.jit
def _rows(t, sub, hkv, Nq, G: tl.constexpr, TQ: tl.constexpr, TQE: tl.constexpr,
          BLOCK_M: tl.constexpr):
    """Rows of sub-block ``sub`` of tile ``t``: query head, query position, validity."""
    rr = sub * BLOCK_M + tl.arange(0, BLOCK_M)
    g = rr // TQE
    qi = t * TQ + rr % TQE
    row_ok = (rr < G * TQE) & (qi < Nq)
    head = hkv * G + tl.where(row_ok, g, 0)
    qi = tl.where(row_ok, qi, 0)
    return head, qi, row_ok


@triton.jit
def _keys(bi_row, e0, e1, it, Nk, C: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key positions of iteration ``it`` over block-list entries ``[e0, e1)``, their
    validity, and (one leaf per key tile, ``C >= BLOCK_N``) the leaf and the tile's first key
    position as scalars (0 otherwise)."""
    offs = tl.arange(0, BLOCK_N)
    if C >= BLOCK_N:
        # A leaf is C // BLOCK_N key tiles: entry it // NCH, chunk it % NCH.
        blk = tl.load(bi_row + e0 + it // (C // BLOCK_N))
        k0 = blk * C + (it % (C // BLOCK_N)) * BLOCK_N
        kpos = k0 + offs
        kvalid = kpos < Nk
    else:
        # Leaves shorter than a key tile: BLOCK_N // C leaves per tile.
        e = e0 + it * (BLOCK_N // C) + offs // C
        ok = e < e1
        leaves = tl.load(bi_row + e, mask=ok, other=-1)
        kpos = leaves * C + offs % C
        kvalid = ok & (leaves >= 0) & (kpos < Nk)
        blk = 0
        k0 = 0
    return tl.where(kvalid, kpos, 0), kvalid, blk, k0


@triton.jit
def _n_iters(e0, e1, C: tl.constexpr, BLOCK_N: tl.constexpr):
    if C >= BLOCK_N:
        return (e1 - e0) * (C // BLOCK_N)
    else:
        return (e1 - e0 + BLOCK_N // C - 1) // (BLOCK_N // C)


@triton.jit
def _tile_program(BC, BI, scb, sch, sct, sib, sih, sit, Hkv, Nq, G: tl.constexpr,
                  TQ: tl.constexpr, TQE: tl.constexpr, BLOCK_M: tl.constexpr,
                  N_SUB: tl.constexpr):
    """This program's rows (program ids ``(tile * N_SUB + sub, b * Hkv + hkv)``), its tile's
    block count and the tile's row of ``block_indices``."""
    pid0 = tl.program_id(0)
    bh = tl.program_id(1)
    t = pid0 // N_SUB
    sub = pid0 % N_SUB
    b = bh // Hkv
    hkv = bh % Hkv
    head, qi, row_ok = _rows(t, sub, hkv, Nq, G, TQ, TQE, BLOCK_M)
    count = tl.load(BC + b * scb + hkv * sch + t * sct)
    bi_row = BI + b * sib + hkv * sih + t * sit
    return b, hkv, head, qi, row_ok, count, bi_row


@triton.jit
def _key_extent(kpos, kvalid):
    """``(any padding key, last valid key)`` of a key tile."""
    return tl.min(kvalid.to(tl.int32), 0) == 0, tl.max(tl.where(kvalid, kpos, 0), 0)


@triton.jit
def _tile_keys_live(kpos, kvalid, blk, k0, Nk, km_row, skmn, C: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
                    HAS_WINDOW: tl.constexpr):
    """A key tile of :func:`_keys`: ``kvalid`` with key-masked keys out, whether any key is
    missing (past ``Nk`` or masked), and bounds ``k_lo``, ``k_hi`` of its valid keys.

    One leaf per key tile: from scalars, no reduction over the tile (two or three per key
    tile otherwise, each across warps); under a key mask the leaf's flag (every key live,
    :func:`_key_mask_args`) is read first and the keys' bytes only for a leaf with a masked
    key (the load is predicated off for the others). The bounds are the tile's; they are
    read only when no key is missing, where they are exact.

    A window under a key mask keeps the per-key load and the reductions: there the flag's
    dependent load cost 2.5% (window 4096 at 32K, head dim 64, runs b and c), where without
    a window the flag and the scalar bounds together gave 1.21x (the "fast" preset's blocks,
    16K, left padding; ``profiles/attention_ab.json``);
    the window's programs whose leaves hold no masked key run in a launch of their own,
    compiled without the key mask (:func:`_fwd_launches`)."""
    if C >= BLOCK_N and not (HAS_KEY_MASK and HAS_WINDOW):
        any_pad = k0 + BLOCK_N > Nk
        if HAS_KEY_MASK:
            part = tl.load(km_row + (((Nk + C - 1) // C) * C + blk).to(tl.int64) * skmn) == 0
            # A predicated load, not a branch: an `if` here cost 17% at head dim 128
            # (profiles/attention_ab.json, run a).
            # (The flag as a vector: the interpreter makes bool-vector & bool-scalar int32.)
            part_n = (kpos * 0 + part.to(tl.int32)) != 0
            km = tl.load(km_row + kpos.to(tl.int64) * skmn, mask=kvalid & part_n, other=1)
            kvalid = kvalid & (km != 0)
            any_pad = any_pad | part
        k_lo = k0
        k_hi = tl.minimum(k0 + BLOCK_N, Nk) - 1
    else:
        kvalid = _key_live(kpos, kvalid, km_row, skmn, HAS_KEY_MASK)
        any_pad, k_hi = _key_extent(kpos, kvalid)
        k_lo = tl.min(tl.where(kvalid, kpos, 2147483647), 0)
    return kvalid, any_pad, k_lo, k_hi


@triton.jit
def _key_live(kpos, kvalid, km_row, skmn, HAS_KEY_MASK: tl.constexpr):
    """``kvalid`` with the key mask's padding keys (``km_row``: this batch's row) taken out,
    so every later step sees them as missing keys (their V and, in the backward, K are never
    loaded)."""
    if HAS_KEY_MASK:
        km = tl.load(km_row + kpos.to(tl.int64) * skmn, mask=kvalid, other=0)
        kvalid = kvalid & (km != 0)
    return kvalid


@triton.jit
def _apply_mask(s, b, head, qi, row_ok, kpos, kvalid, Mask, smb, smh, smq, smk, mask_thr,
                q_offset, window, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                MASK_BOOL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Scores ``s [BLOCK_M, BLOCK_N]`` (log2 units) with hidden keys at -inf, float bias added;
    causal: query ``qi`` sees keys ``kpos <= qi + q_offset``, and with a window only keys
    ``kpos > qi + q_offset - window``."""
    vis = kvalid[None, :] & row_ok[:, None]
    if IS_CAUSAL:
        vis = vis & (kpos[None, :] <= qi[:, None] + q_offset)
    if HAS_WINDOW:
        vis = vis & (kpos[None, :] > qi[:, None] + q_offset - window)
    if HAS_MASK:
        mp = (Mask + b.to(tl.int64) * smb + head[:, None].to(tl.int64) * smh
              + qi[:, None].to(tl.int64) * smq + kpos[None, :].to(tl.int64) * smk)
        mv = tl.load(mp, mask=vis, other=0)
        if MASK_BOOL:
            vis = vis & (mv != 0)
        else:
            mf = mv.to(tl.float32)
            # HF's convention: <= finfo.min / 2 is masked; NaN is a bias (the row turns NaN).
            vis = vis & ~(mf <= mask_thr)
            s = s + tl.where(vis, mf, 0.0) * LOG2E
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _masked_scores(s, b, head, qi, row_ok, kpos, kvalid, any_pad, k_lo, k_hi, q_lo, q_hi, Mask,
                   smb, smh, smq, smk, mask_thr, q_offset, window, IS_CAUSAL: tl.constexpr,
                   HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """:func:`_apply_mask` where the tile needs it: always with a mask; else only for a key
    tile with missing keys (``any_pad``: past ``Nk`` or key-masked) or, causal, a key
    (``k_hi``) after the first row's position (``q_lo + q_offset``), or, with a window, a key
    (``k_lo``) at or before the last row's window start (``q_hi + q_offset - window``)."""
    if HAS_MASK:
        s = _apply_mask(s, b, head, qi, row_ok, kpos, kvalid, Mask, smb, smh, smq, smk,
                        mask_thr, q_offset, window, IS_CAUSAL, HAS_MASK, MASK_BOOL, HAS_WINDOW)
    else:
        need = any_pad
        if IS_CAUSAL:
            need = need | (k_hi > q_lo + q_offset)
        if HAS_WINDOW:
            need = need | (k_lo <= q_hi + q_offset - window)
        if need:
            s = _apply_mask(s, b, head, qi, row_ok, kpos, kvalid, Mask, smb, smh, smq, smk,
                            mask_thr, q_offset, window, IS_CAUSAL, HAS_MASK, MASK_BOOL,
                            HAS_WINDOW)
    return s


@triton.jit
def _fwd_blocks(q, bi_row, e0, e1, Nk, k_base, v_base, skn, skd, svn, svd, offs_d, offs_dv,
                km_row, skmn, b, head, qi, row_ok, q_lo, q_hi, Mask, smb, smh, smq, smk,
                mask_thr, q_offset, window, qk_scale, C: tl.constexpr, D: tl.constexpr,
                DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HEAD_DIM_V: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                MASK_BOOL: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
                DOT_PREC: tl.constexpr):
    """The forward's loop over block-list entries ``[e0, e1)``: online softmax in base 2;
    returns the row max ``m``, the row sum ``l`` and the unnormalised ``acc``."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], tl.float32)
    n_it = _n_iters(e0, e1, C, BLOCK_N)
    for it in range(0, n_it):
        kpos, kvalid, blk, k0 = _keys(bi_row, e0, e1, it, Nk, C, BLOCK_N)
        # K is loaded before the key mask is applied, so the two loads overlap (a padding
        # key's score is masked below and its V is never loaded).
        kt = tl.load(k_base + kpos[None, :].to(tl.int64) * skn + offs_d[:, None] * skd,
                     mask=kvalid[None, :] & (offs_d[:, None] < D), other=0.0)
        kvalid, any_pad, k_lo, k_hi = _tile_keys_live(kpos, kvalid, blk, k0, Nk, km_row, skmn,
                                                      C, BLOCK_N, HAS_KEY_MASK, HAS_WINDOW)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
        s = _masked_scores(s, b, head, qi, row_ok, kpos, kvalid, any_pad, k_lo, k_hi, q_lo, q_hi,
                           Mask, smb, smh, smq, smk, mask_thr, q_offset, window, IS_CAUSAL,
                           HAS_MASK, MASK_BOOL, HAS_WINDOW)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead (no NaN).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + kpos[:, None].to(tl.int64) * svn + offs_dv[None, :] * svd,
                     mask=kvalid[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


# -- forward ----------------------------------------------------------------------------------

@triton.jit
def _fwd_kernel(
    Q, K, V, Mask, KeyMask, BI, BC, Out, Lse, OPart, LPart,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smq, smk, skmb, skmn, sob, soh, son, sod, slb, slh, sln,
    sib, sih, sit, scb, sch, sct,
    Hkv, Nq, Nk, q_offset, window, qk_scale, mask_thr, ENTRIES_PER_SPLIT, part_stride_o,
    part_stride_l,
    G: tl.constexpr, TQ: tl.constexpr, TQE: tl.constexpr, C: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    N_SUB: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
    SPLIT: tl.constexpr, KEY_MASK_PROGRAMS: tl.constexpr = 0,
):
    """One program: one row sub-block of one query tile of one (batch, KV head)[, one split].

    ``SPLIT``: write a partial (normalised out, base-2 lse) in fp32 for entries
    ``[split * ENTRIES_PER_SPLIT, (split + 1) * ENTRIES_PER_SPLIT)`` of the block list
    (flash-decoding); else the final ``out``/``lse``. ``KEY_MASK_PROGRAMS``: 0 every
    program; 1 or 2 one of the window path's two launches under a key mask
    (:func:`_fwd_launches`).
    """
    # Inductor may pass Python floats as fp64 scalars; keep the math in fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    mask_thr = tl.cast(mask_thr, tl.float32)
    b, hkv, head, qi, row_ok, count, bi_row = _tile_program(
        BC, BI, scb, sch, sct, sib, sih, sit, Hkv, Nq, G, TQ, TQE, BLOCK_M, N_SUB)
    if SPLIT:
        e0 = tl.program_id(2) * ENTRIES_PER_SPLIT
        e1 = tl.minimum(count, e0 + ENTRIES_PER_SPLIT)
    else:
        e0 = 0
        e1 = count

    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    b64 = b.to(tl.int64)
    q_ptrs = (Q + b64 * sqb + head[:, None].to(tl.int64) * sqh + qi[:, None].to(tl.int64) * sqn
              + offs_d[None, :] * sqd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    q_lo = tl.min(tl.where(row_ok, qi, Nq), 0)
    q_hi = tl.max(tl.where(row_ok, qi, 0), 0)
    k_base = K + b64 * skb + hkv.to(tl.int64) * skh
    v_base = V + b64 * svb + hkv.to(tl.int64) * svh
    km_row = KeyMask + b64 * skmb

    m_i, l_i, acc = _fwd_blocks(
        q, bi_row, e0, e1, Nk, k_base, v_base, skn, skd, svn, svd, offs_d, offs_dv,
        km_row, skmn, b, head, qi, row_ok, q_lo, q_hi, Mask, smb, smh, smq, smk,
        mask_thr, q_offset, window, qk_scale, C, D, DV, BLOCK_M, BLOCK_N, HEAD_DIM_V,
        IS_CAUSAL, HAS_MASK, MASK_BOOL, HAS_KEY_MASK=HAS_KEY_MASK and KEY_MASK_PROGRAMS != 1,
        HAS_WINDOW=HAS_WINDOW, DOT_PREC=DOT_PREC)

    if KEY_MASK_PROGRAMS != 0:
        # One of the window path's two launches under a key mask (_fwd_launches): a negative
        # block count marks the other launch's program, whose loop was empty (the count
        # bounds it) and whose rows are not stored. Masked here, after the loop: rows masked
        # by a loaded value before it slowed the loop 7-11% (H100, window 4096, 32K, head dim
        # 64: 3.67-3.71 ms against 3.35-3.41 for the loop alone; masked here, 3.14-3.19;
        # profiles/window_key_mask_split.json). (As a vector: the interpreter makes
        # bool-vector & bool-scalar int32.)
        row_ok = row_ok & ((qi * 0 + (count >= 0).to(tl.int32)) != 0)
    # No visible key: zeros and lse = -inf, as SDPA. l_i is NaN (not 0) for a row that met a
    # NaN or +inf score, and that row stays NaN, as in SDPA.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    if SPLIT:
        # Partials in the natural [B, Hq, Nq] row order, contiguous, one slab per split.
        row = (b64 * (Hkv * G) + head.to(tl.int64)) * Nq + qi
        sp = tl.program_id(2).to(tl.int64)
        tl.store(LPart + sp * part_stride_l + row, lse2, mask=row_ok)
        tl.store(OPart + sp * part_stride_o + row[:, None] * DV + offs_dv[None, :], out,
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    else:
        tl.store(Lse + b64 * slb + head.to(tl.int64) * slh + qi * sln, lse2 * LN2, mask=row_ok)
        o_ptrs = (Out + b64 * sob + head[:, None].to(tl.int64) * soh
                  + qi[:, None].to(tl.int64) * son + offs_dv[None, :] * sod)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV))


# -- backward ---------------------------------------------------------------------------------

@triton.jit
def _bwd_delta_kernel(O, DO, Delta, Hq, Nq,
                      sob, soh, son, sod, sdb, sdh, sdn, sdd,
                      DV: tl.constexpr, HEAD_DIM_V: tl.constexpr, ROWS: tl.constexpr):
    """``delta = rowsum(dO * O)`` in fp32, ``[B, Hq, Nq]`` contiguous (FlashAttention-2)."""
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_V)
    msk = (n[:, None] < Nq) & (d[None, :] < DV)
    o = tl.load(O + b * sob + h * soh + n[:, None].to(tl.int64) * son + d[None, :] * sod,
                mask=msk, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + h * sdh + n[:, None].to(tl.int64) * sdn + d[None, :] * sdd,
                 mask=msk, other=0.0).to(tl.float32)
    tl.store(Delta + bh.to(tl.int64) * Nq + n, tl.sum(o * do, 1), mask=n < Nq)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, Mask, KeyMask, BI, BC, DO, Lse, Delta, DQ,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smq, smk, skmb, skmn, sdob, sdoh, sdon, sdod, slb, slh, sln,
    sdqb, sdqh, sdqn, sdqd, sib, sih, sit, scb, sch, sct,
    Hkv, Nq, Nk, q_offset, window, qk_scale, sm_scale, mask_thr,
    G: tl.constexpr, TQ: tl.constexpr, TQE: tl.constexpr, C: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    N_SUB: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """``dq`` of one row sub-block of one tile: loop over the tile's blocks (no atomics)."""
    # Inductor may pass Python floats as fp64 scalars; keep the math in fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    mask_thr = tl.cast(mask_thr, tl.float32)
    b, hkv, head, qi, row_ok, count, bi_row = _tile_program(
        BC, BI, scb, sch, sct, sib, sih, sit, Hkv, Nq, G, TQ, TQE, BLOCK_M, N_SUB)

    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    b64 = b.to(tl.int64)
    h64 = head[:, None].to(tl.int64)
    q64 = qi[:, None].to(tl.int64)
    q = tl.load(Q + b64 * sqb + h64 * sqh + q64 * sqn + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + b64 * sdob + h64 * sdoh + q64 * sdon + offs_dv[None, :] * sdod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    row = (b64 * (Hkv * G) + head.to(tl.int64)) * Nq + qi
    lse = tl.load(Lse + b64 * slb + head.to(tl.int64) * slh + qi * sln, mask=row_ok,
                  other=float("inf"))
    # Rows with no visible key (lse = -inf) get +inf so that P = exp2(S - lse) = 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(Delta + row, mask=row_ok, other=0.0)
    q_lo = tl.min(tl.where(row_ok, qi, Nq), 0)
    q_hi = tl.max(tl.where(row_ok, qi, 0), 0)
    k_base = K + b64 * skb + hkv.to(tl.int64) * skh
    v_base = V + b64 * svb + hkv.to(tl.int64) * svh
    km_row = KeyMask + b64 * skmb

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_it = _n_iters(0, count, C, BLOCK_N)
    for it in range(0, n_it):
        kpos, kvalid, blk, k0 = _keys(bi_row, 0, count, it, Nk, C, BLOCK_N)
        kvalid, any_pad, k_lo, k_hi = _tile_keys_live(kpos, kvalid, blk, k0, Nk, km_row, skmn,
                                                      C, BLOCK_N, HAS_KEY_MASK, HAS_WINDOW)
        k = tl.load(k_base + kpos[:, None].to(tl.int64) * skn + offs_d[None, :] * skd,
                    mask=kvalid[:, None] & (offs_d[None, :] < D), other=0.0)
        v = tl.load(v_base + kpos[:, None].to(tl.int64) * svn + offs_dv[None, :] * svd,
                    mask=kvalid[:, None] & (offs_dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = _masked_scores(s, b, head, qi, row_ok, kpos, kvalid, any_pad, k_lo, k_hi, q_lo, q_hi,
                           Mask, smb, smh, smq, smk, mask_thr, q_offset, window, IS_CAUSAL,
                           HAS_MASK, MASK_BOOL, HAS_WINDOW)
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    dq = dq * sm_scale
    tl.store(DQ + b64 * sdqb + h64 * sdqh + q64 * sdqn + offs_d[None, :] * sdqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, Mask, KeyMask, Offsets, Tiles, Work, SlotBase, DO, Lse, Delta, dK, dV,
    PartK, PartV,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smq, smk, skmb, skmn, sdob, sdoh, sdon, sdod, slb, slh, sln,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    Hkv, Nq, Nk, q_offset, window, L, BHL, TM, SEG, qk_scale, sm_scale, mask_thr,
    G: tl.constexpr, TQ: tl.constexpr, TQE: tl.constexpr, C: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    N_SUB: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """``dk, dv`` of one key tile of one leaf, over one segment of the tiles that chose it.

    Program ``pid0 < B*Hkv*L`` takes segment 0 of leaf ``pid0``; the others take the extra
    segments listed in ``Work`` (``(leaf, segment)`` pairs): a leaf chosen by more than ``SEG``
    tiles, such as the sink, is split so that no program walks a long list alone. A leaf with
    one segment writes ``dk, dv`` directly; otherwise each segment writes an fp32 partial to
    its slot and :func:`_bwd_reduce_kernel` adds them in segment order. The tile lists come from
    :func:`transposed_index` in tile order and each program owns its keys: deterministic sums,
    no atomics.
    """
    # Inductor may pass Python floats as fp64 scalars; keep the math in fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    mask_thr = tl.cast(mask_thr, tl.float32)
    pid0 = tl.program_id(0)
    ch = tl.program_id(1)
    is_x = pid0 >= BHL
    wi = tl.where(is_x, pid0 - BHL, 0).to(tl.int64)
    f_x = tl.load(Work + 2 * wi)  # Work has >= 2 entries (a dummy when there is no split)
    s_x = tl.load(Work + 2 * wi + 1)
    f = tl.where(is_x, f_x, pid0)
    seg = tl.where(is_x, s_x, 0)
    active = f < BHL
    f = tl.where(active, f, 0)
    bh = f // L
    blk = f % L
    b = bh // Hkv
    hkv = bh % Hkv

    o_base = Offsets + bh.to(tl.int64) * (L + 1) + blk
    first = tl.load(o_base)
    last = tl.load(o_base + 1)
    multi = (last - first) > SEG
    start = first + seg * SEG
    end = tl.where(active, tl.minimum(last, start + SEG), start)

    offs_n = ch * BLOCK_N + tl.arange(0, BLOCK_N)
    kpos = blk * C + offs_n
    kvalid = (offs_n < C) & (kpos < Nk)
    kpos = tl.where(kvalid, kpos, 0)
    # Key-masked keys get dk = dv = 0 (stored, as every key of the leaf is).
    kstore = kvalid
    kvalid = _key_live(kpos, kvalid, KeyMask + b.to(tl.int64) * skmb, skmn, HAS_KEY_MASK)
    # Scalar flags broadcast as int vectors: the interpreter turns bool-vector & bool-scalar
    # into int32, which tl.load then refuses as a mask.
    zero_n = offs_n * 0
    act_n = (zero_n + active.to(tl.int32)) != 0
    kload = kvalid & act_n  # idle programs read nothing
    kout = kstore & act_n
    multi_n = (zero_n + multi.to(tl.int32)) != 0

    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    b64 = b.to(tl.int64)
    hk64 = hkv.to(tl.int64)
    k = tl.load(K + b64 * skb + hk64 * skh + kpos[:, None].to(tl.int64) * skn
                + offs_d[None, :] * skd, mask=kload[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + b64 * svb + hk64 * svh + kpos[:, None].to(tl.int64) * svn
                + offs_dv[None, :] * svd,
                mask=kload[:, None] & (offs_dv[None, :] < DV), other=0.0)
    any_pad, k_hi = _key_extent(kpos, kvalid)  # one key tile per program: once
    k_lo = tl.min(tl.where(kvalid, kpos, 2147483647), 0)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], tl.float32)
    tiles_row = Tiles + bh.to(tl.int64) * TM
    for e in range(start, end):
        t = tl.load(tiles_row + e)
        for sub in range(0, N_SUB):
            head, qi, row_ok = _rows(t, sub, hkv, Nq, G, TQ, TQE, BLOCK_M)
            h64 = head[:, None].to(tl.int64)
            q64 = qi[:, None].to(tl.int64)
            q = tl.load(Q + b64 * sqb + h64 * sqh + q64 * sqn + offs_d[None, :] * sqd,
                        mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            do = tl.load(DO + b64 * sdob + h64 * sdoh + q64 * sdon + offs_dv[None, :] * sdod,
                         mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            lse = tl.load(Lse + b64 * slb + head.to(tl.int64) * slh + qi * sln, mask=row_ok,
                          other=float("inf"))
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
            row = (b64 * (Hkv * G) + head.to(tl.int64)) * Nq + qi
            delta = tl.load(Delta + row, mask=row_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            q_lo = tl.min(tl.where(row_ok, qi, Nq), 0)
            q_hi = tl.max(tl.where(row_ok, qi, 0), 0)
            s = _masked_scores(s, b, head, qi, row_ok, kpos, kvalid, any_pad, k_lo, k_hi,
                               q_lo, q_hi, Mask, smb, smh, smq, smk, mask_thr, q_offset, window,
                               IS_CAUSAL, HAS_MASK, MASK_BOOL, HAS_WINDOW)
            p = tl.math.exp2(s - lse2[:, None])
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC)
    dk = dk * sm_scale
    final = kout & (multi_n == 0)
    tl.store(dK + b64 * sdkb + hk64 * sdkh + kpos[:, None].to(tl.int64) * sdkn
             + offs_d[None, :] * sdkd, dk.to(dK.dtype.element_ty),
             mask=final[:, None] & (offs_d[None, :] < D))
    tl.store(dV + b64 * sdvb + hk64 * sdvh + kpos[:, None].to(tl.int64) * sdvn
             + offs_dv[None, :] * sdvd, dv.to(dV.dtype.element_ty),
             mask=final[:, None] & (offs_dv[None, :] < DV))
    part = kout & multi_n
    slot = (tl.load(SlotBase + f) + seg).to(tl.int64)  # garbage unless multi: stores masked
    tl.store(PartK + (slot * C + offs_n[:, None]) * D + offs_d[None, :], dk,
             mask=part[:, None] & (offs_d[None, :] < D))
    tl.store(PartV + (slot * C + offs_n[:, None]) * DV + offs_dv[None, :], dv,
             mask=part[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _bwd_reduce_kernel(Offsets, SlotBase, PartK, PartV, dK, dV,
                       sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
                       Hkv, Nk, L, SEG,
                       C: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
                       HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr):
    """Sum the fp32 partials of each multi-segment leaf in segment order; store dk, dv."""
    f = tl.program_id(0)
    ch = tl.program_id(1)
    bh = f // L
    blk = f % L
    o_base = Offsets + bh.to(tl.int64) * (L + 1) + blk
    cnt = tl.load(o_base + 1) - tl.load(o_base)
    n_seg = tl.where(cnt > SEG, (cnt + SEG - 1) // SEG, 0)
    base = tl.load(SlotBase + f).to(tl.int64)
    offs_n = ch * BLOCK_N + tl.arange(0, BLOCK_N)
    kpos = blk * C + offs_n
    ok = (offs_n < C) & (kpos < Nk) & ((offs_n * 0 + n_seg) > 0)
    kpos = tl.where(ok, kpos, 0)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], tl.float32)
    for s in range(0, n_seg):
        slot = base + s
        dk += tl.load(PartK + (slot * C + offs_n[:, None]) * D + offs_d[None, :],
                      mask=ok[:, None] & (offs_d[None, :] < D), other=0.0)
        dv += tl.load(PartV + (slot * C + offs_n[:, None]) * DV + offs_dv[None, :],
                      mask=ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    b64 = (bh // Hkv).to(tl.int64)
    hk64 = (bh % Hkv).to(tl.int64)
    tl.store(dK + b64 * sdkb + hk64 * sdkh + kpos[:, None].to(tl.int64) * sdkn
             + offs_d[None, :] * sdkd, dk.to(dK.dtype.element_ty),
             mask=ok[:, None] & (offs_d[None, :] < D))
    tl.store(dV + b64 * sdvb + hk64 * sdvh + kpos[:, None].to(tl.int64) * sdvn
             + offs_dv[None, :] * sdvd, dv.to(dV.dtype.element_ty),
             mask=ok[:, None] & (offs_dv[None, :] < DV))


# -- transposed index -------------------------------------------------------------------------

@triton.jit
def _hist_kernel(BI, BC, Counts, T, L, M, BLOCK: tl.constexpr):
    """Per (batch, KV head): how many tiles chose each leaf (integer atomics: order-free)."""
    t = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, BLOCK)
    cnt = tl.load(BC + bh * T + t)
    ok = j < tl.minimum(cnt, M)
    blk = tl.load(BI + (bh * T + t) * M + j, mask=ok, other=-1)
    ok = ok & (blk >= 0) & (blk < L)
    tl.atomic_add(Counts + bh * L + tl.where(ok, blk, 0), 1, mask=ok)


def transposed_index(block_indices: Tensor, block_counts: Tensor,
                     n_leaves: int) -> tuple[Tensor, Tensor]:
    """Leaf -> tiles that chose it (CSR), for the dk/dv pass.

    Args:
        block_indices: int32 ``[B, Hkv, T, M]`` (-1 padded). block_counts: int32 ``[B, Hkv, T]``.
        n_leaves: ``L = ceil(Nk / block_size)``.

    Returns:
        ``offsets`` int32 ``[B, Hkv, L + 1]`` and ``tiles`` int32 ``[B, Hkv, T * M]``: the tiles
        of leaf ``l`` are ``tiles[..., offsets[l]:offsets[l+1]]`` in ascending order.

    A counting sort: a Triton histogram (integer atomics, so the counts do not depend on
    order), ``torch.cumsum`` for the offsets, and a stable radix sort of the flattened
    (tile-major) entries by leaf as the scatter, which keeps each leaf's tiles in tile order.
    Deterministic, no host sync, static shapes.
    """
    B, H, T, M = block_indices.shape
    bi = block_indices.contiguous()
    bc = block_counts.contiguous()
    counts = torch.zeros(B, H, n_leaves, dtype=torch.int32, device=bi.device)
    launcher(_hist_kernel, bi)[(T, B * H)](bi, bc, counts, T, n_leaves, M, BLOCK=pow2(M, 2))
    offsets = torch.zeros(B, H, n_leaves + 1, dtype=torch.int32, device=bi.device)
    offsets[..., 1:] = torch.cumsum(counts, -1, dtype=torch.int32)
    j = torch.arange(M, device=bi.device, dtype=torch.int32)
    valid = (bi >= 0) & (j < bc[..., None])
    key = torch.where(valid, bi, n_leaves).view(B, H, T * M)
    order = torch.sort(key, dim=-1, stable=True).indices
    tiles = torch.div(order, M, rounding_mode="floor").to(torch.int32)
    return offsets, tiles


# -- host side --------------------------------------------------------------------------------

# Launch tiles of the attention kernels, by case. ``block_m`` / ``block_n`` are maxima (rows
# are G * Tq padded to a power of two >= 16; key tiles are the leaf size, at least 16);
# ``num_warps`` None means 8 when BLOCK_M * HEAD_DIM reaches 128 * 128, else 4. H200 sweep, bf16
# D=128 C=64 (profiles/attention_gpu.json): 32-key tiles, 4 warps and 3 stages beat 64-key
# tiles with 8 warps by about 15% forward and 10% forward + backward. On the sliding-window
# path 2 stages beat 3 by 10% on contiguous q/k/v at head dim 64, but the Mistral-shaped
# model's window forward took 19.5 ms with them against 17.9 with 3 (profiles/
# bench_masks_window_stages.json): 3 stages there too.
ATTENTION_TILES = {
    "half": dict(block_m=128, block_n=32, num_warps=4, num_stages=3),   # fp16/bf16, dims <= 128
    "fp32": dict(block_m=64, block_n=64, num_warps=None, num_stages=2),  # fp32, dims <= 128
    "wide": dict(block_m=64, block_n=32, num_warps=None, num_stages=2),  # head dims > 128
}


def tile_params(G: int, tq_eff: int, D: int, Dv: int, C: int, dtype: torch.dtype,
                tuning: Optional[dict] = None) -> dict:
    """Compile-time tiles of the attention kernels for one problem shape.

    ``BLOCK_M`` rows, ``BLOCK_N`` keys, padded head dims ``HEAD_DIM``/``HEAD_DIM_V``, row
    sub-blocks per tile ``N_SUB``, warps and stages, from :data:`ATTENTION_TILES` (and
    ``tuning``, overrides of its entries, for benchmark sweeps).
    """
    hd, hdv = pow2(D), pow2(Dv)
    case = "wide" if max(hd, hdv) > 128 else "fp32" if dtype == torch.float32 else "half"
    t = {**ATTENTION_TILES[case], **(tuning or {})}
    rows = G * tq_eff
    block_m = min(t["block_m"], pow2(rows))
    num_warps = t["num_warps"] or (8 if block_m * max(hd, hdv) >= 128 * 128 else 4)
    return dict(BLOCK_M=block_m, BLOCK_N=min(max(C, 16), t["block_n"]), HEAD_DIM=hd,
                HEAD_DIM_V=hdv, N_SUB=cdiv(rows, block_m), num_warps=num_warps,
                num_stages=t["num_stages"])


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: float32 follows
    ``torch.get_float32_matmul_precision()`` as PyTorch's own matmuls do (``"highest"``, the
    default: full fp32 products, ``"ieee"``; ``"high"``/``"medium"``: TF32, about 1e-3 relative
    error). Half dtypes ignore it (``"tf32"``, Triton's default)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _check(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_counts: Tensor,
           query_tile: int) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"Triton PISA attention supports float16/bfloat16/float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(
            f"head dims must be <= {MAX_HEAD_DIM}, got D={q.shape[-1]}, Dv={v.shape[-1]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k heads ({k.shape[1]})")
    T = cdiv(q.shape[2], query_tile)
    if tuple(block_indices.shape[:3]) != (q.shape[0], k.shape[1], T):
        raise ValueError(
            f"block_indices must be [B, Hkv, T={T}, M], got {tuple(block_indices.shape)}")
    if block_indices.dtype != torch.int32 or block_counts.dtype != torch.int32:
        raise ValueError("block_indices and block_counts must be int32")


def _mask_args(attn_mask: Optional[Tensor], q: Tensor, Nk: int):
    """``(tensor, strides, has_mask, is_bool, threshold)`` of a mask, as ``[B, Hq, Nq, Nk]``.

    Broadcast dims get stride 0; bool masks are read as uint8; a float entry ``<= threshold``
    (``finfo.min / 2``, -inf included) is masked, others are an additive bias.
    """
    if attn_mask is None:
        return q, (0, 0, 0, 0), False, False, 0.0
    if attn_mask.dim() != 4:
        raise ValueError(f"attn_mask must be 4-D here, got shape {tuple(attn_mask.shape)}")
    if attn_mask.dtype == torch.bool:
        # Read as bytes. A value cast, not a bitcast: Inductor cannot lower bool->uint8 views.
        # Cast the broadcast dims' single slice only, so an expanded mask stays a view.
        m = attn_mask
        for d in range(4):
            if m.stride(d) == 0 and m.shape[d] > 1:
                m = m.narrow(d, 0, 1)
        m = m.to(torch.uint8).expand(q.shape[0], q.shape[1], q.shape[2], Nk)
        return m, m.stride(), True, True, 0.0
    m = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], Nk)
    if not m.is_floating_point():
        raise ValueError(f"attn_mask must be bool or floating point, got {m.dtype}")
    thr = max(torch.finfo(m.dtype).min / 2, torch.finfo(torch.float32).min)
    return m, m.stride(), True, False, float(thr)


def _key_mask_args(key_mask: Optional[Tensor], q: Tensor, Nk: int, block_size: int):
    """``(tensor, (stride_b, stride_n), has_key_mask)`` of a ``[B, Nk]`` key mask, read as
    bytes (``q`` stands in for an absent one: never read).

    The tensor is ``[B, L * C + L]`` uint8 (``L = ceil(Nk / C)`` leaves of ``C`` keys): the
    mask, 1 for the keys past ``Nk``, then per leaf 1 if every key of it is live. The
    forward and ``dq`` kernels read a leaf's flag and its keys' bytes only where it is 0
    (with the scalar bounds of :func:`_tile_keys_live`, the ``"fast"`` preset's forward with
    left padding ran 1.21x faster, ``profiles/attention_ab.json``). The batch is 1 or ``B``
    as the key mask's."""
    if key_mask is None:
        return q, (0, 0), False
    if key_mask.dim() != 2 or key_mask.shape[1] != Nk or key_mask.shape[0] not in (1, q.shape[0]):
        raise ValueError(f"key_mask must be [B={q.shape[0]}, Nk={Nk}], got shape "
                         f"{tuple(key_mask.shape)}")
    Bk, n = key_mask.shape[0], cdiv(Nk, block_size) * block_size
    km = torch.ones(Bk, n + n // block_size, dtype=torch.uint8, device=key_mask.device)
    km[:, :Nk] = key_mask  # a value cast (Inductor cannot lower bool->uint8 views)
    km[:, n:] = km[:, :n].view(Bk, n // block_size, block_size).amin(-1)
    return km, (km.stride(0) if Bk > 1 else 0, km.stride(1)), True


def _common(q, k, v, attn_mask, is_causal, block_indices, block_counts, block_size, query_tile,
            tuning=None, key_mask=None, window=None):
    _check(q, k, v, block_indices, block_counts, query_tile)
    if window is not None and (not is_causal or window < 1):
        raise ValueError(f"window must be an int >= 1 with is_causal=True, got window={window}, "
                         f"is_causal={is_causal}")
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    Tq = query_tile
    # A constexpr: a power of two bounds the compiles a short call's length makes (the dense
    # tail and decode through decode_attention see every length up to their bound).
    tqe = min(Tq, triton.next_power_of_2(Nq))
    tp = tile_params(G, tqe, D, Dv, block_size, q.dtype, tuning)
    mask, mstr, has_mask, mask_bool, thr = _mask_args(attn_mask, q, Nk)
    km, kmstr, has_km = _key_mask_args(key_mask, q, Nk, block_size)
    bi = block_indices.contiguous()
    bc = block_counts.contiguous()
    meta = dict(G=G, TQ=Tq, TQE=tqe, C=block_size, D=D, DV=Dv, IS_CAUSAL=bool(is_causal),
                HAS_MASK=has_mask, MASK_BOOL=mask_bool, HAS_KEY_MASK=has_km,
                HAS_WINDOW=window is not None, DOT_PREC=dot_precision(q.dtype), **tp)
    # The key mask rides with the explicit mask: (mask, key mask), strides of both.
    return (B, Hq, Hkv, Nq, Nk, D, Dv, bi, bc, (mask, km), (*mstr, *kmstr), thr, meta)


def _fwd_launches(meta: dict, block_indices: Tensor, block_counts: Tensor,
                  key_mask_bytes: Tensor) -> list[tuple[int, Tensor]]:
    """``(KEY_MASK_PROGRAMS, block_counts)`` of each launch of :func:`_fwd_kernel`.

    On the window path under a key mask: one launch of the loop compiled without the key mask
    for the programs whose leaves hold no key-masked key (``attention_mask=ones``, and left
    padding's windows past the pad), one with it for the others, each with the other's
    programs' counts set to -1 (not run, not stored). Programs are told apart here, by a few
    small tensor ops on the block lists and prefix counts of the leaves flagged as holding a
    masked key (``key_mask_bytes``' per-leaf flags, :func:`_key_mask_args`), so the kernel
    reads no more than the count it reads anyway. Against one kernel with a copy of the loop for each kind of program (H100,
    window 4096, 32K, head dim 64): 1.26x with an all-ones key mask (3.14 ms; 3.37 without a
    key mask), 1.24x with left padding (``profiles/window_key_mask_split.json``). Else, and
    in decode (:func:`~pisa_compile.kernels.triton_decode.decode_attention`, whose few rows
    would not pay for these ops), one launch of every program."""
    if not (meta["HAS_KEY_MASK"] and meta["HAS_WINDOW"]):
        return [(0, block_counts)]
    # part[b, l]: leaves among [0, l) holding a masked key (the flags close the bytes).
    n_leaves = key_mask_bytes.shape[1] // (meta["C"] + 1)
    flags = key_mask_bytes[:, -n_leaves:].to(torch.int32)
    part = F.pad(torch.cumsum(1 - flags, dim=1, dtype=torch.int32), (1, 0))
    # Block lists are ascending (window_blocks): [first, last] spans every listed leaf.
    first = block_indices[..., 0].clamp(min=0).long()
    last = block_indices.gather(-1, (block_counts - 1).clamp(min=0).long()[..., None])[..., 0]
    B = block_indices.shape[0]
    part = part.expand(B, -1).reshape(B, 1, -1).expand(-1, block_indices.shape[1], -1)
    clean = (block_counts <= 0) | (part.gather(-1, last.clamp(min=0).long() + 1)
                                   == part.gather(-1, first))
    skip = torch.full_like(block_counts, -1)
    return [(1, torch.where(clean, block_counts, skip)),
            (2, torch.where(clean, skip, block_counts))]


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                     scale: float, block_indices: Tensor, block_counts: Tensor, *,
                     block_size: int, query_tile: int, key_mask: Optional[Tensor] = None,
                     causal_offset: int = 0, window: Optional[int] = None,
                     tuning: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """Block-sparse attention forward; same contract as ``reference.sparse_attention``.

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]`` (fp16/bf16/fp32,
            one dtype, any strides). attn_mask: None or 4-D bool/float broadcastable to
            ``[B, Hq, Nq, Nk]``. is_causal: query ``i`` sees keys ``j <= i + causal_offset``
            (0: SDPA's top-left rule). scale: softmax scale.
        key_mask: None or bool ``[B, Nk]``: False keys are never attended (padding).
        window: None, or a causal sliding window (int >= 1; needs ``is_causal``): query ``i``
            sees only keys ``j > i + causal_offset - window``.
        block_indices: int32 ``[B, Hkv, T, M]`` ascending, -1 padded. block_counts: int32
            ``[B, Hkv, T]``. block_size, query_tile: the PISA options of those names.
        tuning: overrides of :data:`ATTENTION_TILES` (benchmark sweeps).

    Returns:
        ``out [B, Hq, Nq, Dv]`` in ``q.dtype`` (zero rows where no key is visible) and
        ``lse [B, Hq, Nq]`` float32 (natural log, ``-inf`` for such rows).

    Raises:
        ValueError: unsupported dtype, head dim > 256, or mismatched selection shape.
    """
    B, Hq, Hkv, Nq, Nk, D, Dv, bi, bc, mask, mstr, thr, meta = _common(
        q, k, v, attn_mask, is_causal, block_indices, block_counts, block_size, query_tile,
        tuning, key_mask, window)
    out = torch.empty(B, Hq, Nq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    T = bi.shape[2]
    grid = (T * meta["N_SUB"], B * Hkv, 1)
    for programs, counts in _fwd_launches(meta, bi, bc, mask[1]):
        launcher(_fwd_kernel, q)[grid](
            q, k, v, *mask, bi, counts, out, lse, out, lse,
            *q.stride(), *k.stride(), *v.stride(), *mstr, *out.stride(), *lse.stride(),
            *bi.stride()[:3], *counts.stride(),
            Hkv, Nq, Nk, causal_offset, window or 0, float(scale) * LOG2E.value, thr, 0, 0, 0,
            SPLIT=False, KEY_MASK_PROGRAMS=programs, **meta)
    return out, lse


def sparse_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                              attn_mask: Optional[Tensor], out: Tensor, lse: Tensor,
                              block_indices: Tensor, block_counts: Tensor, is_causal: bool,
                              scale: float, *, block_size: int, query_tile: int,
                              key_mask: Optional[Tensor] = None, causal_offset: int = 0,
                              window: Optional[int] = None,
                              tuning: Optional[dict] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` of :func:`sparse_attention` with the selection fixed (FlashAttention-2).

    Three passes: ``delta = rowsum(dO * O)``; ``dq`` per query tile (loop over its blocks);
    ``dk, dv`` per key tile from :func:`transposed_index` (loop over the tiles that chose the
    leaf, in tile order). Deterministic; fp32 accumulation; returns q/k/v dtypes.

    Args: as :func:`sparse_attention`, plus ``grad_out [B, Hq, Nq, Dv]``, the forward's ``out``
    and ``lse`` (float32 ``[B, Hq, Nq]``).
    """
    B, Hq, Hkv, Nq, Nk, D, Dv, bi, bc, mask, mstr, thr, meta = _common(
        q, k, v, attn_mask, is_causal, block_indices, block_counts, block_size, query_tile,
        tuning, key_mask, window)
    T = bi.shape[2]
    C = block_size
    L = cdiv(Nk, C)
    delta = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    rows = 64 if meta["HEAD_DIM_V"] <= 128 else 32
    launcher(_bwd_delta_kernel, q)[(triton.cdiv(Nq, rows), B * Hq)](
        out, grad_out, delta, Hq, Nq, *out.stride(), *grad_out.stride(),
        DV=Dv, HEAD_DIM_V=meta["HEAD_DIM_V"], ROWS=rows)
    lse = lse.float()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    qk_scale = float(scale) * LOG2E.value
    launcher(_bwd_dq_kernel, q)[(T * meta["N_SUB"], B * Hkv)](
        q, k, v, *mask, bi, bc, grad_out, lse, delta, dq,
        *q.stride(), *k.stride(), *v.stride(), *mstr, *grad_out.stride(), *lse.stride(),
        *dq.stride(), *bi.stride()[:3], *bc.stride(),
        Hkv, Nq, Nk, causal_offset, window or 0, qk_scale, float(scale), thr, **meta)
    offsets, tiles = transposed_index(bi, bc, L)
    nch = cdiv(C, meta["BLOCK_N"])
    seg = SEG_TILES
    M = bi.shape[3]
    BHL = B * Hkv * L
    W = (B * Hkv * T * M) // seg if T > seg else 0  # static bound on extra segments
    if W:
        work, slot_base = _segment_plan(offsets, seg, W)
        part_k = torch.empty(2 * W, C, D, dtype=torch.float32, device=q.device)
        part_v = torch.empty(2 * W, C, Dv, dtype=torch.float32, device=q.device)
    else:
        work = slot_base = part_k = part_v = offsets  # unused: no leaf has two segments
    launcher(_bwd_dkdv_kernel, q)[(BHL + W, nch)](
        q, k, v, *mask, offsets, tiles, work, slot_base, grad_out, lse, delta, dk, dv,
        part_k, part_v,
        *q.stride(), *k.stride(), *v.stride(), *mstr, *grad_out.stride(), *lse.stride(),
        *dk.stride(), *dv.stride(),
        Hkv, Nq, Nk, causal_offset, window or 0, L, BHL, tiles.shape[-1], seg, qk_scale,
        float(scale), thr, **meta)
    if W:
        launcher(_bwd_reduce_kernel, q)[(BHL, nch)](
            offsets, slot_base, part_k, part_v, dk, dv, *dk.stride(), *dv.stride(),
            Hkv, Nk, L, seg, C=C, D=D, DV=Dv, BLOCK_N=meta["BLOCK_N"],
            HEAD_DIM=meta["HEAD_DIM"], HEAD_DIM_V=meta["HEAD_DIM_V"], num_warps=4)
    return dq, dk, dv


def _segment_plan(offsets: Tensor, seg: int, W: int) -> tuple[Tensor, Tensor]:
    """Work list of the extra dk/dv segments and the partial slots of split leaves.

    A leaf chosen by ``cnt`` tiles has ``ceil(cnt / seg)`` segments. Returns ``work`` int32
    ``[W, 2]`` (flat leaf id, segment >= 1; leaf id ``B*Hkv*L`` marks an idle entry) and
    ``slot_base`` int32 ``[B*Hkv*L]`` (first partial slot of each split leaf). At most
    ``W = B*Hkv*T*M // seg`` extra segments and ``2 W`` slots exist; static shapes, no sync.
    """
    cnt = (offsets[..., 1:] - offsets[..., :-1]).reshape(-1)
    extra = torch.div(cnt - 1, seg, rounding_mode="floor").clamp(min=0)
    n_slot = torch.where(extra > 0, extra + 1, 0)
    slot_base = (torch.cumsum(n_slot, 0) - n_slot).to(torch.int32)
    ext_cum = torch.cumsum(extra, 0)
    w = torch.arange(W, device=offsets.device, dtype=ext_cum.dtype)
    owner = torch.searchsorted(ext_cum, w, right=True)
    o = owner.clamp(max=cnt.numel() - 1)
    segment = w - (ext_cum[o] - extra[o]) + 1
    work = torch.stack([owner.to(torch.int32), segment.to(torch.int32)], -1).contiguous()
    return work, slot_base
