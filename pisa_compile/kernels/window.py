"""Exact sliding-window attention, for the sites whose mask the pass proves to be a causal
sliding window (Mistral, Gemma 3, Gemma 2 without logit softcapping, Qwen2 with
``use_sliding_window``): through PyTorch's FlexAttention, or through PISA's Triton attention
kernels over the leaf blocks that :func:`window_blocks` lists (a window with a key mask, where
FlexAttention traced by Inductor gave wrong rows).

A query sees at most ``window`` keys there, so the attention is already ``O(N * window)``; it
runs exactly (no selection) over the key blocks the window touches. The block lists come from
the window's geometry per 128 x 128 block: no ``Nq x Nk`` mask is ever built
(``create_block_mask`` would evaluate the mask on every entry). FlexAttention (``torch.nn.attention.flex_attention``; Dong et al., 2024) skips the
other blocks and applies the mask only on the edge blocks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["window_attention", "window_block_mask", "window_blocks", "WINDOW_QUERY_TILE"]

BLOCK = 128  # FlexAttention's default query and key block
# Queries per tile of the Triton window path: a tile reads window + tile - 1 keys, so a wider
# tile wastes less of its key blocks on keys no row sees, at the price of more rows per block.
WINDOW_QUERY_TILE = 64


def _tile_extent(Nq, Nk, window: int, causal_offset, block_size: int, query_tile: int,
                 device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per tile of ``query_tile`` queries: its first and last rows' key positions, the first
    key block of ``block_size`` its windows touch, and how many they touch (0 when every
    row's window starts past the last key). ``[ceil(Nq / query_tile)]`` each."""
    t = torch.arange(-(-Nq // query_tile), device=device)
    q_lo = t * query_tile + causal_offset
    q_hi = torch.clamp((t + 1) * query_tile, max=Nq) - 1 + causal_offset
    lo = torch.clamp(q_lo - window + 1, min=0)  # keys some row sees: [lo, hi]
    hi = torch.clamp(q_hi, max=Nk - 1)
    first = lo // block_size
    return q_lo, q_hi, first, torch.where(lo > hi, 0, hi // block_size - first + 1)


def window_blocks(Nq, Nk, window: int, causal_offset, block_size: int, query_tile: int,
                  device: torch.device) -> tuple[Tensor, Tensor]:
    """Block lists of a causal sliding window, for the Triton attention kernels.

    Query ``i`` sits at key position ``p = i + causal_offset`` and sees keys ``j`` with
    ``p - window < j <= p``; a tile of ``query_tile`` queries lists every leaf block of
    ``block_size`` keys that some row of it sees (the kernels mask the edges).

    Args:
        Nq, Nk: queries and keys (ints or SymInts);
        window: keys per query (int >= 1); causal_offset: int or SymInt >= 0;
        block_size, query_tile: leaf and tile sizes of the attention call; device: q's.

    Returns:
        ``block_indices`` int32 ``[T, M]`` (ascending, ``-1`` padded; ``T =
        ceil(Nq / query_tile)``, ``M = ceil((window + query_tile - 1) / block_size) + 1``,
        a static bound) and ``block_counts`` int32 ``[T]``: the same for every batch row and
        head (callers expand them). Built on the device from the geometry: no host sync,
        ``O(T * M)``.
    """
    M = -(-(window + query_tile - 1) // block_size) + 1
    _, _, first, count = _tile_extent(Nq, Nk, window, causal_offset, block_size, query_tile,
                                      device)
    slot = torch.arange(M, device=device)
    idx = torch.where(slot[None, :] < count[:, None], first[:, None] + slot[None, :], -1)
    return idx.to(torch.int32), count.to(torch.int32)


def window_block_mask(B: int, Nq: int, Nk: int, window: int, causal_offset,
                      key_mask: Optional[Tensor], device: torch.device):
    """The :class:`~torch.nn.attention.flex_attention.BlockMask` of a causal sliding window.

    Query ``i`` sits at key position ``p = i + causal_offset`` and sees keys ``j`` with
    ``p - window < j <= p`` (transformers' ``sliding_window``), and only keys where
    ``key_mask[b, j]`` is set.

    Args:
        B, Nq, Nk: batch, queries, keys; window: keys per query (int >= 1);
        causal_offset: int or SymInt >= 0 (a KV cache's length).
        key_mask: None or bool ``[B, Nk]`` (True = the key may be attended).
        device: where the block lists live (q's device).

    Returns:
        A ``BlockMask`` of 128 x 128 blocks: as full blocks those wholly inside every row's
        window (and, with a key mask, holding no masked key in that batch row), as partial
        ones the rest the window touches. The index lists are ``[B or 1, 1, Nq/128, Nk/128]``
        int32 (FlexAttention's layout), so building them is ``O((N/128)^2)``, small next to
        the attention's ``O(N * window)``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    nkb = -(-Nk // BLOCK)
    q_lo, q_hi, first, n_touch = _tile_extent(Nq, Nk, window, causal_offset, BLOCK, BLOCK,
                                              device)
    # Index lists as wide as the key blocks (FlexAttention's layout; the transposed lists
    # for the backward assume it), the touched ones first.
    cols = first[:, None] + torch.arange(nkb, device=device)[None, :]
    touched = torch.arange(nkb, device=device)[None, :] < n_touch[:, None]
    # Full: every row of block m sees every key of block n.
    k_lo, k_hi = cols * BLOCK, torch.clamp((cols + 1) * BLOCK, max=Nk) - 1
    full = (touched & (k_hi <= q_lo[:, None]) & (k_lo > q_hi[:, None] - window))[None]
    touched = touched[None]
    if key_mask is not None:
        # Per batch row: a block with a masked key is partial, one with no attendable key is
        # not listed (keys past Nk do not exist: they count as neither).
        Bk, grow, col = key_mask.shape[0], (0, nkb * BLOCK - Nk), torch.remainder(cols, nkb)
        clean = F.pad(key_mask, grow, value=True).view(Bk, nkb, BLOCK).all(-1)   # [B, nkb]
        some = F.pad(key_mask, grow, value=False).view(Bk, nkb, BLOCK).any(-1)
        touched = touched & some[:, col]                                       # [B, nqb, nkb]
        full = full & clean[:, col] & touched
    partial = touched & ~full

    def lists(sel: Tensor):
        # Selected columns first, ascending; then every other block once (never read).
        key = torch.where(sel, cols, 2 * nkb + cols)
        order = torch.sort(key, dim=-1).indices
        idx = torch.remainder(torch.gather(cols.expand_as(sel), -1, order), nkb)
        # Batch dim 1 without a key mask: FlexAttention broadcasts it.
        return sel.sum(-1).to(torch.int32)[:, None], idx.to(torch.int32)[:, None]

    # A traced scalar tensor, not a Python or symbolic int captured as a constant: a KV
    # cache's growing offset then neither recompiles nor goes stale in the graph.
    off = torch.scalar_tensor(causal_offset, dtype=torch.int64, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        pos = q_idx + off
        ok = (kv_idx <= pos) & (kv_idx > pos - window)
        if key_mask is not None:
            ok = ok & key_mask[b, kv_idx]
        return ok

    kv_num, kv_idx = lists(partial)
    full_num, full_idx = lists(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(Nq, Nk))


_compiled_flex = None


def _flex(q: Tensor):
    """FlexAttention as the call needs it: plain while traced (Inductor compiles the
    higher-order op with the graph) and on the CPU (eager; tests), compiled once on CUDA in
    eager calls (uncompiled, it would compute every score of the window's blocks unfused)."""
    from torch._guards import detect_fake_mode
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if (q.device.type != "cuda" or torch.compiler.is_compiling()
            or detect_fake_mode((q,)) is not None):
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def window_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal_offset: int,
                     key_mask: Optional[Tensor], scale: float, enable_gqa: bool) -> Tensor:
    """Exact causal sliding-window attention (FlexAttention over the window's blocks).

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]``; float16,
            bfloat16 or float32 (FlexAttention's dtypes).
        window, causal_offset, key_mask: as :func:`window_block_mask`.
        scale: softmax scale; enable_gqa: ``Hq`` a multiple of ``Hkv``.

    Returns:
        ``[B, Hq, Nq, Dv]`` in q's dtype; a row that sees no key is zero (as SDPA).
    """
    if not torch.is_grad_enabled():  # FlexAttention refuses CPU inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
    bm = window_block_mask(q.shape[0], q.shape[2], k.shape[2], window, causal_offset,
                           key_mask, q.device)
    # A row that sees no key comes out 0 (FlexAttention's rule, SDPA's for -inf masks).
    return _flex(q)(q, k, v, block_mask=bm, scale=scale, enable_gqa=enable_gqa)
