"""Selection quality against the exact oracle: recall@K and the attention-mass ratio.

The oracle ranks each tile's leaf blocks by the attention mass its rows actually send them
(dense softmax, summed over the tile's rows): the quantity PISA's scores estimate
(DESIGN.md "Scoring"). The PISA paper reports recall@8 and the mass kept this way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .config import PisaConfig
from .kernels import reference
from .kernels.geometry import forced_ranges, query_offset, sink_start
from .ops import select_blocks

__all__ = ["SelectionQuality", "selection_recall", "block_mass"]


@dataclass(frozen=True)
class SelectionQuality:
    """``recall``: mean over tiles of |chosen ∩ oracle top-k| / |oracle top-k| (scored blocks
    only, forced blocks excluded from both sides); ``mass_ratio``: mean over valid rows of the
    attention mass inside the attended blocks (forced included); ``n_tiles``: tiles counted.
    Each is NaN where nothing was left to count (no scorable tile, no row that sees a key)."""

    recall: float
    mass_ratio: float
    n_tiles: int


def block_mass(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
               scale: float, config: PisaConfig) -> Tensor:
    """Dense attention mass per row and leaf block: float32 ``[B, Hq, Nq, L]`` (rows sum to 1,
    or 0 where a row sees no key). O(Nq * Nk) time, computed in query chunks."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, C = Hq // Hkv, config.block_size
    L = (Nk + C - 1) // C
    allowed, bias = reference.mask_parts(attn_mask)
    kk = k.float().repeat_interleave(G, 1)
    out = torch.empty(B, Hq, Nq, L, dtype=torch.float32, device=q.device)
    step = max(1, (1 << 24) // max(1, B * Hq * Nk))
    kpos = torch.arange(Nk, device=q.device)
    for q0 in range(0, Nq, step):
        q1 = min(Nq, q0 + step)
        s = torch.matmul(q[:, :, q0:q1].float(), kk.transpose(-1, -2)) * scale
        vis = torch.ones(q1 - q0, Nk, dtype=torch.bool, device=q.device)
        if is_causal:
            vis = kpos[None, :] <= torch.arange(q0, q1, device=q.device)[:, None]
        if allowed is not None:
            vis = vis & allowed[..., q0:q1, :]
        if bias is not None:
            s = s + torch.where(allowed[..., q0:q1, :], bias[..., q0:q1, :].float(), 0.0)
        w, _ = reference.softmax_rows(s.masked_fill(~vis, float("-inf")))
        w = torch.nn.functional.pad(w, (0, L * C - Nk)).view(B, Hq, q1 - q0, L, C).sum(-1)
        out[:, :, q0:q1] = w
    return out


def selection_recall(q: Tensor, k: Tensor, config: Optional[PisaConfig] = None, *,
                     attn_mask: Optional[Tensor] = None, is_causal: bool = False,
                     scale: Optional[float] = None, block_indices: Optional[Tensor] = None,
                     block_counts: Optional[Tensor] = None,
                     mass: Optional[Tensor] = None) -> SelectionQuality:
    """Recall@K and mass ratio of a PISA selection against the exact (dense) oracle.

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]`` (GQA allowed).
        config: the selection's options (``top_k`` is the K of recall@K).
        attn_mask, is_causal, scale: as in :func:`pisa_compile.pisa_attention`.
        block_indices, block_counts: a selection to judge (e.g. a baseline's); default: PISA's
            own, from :func:`pisa_compile.select_blocks`.
        mass: :func:`block_mass` of these inputs with ``config.block_size``, to judge several
            selections against one oracle (computed here if None).

    Returns:
        :class:`SelectionQuality`. Tiles with no scorable block are left out of the recall,
        rows that see no key out of the mass ratio; with none left, each is NaN (a fully
        masked input, or blocks all forced), not a perfect 1.

    Cost: O(Nq * Nk * D) (the oracle is dense); use it on evaluation-sized inputs.
    Source: recall and mass follow the PISA paper's selection study; the tile mass is the
    per-row normalised score of DESIGN.md "Scoring", evaluated exactly.
    """
    config = config or PisaConfig()
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if block_indices is None:
        block_indices, block_counts = select_blocks(q, k, attn_mask, is_causal, scale,
                                                    enable_gqa=True, config=config)
    B, Hq, Nq, _ = q.shape
    Hkv, G, Tq = k.shape[1], Hq // k.shape[1], config.query_tile
    if mass is None:
        mass = block_mass(q, k, attn_mask, is_causal, scale, config)  # [B, Hq, Nq, L]
    L = mass.shape[-1]
    T = block_indices.shape[2]
    # Tile mass: sum over the tile's rows (G heads x Tq queries).
    pad = T * Tq - Nq
    m = torch.nn.functional.pad(mass, (0, 0, 0, pad)).view(B, Hkv, G, T, Tq, L)
    tile_mass = m.sum((2, 4))  # [B, Hkv, T, L]
    chosen = torch.zeros(B, Hkv, T, L + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, torch.where(block_indices < 0, L, block_indices).long(), True)
    chosen = chosen[..., :L]

    # Forced blocks are attended regardless; they are left out of the ranking on both sides.
    forced = _forced_mask(q, k, attn_mask, is_causal, config, T, L)
    scorable = ~forced & (tile_mass > 0)
    k_eff = torch.minimum(scorable.sum(-1), torch.tensor(config.top_k, device=q.device))
    ranked = torch.sort(tile_mass.masked_fill(~scorable, -1.0), -1, descending=True).indices
    rank_of = torch.empty_like(ranked)
    rank_of.scatter_(-1, ranked, torch.arange(L, device=q.device).expand_as(ranked))
    oracle = scorable & (rank_of < k_eff[..., None])
    hit = (oracle & chosen).sum(-1).float()
    counted = k_eff > 0
    # Nothing to score (every block forced, or no key seen): undefined, not perfect.
    recall = (hit[counted] / k_eff[counted].float()).mean().item() if counted.any() \
        else math.nan

    kept_mass = m * chosen.view(B, Hkv, 1, T, 1, L)
    row_mass = kept_mass.sum(-1).reshape(B, Hq, T * Tq)[..., :Nq]
    row_total = mass.sum(-1)
    valid = row_total > 0
    mass_ratio = (row_mass[valid] / row_total[valid]).mean().item() if valid.any() \
        else math.nan
    return SelectionQuality(recall=recall, mass_ratio=mass_ratio, n_tiles=int(counted.sum()))


def _forced_mask(q, k, attn_mask, is_causal, config, T, L) -> Tensor:
    """The leaves the selection forces, ``[B, Hkv, T, L]``: sinks from each row's first
    attendable key (as :func:`~pisa_compile.ops.select_blocks` places them) and the local
    leaves."""
    B = q.shape[0]
    offset = query_offset(q.shape[2], k.shape[2], is_causal,
                          explicit_mask=attn_mask is not None)
    t = torch.arange(T, device=q.device)
    n_sink, lo, hi = forced_ranges(t, q.shape[2], k.shape[2], offset, config.block_size,
                                   config.query_tile, config.sink_blocks, config.local_blocks)
    s0 = sink_start(None, config.block_size, reference.mask_parts(attn_mask)[0])
    s0 = torch.zeros(B, dtype=torch.int32, device=q.device) if s0 is None else (
        s0.to(q.device).expand(B))
    b = torch.arange(L, device=q.device)
    sink = (b >= s0[:, None, None]) & (b < s0[:, None, None] + n_sink)  # [B, 1, L]
    local = (b[None, :] >= lo[:, None]) & (b[None, :] <= hi[:, None])  # [T, L]
    return (sink | local[None])[:, None].expand(B, k.shape[1], T, L)
