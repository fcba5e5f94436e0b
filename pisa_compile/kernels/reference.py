"""PISA in plain PyTorch: the oracle for every Triton kernel, and the CPU path.

Follows DESIGN.md "The algorithm". Everything is computed in query-tile chunks, so memory
grows as O(N * top_k * block_size) (plus the user's mask, if one is given), never O(N^2).

Notation: ``B`` batch, ``Hq`` query heads, ``Hkv`` KV heads, ``G = Hq / Hkv``, ``Tq =
query_tile``, ``C = block_size``, ``L = ceil(Nk / C)`` leaves, ``T = ceil(Nq / Tq)`` tiles,
``R = G * Tq`` rows per tile, ``g = branching``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .geometry import (block_width, cdiv, dense_mask, flat_beam, forced_ranges, level_sizes,
                       local_bound, positive_scale, query_offset, sink_start)
from .runtime import stage_range

# How a tile's rows see one leaf: no live key at all; live keys, none visible to the tile;
# some live key hidden from some valid row; every live key visible to every valid row.
DEAD, UNSEEN, PARTIAL, CLEAN = 0, 1, 2, 3
# Elements of one chunk's largest temporary; bounds CPU memory per step.
_CHUNK_ELEMS = 1 << 24


def softmax_rows(s: Tensor) -> tuple[Tensor, Tensor]:
    """Row softmax and log-sum-exp of scores ``s`` (``-inf`` = hidden); all-hidden rows give
    zero weights and ``lse = -inf``. A NaN or ``+inf`` score makes its row NaN, as in SDPA.

    Normalises by the row maximum, not by ``exp(s - lse)``: with large finite biases
    (``-1e9`` on every key of a row) ``lse`` rounds onto the scores and ``exp(s - lse)``
    would give every key weight 1.
    """
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)  # NaN and +inf stay: the row turns NaN
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    hidden = total == 0  # every key hidden; NaN is not 0, so NaN rows stay NaN
    w = torch.where(hidden, 0.0, e / torch.where(hidden, 1.0, total))
    return w, torch.where(hidden, float("-inf"), m + torch.log(total))


def _acc_dtype(x: Tensor) -> torch.dtype:
    """float32 accumulation, float64 for float64 inputs (the oracle must not lose precision)."""
    return torch.promote_types(x.dtype, torch.float32)


# -- masks ----------------------------------------------------------------------------------

def mask_parts(attn_mask: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Split an SDPA mask into ``allowed`` (bool, True = attend) and a float ``bias``.

    A float entry of ``-inf`` or at or below ``finfo.min / 2`` counts as masked (HF's way); a
    NaN entry is a NaN bias (it reaches its row, as in dense attention). Shapes are kept as
    given (4-D, broadcastable to ``[B, Hq, Nq, Nk]``).
    """
    if attn_mask is None:
        return None, None
    if attn_mask.dtype == torch.bool:
        return attn_mask, None
    allowed = ~(attn_mask <= torch.finfo(attn_mask.dtype).min / 2)
    return allowed, attn_mask


def _grouped(m: Tensor, B: int, Hkv: int, G: int, Nq: int, Nk: int) -> Tensor:
    """A 4-D mask broadcastable to ``[B, Hq, Nq, Nk]`` as a ``[B, h, gm, Nq, Nk]`` view
    (``h * gm`` is 1 or Hq; HF's key-padding masks arrive as ``[B, 1, 1, Nk]``)."""
    Hm = m.shape[1]
    m = m.expand(B, Hm, Nq, Nk)
    if Hm == 1:
        return m.unsqueeze(1)
    return m.reshape(B, Hkv, G, m.shape[2], m.shape[3])


@dataclass
class _Problem:
    """Shapes and the visibility rules of one call, shared by selection and attention."""

    B: int
    Hq: int
    Hkv: int
    G: int
    Nq: int
    Nk: int
    D: int
    C: int
    Tq: int
    T: int
    L: int
    is_causal: bool
    allowed: Optional[Tensor]  # [B, h, gm, Nq, Nk] bool view, or None
    bias: Optional[Tensor]  # same layout, float, or None
    offset: Optional[int]  # query i sits at key position i + offset; None: no local blocks
    key_mask: Optional[Tensor] = None  # [B, Nk] bool, True = the key may be attended
    causal_offset: int = 0  # causal: query i sees keys j <= i + causal_offset

    @staticmethod
    def make(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
             block_size: int, query_tile: int, key_mask: Optional[Tensor] = None,
             causal_offset: int = 0) -> "_Problem":
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        G = Hq // Hkv
        allowed, bias = mask_parts(attn_mask)
        if allowed is not None:
            allowed = _grouped(allowed, B, Hkv, G, Nq, Nk)
            bias = None if bias is None else _grouped(bias, B, Hkv, G, Nq, Nk)
        C, Tq = block_size, query_tile
        return _Problem(B, Hq, Hkv, G, Nq, Nk, D, C, Tq, cdiv(Nq, Tq), cdiv(Nk, C),
                        is_causal, allowed, bias,
                        query_offset(Nq, Nk, is_causal, causal_offset,
                                     explicit_mask=attn_mask is not None),
                        None if key_mask is None else key_mask.bool(), causal_offset)

    def visible(self, q_pos: Tensor, k_pos: Tensor, t0: int, t1: int) -> Tensor:
        """Visibility ``[B, h, gm, tiles, Tq, n_keys]`` for tiles ``[t0, t1)``.

        ``q_pos``: ``[tiles, Tq]`` query positions; ``k_pos``: ``[B, Hkv, tiles, n_keys]`` key
        positions (-1 = padding). Positions beyond ``Nq``/``Nk`` are invisible.
        """
        kp = k_pos[:, :, :, None, :]
        qp = q_pos[None, None, :, :, None]
        ok = (kp >= 0) & (kp < self.Nk) & (qp < self.Nq)
        if self.is_causal:
            ok = ok & (kp <= qp + self.causal_offset)
        ok = ok.unsqueeze(2)  # gm axis
        if self.key_mask is not None:
            km = self.key_mask[:, None, None, :].expand(self.B, self.Hkv, k_pos.shape[2], self.Nk)
            km = torch.gather(km, 3, k_pos.clamp(0, self.Nk - 1).long())  # [B, Hkv, tiles, n]
            ok = ok & km[:, :, None, :, None, :]
        if self.allowed is not None:
            ok = ok & self._gather_mask(self.allowed, k_pos, t0, t1, False)
        return ok

    def bias_at(self, k_pos: Tensor, t0: int, t1: int) -> Optional[Tensor]:
        if self.bias is None:
            return None
        return self._gather_mask(self.bias, k_pos, t0, t1, 0.0)

    def _gather_mask(self, m: Tensor, k_pos: Tensor, t0: int, t1: int, fill) -> Tensor:
        q0, q1 = t0 * self.Tq, min(t1 * self.Tq, self.Nq)
        rows = m[:, :, :, q0:q1]  # [B, h, gm, nq, Nk]
        pad = (t1 - t0) * self.Tq - (q1 - q0)
        if pad:
            rows = torch.cat([rows, rows.new_full(rows.shape[:3] + (pad, rows.shape[4]), fill)], 3)
        B, h, gm = rows.shape[:3]
        rows = rows.reshape(B, h, gm, t1 - t0, self.Tq, self.Nk)
        rows = rows.expand(B, self.Hkv, gm, t1 - t0, self.Tq, self.Nk)  # a view when h == 1
        idx = k_pos.clamp(0, self.Nk - 1)  # [B, Hkv, tiles, n]
        idx = idx[:, :, None, :, None, :].expand(B, self.Hkv, gm, t1 - t0, self.Tq, idx.shape[-1])
        return torch.gather(rows, 5, idx)


