"""(h) selection_recall on planted needles, and its bounds."""

import math

import torch
from hypothesis import given, settings, strategies as st

from pisa_compile import PisaConfig, select_blocks
from pisa_compile.metrics import _forced_mask, selection_recall


def _needle(N: int, C: int, needle_block: int, G: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    D = 32
    q = torch.randn(1, 2 * G, N, D, generator=gen) * 0.1
    k = torch.randn(1, 2, N, D, generator=gen) * 0.1
    direction = torch.randn(D, generator=gen)
    direction = direction / direction.norm()
    q += 4.0 * direction  # every query looks for the needle
    k[:, :, needle_block * C:(needle_block + 1) * C] += 4.0 * direction
    return q, k


@settings(max_examples=25)
@given(n_blocks=st.integers(8, 40), data=st.data(), seed=st.integers(0, 10**6),
       G=st.sampled_from([1, 3]), tile=st.sampled_from([1, 8, 16]),
       scoring=st.sampled_from(["pooled", "exact"]))
def test_planted_needle_is_always_selected(n_blocks, data, seed, G, tile, scoring):
    C = 8
    needle = data.draw(st.integers(1, n_blocks - 1))
    opts = dict(block_size=C, top_k=2, query_tile=tile, sink_blocks=0, local_blocks=1,
                min_seq_len=0)
    q, k = _needle(n_blocks * C, C, needle, G, seed)
    # The defaults' selection (box bounds, exact shortlist) keeps the needle too.
    bi, _ = select_blocks(q, k, enable_gqa=True, config=PisaConfig(**opts))
    assert bool((bi == needle).any(-1).all()), "the defaults missed the dominant block"
    cfg = PisaConfig.preset("fast", leaf_scoring=scoring, **opts)
    bi, bc = select_blocks(q, k, enable_gqa=True, config=cfg)
    assert bool((bi == needle).any(-1).all()), "the dominant block was missed by some tile"
    quality = selection_recall(q, k, cfg)
    # Where the needle is scorable it is each tile's oracle top-1 and chosen, so it is half of
    # that tile's top-2. Where it is the tile's forced local leaf the recall leaves it out of
    # both sides, and the tile may score 0 (CI found 0.491 with tile=1).
    T, L = bi.shape[2], n_blocks
    scorable = ~_forced_mask(q, k, None, False, cfg, T, L)[..., needle]
    bound = 0.5 * scorable.float().mean().item()
    assert quality.recall >= bound - 1e-6 and 0.0 <= quality.mass_ratio <= 1.0 + 1e-6


def test_recall_is_one_when_everything_is_selected():
    q, k = torch.randn(1, 4, 96, 16), torch.randn(1, 2, 96, 16)
    cfg = PisaConfig(block_size=8, top_k=12, query_tile=16, min_seq_len=0)
    quality = selection_recall(q, k, cfg, is_causal=True)
    assert quality.recall == 1.0
    assert abs(quality.mass_ratio - 1.0) < 1e-5


def test_a_bad_selection_scores_low():
    """Recall must fall when the judged selection skips the oracle's blocks."""
    q, k = _needle(128, 8, 9, 1, 0)
    cfg = PisaConfig(block_size=8, top_k=1, query_tile=16, sink_blocks=0, local_blocks=1,
                     min_seq_len=0)
    bi, bc = select_blocks(q, k, config=cfg)
    good = selection_recall(q, k, cfg, block_indices=bi, block_counts=bc)
    bad_bi = torch.where(bi == 9, 3, bi)  # swap the needle for a dull block
    bad = selection_recall(q, k, cfg, block_indices=bad_bi, block_counts=bc)
    assert good.recall > bad.recall and good.mass_ratio > bad.mass_ratio


def test_a_given_oracle_gives_the_same_quality():
    """``mass=`` (one ``block_mass`` for several selections) judges as the computed one."""
    from pisa_compile.metrics import block_mass

    q, k = torch.randn(1, 4, 128, 16), torch.randn(1, 2, 128, 16)
    cfg = PisaConfig(block_size=8, top_k=3, query_tile=16, min_seq_len=0)
    oracle = block_mass(q, k, None, True, 0.25, cfg)
    assert (selection_recall(q, k, cfg, is_causal=True, scale=0.25, mass=oracle)
            == selection_recall(q, k, cfg, is_causal=True, scale=0.25))
    # And it is the one used: another oracle (all mass on leaf 0) judges differently.
    other = torch.zeros_like(oracle)
    other[..., 0] = 1.0
    assert (selection_recall(q, k, cfg, is_causal=True, scale=0.25, mass=other)
            != selection_recall(q, k, cfg, is_causal=True, scale=0.25, mass=oracle))


def test_forced_sinks_sit_where_the_selection_puts_them():
    """Under a left-padded explicit mask the selection's sink is the leaf of the row's first
    real key; the metrics leave that leaf (not leaf 0, all padding) out of the ranking, or
    it would count as a free hit. Checked against ``select_blocks``' own forced leaves."""
    from pisa_compile.metrics import _forced_mask
    B, H, N, D, C = 2, 2, 128, 16, 16
    cfg = PisaConfig(block_size=C, top_k=1, query_tile=16, sink_blocks=1, local_blocks=1,
                     min_seq_len=0, dense_tail=0, kernel="reference")
    pads = torch.tensor([40, 0])  # row 0: leaves 0-1 padding, its text from leaf 2
    km = torch.arange(N)[None, :] >= pads[:, None]
    mask = torch.ones(N, N, dtype=torch.bool).tril()[None, None] & km[:, None, None, :]
    q, k = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    T, L = N // 16, N // C
    forced = _forced_mask(q, k, mask, False, cfg, T, L)
    assert forced[0, :, :, 2].all() and not forced[0, :, 4:, 0].any()
    assert forced[1, :, :, 0].all()
    # Every tile's block list holds its forced leaves (plus top_k=1 scored one).
    bi, _ = select_blocks(q, k, mask, config=cfg)
    chosen = torch.zeros(B, H, T, L + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(bi < 0, L, bi).long(), True)
    assert (chosen[..., :L] | ~forced).all()


def test_nothing_to_judge_is_nan_not_perfect():
    """A fully masked input has no scorable tile and no row that sees a key: recall and mass
    ratio are NaN and no tile is counted (they once read 1.0, a perfect score)."""
    q, k = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    cfg = PisaConfig(block_size=8, top_k=2, query_tile=16, min_seq_len=0)
    quality = selection_recall(q, k, cfg, attn_mask=torch.zeros(64, 64, dtype=torch.bool))
    assert quality.n_tiles == 0
    assert math.isnan(quality.recall) and math.isnan(quality.mass_ratio)
