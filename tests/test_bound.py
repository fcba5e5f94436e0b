"""Box-bound scores (``PisaConfig.bound_block``): the bound holds, unit sub-blocks are exact
leaf scores, the exact regime is dense, and a planted one-key needle that pooled means lose
is kept (reference selection; tests/test_triton_select.py diffs the Triton one)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pisa_compile import PisaConfig
from pisa_compile.kernels import dispatch, reference as ref
from pisa_compile.kernels import triton_select
from pisa_compile.ops import pisa_attention, select_blocks


@settings(max_examples=60)
@given(R=st.integers(1, 8), n=st.integers(1, 40), D=st.integers(1, 24),
       spread=st.sampled_from([0.01, 1.0, 30.0]), seed=st.integers(0, 2**31 - 1))
def test_box_bound_is_an_upper_bound_of_every_logit(R, n, D, spread, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, D, generator=g) * spread
    k = torch.randn(n, D, generator=g) * spread + torch.randn(D, generator=g)
    bound = ref._bound_scores(q, k.amax(0, keepdim=True), k.amin(0, keepdim=True), 0.0, 0.7)
    logits = (q @ k.T * 0.7).amax(-1, keepdim=True)
    assert (bound >= logits - 1e-4 * (1 + logits.abs())).all()
    if n == 1:  # a one-key box is the key: the bound is its logit
        torch.testing.assert_close(bound, logits, atol=1e-4, rtol=1e-5)


def _qk(seed, B=1, Hkv=2, G=7, N=700, D=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hkv * G, N, D, generator=g),
            torch.randn(B, Hkv, N, D, generator=g))


@pytest.mark.parametrize("causal", [True, False])
def test_unit_sub_blocks_are_exact_leaf_scores(causal):
    """With 1-key sub-blocks a leaf's rough score is the LSE of its logits: with a pool that
    holds every leaf (no internal pruning) the pick equals ``leaf_scoring="exact"``'s."""
    q, k = _qk(0)
    base = dict(block_size=32, top_k=4, query_tile=16, beam=32, min_seq_len=0,
                kernel="reference")
    want = select_blocks(q, k, is_causal=causal, enable_gqa=True,
                         config=PisaConfig.preset("fast", **base, leaf_scoring="exact"))
    got = select_blocks(q, k, is_causal=causal, enable_gqa=True,
                        config=PisaConfig.preset("fast", **base, bound_block=1))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_exact_regime_with_padding_is_dense():
    """A budget that covers every leaf is dense attention, with a key mask (left padding)."""
    q, k = _qk(1, B=2, N=300)
    v = torch.randn_like(k)
    key_mask = torch.ones(2, 300, dtype=torch.bool)
    key_mask[1, :70] = False
    cfg = PisaConfig(block_size=16, top_k=64, query_tile=16, min_seq_len=0, kernel="reference",
                     bound_block=4, leaf_scoring="exact", shortlist=64)
    out = pisa_attention(q, k, v, is_causal=True, enable_gqa=True, key_mask=key_mask,
                         config=cfg)
    mask = torch.ones(300, 300, dtype=torch.bool).tril()[None, None] & key_mask[:, None, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(7, 1), v.repeat_interleave(7, 1), attn_mask=mask)
    # Rows 0..69 of the padded row see no key (PISA gives 0, SDPA NaN): compared from 70 on.
    torch.testing.assert_close(out[:, :, 70:], want[:, :, 70:], atol=1e-5, rtol=1e-5)


def _needle(seed, N=2048, D=32, C=64, G=7):
    """Keys that share a direction (as a language model's do), the last 8 queries asking
    for one key planted at a random leaf; returns ``q, k`` and that leaf."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(D, generator=g)
    k = base + 0.5 * torch.randn(1, 1, N, D, generator=g)
    q = 0.5 * torch.randn(1, G, N, D, generator=g)
    u = torch.randn(D, generator=g)
    u = u / u.norm()
    q[0, :, -8:] += 3 * u
    pos = int(torch.randint(2 * C, N - 4 * C, (1,), generator=g))
    k[0, 0, pos] = base + 4 * u
    return q, k, pos // C


@pytest.mark.parametrize("beam", [32, 8])
def test_bounds_keep_a_needle_that_pooled_means_lose(beam):
    """20 planted cases, last query tile: the count of cases whose needle leaf is selected.
    ``beam=32`` holds every leaf (the leaf scores decide), ``beam=8`` prunes once above.
    Measured: pooled 7 of 20 at both beams, bounds 18 and 15."""
    def hits(**kw):
        n = 0
        for seed in range(20):
            q, k, leaf = _needle(seed)
            cfg = PisaConfig.preset("fast", top_k=4, beam=beam, min_seq_len=0,
                                    kernel="reference", **kw)
            idx, _ = select_blocks(q, k, is_causal=True, enable_gqa=True, scale=0.5, config=cfg)
            n += leaf in idx[0, 0, -1].tolist()
        return n

    pooled = hits()
    bound = hits(bound_block=8, leaf_scoring="exact", shortlist=8)
    assert pooled <= 10 and bound >= 14, (pooled, bound)


def test_bound_block_is_validated_and_planned_on_the_reference():
    """Config validation; both selections take the option: ``dispatch.plan`` keeps the fused
    Triton selection, which selects what the reference does (more cases, level by level:
    ``tests/test_triton_select.py``)."""
    assert PisaConfig(bound_block=128).selection_options()["bound_block"] == 64  # a leaf
    with pytest.raises(ValueError, match="bound_block must be a power of two"):
        PisaConfig(bound_block=3)
    q = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
    how = dispatch.plan(q, q, q, None, True, kernel="triton", bound_block=4)
    assert how.select == "triton" and "bound_block" not in how.reason
    opts = dict(block_size=8, top_k=2, branching=2, beam=2, sink_blocks=1, local_blocks=1,
                query_tile=8, leaf_scoring="pooled", bound_block=4)
    got = triton_select.select_blocks(q, q, True, 0.25, **opts)
    want = ref.select_blocks(q, q, None, True, 0.25, **opts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("options", [dict(leaf_scoring="pooled", shortlist=None),
                                     dict()], ids=["pooled_bounds", "defaults"])
def test_a_negative_scale_selects_as_the_negated_queries(options):
    """``scale * q.k`` is ``|scale| * (-q).k``: a negative scale selects the blocks the negated
    queries select with ``|scale|``. The box bounds bound ``q.k`` from above, an upper bound
    of the scores only for a positive scale (pooled leaves with ``bound_block`` picked other
    blocks in 50 of 64 tiles, a new user's finding)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 256, 16, generator=g), torch.randn(1, 2, 256, 16, generator=g)
    k[:, :, 64:80] -= 3 * q[:, :, 230:231]  # a block late queries want under a negative scale
    cfg = PisaConfig(min_seq_len=0, block_size=16, top_k=3, query_tile=16, dense_tail=0,
                     **options)
    idx, cnt = select_blocks(q, k, scale=-0.5, is_causal=True, config=cfg)
    want_idx, want_cnt = select_blocks(-q, k, scale=0.5, is_causal=True, config=cfg)
    assert torch.equal(idx, want_idx) and torch.equal(cnt, want_cnt)
