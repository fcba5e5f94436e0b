"""Triton kernels that build the PISA key pyramid (DESIGN.md "Leaves and pyramid").

Two launches, one pass over ``K``:

1. ``_leaf_kernel``: one program per (leaf, batch*kv-head) sums the live keys of one leaf and
   writes the leaf mean ``mu`` and count ``n`` (float32).
2. ``_upper_kernel``: one program per (batch*kv-head, slice of D) walks the levels bottom-up,
   each level reading the one below it (count-weighted mean of ``g = branching`` children,
   counts summed). Levels are tiny (``O(Nk*D/C)``), so one program per head and D-slice is
   enough; a CTA barrier orders the writes of level ``l`` before the reads of level ``l+1``.

Every level lives in one flat buffer ``[B, Hkv, sum_l n_l, D]`` (level 0 = leaves first),
which the selection kernel indexes with offsets it recomputes from ``L`` and ``g``.
Same numbers as :func:`pisa_compile.kernels.reference.build_pyramid` up to float32 summation
order.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .geometry import cdiv, level_sizes
from .persistent import BoxPyramid
from .runtime import launcher


def total_bound(n_leaves, branching: int):
    """Rows enough for every level: ``L + ceil(L / (g - 1)) + 64`` bounds ``sum(level_sizes)``
    (``ceil(x / g) <= x / g + 1`` per level, at most 64 levels). A closed form, so symbolic
    lengths need no guard per level count."""
    return n_leaves + (n_leaves + branching - 2) // (branching - 1) + 64


@triton.jit
def n_levels(L, GB: tl.constexpr, TOP: tl.constexpr):
    """Levels of the pyramid, leaves included: coarsen until at most ``TOP = g * beam`` nodes
    (:func:`pisa_compile.kernels.geometry.level_sizes` in the kernel)."""
    n = L
    lev = 1
    while n > TOP:
        n = (n + GB - 1) // GB
        lev += 1
    return lev


@triton.jit
def _leaf_kernel(k_ptr, live_ptr, mu_ptr, cnt_ptr, lc_ptr,
                 skb, skh, skn, skd, slb, slh, sln,
                 Hkv, Nk, live_limit, total, D,
                 C: tl.constexpr, KC: tl.constexpr, BD: tl.constexpr, HAS_LIVE: tl.constexpr):
    leaf = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    d = tl.arange(0, BD)
    dm = d < D
    acc = tl.zeros([BD], dtype=tl.float32)
    n = tl.zeros([KC], dtype=tl.float32)
    kbase = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    for c0 in tl.static_range(0, C, KC):
        kp = leaf * C + c0 + tl.arange(0, KC)
        # Keys past Nk are padding; causal keys at or past Nq are seen by no query.
        live = (kp < Nk) & (kp < live_limit)
        if HAS_LIVE:
            lv = tl.load(live_ptr + b.to(tl.int64) * slb + h.to(tl.int64) * slh + kp * sln,
                         mask=live, other=0)
            live = live & (lv != 0)
        kk = tl.load(kbase + kp.to(tl.int64)[:, None] * skn + d[None, :] * skd,
                     mask=live[:, None] & dm[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(kk, axis=0)
        n += live.to(tl.float32)
    cnt = tl.sum(n, axis=0)
    out = bh.to(tl.int64) * total + leaf
    mean = acc / tl.maximum(cnt, 1.0)
    bad = tl.max(((mean != mean) | (tl.abs(mean) == float("inf"))).to(tl.int32), axis=0) > 0
    tl.store(mu_ptr + out * D + d, tl.where(bad, 0.0, mean), mask=dm)
    tl.store(cnt_ptr + out, cnt)
    tl.store(lc_ptr + out, tl.where(bad, float("inf"), tl.log2(cnt)))


@triton.jit
def _upper_kernel(mu_ptr, cnt_ptr, lc_ptr, L, total, D,
                  GB: tl.constexpr, TOP: tl.constexpr, GP: tl.constexpr, NB: tl.constexpr,
                  DB: tl.constexpr):
    bh = tl.program_id(0)
    pd = tl.program_id(1)
    d = pd * DB + tl.arange(0, DB)
    dm = d < D
    j = tl.arange(0, GP)
    base = bh.to(tl.int64) * total
    n_prev = L
    off_prev = 0
    for _lev in range(1, n_levels(L, GB, TOP)):
        n_cur = (n_prev + GB - 1) // GB
        off_cur = off_prev + n_prev
        for i0 in range(0, n_cur, NB):
            node = i0 + tl.arange(0, NB)
            kid = node[:, None] * GB + j[None, :]  # [NB, GP]
            km = (kid < n_prev) & (j[None, :] < GB) & (node[:, None] < n_cur)
            cn = tl.load(cnt_ptr + base + off_prev + kid, mask=km, other=0.0)
            # A node over a non-finite summary is non-finite (a NaN mean, or inf - inf).
            bad = tl.max((tl.load(lc_ptr + base + off_prev + kid, mask=km, other=0.0)
                          == float("inf")).to(tl.int32), axis=1) > 0
            m = tl.load(mu_ptr + (base + off_prev + kid)[:, :, None] * D + d[None, None, :],
                        mask=km[:, :, None] & dm[None, None, :], other=0.0)
            s = tl.sum(m * cn[:, :, None], axis=1)  # [NB, DB]
            c = tl.sum(cn, axis=1)
            nm = node < n_cur
            tl.store(mu_ptr + (base + off_cur + node)[:, None] * D + d[None, :],
                     tl.where(bad[:, None], 0.0, s / tl.maximum(c, 1.0)[:, None]),
                     mask=nm[:, None] & dm[None, :])
            # Every D-slice program writes the same counts, so each reads back its own writes.
            tl.store(cnt_ptr + base + off_cur + node, c, mask=nm)
            tl.store(lc_ptr + base + off_cur + node, tl.where(bad, float("inf"), tl.log2(c)),
                     mask=nm)
        # The next level reads what other threads of this CTA just wrote.
        tl.debug_barrier()
        n_prev = n_cur
        off_prev = off_cur


def pyramid_buffers(k: Tensor, block_size: int, branching: int, beam: int,
                    live_limit: Optional[int] = None,
                    key_live: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, int]:
    """All levels in flat buffers.

    Args:
        k: ``[B, Hkv, Nk, D]`` (any float dtype, any strides).
        block_size, branching, beam: the PISA options of those names (``beam`` resolved).
        live_limit: keys at positions ``>= live_limit`` are left out (causal: ``Nq``).
        key_live: optional bool ``[B, Hkv or 1, Nk]``: keys some query may see.

    Returns:
        ``mu`` float32 ``[B, Hkv, total, D]``, ``cnt`` float32 ``[B, Hkv, total]`` and the
        base-2 log counts ``lcnt`` (``-inf`` for empty nodes) with the levels stacked leaves
        first (sizes: :func:`level_sizes`; ``total`` is :func:`total_bound`, rows past the
        last level are unused), and the row count ``total``. A node whose summary is not
        finite (it holds a NaN or infinite key) has ``mu`` zeroed and ``lcnt = +inf``: the
        selection keeps it first (``triton_select._prioritise``).
    """
    B, Hkv, Nk, D = k.shape
    C = block_size
    L = cdiv(Nk, C)
    total = total_bound(L, branching)
    mu = torch.empty(B, Hkv, total, D, dtype=torch.float32, device=k.device)
    cnt = torch.empty(B, Hkv, total, dtype=torch.float32, device=k.device)
    lcnt = torch.empty(B, Hkv, total, dtype=torch.float32, device=k.device)
    BD = max(16, triton.next_power_of_2(D))
    KC = min(C, max(1, 8192 // BD))
    if key_live is not None:
        kl = key_live.expand(B, key_live.shape[1], Nk)
        live_arg, sl = kl, (kl.stride(0), kl.stride(1) if kl.shape[1] > 1 else 0, kl.stride(2))
    else:
        live_arg, sl = cnt, (0, 0, 0)  # unused
    limit = Nk if live_limit is None else live_limit  # the kernel also stops at Nk
    launcher(_leaf_kernel, k)[(L, B * Hkv)](
        k, live_arg, mu, cnt, lcnt, *k.stride(), *sl, Hkv, Nk, limit, total, D,
        C=C, KC=KC, BD=BD, HAS_LIVE=key_live is not None, num_warps=4)
    _upper_levels(mu, cnt, lcnt, L, total, branching, beam)
    return mu, cnt, lcnt, total


def _upper_levels(mu: Tensor, cnt: Tensor, lcnt: Tensor, L: int, total: int, branching: int,
                  beam: int) -> None:
    """Every level above the ``L`` leaves already in the buffers, in place."""
    D = mu.shape[-1]
    BD = max(16, triton.next_power_of_2(D))
    DB = min(BD, 32)
    g = branching
    launcher(_upper_kernel, mu)[(mu.shape[0] * mu.shape[1], triton.cdiv(BD, DB))](
        mu, cnt, lcnt, L, total, D, GB=g, TOP=g * beam,
        GP=triton.next_power_of_2(g), NB=64, DB=DB, num_warps=4)


def pyramid_from_leaves(mu: Tensor, cnt: Tensor, lcnt: Tensor, branching: int,
                        beam: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """:func:`pyramid_buffers` from a leaf level computed elsewhere (context parallelism:
    the leaf levels of every rank's keys, gathered).

    Args:
        mu: float32 ``[B, Hkv, L, D]``; cnt, lcnt: float32 ``[B, Hkv, L]``: the first ``L``
            rows of :func:`pyramid_buffers`' outputs for the same keys (``L`` leaves).
        branching, beam: the PISA options of those names (``beam`` resolved).

    Returns:
        As :func:`pyramid_buffers`; the same values as it gives from the keys themselves.
    """
    B, Hkv, L, D = mu.shape
    total = total_bound(L, branching)
    bufs = [t.new_empty((B, Hkv, total) + t.shape[3:]) for t in (mu, cnt, lcnt)]
    for buf, leaves in zip(bufs, (mu, cnt, lcnt)):
        buf[:, :, :L] = leaves
    _upper_levels(*bufs, L, total, branching, beam)
    return (*bufs, total)


def build_pyramid(k: Tensor, key_live: Tensor, block_size: int, branching: int,
                  beam: int) -> tuple[list[Tensor], list[Tensor]]:
    """Triton version of :func:`pisa_compile.kernels.reference.build_pyramid`.

    Args:
        k: ``[B, Hkv, Nk, D]``. key_live: bool ``[B, Hkv or 1, Nk]`` (keys some query may see).
        block_size, branching, beam: the PISA options of those names (``beam`` resolved).

    Returns:
        ``mus[l]`` float32 ``[B, Hkv, n_l, D]`` and ``counts[l]`` float32 ``[B, Hkv, n_l]``,
        level 0 = leaves (views into one buffer).
    """
    mu, cnt, _, _ = pyramid_buffers(k, block_size, branching, beam, key_live=key_live)
    mus, counts, off = [], [], 0
    for n in level_sizes(k.shape[2], block_size, branching, beam):
        mus.append(mu[:, :, off:off + n])
        counts.append(cnt[:, :, off:off + n])
        off += n
    return mus, counts


# -- a persistent box pyramid (decode: kept beside a KV cache, updated as keys are appended) --
# The layout is :class:`.persistent.BoxPyramid`'s.

@triton.jit
def _box_leaf_kernel(k_ptr, km_ptr, hi_ptr, lo_ptr, cnt_ptr, lc_ptr, len_ptr,
                     skb, skh, skn, skd, smb, smn,
                     Hkv, n_keys, leaf0, n_new, total, D,
                     C: tl.constexpr, KC: tl.constexpr, BD: tl.constexpr,
                     HAS_KEY_MASK: tl.constexpr, DEV_LEN: tl.constexpr):
    """Leaf ``leaf0 + program_id(0)`` of head ``program_id(1)``: its box over the live keys
    (positions ``< n_keys`` that ``key_mask`` lets through), recomputed whole. ``DEV_LEN``:
    ``n_keys`` is read from ``len_ptr``, the new keys are ``[n_keys - n_new, n_keys)`` and
    ``leaf0`` is the first leaf holding one (a static cache under a CUDA graph: no host
    length); programs past the last leaf store nothing."""
    last = leaf0 + tl.program_id(0)
    if DEV_LEN:
        n_keys = tl.load(len_ptr).to(tl.int32)
        leaf0 = (n_keys - n_new) // C
        last = (n_keys - 1) // C
    leaf = leaf0 + tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    d = tl.arange(0, BD)
    dm = d < D
    mx = tl.full([BD], float("-inf"), tl.float32)
    mn = tl.full([BD], float("inf"), tl.float32)
    n = tl.zeros([KC], dtype=tl.float32)
    bad = tl.zeros([KC], dtype=tl.int32)
    kbase = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    for c0 in tl.static_range(0, C, KC):
        kp = leaf * C + c0 + tl.arange(0, KC)
        live = kp < n_keys
        if HAS_KEY_MASK:
            live = live & (tl.load(km_ptr + b.to(tl.int64) * smb + kp.to(tl.int64) * smn,
                                   mask=live, other=0) != 0)
        kk = tl.load(kbase + kp.to(tl.int64)[:, None] * skn + d[None, :] * skd,
                     mask=live[:, None] & dm[None, :], other=0.0).to(tl.float32)
        # A NaN or infinite key makes the box not finite (as the reference's amax/amin).
        bad = bad | tl.max(((kk != kk) | (tl.abs(kk) == float("inf"))).to(tl.int32), axis=1)
        mx = tl.maximum(mx, tl.max(tl.where(live[:, None], kk, float("-inf")), axis=0))
        mn = tl.minimum(mn, tl.min(tl.where(live[:, None], kk, float("inf")), axis=0))
        n += live.to(tl.float32)
    cnt = tl.sum(n, axis=0)
    not_ok = tl.max(bad, axis=0) > 0
    zero = not_ok | (cnt == 0.0)
    out = bh.to(tl.int64) * total + leaf
    sm = dm & ((d * 0 + leaf) <= last)  # DEV_LEN: a program past the last leaf stores nothing
    # One-element blocks: the interpreter refuses a scalar store mask.
    at = tl.zeros([1], tl.int32)
    tl.store(hi_ptr + out * D + d, tl.where(zero, 0.0, mx).to(hi_ptr.dtype.element_ty), mask=sm)
    tl.store(lo_ptr + out * D + d, tl.where(zero, 0.0, mn).to(lo_ptr.dtype.element_ty), mask=sm)
    tl.store(cnt_ptr + out + at, cnt + tl.zeros([1], tl.float32), mask=leaf + at <= last)
    tl.store(lc_ptr + out + at, tl.where(not_ok, float("inf"), tl.log2(cnt))
             + tl.zeros([1], tl.float32), mask=leaf + at <= last)


@triton.jit
def _box_node_kernel(hi_ptr, lo_ptr, cnt_ptr, lc_ptr, len_ptr, node0, node1, n_new, off_prev,
                     n_prev, off_cur, total, D, GB: tl.constexpr, GP: tl.constexpr,
                     NB: tl.constexpr, BD: tl.constexpr, DEV_LEN: tl.constexpr,
                     SPAN: tl.constexpr):
    """Nodes ``[node0, node1]`` of one level (rows from ``off_cur``) of head
    ``program_id(1)``, ``NB`` per program: the union of their children's boxes (the level
    below, ``n_prev`` nodes from ``off_prev``), counts summed; a node over a non-finite box is
    not finite. One launch per level: a level reads only what earlier launches wrote (a
    single launch walking the levels with CTA barriers lost upper-level writes on the H200).
    ``DEV_LEN``: the nodes over the new keys ``[n - n_new, n)``, ``n`` read from ``len_ptr``;
    a node of this level spans ``SPAN`` keys."""
    if DEV_LEN:
        n_keys = tl.load(len_ptr).to(tl.int32)
        node0 = (n_keys - n_new) // SPAN
        node1 = (n_keys - 1) // SPAN
    bh = tl.program_id(1)
    node = node0 + tl.program_id(0) * NB + tl.arange(0, NB)
    nm = node <= node1
    d = tl.arange(0, BD)
    dm = d < D
    j = tl.arange(0, GP)
    base = bh.to(tl.int64) * total
    kid = node[:, None] * GB + j[None, :]  # [NB, GP]
    km = (kid < n_prev) & (j[None, :] < GB) & nm[:, None]
    cn = tl.load(cnt_ptr + base + off_prev + kid, mask=km, other=0.0)
    bad = tl.max((tl.load(lc_ptr + base + off_prev + kid, mask=km, other=0.0)
                  == float("inf")).to(tl.int32), axis=1) > 0
    live = km & (cn > 0.0)
    ptr = (base + off_prev + kid)[:, :, None] * D + d[None, None, :]
    lm = live[:, :, None] & dm[None, None, :]
    h = tl.max(tl.load(hi_ptr + ptr, mask=lm, other=float("-inf")).to(tl.float32), axis=1)
    x = tl.min(tl.load(lo_ptr + ptr, mask=lm, other=float("inf")).to(tl.float32), axis=1)
    c = tl.sum(cn, axis=1)
    zero = (bad | (c == 0.0))[:, None]
    optr = (base + off_cur + node)[:, None] * D + d[None, :]
    om = nm[:, None] & dm[None, :]
    tl.store(hi_ptr + optr, tl.where(zero, 0.0, h).to(hi_ptr.dtype.element_ty), mask=om)
    tl.store(lo_ptr + optr, tl.where(zero, 0.0, x).to(lo_ptr.dtype.element_ty), mask=om)
    tl.store(cnt_ptr + base + off_cur + node, c, mask=nm)
    tl.store(lc_ptr + base + off_cur + node, tl.where(bad, float("inf"), tl.log2(c)), mask=nm)


def append_boxes(pyramid: BoxPyramid, k: Tensor, start: int, end: int,
                 key_mask: Optional[Tensor] = None) -> None:
    """Bring ``pyramid`` up to date after keys ``[start, end)`` of ``k`` were written: the
    leaves holding them are recomputed from ``k`` and their ancestors from their children,
    ``O((end - start + C) * D + D log L)`` work per head (a decode step touches one leaf and
    its ``O(log L)`` ancestors), in one launch per level, in place.

    Args:
        pyramid: from :func:`box_pyramid`, up to date for the keys before ``start``.
        k: ``[B, Hkv, >= end, D]`` the cache's keys (any strides), keys ``[0, end)`` written.
        start, end: ``0 <= start < end <= pyramid.capacity``.
        key_mask: None or ``[B, >= end]`` (bool or integer, nonzero = a real key): padding is
            left out of the boxes. It must not change for keys before ``start``.

    Raises:
        ValueError: ``start``/``end`` out of range, or ``k`` not ``[B, Hkv, >= end, D]`` of
            the pyramid's batch, heads and head dim.
    """
    if not (0 <= start < end <= pyramid.capacity):
        raise ValueError(f"append_boxes: need 0 <= start < end <= capacity "
                         f"({pyramid.capacity}), got start={start}, end={end}")
    _check(pyramid, k, end, key_mask, "append_boxes")
    _launch(pyramid, k, key_mask, start=start, end=end)


def append_boxes_at(pyramid: BoxPyramid, k: Tensor, length: Tensor, n_new: int,
                    key_mask: Optional[Tensor] = None) -> None:
    """:func:`append_boxes` with the cache length on the device: keys ``[length - n_new,
    length)`` of ``k`` were just written, ``length`` the keys now held. Nothing is read back
    to the host, so a static cache's update can be captured in a CUDA graph: each level's
    launch covers the most nodes ``n_new`` keys can touch, and programs past the touched
    range store nothing.

    Args:
        pyramid: as :func:`append_boxes`.
        k: ``[B, Hkv, capacity, D]`` the cache's keys.
        length: int32/int64 tensor of one element on ``k``'s device, ``n_new <= length <=
            capacity`` (not checked: that would read it).
        n_new: the keys just written (int >= 1).
        key_mask: as :func:`append_boxes`, ``[B, capacity]``.

    Raises:
        ValueError: ``n_new`` out of range, ``length`` not one integer on ``k``'s device, or
            ``k`` not ``[B, Hkv, >= capacity, D]`` of the pyramid's batch, heads, head dim.
    """
    if not (isinstance(n_new, int) and 1 <= n_new <= pyramid.capacity):
        raise ValueError(f"append_boxes_at: n_new must be an int in [1, {pyramid.capacity}], "
                         f"got {n_new!r}")
    if (length.numel() != 1 or length.dtype not in (torch.int32, torch.int64)
            or length.device != k.device):
        raise ValueError(f"append_boxes_at: length must be one int32/int64 on {k.device}, got "
                         f"{tuple(length.shape)} {length.dtype} on {length.device}")
    _check(pyramid, k, pyramid.capacity, key_mask, "append_boxes_at")
    _launch(pyramid, k, key_mask, length=length, n_new=n_new)


def _check(pyramid: BoxPyramid, k: Tensor, end: int, key_mask: Optional[Tensor],
           where: str) -> None:
    B, Hkv, total, D = pyramid.hi.shape
    if k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (B, Hkv, D) or k.shape[2] < end:
        raise ValueError(f"{where}: k must be [B={B}, Hkv={Hkv}, >= {end}, D={D}], "
                         f"got {tuple(k.shape)}")
    if key_mask is not None and (key_mask.dim() != 2 or key_mask.shape[0] != B
                                 or key_mask.shape[1] < end):
        raise ValueError(f"{where}: key_mask must be [B={B}, >= {end}], got "
                         f"{tuple(key_mask.shape)}")
    if k.dtype != pyramid.hi.dtype or k.device != pyramid.hi.device:
        raise ValueError(f"{where}: k is {k.dtype} on {k.device}, the pyramid "
                         f"{pyramid.hi.dtype} on {pyramid.hi.device}")


def _launch(pyramid: BoxPyramid, k: Tensor, key_mask: Optional[Tensor], *, start: int = 0,
            end: int = 0, length: Optional[Tensor] = None, n_new: int = 0) -> None:
    """The launches of :func:`append_boxes` (keys ``[start, end)``) and of
    :func:`append_boxes_at` (``length`` given: ``n_new`` keys up to it, read on the device)."""
    B, Hkv, total, D = pyramid.hi.shape
    C, g = pyramid.block_size, pyramid.branching
    dev = length is not None
    if dev:
        # The most leaves n new keys can touch; each level's span below shrinks from it.
        leaf0, len_arg = 0, length  # leaf0: read on the device
        a, z = 0, cdiv(n_new, C)
    else:
        leaf0, len_arg = start // C, pyramid.cnt  # unused
        a, z = leaf0, (end - 1) // C
    BD = max(16, triton.next_power_of_2(D))
    KC = min(C, max(1, 4096 // BD))
    if key_mask is not None:
        km = key_mask if key_mask.dtype != torch.bool else key_mask.to(torch.uint8)
        km_arg, sm = km, (km.stride(0), km.stride(1))
    else:
        km_arg, sm = pyramid.cnt, (0, 0)  # unused
    launcher(_box_leaf_kernel, k)[(z - a + 1, B * Hkv)](
        k, km_arg, pyramid.hi, pyramid.lo, pyramid.cnt, pyramid.lc, len_arg, *k.stride(), *sm,
        Hkv, end, leaf0, n_new, total, D, C=C, KC=KC, BD=BD,
        HAS_KEY_MASK=key_mask is not None, DEV_LEN=dev, num_warps=4)
    sizes = level_sizes(pyramid.capacity, C, g, pyramid.beam)
    offs = pyramid.level_offsets()
    span = C
    for lev in range(1, len(sizes)):
        span *= g
        # Device length: z - a + 1 nodes touched below, at most z // g + 2 here (a range of
        # m consecutive nodes has at most cdiv(m - 1, g) + 1 parents).
        a, z = (0, cdiv(z - a, g)) if dev else (a // g, z // g)
        NB = 16 if z - a < 16 else 64
        launcher(_box_node_kernel, k)[(triton.cdiv(z - a + 1, NB), B * Hkv)](
            pyramid.hi, pyramid.lo, pyramid.cnt, pyramid.lc, len_arg,
            a, z, n_new, offs[lev - 1], sizes[lev - 1], offs[lev], total, D,
            GB=g, GP=triton.next_power_of_2(g), NB=NB, BD=BD, DEV_LEN=dev,
            SPAN=span if dev else 1, num_warps=4)
