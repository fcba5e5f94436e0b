"""Triton split-K decode for PISA: a few queries over a long KV cache (flash-decoding).

With ``Nq <= 16`` there are only ``B * Hkv`` query tiles, far too few programs to fill a GPU,
so the block list of each tile is cut into ``n_splits`` contiguous slices. Each slice runs the
forward kernel of :mod:`.triton_attention` in ``SPLIT`` mode and writes a partial (normalised
output, base-2 lse) in fp32; a combine kernel merges the partials with a log-sum-exp
(Dao et al., "Flash-Decoding for long-context inference", 2023). The rows of a tile are
packed ``G * Nq`` (GQA heads times queries), so one K/V tile load serves every head of the group.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .geometry import cdiv
from .runtime import launcher
from .triton_attention import _common, _fwd_kernel
from .triton_util import LN2, LOG2E

__all__ = ["decode_attention", "num_splits"]


@triton.jit
def _combine_kernel(OPart, LPart, Out, Lse, n_rows, NS, part_stride_o, part_stride_l,
                    DV: tl.constexpr, HEAD_DIM_V: tl.constexpr, ROWS: tl.constexpr):
    """Merge ``NS`` partials of ``n_rows`` rows (``[B, Hq, Nq]`` order, contiguous)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    ok = rows < n_rows
    d = tl.arange(0, HEAD_DIM_V)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    for s in range(0, NS):
        m = tl.maximum(m, tl.load(LPart + s * part_stride_l + rows, mask=ok, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_V], tl.float32)
    for s in range(0, NS):
        w = tl.math.exp2(tl.load(LPart + s * part_stride_l + rows, mask=ok, other=float("-inf"))
                         - m_use)
        o = tl.load(OPart + s * part_stride_o + rows[:, None] * DV + d[None, :],
                    mask=ok[:, None] & (d[None, :] < DV), other=0.0)
        den += w
        acc += w[:, None] * o
    empty = den == 0.0  # no visible key in any split; a NaN row stays NaN
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, den)[:, None])
    lse = tl.where(~empty, (m_use + tl.math.log2(tl.where(empty, 1.0, den))) * LN2,
                   float("-inf"))
    tl.store(Out + rows[:, None] * DV + d[None, :], out.to(Out.dtype.element_ty),
             mask=ok[:, None] & (d[None, :] < DV))
    tl.store(Lse + rows, lse, mask=ok)


def _n_sm(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def num_splits(n_programs: int, n_entries: int, device: torch.device,
               entries_per_iter: int = 1) -> tuple[int, int]:
    """``(n_splits, entries_per_split)``: about two programs per SM, at least one tile each.

    ``entries_per_split`` is a multiple of ``entries_per_iter`` (leaves per key tile).
    Depends on shapes only, so the launch is graph-safe.
    """
    want = max(1, cdiv(2 * _n_sm(device), max(1, n_programs)))
    ns = max(1, min(want, n_entries))
    per_split = cdiv(cdiv(n_entries, ns), entries_per_iter) * entries_per_iter
    return cdiv(n_entries, per_split), per_split


def decode_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                     scale: float, block_indices: Tensor, block_counts: Tensor,
                     *, block_size: int, query_tile: int, key_mask: Optional[Tensor] = None,
                     causal_offset: int = 0, window: Optional[int] = None,
                     n_splits: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Block-sparse attention for a few queries (decode); same contract as ``sparse_attention``.

    Args:
        q: ``[B, Hq, Nq, D]`` (meant for ``Nq <= 16``; any ``Nq`` is correct); k, v: the cache
            ``[B, Hkv, Nk, D]`` / ``[B, Hkv, Nk, Dv]``; attn_mask, is_causal, scale,
            block_indices ``[B, Hkv, T, M]``, block_counts ``[B, Hkv, T]``, block_size,
            query_tile, key_mask, causal_offset, window: as
            :func:`pisa_compile.kernels.reference.sparse_attention`.
        n_splits: override the number of slices per block list (default: fill the GPU).

    Returns:
        ``out [B, Hq, Nq, Dv]`` (``q.dtype``) and ``lse [B, Hq, Nq]`` float32 (natural log,
        ``-inf`` for rows with no visible key, whose output is 0).

    Raises:
        ValueError: as :func:`pisa_compile.kernels.triton_attention.sparse_attention`.
    """
    B, Hq, Hkv, Nq, Nk, D, Dv, bi, bc, mask, mstr, thr, meta = _common(
        q, k, v, attn_mask, is_causal, block_indices, block_counts, block_size, query_tile,
        key_mask=key_mask, window=window)
    T, M = bi.shape[2], bi.shape[3]
    C = block_size
    per_iter = max(1, meta["BLOCK_N"] // C)
    n_prog = T * meta["N_SUB"] * B * Hkv
    if n_splits is None:
        ns, per_split = num_splits(n_prog, M, q.device, per_iter)
    else:
        per_split = cdiv(cdiv(M, max(1, min(n_splits, M))), per_iter) * per_iter
        ns = cdiv(M, per_split)
    out = torch.empty(B, Hq, Nq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    n_rows = B * Hq * Nq
    o_part = torch.empty(ns, n_rows, Dv, dtype=torch.float32, device=q.device)
    l_part = torch.empty(ns, n_rows, dtype=torch.float32, device=q.device)
    # One launch, also on the window path under a key mask (its keys' mask read per key):
    # the prefill's two launches (_fwd_launches) would add their host-side ops to every step
    # for a few rows of work (a review measured 100 us of them, eager, on an H100).
    launcher(_fwd_kernel, q)[(T * meta["N_SUB"], B * Hkv, ns)](
        q, k, v, *mask, bi, bc, out, lse, o_part, l_part,
        *q.stride(), *k.stride(), *v.stride(), *mstr, *out.stride(), *lse.stride(),
        *bi.stride()[:3], *bc.stride(),
        Hkv, Nq, Nk, causal_offset, window or 0, float(scale) * LOG2E.value, thr, per_split,
        n_rows * Dv, n_rows,
        SPLIT=True, **meta)
    rows = 16
    launcher(_combine_kernel, q)[(triton.cdiv(n_rows, rows),)](
        o_part, l_part, out, lse, n_rows, ns, n_rows * Dv, n_rows,
        DV=Dv, HEAD_DIM_V=meta["HEAD_DIM_V"], ROWS=rows, num_warps=4)
    return out, lse
