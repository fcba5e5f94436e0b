"""Shared checker: Triton selection against the reference, level by level.

The reference walk (``reference._select_chunk``) is replayed here with every level's pool,
tile score ``S`` and kept set recorded. The kernel writes its kept set per level
(``trace``). A tile must match the reference exactly, except where, at the first level where
the two differ, the pools are the same and the ``S`` values of the two kept sets agree
within ``tol`` (an exact near-tie broken the other way by rounding). Below such a level the
pools differ, so nothing further is compared for that tile.
"""

from __future__ import annotations

import torch

from pisa_compile.kernels import reference as ref
from pisa_compile.kernels import triton_select as ts
from pisa_compile.kernels.geometry import (block_width, flat_beam, forced_ranges, level_sizes,
                                           local_bound, sink_start)


def _beam(config, n_keys):
    """The beam a call with ``n_keys`` keys selects with (``flat_leaves`` raises it)."""
    return flat_beam(n_keys, config.block_size, config.branching, config.effective_beam,
                     config.effective_flat_leaves, leaf_scoring=config.leaf_scoring,
                     shortlist=config.effective_shortlist,
                     bound_block=config.effective_bound_block)


def _pyramid_args(config, n_keys):
    return config.block_size, config.branching, _beam(config, n_keys)


def check_pyramid(k, key_live, config):
    """The Triton pyramid equals the reference's: same levels, means to 1e-5, exact counts."""
    from pisa_compile.kernels import triton_pyramid as tp
    m1, c1 = ref.build_pyramid(k, key_live, *_pyramid_args(config, k.shape[2]))
    m2, c2 = tp.build_pyramid(k, key_live, *_pyramid_args(config, k.shape[2]))
    assert len(m1) == len(m2)
    for a, b in zip(m1, m2):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for a, b in zip(c1, c2):
        assert torch.equal(a, b)


def reference_trace(q, k, is_causal, scale, config, key_mask=None, causal_offset=0):
    """Per level (top first): ``(level, pool [B,H,T,P], S [B,H,T,P], kept bool)``."""
    p = ref._Problem.make(q, k, None, is_causal, config.block_size, config.query_tile, key_mask,
                          causal_offset)
    beam = _beam(config, k.shape[2])
    sel = ref._Select(config.top_k, config.branching, beam, config.sink_blocks,
                      config.local_blocks, config.leaf_scoring == "exact",
                      config.effective_shortlist, config.effective_bound_block)
    g, top_k = config.branching, config.top_k
    dev = q.device
    states, key_live = ref.leaf_states(p)
    states = states.to(dev)
    mus, counts = ref.build_pyramid(k.float(), key_live.to(dev), *_pyramid_args(config, p.Nk))
    flags = ref._node_flags(states, g, len(mus))
    boxes = None
    if config.effective_bound_block:  # box bounds rank (no float bias here: sub_bias None)
        boxes = ref.build_boxes(k.float(), key_live.to(dev), config.block_size,
                                config.effective_bound_block, g, counts)
    n_forced = min(config.sink_blocks, p.L) + local_bound(config.local_blocks,
                                                           config.query_tile, config.block_size)
    e_max = n_forced + beam
    P = g * (beam + e_max)
    R = p.G * p.Tq
    qp = torch.nn.functional.pad(q.float(), (0, 0, 0, p.T * p.Tq - p.Nq))
    q_rows = qp.view(p.B, p.Hkv, p.G, p.T, p.Tq, p.D).permute(0, 1, 3, 2, 4, 5).reshape(
        p.B, p.Hkv, p.T, R, p.D)
    t0, t1 = 0, p.T
    t = torch.arange(t0, t1, device=dev)
    n_sink, lo, hi = forced_ranges(t, p.Nq, p.Nk, p.offset, p.C, p.Tq, config.sink_blocks,
                                   config.local_blocks)
    row_ok = ref._row_valid(p, t0, t1, dev)
    s0 = sink_start(key_mask, config.block_size)
    s0 = 0 if s0 is None else s0.view(-1, 1, 1, 1)
    s1 = s0 + n_sink
    level = len(mus) - 1
    n_top = mus[level].shape[2]
    pool = torch.arange(n_top, device=dev).expand(p.B, p.Hkv, p.T, n_top)
    pool = torch.nn.functional.pad(pool, (0, P - n_top), value=-1) if n_top < P else pool
    lo_b, hi_b = lo.view(1, 1, -1, 1), hi.view(1, 1, -1, 1)
    out = []
    while True:
        valid = pool >= 0
        span = g ** level
        first, last = pool * span, pool * span + span - 1
        forced_anc = valid & (((last >= s0) & (first < s1)) | ((last >= lo_b) & (first <= hi_b)))
        vis = ref._gather_tile_flags(flags[level][0], pool)
        bad = ref._gather_tile_flags(flags[level][1], pool)
        if level == 0:
            st = ref._gather_tile_flags(states, pool)
            forced = valid & (((pool >= s0) & (pool < s1)) | ((pool >= lo_b) & (pool <= hi_b)))
            cand = valid & ~forced & ((st == ref.CLEAN) | (st == ref.PARTIAL))
            s, bad, cand = ref._leaf_scores(p, sel, q_rows, k.float(), mus[0], counts[0], None,
                                            pool, st, cand, row_ok, t0, t1, scale, boxes)
            S, kept = _scores(s, cand, row_ok, top_k, bad)
            out.append((0, pool, S, kept))
            return out
        expand = valid & (forced_anc | (vis & bad))
        cand = valid & ~expand & vis
        box = None if boxes is None else (boxes.his[level - 1], boxes.los[level - 1])
        s, bad = ref._internal_scores(p, q_rows, mus[level - 1], counts[level - 1], None, pool,
                                      g, t0, t1, scale, box)
        S, kept = _scores(s, cand, row_ok, beam, bad)
        out.append((level, pool, S, kept))
        pool = ref.next_pool(pool, kept, forced_anc, expand, beam, e_max, g,
                             mus[level - 1].shape[2])
        level -= 1