# -- leaf states and the pyramid -------------------------------------------------------------

def _tile_chunks(T: int, per_tile: int):
    step = max(1, _CHUNK_ELEMS // max(1, per_tile))
    for t0 in range(0, T, step):
        yield t0, min(T, t0 + step)


def leaf_states(p: _Problem) -> tuple[Tensor, Tensor]:
    """Per tile and leaf, how the tile's rows see the leaf; and which keys are pooled.

    Returns:
        states: int8 ``[B, Hkv or 1, T, L]``: DEAD (no live key), UNSEEN (live keys, none
            visible to the tile), PARTIAL (some live key hidden from some valid row), CLEAN
            (every live key visible to every valid row). A row is valid if it sees any key.
        key_live: bool ``[B, Hkv or 1, Nk]``: keys some query may see (DESIGN.md "Leaves").
    """
    dev = p.allowed.device if p.allowed is not None else None
    q_tile = torch.arange(p.T * p.Tq, device=dev).view(p.T, p.Tq)
    leaf = torch.arange(p.L, device=dev)
    if p.allowed is None:
        # Analytic: no explicit mask, so visibility is the causal rule (with its offset) and
        # the key mask. States follow positions only (a leaf of padding keys is not DEAD, its
        # count is 0), as in the Triton kernel; the pooled summaries leave padding out.
        off = p.causal_offset
        key_pos = torch.arange(p.Nk, device=dev)
        key_live = ((key_pos < p.Nq + off) if p.is_causal
                    else torch.ones_like(key_pos, dtype=torch.bool))[None, None]
        if p.key_mask is not None:
            key_live = key_live.to(p.key_mask.device) & p.key_mask[:, None, :]
        first = leaf * p.C
        last_live = torch.clamp(torch.minimum((leaf + 1) * p.C, torch.tensor(p.Nk)) - 1,
                                max=(p.Nq - 1 + off) if p.is_causal else p.Nk)
        q0 = q_tile[:, 0].clamp(max=p.Nq - 1)[:, None] + off
        q1 = (q_tile[:, -1].clamp(max=p.Nq - 1))[:, None] + off
        dead = (first > last_live)[None, :]
        if p.is_causal:
            clean = last_live[None, :] <= q0
            none = first[None, :] > q1
        else:
            clean = torch.ones(p.T, p.L, dtype=torch.bool)
            none = torch.zeros(p.T, p.L, dtype=torch.bool)
        states = torch.where(dead, DEAD, torch.where(clean, CLEAN, torch.where(none, UNSEEN, PARTIAL)))
        return states.to(torch.int8)[None, None], key_live

    a = p.allowed  # [B, h, gm, Nq, Nk]
    B, h, gm = a.shape[:3]
    key_live = a.any(3).any(2)  # [B, h, Nk]
    pad_k = p.L * p.C - p.Nk
    live_pad = torch.nn.functional.pad(key_live, (0, pad_k))
    n_live = live_pad.view(B, h, p.L, p.C).sum(-1)  # [B, h, L]
    states = torch.empty(B, h, p.T, p.L, dtype=torch.int8, device=a.device)
    for t0, t1 in _tile_chunks(p.T, B * h * gm * p.Tq * (p.Nk + pad_k)):
        q0, q1 = t0 * p.Tq, min(t1 * p.Tq, p.Nq)
        rows = a[:, :, :, q0:q1]
        rows = torch.nn.functional.pad(rows, (0, pad_k, 0, (t1 - t0) * p.Tq - (q1 - q0)))
        rows = rows.view(B, h, gm, t1 - t0, p.Tq, p.L, p.C)
        row_valid = rows.any(-1).any(-1)  # [B, h, gm, t, Tq]
        vis = (rows & row_valid[..., None, None]).sum(-1).sum(4).sum(2)  # [B, h, t, L]
        n_rows = row_valid.sum(4).sum(2)  # [B, h, t]
        full = n_rows[..., None] * n_live[:, :, None, :]
        st = torch.full_like(vis, PARTIAL)
        st = torch.where(vis == full, CLEAN, st)
        st = torch.where(vis == 0, UNSEEN, st)
        st = torch.where(n_live[:, :, None, :] == 0, DEAD, st)
        states[:, :, t0:t1] = st.to(torch.int8)
    return states, key_live


def leaf_sums(k: Tensor, key_live: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Per leaf block, the float32 sum of its live keys and their count.

    Args:
        k: ``[B, Hkv, Nk, D]``. key_live: bool ``[B, Hkv or 1, Nk]``.
        block_size: keys per leaf ``C``; the last leaf may be short.

    Returns:
        ``sums`` ``[B, Hkv, ceil(Nk / C), D]`` and ``counts`` ``[B, Hkv, ceil(Nk / C)]``, both
        float32. A leaf's values come from its own keys only, so a shard of whole leaves
        gives the values of the whole sequence (context parallelism gathers them).
    """
    B, Hkv, Nk, D = k.shape
    C = block_size
    L = cdiv(Nk, C)
    w = key_live.expand(B, Hkv, Nk).to(torch.float32)
    pad = L * C - Nk
    # where, not k * w: a NaN in a key no query sees must not reach a summary (0 * NaN).
    kw = torch.nn.functional.pad(torch.where(w[..., None] > 0, k.float(), 0.0), (0, 0, 0, pad))
    sums = kw.view(B, Hkv, L, C, D).sum(3)
    n = torch.nn.functional.pad(w, (0, pad)).view(B, Hkv, L, C).sum(3)
    return sums, n


def pyramid_levels(means: Tensor, counts: Tensor, n_keys: int, block_size: int,
                   branching: int, beam: int) -> tuple[list[Tensor], list[Tensor]]:
    """The pyramid over given leaf summaries (DESIGN.md "Leaves and pyramid").

    Args:
        means, counts: float32 ``[B, Hkv, L, D]`` mean live keys and ``[B, Hkv, L]`` live-key
            counts of the ``L = ceil(n_keys / block_size)`` leaves (:func:`leaf_sums` gives
            sums; ``sums / counts.clamp(min=1)`` are the means).
        block_size, branching, beam: the PISA options of those names (``beam`` resolved).

    Returns:
        As :func:`build_pyramid`.
    """
    g = branching
    mus, counts = [means], [counts]
    B, Hkv, _, D = means.shape
    for _ in level_sizes(n_keys, block_size, g, beam)[1:]:
        m = counts[-1].shape[-1]
        pad = cdiv(m, g) * g - m
        s = torch.nn.functional.pad(mus[-1] * counts[-1][..., None], (0, 0, 0, pad))
        s = s.view(B, Hkv, -1, g, D).sum(3)
        c = torch.nn.functional.pad(counts[-1], (0, pad)).view(B, Hkv, -1, g).sum(3)
        mus.append(s / c.clamp(min=1)[..., None])
        counts.append(c)
    return mus, counts


def build_pyramid(k: Tensor, key_live: Tensor, block_size: int, branching: int,
                  beam: int) -> tuple[list[Tensor], list[Tensor]]:
    """Leaf summaries and every level above, in float32 (DESIGN.md "Leaves and pyramid").

    Args:
        k: ``[B, Hkv, Nk, D]``. key_live: bool ``[B, Hkv or 1, Nk]``.
        block_size, branching, beam: the PISA options of those names (``beam`` resolved).

    Returns:
        ``mus[l]``: ``[B, Hkv, n_l, D]`` count-weighted mean keys of level ``l`` (0 = leaves);
        ``counts[l]``: ``[B, Hkv, n_l]`` live keys under each node. The last level is the
        finest one with at most ``branching * beam`` nodes.
    """
    sums, n = leaf_sums(k, key_live, block_size)
    return pyramid_levels(sums / n.clamp(min=1)[..., None], n, k.shape[2], block_size,
                          branching, beam)


class Boxes(NamedTuple):
    """Per-channel key boxes for ``bound_block`` (DESIGN.md "Bound scores"), float32.

    ``his[l]``/``los[l]``: ``[B, Hkv, n_l, D]`` channel max/min over the live keys of each
    node of pyramid level ``l`` (0 = leaves); ``sub_hi``/``sub_lo``: the same over
    ``bound_block``-key sub-blocks of the leaves, ``[B, Hkv, L * C / S, D]``, with
    ``sub_counts`` float32 ``[B, Hkv, L * C / S]`` live keys each and ``sub_bias`` their bias
    LSE, ``[B, h, gm, Nq or 1, L * C / S]`` (:func:`_bias_levels` at that granularity; None
    without a float bias). Empty boxes are 0
    (their count is 0, so they score ``-inf``); a box holding a non-finite key is not finite.
    """

    his: list
    los: list
    sub_hi: Tensor
    sub_lo: Tensor
    sub_counts: Tensor
    sub_bias: Optional[Tensor]


def build_boxes(k: Tensor, key_live: Tensor, block_size: int, bound_block: int,
                branching: int, counts: list) -> Boxes:
    """Channel-wise max/min boxes of the live keys (the page bounds of Quest: Tang et al.,
    2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"), per
    ``bound_block``-key sub-block and per pyramid node; see :class:`Boxes`.

    Args:
        k: ``[B, Hkv, Nk, D]``; key_live: bool ``[B, Hkv or 1, Nk]``.
        block_size: ``C``; bound_block: ``S`` (a power of two dividing ``C``);
        branching: ``g``; counts: :func:`build_pyramid`'s live keys per node and level.

    Returns:
        :class:`Boxes` with ``sub_bias`` None.
    """
    B, Hkv, Nk, D = k.shape
    C, S, g = block_size, bound_block, branching
    L = cdiv(Nk, C)
    pad = L * C - Nk
    live = torch.nn.functional.pad(key_live.expand(B, Hkv, Nk), (0, pad))[..., None]
    kp = torch.nn.functional.pad(k.float(), (0, 0, 0, pad))
    hi = torch.where(live, kp, float("-inf")).view(B, Hkv, L * C // S, S, D).amax(3)
    lo = torch.where(live, kp, float("inf")).view(B, Hkv, L * C // S, S, D).amin(3)
    sub_counts = live[..., 0].view(B, Hkv, L * C // S, S).sum(3).float()
    his = [hi.view(B, Hkv, L, C // S, D).amax(3)]
    los = [lo.view(B, Hkv, L, C // S, D).amin(3)]
    for _ in range(len(counts) - 1):
        m = his[-1].shape[2]
        p = cdiv(m, g) * g - m
        his.append(torch.nn.functional.pad(his[-1], (0, 0, 0, p), value=float("-inf"))
                   .view(B, Hkv, -1, g, D).amax(3))
        los.append(torch.nn.functional.pad(los[-1], (0, 0, 0, p), value=float("inf"))
                   .view(B, Hkv, -1, g, D).amin(3))

    def clear(x: Tensor, n: Tensor) -> Tensor:
        # Empty boxes (-inf/+inf) become 0: their count is 0, so they score -inf anyway,
        # and 0 * inf would make the bound NaN.
        return x.masked_fill((n == 0)[..., None], 0.0)

    return Boxes([clear(h, n) for h, n in zip(his, counts)],
                 [clear(x, n) for x, n in zip(los, counts)],
                 clear(hi, sub_counts), clear(lo, sub_counts), sub_counts, None)


def _bound_scores(qr: Tensor, hi: Tensor, lo: Tensor, term: Tensor, scale: float) -> Tensor:
    """``scale * max over the box of q . k + term`` for rows ``qr [..., R, D]`` and boxes
    ``hi, lo [..., P, D]`` (float32): ``sum_d max(q_d hi_d, q_d lo_d) = q+ . hi + q- . lo``
    (two matmuls), an upper bound of every logit in the box. ``term`` broadcasts to
    ``[..., R or 1, P]``; returns float32 ``[..., R, P]``."""
    up = torch.matmul(qr.clamp(min=0), hi.transpose(-1, -2))
    up = up + torch.matmul(qr.clamp(max=0), lo.transpose(-1, -2))
    return up * scale + term


# -- selection --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Select:
    """The selection options (DESIGN.md "Coarse-to-fine selection")."""

    top_k: int
    branching: int
    beam: int
    sink_blocks: int
    local_blocks: int
    exact: bool  # leaf_scoring == "exact"
    shortlist: int = 0  # exact: score only the best `shortlist` by rough score (0: all)
    bound_block: int = 0  # rough scores: box bounds over these sub-blocks (0: pooled means)


def _node_flags(states: Tensor, g: int, levels: int) -> list[tuple[Tensor, Tensor]]:
    """Per level, ``(any_visible, any_bad)`` over each node's leaves, ``[B, h, T, n_l]``."""
    vis = (states == CLEAN) | (states == PARTIAL)
    bad = (states == PARTIAL) | (states == UNSEEN)
    out = [(vis, bad)]
    for _ in range(levels - 1):
        v, b = out[-1]
        m = v.shape[-1]
        pad = cdiv(m, g) * g - m
        v = torch.nn.functional.pad(v, (0, pad)).view(*v.shape[:-1], -1, g).any(-1)
        b = torch.nn.functional.pad(b, (0, pad)).view(*b.shape[:-1], -1, g).any(-1)
        out.append((v, b))
    return out


def _bias_levels(p: _Problem, key_live: Tensor, n_levels: int, g: int,
                 block: Optional[int] = None) -> Optional[list]:
    """Per level, ``log sum over the node's live keys j of exp(bias_rj)`` for each row ``r``:
    float32 ``[B, h, gm, Nq or 1, n_l]`` (``Nq`` is 1 when the bias is the same for every
    query, as for key padding). ``None`` without a float bias.

    It takes the place of ``log n`` in the pooled scores (``scale q.mu + log n`` is the LSE
    of the node's keys when they all sit at ``mu``; with a bias each key counts ``exp(bias)``
    instead of 1), so a finite bias (ALiBi, T5's, ``-1e4`` padding) steers the selection as
    it steers attention. Only nodes whose live keys every valid row sees are pooled-scored,
    so masked entries never enter (they are -inf here). ``block``: the granularity of
    level 0 (default ``block_size``; ``bound_block`` for the sub-blocks of :class:`Boxes`).
    """
    if p.bias is None:
        return None
    allowed, bias = p.allowed, p.bias
    if bias.stride(3) == 0:  # broadcast over queries: one row holds them all
        allowed, bias = allowed[:, :, :, :1], bias[:, :, :, :1]
    live = key_live[:, :, None, None, :]  # [B, h, 1, 1, Nk]
    n_rows, pad = bias.shape[3], p.L * p.C - p.Nk
    step = max(1, _CHUNK_ELEMS // max(1, bias.numel() // max(1, n_rows)))
    level0, finite_bias = [], False
    for r0 in range(0, n_rows, step):  # query chunks: O(N * L) memory, never O(N^2)
        a, b = allowed[:, :, :, r0:r0 + step], bias[:, :, :, r0:r0 + step].float()
        x = torch.where(a & live, b, float("-inf"))
        finite_bias = finite_bias or bool(((x != 0) & (x != float("-inf"))).any())
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
        C = block or p.C
        level0.append(torch.logsumexp(x.view(*x.shape[:-1], p.L * p.C // C, C), -1))
    if not finite_bias:  # a 0 / masked mask (HF's): the terms are log n
        return None
    out = [torch.cat(level0, 3)]
    for _ in range(n_levels - 1):
        m = out[-1].shape[-1]
        y = torch.nn.functional.pad(out[-1], (0, cdiv(m, g) * g - m), value=float("-inf"))
        out.append(torch.logsumexp(y.view(*y.shape[:-1], -1, g), -1))
    return out


def _node_term(p: _Problem, bias_lvl: Optional[Tensor], cnt: Tensor, idx: Tensor, t0: int,
               t1: int) -> Tensor:
    """The additive term of the pooled score of nodes ``idx [B, Hkv, t, P]``: ``log n``
    (``[B, Hkv, t, 1, P]``), or with a bias the row's :func:`_bias_levels` entry
    (``[B, Hkv, t, R, P]``, rows as in the selection)."""
    if bias_lvl is None:
        return torch.log(_gather_nodes(cnt, idx)).unsqueeze(-2)
    B, H, nt, P = idx.shape
    h, gm, n_rows = bias_lvl.shape[1], bias_lvl.shape[2], (t1 - t0) * p.Tq
    if bias_lvl.shape[3] == 1:
        x = bias_lvl.expand(B, h, gm, n_rows, bias_lvl.shape[-1])
    else:  # rows past Nq are invalid: their scores are never read
        x = bias_lvl[:, :, :, t0 * p.Tq:min(t1 * p.Tq, p.Nq)]
        x = torch.nn.functional.pad(x, (0, 0, 0, n_rows - x.shape[3]))
    x = x.reshape(B, h, gm, nt, p.Tq, x.shape[-1]).expand(B, H, p.G, nt, p.Tq, x.shape[-1])
    ix = idx.clamp(min=0)[:, :, None, :, None, :].expand(B, H, p.G, nt, p.Tq, P)
    out = torch.gather(x, 5, ix)  # [B, H, G, t, Tq, P]
    return out.permute(0, 1, 3, 2, 4, 5).reshape(B, H, nt, p.G * p.Tq, P)


def _lse_scores(qr: Tensor, mu: Tensor, term: Tensor, scale: float) -> Tensor:
    """``scale * q . mu + term`` for rows ``qr [..., R, D]`` and nodes ``mu [..., P, D]``;
    ``term`` from :func:`_node_term` (``log n`` without a bias)."""
    return torch.matmul(qr, mu.transpose(-1, -2)) * scale + term


def select_blocks(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: float,
                  *, block_size: int, top_k: int, branching: int, beam: int, sink_blocks: int,
                  local_blocks: int, query_tile: int, leaf_scoring: str, shortlist: int = 0,
                  bound_block: int = 0, flat_leaves: int = 0, key_mask: Optional[Tensor] = None,
                  causal_offset: int = 0,
                  pyramid: Optional[tuple[list[Tensor], list[Tensor]]] = None
                  ) -> tuple[Tensor, Tensor]:
    """Coarse-to-fine top-K leaf selection per query tile (DESIGN.md "Coarse-to-fine selection").

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``; attn_mask: 4-D bool/float or None.
        scale: softmax scale (float).
        key_mask: bool ``[B, Nk]`` (True = the key may be attended) or None.
        causal_offset: with ``is_causal``, query ``i`` sees keys ``j <= i + causal_offset``.
        block_size, top_k, branching, beam, sink_blocks, local_blocks, query_tile,
        leaf_scoring, shortlist, bound_block, flat_leaves: the PISA options of those names
        (``beam`` resolved, never None; ``shortlist`` and ``bound_block`` 0 for None); a
        call with at most ``flat_leaves`` leaves raises its beam to one level
        (:func:`geometry.flat_beam`).
        pyramid: ``(mus, counts)`` as :func:`build_pyramid` returns them (with the raised
            beam), or None to build it from ``k``. Given one, it is used as it is: its keys'
            liveness may differ from what this call's queries see (context parallelism passes
            the whole sequence's pyramid, every key live, with a chunk's queries and its
            ``causal_offset``, as single-process selection over the whole sequence has it);
            pooled scores then read no key, and ``k`` may stand for the keys' shape only.

    Returns:
        ``block_indices`` int32 ``[B, Hkv, T, M]`` (ascending, -1 padded; forced leaves
        included) and ``block_counts`` int32 ``[B, Hkv, T]``.

    Raises:
        ValueError: a ``pyramid`` with ``bound_block`` (its boxes are built from the keys).
    """
    if pyramid is not None and bound_block:
        raise ValueError("select_blocks: a given pyramid needs bound_block=0 (box bounds are "
                         "built from the keys)")
    q, scale = positive_scale(q, scale)
    p = _Problem.make(q, k, attn_mask, is_causal, block_size, query_tile, key_mask, causal_offset)
    beam = flat_beam(p.Nk, block_size, branching, beam, flat_leaves, leaf_scoring=leaf_scoring,
                     shortlist=shortlist, bound_block=bound_block)
    sel = _Select(top_k, branching, beam, sink_blocks, local_blocks, leaf_scoring == "exact",
                  shortlist, bound_block)
    g = branching
    dev = q.device
    states, key_live = leaf_states(p)
    states = states.to(dev)
    # Sinks start at each batch row's first attendable key, under a key mask or an explicit
    # one alike: a left-padded row's sink is its text, not its padding. Under an explicit
    # mask, key_live is that mask reduced over queries already ([B, h, Nk]).
    sink_from = sink_start(p.key_mask, p.C, key_live if p.allowed is not None else None)
    sink_from = 0 if sink_from is None else sink_from.to(dev).expand(p.B).reshape(p.B, 1, 1, 1)
    if pyramid is None:
        with stage_range("pisa.pyramid", k):
            mus, counts = build_pyramid(k, key_live.to(dev), block_size, branching, beam)
    else:
        mus, counts = pyramid
    n_levels = len(mus)
    biases = _bias_levels(p, key_live.to(dev), n_levels, g)
    boxes = None
    if bound_block:
        boxes = build_boxes(k, key_live.to(dev), block_size, bound_block, g, counts)
        sub_bias = _bias_levels(p, key_live.to(dev), 1, g, block=bound_block)
        boxes = boxes._replace(sub_bias=None if sub_bias is None else sub_bias[0])
    flags = _node_flags(states, g, n_levels)
    M = block_width(p.Nk, block_size, top_k, sink_blocks, local_blocks, query_tile)
    n_forced = min(sink_blocks, p.L) + local_bound(local_blocks, query_tile, block_size)
    e_max = n_forced + beam  # expanded nodes kept per level; past it the excess is dropped
    P = min(g * (beam + e_max), p.L)  # pool width: never more than the widest level
    R = p.G * p.Tq

    # Rows of each tile: [B, Hkv, T, R, D] with row r = (head g_, query i).
    qp = torch.nn.functional.pad(q, (0, 0, 0, p.T * p.Tq - p.Nq))
    q_rows = qp.view(p.B, p.Hkv, p.G, p.T, p.Tq, p.D).permute(0, 1, 3, 2, 4, 5).reshape(
        p.B, p.Hkv, p.T, R, p.D)

    block_indices = torch.full((p.B, p.Hkv, p.T, M), -1, dtype=torch.int32, device=dev)
    block_counts = torch.zeros((p.B, p.Hkv, p.T), dtype=torch.int32, device=dev)
    per_tile = R * P * (g + p.C) + P * p.C * p.D
    if bound_block:
        # hi/lo gathered and cleaned, two matmul outputs and the term, per sub-block
        per_tile += 4 * P * (p.C // bound_block) * (R + p.D)
    for t0, t1 in _tile_chunks(p.T, p.B * p.Hkv * per_tile):
        idx, cnt = _select_chunk(p, sel, q_rows[:, :, t0:t1].float(), k, mus, counts, biases,
                                 flags, states, t0, t1, scale, e_max, M, sink_from, boxes)
        block_indices[:, :, t0:t1] = idx
        block_counts[:, :, t0:t1] = cnt
    return block_indices, block_counts


def _row_valid(p: _Problem, t0: int, t1: int, dev) -> Tensor:
    """``[B, Hkv, t, R]`` rows that exist (query < Nq) and see at least one key."""
    q_pos = torch.arange(t0 * p.Tq, t1 * p.Tq, device=dev).view(t1 - t0, p.Tq)
    ok = (q_pos < p.Nq)[None, None, :, None, :].expand(p.B, p.Hkv, t1 - t0, p.G, p.Tq)
    if p.allowed is not None:
        q0, q1 = t0 * p.Tq, min(t1 * p.Tq, p.Nq)
        any_k = p.allowed[:, :, :, q0:q1].any(-1)  # [B, h, gm, nq]
        any_k = torch.nn.functional.pad(any_k, (0, (t1 - t0) * p.Tq - (q1 - q0)))
        any_k = any_k.view(p.B, any_k.shape[1], any_k.shape[2], t1 - t0, p.Tq).permute(0, 1, 3, 2, 4)
        ok = ok & any_k
    return ok.reshape(p.B, p.Hkv, t1 - t0, p.G * p.Tq)


def _gather_nodes(x: Tensor, idx: Tensor) -> Tensor:
    """``x [B, Hkv, n, ...]`` at ``idx [B, Hkv, t, P]`` (clamped) -> ``[B, Hkv, t, P, ...]``."""
    B, H, t, P = idx.shape
    flat = idx.clamp(min=0).reshape(B, H, t * P)
    tail = x.shape[3:]
    ix = flat.view(B, H, t * P, *([1] * len(tail))).expand(B, H, t * P, *tail)
    return torch.gather(x, 2, ix).view(B, H, t, P, *tail)


def _gather_tile_flags(f: Tensor, idx: Tensor) -> Tensor:
    """Per-tile flags ``f [B, h, t, n]`` at node indices ``idx [B, Hkv, t, P]``."""
    f = f.expand(idx.shape[0], idx.shape[1], idx.shape[2], f.shape[-1])
    return torch.gather(f, 3, idx.clamp(min=0).long())


def _select_chunk(p, sel, q_rows, k, mus, counts, biases, flags, states, t0, t1, scale,
                  e_max, M, s0, boxes=None):
    g, beam, top_k = sel.branching, sel.beam, sel.top_k
    dev = q_rows.device
    nt = t1 - t0
    t = torch.arange(t0, t1, device=dev)
    n_sink, lo, hi = forced_ranges(t, p.Nq, p.Nk, p.offset, p.C, p.Tq, sel.sink_blocks,
                                   sel.local_blocks)
    s1 = s0 + n_sink  # sinks: the first n_sink leaves from s0 ([B, 1, 1, 1] or 0)
    row_ok = _row_valid(p, t0, t1, dev)  # [B, Hkv, nt, R]
    level = len(mus) - 1
    n_top = mus[level].shape[2]
    # Pools are at most P wide, and never wider than their level (a wide beam over a short
    # sequence would otherwise score and gather mostly padding).
    pool = torch.arange(n_top, device=dev).expand(p.B, p.Hkv, nt, n_top)
    lo_b, hi_b = lo.view(1, 1, nt, 1), hi.view(1, 1, nt, 1)
    while True:
        valid = pool >= 0
        span = g ** level  # leaves under one node of this level
        first, last = pool * span, pool * span + span - 1
        forced_anc = valid & (((last >= s0) & (first < s1)) | ((last >= lo_b) & (first <= hi_b)))
        fl = states[..., t0:t1, :] if level == 0 else None
        vis, mixed = (_gather_tile_flags(flags[level][0][..., t0:t1, :], pool),
                      _gather_tile_flags(flags[level][1][..., t0:t1, :], pool))
        if level == 0:
            st = _gather_tile_flags(fl, pool)
            forced = valid & (((pool >= s0) & (pool < s1)) | ((pool >= lo_b) & (pool <= hi_b)))
            cand = valid & ~forced & ((st == CLEAN) | (st == PARTIAL))
            s, bad, cand = _leaf_scores(p, sel, q_rows, k, mus[0], counts[0],
                                        _level(biases, 0), pool, st, cand, row_ok, t0, t1,
                                        scale, boxes)
            picked = _top(s, cand, row_ok, top_k, bad)
            chosen = torch.where(picked | forced, pool, torch.full_like(pool, -1))
            chosen = torch.sort(torch.where(chosen < 0, p.L, chosen), dim=-1).values
            chosen = torch.where(chosen >= p.L, -1, chosen)
            # Forced and picked leaves are distinct, so at most M are valid.
            cnt = (chosen >= 0).sum(-1)
            return chosen[..., :M].to(torch.int32), cnt.to(torch.int32)
        expand = valid & (forced_anc | (vis & mixed))
        cand = valid & ~expand & vis
        box = None if boxes is None else (boxes.his[level - 1], boxes.los[level - 1])
        s, bad = _internal_scores(p, q_rows, mus[level - 1], counts[level - 1],
                                  _level(biases, level - 1), pool, g, t0, t1, scale, box)
        kept = _top(s, cand, row_ok, beam, bad)
        n_next = mus[level - 1].shape[2]
        pool = next_pool(pool, kept, forced_anc, expand, beam, e_max, g, n_next)[..., :n_next]
        level -= 1


def next_pool(pool: Tensor, kept: Tensor, forced_anc: Tensor, expand: Tensor, beam: int,
              e_max: int, g: int, n_next: int) -> Tensor:
    """The next level's pool: the children of the kept nodes and of the expanded ones,
    ascending, -1 padded (``[..., g * (beam + e_max)]``); ``n_next`` nodes exist there."""
    keep_idx = _first_true(pool, kept, beam)
    # Forced ancestors first: mixed nodes past the bound are dropped, forced ones never.
    exp_idx = torch.cat([_first_true(pool, forced_anc, e_max - beam),
                         _first_true(pool, expand & ~forced_anc, beam)], -1)
    parents = torch.cat([keep_idx, exp_idx], -1)  # [B, Hkv, nt, beam + e_max]
    kids = parents[..., None] * g + torch.arange(g, device=pool.device)
    kids = torch.where((parents[..., None] >= 0) & (kids < n_next), kids, -1)
    pool = torch.sort(torch.where(kids < 0, n_next, kids).flatten(-2), dim=-1).values
    return torch.where(pool >= n_next, -1, pool)


def _first_true(pool: Tensor, sel: Tensor, n: int) -> Tensor:
    """The first ``n`` entries of ``pool`` where ``sel`` holds, -1 padded: ``[..., n]``."""
    key = torch.where(sel, torch.arange(pool.shape[-1], device=pool.device), pool.shape[-1])
    order = torch.sort(key, dim=-1).indices[..., :n]
    out = torch.gather(pool, -1, order)
    ok = torch.gather(sel, -1, order)
    out = torch.where(ok, out, -1)
    if out.shape[-1] < n:
        out = torch.nn.functional.pad(out, (0, n - out.shape[-1]), value=-1)
    return out


def tile_scores(s: Tensor, cand: Tensor, row_ok: Tensor, bad: Tensor) -> Tensor:
    """Tile score ``S(a) = sum_r softmax_pool(s_r)(a)`` over voting rows: ``[B, Hkv, t, P]``.

    ``s``: ``[B, Hkv, t, R, P]`` per-row scores; ``row_ok`` ``[B, Hkv, t, R]``: rows that
    exist and see a key; ``bad`` ``[B, Hkv, t, P]``: nodes whose summary is not finite (they
    hold a NaN or infinite key). Bad nodes are left out of the softmax and rank above every
    finite score (``+inf``), so the rows that see such a key get NaN as in dense attention. A
    row whose scores do not sum to a finite value (a NaN or infinite query, a NaN scale)
    votes for nothing: its output is NaN whatever is selected.
    """
    s = s.masked_fill(~cand[..., None, :] | bad[..., None, :], float("-inf"))
    z = torch.logsumexp(s, -1, keepdim=True)
    voting = torch.isfinite(z) & row_ok[..., None]
    S = torch.where(voting, torch.exp(s - z), 0.0).sum(-2)
    return S.masked_fill(bad & cand & voting.any(-2), float("inf"))


def _top(s: Tensor, cand: Tensor, row_ok: Tensor, n: int, bad: Tensor) -> Tensor:
    """The ``n`` candidates of best :func:`tile_scores`: a bool ``[B, Hkv, t, P]``; ties go
    to the lower pool position (the pool is sorted by node index)."""
    S = tile_scores(s, cand, row_ok, bad)
    key = torch.where(cand, S, -1.0)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :n]
    kept = torch.zeros_like(cand)
    kept.scatter_(-1, order, torch.gather(cand, -1, order))
    return kept


def _level(biases: Optional[list], level: int) -> Optional[Tensor]:
    return None if biases is None else biases[level]


def _finite_nodes(mu: Tensor, ok: Tensor) -> tuple[Tensor, Tensor]:
    """Gathered summaries ``mu [..., n, D]`` with the non-finite ones zeroed, and which those
    were (among ``ok``): ``[..., n]``."""
    bad = ~torch.isfinite(mu).all(-1) & ok
    return mu.masked_fill(bad[..., None], 0.0), bad


def _internal_scores(p, q_rows, mu_child, cnt_child, bias_child, pool, g, t0, t1, scale,
                     box_child=None):
    """``s_r(a) = LSE_c (scale q_r . mu_c + term_c)`` over the children of pool nodes
    (``term`` is ``log n`` or the bias LSE: :func:`_node_term`), and which pool nodes have a
    child whose summary is not finite (those children score nothing: see :func:`_top`).
    With ``box_child = (hi, lo)`` (``bound_block``), each child scores its box bound
    (:func:`_bound_scores`) in place of ``scale q_r . mu_c``."""
    B, H, nt, P = pool.shape
    kids = pool[..., None] * g + torch.arange(g, device=pool.device)
    n_child = mu_child.shape[2]
    kid_ok = (pool[..., None] >= 0) & (kids < n_child)
    kids = torch.where(kid_ok, kids, 0).view(B, H, nt, P * g)
    ok = kid_ok.view(B, H, nt, P * g)
    term = _node_term(p, bias_child, cnt_child, kids, t0, t1)
    if box_child is None:
        mu, kid_bad = _finite_nodes(_gather_nodes(mu_child, kids), ok)
    else:
        hi, kid_bad = _finite_nodes(_gather_nodes(box_child[0], kids), ok)
        lo, lo_bad = _finite_nodes(_gather_nodes(box_child[1], kids), ok)
        kid_bad = kid_bad | lo_bad
    term = term.masked_fill(~(ok[..., None, :] & ~kid_bad[..., None, :]), float("-inf"))
    if box_child is None:
        s = _lse_scores(q_rows, mu, term, scale)
    else:
        s = _bound_scores(q_rows, hi, lo, term, scale)
    s = s.view(B, H, nt, q_rows.shape[3], P, g)
    return torch.logsumexp(s, -1), kid_bad.view(B, H, nt, P, g).any(-1)


def _sub_block_scores(p, q_rows, boxes: Boxes, pool, t0, t1, scale):
    """Rough leaf scores from the leaves' sub-block boxes (``bound_block``):
    ``LSE over sub-blocks u of (bound_u + term_u)``, ``[B, Hkv, t, R, P]``, and which leaves
    hold a non-finite box. Only CLEAN leaves use them (every row sees all their keys)."""
    B, H, nt, P = pool.shape
    n_sub = boxes.sub_hi.shape[2] // p.L  # sub-blocks per leaf
    sub = pool.clamp(min=0)[..., None] * n_sub + torch.arange(n_sub, device=pool.device)
    sub = sub.view(B, H, nt, P * n_sub)
    ok = (pool >= 0)[..., None].expand(B, H, nt, P, n_sub).reshape(B, H, nt, P * n_sub)
    hi, bad = _finite_nodes(_gather_nodes(boxes.sub_hi, sub), ok)
    lo, lo_bad = _finite_nodes(_gather_nodes(boxes.sub_lo, sub), ok)
    bad = bad | lo_bad
    term = _node_term(p, boxes.sub_bias, boxes.sub_counts, sub, t0, t1)
    term = term.masked_fill(~(ok & ~bad)[..., None, :], float("-inf"))
    s = _bound_scores(q_rows, hi, lo, term, scale).view(B, H, nt, q_rows.shape[3], P, n_sub)
    return torch.logsumexp(s, -1), bad.view(B, H, nt, P, n_sub).any(-1)


def _leaf_scores(p, sel, q_rows, k, mu_leaf, cnt_leaf, bias_leaf, pool, st, cand, row_ok, t0,
                 t1, scale, boxes=None):
    """Leaf scores ``[B, Hkv, t, R, P]``: pooled, or exact LSE over visible keys; which
    leaves have a summary that is not finite (see :func:`tile_scores`); and the candidates
    the pick is made from (``cand``, cut to the shortlist when there is one).

    Exact scoring is used for every leaf with ``leaf_scoring="exact"``, and always for
    PARTIAL leaves, whose pooled summary would include keys hidden from some row. With a
    ``shortlist``, only the ``shortlist`` best CLEAN candidates by rough tile score, and every
    PARTIAL one, stay candidates. Rough scores are pooled, or with ``boxes``
    (``bound_block``) the sub-block bounds of :func:`_sub_block_scores`. Only candidates are
    scored exactly: the scores and ``bad`` of other leaves stay rough, and are never read.
    """
    B, H, nt = pool.shape[:3]
    if boxes is None or (sel.exact and not sel.shortlist):  # bounds only rank: no shortlist,
        mu, bad = _finite_nodes(_gather_nodes(mu_leaf, pool), pool >= 0)  # nothing to rank
        term = _node_term(p, bias_leaf, cnt_leaf, pool, t0, t1).masked_fill(bad[..., None, :],
                                                                            float("-inf"))
        pooled = _lse_scores(q_rows, mu, term, scale)
    else:
        pooled, bad = _sub_block_scores(p, q_rows, boxes, pool, t0, t1, scale)
    if sel.exact and sel.shortlist:
        best = _top(pooled, cand & (st == CLEAN), row_ok, sel.shortlist, bad)
        cand = cand & (best | (st == PARTIAL))
    exact_leaf = st == PARTIAL
    if sel.exact:
        exact_leaf = exact_leaf | (st == CLEAN)
    # Only candidates are read (tile_scores masks the rest): with a shortlist that is
    # `shortlist` + PARTIAL leaves per tile, not the whole pool (every leaf, flat_leaves).
    need = exact_leaf & cand
    w = int(need.sum(-1).max()) if need.numel() else 0
    if w == 0:
        return pooled, bad, cand
    # Each tile's needed leaves first, in pool order (stable), w = the most any tile needs.
    slot = torch.sort((~need).to(torch.uint8), dim=-1, stable=True).indices[..., :w]
    leaf = torch.where(torch.gather(need, -1, slot), torch.gather(pool, -1, slot), -1)
    k_pos = (leaf.clamp(min=0)[..., None] * p.C + torch.arange(p.C, device=pool.device))
    k_pos = torch.where(leaf[..., None] >= 0, k_pos, -1).view(B, H, nt, w * p.C)
    kk = _gather_nodes(torch.nn.functional.pad(k, (0, 0, 0, p.L * p.C - p.Nk)),
                       k_pos.clamp(min=0))  # [B, H, nt, w*C, D]
    s = torch.matmul(q_rows, kk.float().transpose(-1, -2)) * scale  # [B, H, nt, R, w*C]
    s = s + _bias_rows(p, k_pos, t0, t1)
    vis = _visible_rows(p, k_pos, t0, t1)
    s = s.masked_fill(~vis, float("-inf")).view(B, H, nt, -1, w, p.C)
    exact = torch.logsumexp(s, -1)
    # An exact-scored leaf is non-finite only through a key some row of this tile sees (its
    # summary also holds keys only other tiles see).
    seen_bad = (~torch.isfinite(kk).all(-1) & vis.any(-2)).view(B, H, nt, w, p.C).any(-1)
    # Back to pool positions; padding slots (a tile needing fewer than w) keep pooled values.
    R = q_rows.shape[3]
    s = pooled.to(exact.dtype).scatter(-1, slot[..., None, :].expand(B, H, nt, R, w), exact)
    return (torch.where(need[..., None, :], s, pooled),
            torch.where(need, bad.scatter(-1, slot, seen_bad), bad), cand)


def _to_rows(x: Tensor, B: int, H: int, nt: int, G: int, Tq: int) -> Tensor:
    """``[B, H|1, gm, nt, Tq, n]`` -> ``[B, H, nt, R, n]`` with rows ``(head, query)``."""
    x = x.expand(B, H, G, nt, Tq, x.shape[-1]) if x.shape[2] == 1 else x.expand(B, H, *x.shape[2:])
    return x.permute(0, 1, 3, 2, 4, 5).reshape(B, H, nt, G * Tq, x.shape[-1])


def _visible_rows(p: _Problem, k_pos: Tensor, t0: int, t1: int) -> Tensor:
    q_pos = torch.arange(t0 * p.Tq, t1 * p.Tq, device=k_pos.device).view(t1 - t0, p.Tq)
    return _to_rows(p.visible(q_pos, k_pos, t0, t1), p.B, p.Hkv, t1 - t0, p.G, p.Tq)


def _bias_rows(p: _Problem, k_pos: Tensor, t0: int, t1: int):
    b = p.bias_at(k_pos, t0, t1)
    if b is None:
        return 0.0
    b = _to_rows(b.to(_acc_dtype(b)), p.B, p.Hkv, t1 - t0, p.G, p.Tq)
    # -inf entries are dropped by `visible`; a NaN bias stays and spoils its row (dense does).
    return torch.where(b == float("-inf"), 0.0, b)


# -- block-sparse attention ------------------------------------------------------------------

def _block_keys(p: _Problem, block_indices: Tensor, t0: int, t1: int) -> Tensor:
    """Key positions of the selected blocks: ``[B, Hkv, t, M*C]``, -1 where padding."""
    bi = block_indices[:, :, t0:t1].long()
    pos = bi[..., None] * p.C + torch.arange(p.C, device=bi.device)
    pos = torch.where((bi[..., None] >= 0) & (pos < p.Nk), pos, -1)
    return pos.flatten(-2)


def _chunk_rows(x: Tensor, p: _Problem, t0: int, t1: int) -> Tensor:
    """``[B, Hq, Nq, E]`` -> padded rows ``[B, Hkv, t, R, E]`` of tiles ``[t0, t1)``."""
    q0, q1 = t0 * p.Tq, min(t1 * p.Tq, p.Nq)
    x = torch.nn.functional.pad(x[:, :, q0:q1], (0, 0, 0, (t1 - t0) * p.Tq - (q1 - q0)))
    x = x.view(p.B, p.Hkv, p.G, t1 - t0, p.Tq, x.shape[-1]).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(p.B, p.Hkv, t1 - t0, p.G * p.Tq, x.shape[-1])


def _from_rows(x: Tensor, p: _Problem, t0: int, t1: int) -> Tensor:
    """Inverse of :func:`_chunk_rows`: ``[B, Hkv, t, R, E]`` -> ``[B, Hq, n, E]`` unpadded."""
    E = x.shape[-1]
    x = x.view(p.B, p.Hkv, t1 - t0, p.G, p.Tq, E).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(p.B, p.Hq, (t1 - t0) * p.Tq, E)
    return x[:, :, : min(t1 * p.Tq, p.Nq) - t0 * p.Tq]


def _chunk_logits(p, q, k, block_indices, t0, t1, scale):
    """Scores ``[B, Hkv, t, R, M*C]`` (accumulation dtype, -inf where hidden) and gathered key positions."""
    pos = _block_keys(p, block_indices, t0, t1)
    acc = _acc_dtype(q)
    qr = _chunk_rows(q, p, t0, t1).to(acc)
    kk = _gather_nodes(k, pos.clamp(min=0)).to(acc)  # [B, Hkv, t, M*C, D]
    s = torch.matmul(qr, kk.transpose(-1, -2)) * scale + _bias_rows(p, pos, t0, t1)
    vis = _visible_rows(p, pos, t0, t1)
    return s.masked_fill(~vis, float("-inf")), pos, qr, kk


def _unseen(s: Tensor) -> Tensor:
    """``[.., n, 1]``: the gathered keys no row of the chunk's tile sees (``s [.., rows, n]``
    is ``-inf`` there for every row). Their weights are 0, but ``0 * NaN`` in a matmul would
    carry a padding key's NaN into the rows, so their keys and values are zeroed first (the
    Triton kernels never load such keys)."""
    return ~(s != float("-inf")).any(-2)[..., None]


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                     scale: float, block_indices: Tensor, block_counts: Tensor, *,
                     block_size: int, query_tile: int, key_mask: Optional[Tensor] = None,
                     causal_offset: int = 0) -> tuple[Tensor, Tensor]:
    """Block-sparse attention over the selected leaves, with the usual masks inside each block
    (``key_mask``, ``causal_offset``: as in :func:`select_blocks`).

    Returns ``out [B, Hq, Nq, Dv]`` (``q.dtype``; zero for rows with no visible key) and
    ``lse [B, Hq, Nq]`` float32 (float64 for float64 inputs; natural log; ``-inf`` for such rows).
    """
    p = _Problem.make(q, k, attn_mask, is_causal, block_size, query_tile, key_mask, causal_offset)
    M = block_indices.shape[-1]
    out = q.new_empty(p.B, p.Hq, p.Nq, v.shape[-1])
    lse = torch.empty(p.B, p.Hq, p.Nq, dtype=_acc_dtype(q), device=q.device)
    per_tile = p.G * p.Tq * M * p.C * 3 + M * p.C * (p.D + v.shape[-1])
    for t0, t1 in _tile_chunks(p.T, p.B * p.Hkv * per_tile):
        s, pos, _, _ = _chunk_logits(p, q, k, block_indices, t0, t1, scale)
        w, z = softmax_rows(s)
        vv = _gather_nodes(v, pos.clamp(min=0)).to(w.dtype).masked_fill(_unseen(s), 0.0)
        o = torch.matmul(w, vv)
        q0, q1 = t0 * p.Tq, min(t1 * p.Tq, p.Nq)
        out[:, :, q0:q1] = _from_rows(o, p, t0, t1).to(q.dtype)
        lse[:, :, q0:q1] = _from_rows(z, p, t0, t1)[..., 0]
    return out, lse


def sparse_attention_backward(grad_out, q, k, v, attn_mask, out, lse, block_indices, block_counts,
                              is_causal, scale, *, block_size, query_tile, key_mask=None,
                              causal_offset=0):
    """Exact ``dq, dk, dv`` of :func:`sparse_attention` with the selection held fixed.

    ``dS = P * (dO V^T - rowsum(dO * O))`` (FlashAttention-2's backward), with ``P``
    recomputed from the scores by :func:`softmax_rows` (``lse`` is accepted for the kernels'
    common signature). Gradients are accumulated in float32 (float64 for float64 inputs).
    """
    p = _Problem.make(q, k, attn_mask, is_causal, block_size, query_tile, key_mask, causal_offset)
    M = block_indices.shape[-1]
    dq = q.new_empty(q.shape)
    acc = _acc_dtype(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1, keepdim=True)
    per_tile = p.G * p.Tq * M * p.C * 4 + M * p.C * (p.D + v.shape[-1]) * 3
    for t0, t1 in _tile_chunks(p.T, p.B * p.Hkv * per_tile):
        s, pos, qr, kk = _chunk_logits(p, q, k, block_indices, t0, t1, scale)
        # Recomputed from the scores, not from `lse`: see softmax_rows.
        w, _ = softmax_rows(s)  # [B, Hkv, t, R, MC]
        do = _chunk_rows(grad_out, p, t0, t1).to(acc)
        unseen = _unseen(s)
        vv = _gather_nodes(v, pos.clamp(min=0)).to(acc).masked_fill(unseen, 0.0)
        dp = torch.matmul(do, vv.transpose(-1, -2))
        ds = w * (dp - _chunk_rows(delta, p, t0, t1))
        dqr = torch.matmul(ds, kk.masked_fill(unseen, 0.0)) * scale
        q0, q1 = t0 * p.Tq, min(t1 * p.Tq, p.Nq)
        dq[:, :, q0:q1] = _from_rows(dqr, p, t0, t1).to(q.dtype)
        dk_blk = torch.matmul(ds.transpose(-1, -2), qr) * scale  # [B, Hkv, t, MC, D]
        dv_blk = torch.matmul(w.transpose(-1, -2), do)
        # Padding positions carry zero weight, so clamping them onto key 0 adds nothing.
        ix = pos.clamp(min=0).flatten(2)
        dk.scatter_add_(2, ix[..., None].expand(-1, -1, -1, p.D), dk_blk.flatten(2, 3))
        dv.scatter_add_(2, ix[..., None].expand(-1, -1, -1, v.shape[-1]), dv_blk.flatten(2, 3))
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# -- naive dense oracle -------------------------------------------------------------------------

def dense_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                    is_causal: bool = False, scale: Optional[float] = None, *,
                    key_mask: Optional[Tensor] = None, causal_offset: int = 0) -> Tensor:
    """Naive dense attention in float64 (O(N^2) memory; tests only). Hidden rows give zero.

    ``q [B, Hq, Nq, D]``, ``k [B, Hkv, Nk, D]``, ``v [B, Hkv, Nk, Dv]``; returns ``q.dtype``.
    ``key_mask`` ``[B, Nk]`` bool and ``causal_offset``: as in :func:`select_blocks`.
    """
    G = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kk = k.double().repeat_interleave(G, 1)
    vv = v.double().repeat_interleave(G, 1)
    s = torch.matmul(q.double(), kk.transpose(-1, -2)) * scale
    Nq, Nk = q.shape[2], k.shape[2]
    allowed, bias = mask_parts(attn_mask)
    vis = dense_mask(q.shape[0], Nq, Nk, is_causal, causal_offset, key_mask, q.device)
    if allowed is not None:
        vis = vis & allowed
    if bias is not None:
        s = s + torch.where(allowed, bias.double(), 0.0)
    s = s.masked_fill(~vis, float("-inf"))
    w, _ = softmax_rows(s)
    return torch.matmul(w, vv).to(q.dtype)
