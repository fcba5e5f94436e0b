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
    DB = min(BD, 32)
    g = branching
    launcher(_upper_kernel, k)[(B * Hkv, triton.cdiv(BD, DB))](
        mu, cnt, lcnt, L, total, D, GB=g, TOP=g * beam,
        GP=triton.next_power_of_2(g), NB=64, DB=DB, num_warps=4)
    return mu, cnt, lcnt, total


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