def _scores(s, cand, row_ok, n, bad):
    return ref.tile_scores(s, cand, row_ok, bad), ref._top(s, cand, row_ok, n, bad)


def check_selection(q, k, is_causal, scale, config, tol=1e-4, max_tie_frac=0.05, key_mask=None,
                    causal_offset=0):
    """Run the kernel with a trace and compare it with the reference; returns the number of
    tiles decided by a near-tie. Raises AssertionError naming the first offending tile."""
    st = dict(key_mask=key_mask, causal_offset=causal_offset)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    T = -(-Nq // config.query_tile)
    n_levels = len(level_sizes(Nk, *_pyramid_args(config, Nk)))
    TW = ts.trace_width(_beam(config, Nk))
    trace = torch.full((B, Hkv, T, n_levels, TW), -7, dtype=torch.int32, device=q.device)
    idx, cnt = ts.select_blocks(q, k, is_causal, scale, **config.selection_options(), trace=trace,
                                **st)
    ridx, rcnt = ref.select_blocks(q, k, None, is_causal, scale, **config.selection_options(),
                                   **st)
    M = block_width(Nk, config.block_size, config.top_k, config.sink_blocks, config.local_blocks,
                    config.query_tile)
    assert idx.shape == ridx.shape == (B, Hkv, T, M)
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32
    levels = reference_trace(q, k, is_causal, scale, config, **st)
    assert len(levels) == n_levels
    alive = torch.ones(B, Hkv, T, dtype=torch.bool, device=q.device)
    ties = torch.zeros_like(alive)
    big = 1 << 30
    for lev, pool, S, kept in levels:
        want = torch.sort(torch.where(kept, pool, big), -1).values[..., :TW]
        if want.shape[-1] < TW:
            want = torch.nn.functional.pad(want, (0, TW - want.shape[-1]), value=big)
        want = torch.where(want >= big, -1, want)
        got = trace[:, :, :, lev].long().clamp(min=-1)  # -7: slots the kernel leaves unwritten
        same = (got == want).all(-1)
        diff = alive & ~same
        if bool(diff.any()):
            # Near-tie check: both kept sets are in the (identical) pool; compare their S.
            def s_of(nodes):
                hit = (nodes[..., :, None] == pool[..., None, :]) & (nodes[..., :, None] >= 0)
                found = hit.any(-1) | (nodes < 0)
                val = torch.where(hit, S[..., None, :], 0.0).sum(-1)
                return torch.sort(torch.where(nodes >= 0, val, -1.0), -1).values, found.all(-1)
            sg, okg = s_of(got)
            sw, _ = s_of(want)
            gap = (sg - sw).abs().amax(-1)
            lim = tol * sw.amax(-1).clamp(min=1.0)
            n_got, n_want = (got >= 0).sum(-1), (want >= 0).sum(-1)
            good = okg & (n_got == n_want) & (gap <= lim)
            bad = diff & ~good
            if bool(bad.any()):
                b, h, t = (int(x) for x in bad.nonzero()[0])
                raise AssertionError(
                    f"tile (b={b}, h={h}, t={t}) level {lev}: kernel {got[b, h, t].tolist()} "
                    f"ref {want[b, h, t].tolist()} S gap {gap[b, h, t].item()}")
            ties |= diff
            alive &= same
    same_out = (idx == ridx).all(-1) & (cnt == rcnt)
    bad = alive & ~same_out
    if bool(bad.any()):
        b, h, t = (int(x) for x in bad.nonzero()[0])
        raise AssertionError(f"tile (b={b}, h={h}, t={t}): kernel {idx[b, h, t].tolist()} "
                             f"{cnt[b, h, t].item()} ref {ridx[b, h, t].tolist()} "
                             f"{rcnt[b, h, t].item()}")
    n_ties = int(ties.sum())
    assert n_ties <= max(1, max_tie_frac * B * Hkv * T), f"{n_ties} near-tie tiles"
    return n_ties


def opcheck_stages(q, k, v, attn_mask, key_mask, is_causal, causal_offset, config, impl):
    """``torch.library.opcheck`` of ``pisa::select_blocks`` and of ``pisa::attention`` on its
    selection (``impl``: ``"reference"`` or ``"triton"``); scale 0.25."""
    from pisa_compile.ops import _attention_op, _select_blocks_op
    sel = (q.detach(), k.detach(), attn_mask, key_mask, is_causal, causal_offset, 0.25,
           *config.selection_args(), impl)
    torch.library.opcheck(_select_blocks_op, sel)
    bi, bc = _select_blocks_op(*sel)
    torch.library.opcheck(_attention_op, (q, k, v, attn_mask, key_mask, bi, bc, is_causal,
                                          causal_offset, 0.25, config.block_size,
                                          config.query_tile, impl))


def alone_and_right_padded(config, causal: bool, L: int, N: int = 300, seed: int = 0):
    """``(alone, padded, unmarked)``: a sequence of ``L`` tokens (4 query heads, 2 KV heads of
    16) attended alone, and right-padded to ``N`` with ``query_mask`` marking the padding
    queries, and without it; the padding queries all point at keys 20.. (a block no real
    row of their tile wants), so their votes change the selection where they count."""
    from pisa_compile import pisa_attention
    from pisa_compile.ops import self_attention_query_mask
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, N, 16, generator=g)
    k, v = (torch.randn(1, 2, N, 16, generator=g) for _ in range(2))
    q[:, :, L:] = 5 * k.repeat_interleave(2, 1)[:, :, 20:20 + N - L]
    keep = torch.ones(1, N, dtype=torch.bool)
    keep[:, L:] = False
    alone = pisa_attention(q[:, :, :L], k[:, :, :L], v[:, :, :L], is_causal=causal,
                           enable_gqa=True, config=config)
    padded, unmarked = (pisa_attention(q, k, v, is_causal=causal, key_mask=keep,
                                       enable_gqa=True, config=config, query_mask=m)
                        for m in (self_attention_query_mask(keep, N), None))
    return alone, padded[:, :, :L], unmarked[:, :, :L]
