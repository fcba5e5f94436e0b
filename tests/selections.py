"""A synthetic PISA-shaped selection for testing and timing the attention kernels alone."""

from __future__ import annotations

import torch

from pisa_compile.kernels.geometry import block_width, cdiv, forced_ranges


def synthetic_selection(B, Hkv, Nq, Nk, cfg, seed=0, device="cuda"):
    """Causal selection: sink + local leaves + ``top_k`` random earlier leaves per tile.

    Returns ``block_indices`` int32 ``[B, Hkv, T, M]`` (ascending, -1 padded) and
    ``block_counts`` int32 ``[B, Hkv, T]``, as ``select_blocks`` does.
    """
    C, Tq = cfg.block_size, cfg.query_tile
    L, T = cdiv(Nk, C), cdiv(Nq, Tq)
    M = block_width(Nk, C, cfg.top_k, cfg.sink_blocks, cfg.local_blocks, Tq)
    t = torch.arange(T, device=device)
    n_sink, lo, hi = forced_ranges(t, Nq, Nk, 0, C, Tq, cfg.sink_blocks, cfg.local_blocks)
    leaf = torch.arange(L, device=device)
    forced = (leaf < n_sink) | ((leaf >= lo[:, None]) & (leaf <= hi[:, None]))
    eligible = (leaf < lo[:, None]) & ~forced
    g = torch.Generator(device=device).manual_seed(seed)
    bi = torch.empty(B, Hkv, T, M, dtype=torch.int32, device=device)
    bc = torch.empty(B, Hkv, T, dtype=torch.int32, device=device)
    for h in range(Hkv):  # one head at a time: T x L scores stay small at 128K
        score = torch.rand(B, T, L, generator=g, device=device).masked_fill(~eligible, -1.0)
        val, idx = score.topk(min(cfg.top_k, L), -1)
        chosen = torch.zeros(B, T, L, dtype=torch.bool, device=device)
        chosen.scatter_(-1, idx, val >= 0)
        chosen |= forced
        key = torch.where(chosen, leaf, L).sort(-1).values[..., :M]
        bi[:, h] = torch.where(key < L, key, -1)
        bc[:, h] = chosen.sum(-1)
    return bi, bc
