"""Block and tile geometry: the rules every implementation shares (DESIGN.md "The algorithm").

One definition each of: the width of ``block_indices``, the local leaves a tile can force,
where queries sit among the keys (the query offset), the forced leaf ranges of a tile, when
the pool is every leaf (``flat_leaves``), the pyramid's level sizes, and the dense mask that structured arguments (causal offset, key
mask) stand for. The reference, the Triton kernels, ``metrics`` and the tests all
use these. A leaf module: plain ints (SymInt-safe where noted) and torch only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["cdiv", "local_bound", "block_width", "query_offset", "forced_ranges",
           "flat_applies", "flat_beam", "level_sizes", "dense_mask"]


def cdiv(a, b):
    """``ceil(a / b)`` for non-negative ints (SymInt-safe)."""
    return (a + b - 1) // b


def positive_scale(q: Tensor, scale: float) -> tuple[Tensor, float]:
    """``(q, scale)`` for a selection, with a negative softmax scale moved onto the queries:
    ``scale * q.k == |scale| * (-q).k``. Box bounds bound ``q.k`` from above, an upper bound
    of the scores only for a positive scale (a new user's trial: with a negative one, pooled
    leaves with ``bound_block`` picked other blocks in 50 of 64 tiles)."""
    return (-q, -scale) if scale < 0 else (q, scale)


def local_bound(local_blocks, query_tile, block_size):
    """Most local leaves one tile can force: ``local_blocks - 1`` plus the leaves the tile's
    ``query_tile`` positions can touch (0 without local blocks). SymInt-safe."""
    if local_blocks == 0:
        return 0
    return local_blocks - 1 + (query_tile + block_size - 2) // block_size + 1


def block_width(n_keys, block_size, top_k, sink_blocks, local_blocks, query_tile):
    """Width ``M`` of ``block_indices``: forced leaves plus ``top_k``, capped at the leaf count.

    SymInt-safe (fake kernels get the shapes as symbols). Python's ``min``, not ``sym_min``: a
    symbolic length then costs one range guard and the width stays a plain int, which the
    kernels need as a compile-time tile size.
    """
    bound = sink_blocks + top_k + local_bound(local_blocks, query_tile, block_size)
    return min(cdiv(n_keys, block_size), bound)


def query_offset(n_queries: int, n_keys: int, is_causal: bool,
                 causal_offset: int = 0, explicit_mask: bool = False) -> Optional[int]:
    """Key position of query 0: query ``i`` sits at key position ``i + offset``.

    Causal attention sees keys ``j <= i + causal_offset``: 0 is SDPA's top-left rule, a KV
    cache of ``past`` keys gives ``past`` (bottom-right when ``Nk = past + Nq``). Otherwise
    ``Nq == Nk`` is self-attention (offset 0). Under an ``explicit_mask`` with ``Nq < Nk`` the
    queries are the last positions (offset ``Nk - Nq``): the mask may be a KV cache's causal
    one as a tensor, which the op does not read as structure everywhere. Any other call is
    cross-attention, with no local leaves (``None``): until December 2026 a call under a key
    mask or none placed its queries last as well, and an encoder batch's right padding took a
    decoder tile's forced leaves (1.23 apart from the keys alone in a new user's trial).
    """
    if is_causal:
        return causal_offset
    if n_queries == n_keys:
        return 0
    if explicit_mask and n_queries < n_keys:
        return n_keys - n_queries
    return None


def forced_ranges(tiles: Tensor, n_queries: int, n_keys: int, offset: Optional[int],
                  block_size: int, query_tile: int, sink_blocks: int,
                  local_blocks: int) -> tuple[int, Tensor, Tensor]:
    """Forced leaves of query tiles ``tiles`` (int tensor): ``n_sink`` sink leaves (from leaf
    0, or from :func:`sink_start` with a key mask) and local leaves ``[lo, hi]`` per tile
    (``lo > hi``: none). ``offset`` from :func:`query_offset`."""
    n_leaves = cdiv(n_keys, block_size)
    n_sink = min(sink_blocks, n_leaves)
    if offset is None or local_blocks == 0:
        return n_sink, torch.full_like(tiles, n_leaves + 1), torch.full_like(tiles, -1)
    q0 = tiles * query_tile
    q1 = torch.clamp((tiles + 1) * query_tile, max=n_queries) - 1
    p0 = torch.clamp(q0 + offset, max=n_keys - 1)
    p1 = torch.clamp(q1 + offset, max=n_keys - 1)
    hi = p1 // block_size
    lo = torch.clamp(p0 // block_size - (local_blocks - 1), min=0)
    return n_sink, lo, hi


def sink_start(key_mask: Optional[Tensor], block_size: int,
               allowed: Optional[Tensor] = None) -> Optional[Tensor]:
    """The leaf of each batch row's first attendable key: int32 ``[B]`` (``[1]`` for a mask
    broadcast over the batch; 0 for a row with none), or None without a mask. The sink
    leaves of a row start there, so a left-padded row keeps the start of its text, where
    attention sinks form, instead of its padding.

    ``key_mask``: bool ``[B, Nk]``; ``allowed``: an explicit mask's visibility (bool, batch
    first, keys last, any dims between, broadcast ones included): a key some query of the
    row sees is attendable. With both, a key must pass both."""
    live = key_mask
    if allowed is not None:
        seen = allowed.any(-2)
        while seen.dim() > 2:
            seen = seen.any(1)
        live = seen if live is None else seen & live
    if live is None:
        return None
    return (live.to(torch.int32).argmax(-1) // block_size).to(torch.int32)


def flat_applies(leaf_scoring: str, shortlist: Optional[int], bound_block: Optional[int]) -> bool:
    """Whether ``flat_leaves`` applies: exact leaves ranked by box bounds into a shortlist (the
    flat kernel's selection; others keep the walk, whose pool lives in registers)."""
    return leaf_scoring == "exact" and bool(shortlist) and bool(bound_block)


def flat_beam(n_keys: int, block_size: int, branching: int, beam: int, flat_leaves: int, *,
              leaf_scoring: str, shortlist: int, bound_block: int) -> int:
    """The beam a call selects with: ``beam``, raised to ``ceil(L / branching)`` when the call
    has ``L = ceil(n_keys / block_size)`` leaves, at most ``flat_leaves``, and
    :func:`flat_applies`. The pyramid then has one level (:func:`level_sizes`), so the first
    pool is every leaf: the flat scan of the ``flat_leaves`` option (DESIGN.md "Flat
    leaves"). Capped at ``L``: a wider beam keeps the same one level, and the Triton pool
    (``branching * beam`` wide) would be sized by a ``beam`` as large as ``top_k``."""
    L = cdiv(n_keys, block_size)
    if (flat_applies(leaf_scoring, shortlist, bound_block) and L <= flat_leaves
            and L > branching * beam):
        return cdiv(L, branching)
    return min(beam, L)


def level_sizes(n_keys: int, block_size: int, branching: int, beam: int) -> list[int]:
    """Node counts per pyramid level, leaves first. Levels coarsen by ``branching`` until one
    has at most ``branching * beam`` nodes: the selection's first pool."""
    sizes = [cdiv(n_keys, block_size)]
    while sizes[-1] > branching * beam:
        sizes.append(cdiv(sizes[-1], branching))
    return sizes


def dense_mask(batch: int, n_queries: int, n_keys: int, is_causal: bool, causal_offset=0,
               key_mask: Optional[Tensor] = None, device=None,
               window: Optional[int] = None) -> Tensor:
    """The bool mask ``[batch, 1, Nq, Nk]`` (True = attend) that the structured arguments
    stand for: query ``i`` sees key ``j`` iff ``j <= i + causal_offset`` (when causal),
    ``j > i + causal_offset - window`` (a sliding window) and ``key_mask[b, j]``.
    O(Nq * Nk): for plain-SDPA fallbacks and tests, never the fast path."""
    if key_mask is not None:
        device = key_mask.device
    q = torch.arange(n_queries, device=device)[:, None]
    j = torch.arange(n_keys, device=device)[None, :]
    m = (j <= q + causal_offset) if is_causal else torch.ones(
        n_queries, n_keys, dtype=torch.bool, device=device)
    if window is not None:
        m = m & (j > q + causal_offset - window)
    m = m[None, None].expand(batch, 1, n_queries, n_keys)
    if key_mask is not None:
        m = m & key_mask[:, None, None, :].bool()
    return m
