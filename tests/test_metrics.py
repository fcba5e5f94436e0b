"""(h) selection_recall on planted needles, and its bounds."""

import torch
from hypothesis import given, settings, strategies as st

from pisa_compile import PisaConfig, select_blocks
from pisa_compile.metrics import selection_recall


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
    # The needle is in every tile's oracle top-2, so at least half of it is always hit.
    assert quality.recall >= 0.5 and 0.0 <= quality.mass_ratio <= 1.0 + 1e-6


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
