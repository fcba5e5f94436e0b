"""The persistent pyramid's layout (:class:`BoxPyramid`) and which key tensors a pyramid
stands behind (torch and :mod:`.geometry` only: importable without Triton).

A :class:`pisa_compile.PisaKVCache` registers its key buffer here; the decode op
(``ops``'s ``pisa::cached_decode``) looks up the keys it is handed at run time. A key tensor
is recognised only as the exact view ``buffer[:, :, :view_length]`` of a live cache (same
data pointer, shape, strides, dtype and device: the filled part of a growing cache, the whole
buffer of a static one), so a copy, another slice, or a buffer written outside the cache's
``append`` never is; the owner then decides (its cost model) whether the step is sparse.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .geometry import cdiv, level_sizes

__all__ = ["BoxPyramid", "box_pyramid", "register", "lookup", "any_registered"]


class BoxPyramid(NamedTuple):
    """Key boxes of every pyramid node for up to ``capacity`` keys, laid out for the capacity
    so that appending keys never moves a node (DESIGN.md "Persistent pyramid").

    Level ``l`` (0 = leaves of ``block_size`` keys) starts at row ``sum_{i<l} ceil(L_cap /
    g^i)`` of each ``[B, Hkv]`` slice (``L_cap = ceil(capacity / block_size)``); with ``n``
    keys its first ``ceil(ceil(n / C) / g^l)`` nodes are in use, the same nodes (same
    numbering) as a pyramid built from scratch over those ``n`` keys.

    Attributes:
        hi, lo: ``[B, Hkv, total, D]`` in the keys' dtype: channel max/min over each node's
            live keys (0 when empty or not finite).
        cnt: float32 ``[B, Hkv, total]`` live keys per node.
        lc: float32 ``[B, Hkv, total]``: ``log2(cnt)`` (``-inf`` empty, ``+inf`` a box holding
            a non-finite key, which the selection keeps first).
        capacity, block_size, branching, beam: the layout (``beam`` resolved: levels coarsen
            until one has at most ``branching * beam`` nodes).
    """

    hi: Tensor
    lo: Tensor
    cnt: Tensor
    lc: Tensor
    capacity: int
    block_size: int
    branching: int
    beam: int

    @property
    def leaf_capacity(self) -> int:
        return cdiv(self.capacity, self.block_size)

    @property
    def total(self) -> int:
        return self.hi.shape[2]

    def level_offsets(self) -> list[int]:
        """Row of each level's first node (the capacity layout)."""
        offs, off = [], 0
        for n in level_sizes(self.capacity, self.block_size, self.branching, self.beam):
            offs.append(off)
            off += n
        return offs

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hi, self.lo, self.cnt, self.lc))

    def clear(self) -> None:
        """Empty every node, in place (the buffers are kept)."""
        self.cnt.zero_()
        self.lc.fill_(float("-inf"))
        self.hi.zero_()
        self.lo.zero_()


def box_pyramid(batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                device, *, block_size: int, branching: int, beam: int) -> BoxPyramid:
    """An empty :class:`BoxPyramid` for ``capacity`` keys (every node empty).

    Args:
        batch, kv_heads, capacity, head_dim: ``B``, ``Hkv``, the most keys, ``D`` (ints >= 1).
        dtype: the keys' dtype (the boxes are stored in it); device: where.
        block_size, branching, beam: the PISA options (``beam`` resolved, >= 1).

    Returns:
        A :class:`BoxPyramid` of ``sum(level_sizes(capacity, ...))`` rows per head:
        ``2 * D * itemsize + 8`` bytes each.
    """
    total = sum(level_sizes(capacity, block_size, branching, beam))
    hi = torch.zeros(batch, kv_heads, total, head_dim, dtype=dtype, device=device)
    return BoxPyramid(hi, torch.zeros_like(hi),
                      torch.zeros(batch, kv_heads, total, dtype=torch.float32, device=device),
                      torch.full((batch, kv_heads, total), float("-inf"), dtype=torch.float32,
                                 device=device),
                      capacity, block_size, branching, beam)


_OWNERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register(keys: Tensor, owner: object) -> None:
    """Record that ``owner`` (it has ``keys``, ``view_length`` and ``decode``) keeps a pyramid for
    the buffer ``keys`` ``[B, Hkv, capacity, D]``; dropped when ``owner`` is collected."""
    _OWNERS[keys.data_ptr()] = owner


def lookup(k: Tensor) -> Optional[object]:
    """The owner whose keys ``k`` is exactly (``buffer[:, :, :view_length]``), or None."""
    if k.numel() == 0 or not hasattr(k, "data_ptr"):
        return None
    try:
        owner = _OWNERS.get(k.data_ptr())
    except RuntimeError:  # fake or functional tensors have no storage
        return None
    if owner is None:
        return None
    buf = owner.keys
    if (k.shape[:2] != buf.shape[:2] or k.shape[2] != owner.view_length
            or k.shape[3] != buf.shape[3]
            or k.stride() != buf.stride() or k.dtype != buf.dtype or k.device != buf.device):
        return None
    return owner


def any_registered() -> bool:
    """Whether any cache is alive (a graph traced without one keeps its dense decode)."""
    return len(_OWNERS) > 0
