"""PisaKVCache and its persistent pyramid, in Triton's interpreter (CPU, fp32/fp16).

The pyramid after any sequence of appends equals the pyramid built from scratch over the same
keys; a sparse decode step from it selects what the from-scratch Triton selection does (and
that one is diffed against the reference in ``test_triton_select.py``), attends what the
reference attends under that selection, equals dense attention in the exact regime, and never
reads a padded key.
"""

from __future__ import annotations

import os

import pytest

from tests.interpreter import use_interpreter

use_interpreter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from hypothesis import given, settings, strategies as st  # noqa: E402

from pisa_compile import PisaConfig, PisaKVCache  # noqa: E402
from pisa_compile.kernels import reference as ref  # noqa: E402
from pisa_compile.kernels import triton_pyramid as tp  # noqa: E402
from pisa_compile.kernels import triton_select as ts  # noqa: E402
from pisa_compile.kernels.geometry import dense_mask  # noqa: E402
from tests.pyramid_check import assert_pyramid_is_scratch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET is not 1", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # log2(0) in the interpreter


def _cfg(**kw):
    base = dict(block_size=4, top_k=2, branching=2, beam=2, sink_blocks=1, local_blocks=1,
                shortlist=None, kernel="triton", min_seq_len=0)
    return PisaConfig(**{**base, **kw})


@settings(max_examples=25)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), C=st.sampled_from([4, 8]),
       g=st.sampled_from([2, 3]), beam=st.integers(1, 3),
       chunks=st.lists(st.integers(1, 37), min_size=1, max_size=6),
       padded=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_pyramid_after_appends_equals_scratch(B, Hkv, C, g, beam, chunks, padded, seed):
    gen = torch.Generator().manual_seed(seed)
    cap = sum(chunks) + int(torch.randint(0, 9, (1,), generator=gen))
    cache = PisaKVCache(B, Hkv, cap, 8, dtype=torch.float32, device="cpu",
                        config=_cfg(block_size=C, branching=g, beam=beam, top_k=1), sparse_from=0)
    for n in chunks:
        k = torch.randn(B, Hkv, n, 8, generator=gen)
        pad = (torch.rand(B, n, generator=gen) > 0.3) if padded else None
        cache.append(k, torch.randn(B, Hkv, n, 8, generator=gen), pad)
        assert_pyramid_is_scratch(cache)


def test_pyramid_keeps_a_non_finite_key_first():
    cache = PisaKVCache(1, 1, 40, 8, dtype=torch.float32, device="cpu", config=_cfg(),
                        sparse_from=0)
    k = torch.randn(1, 1, 40, 8)
    k[0, 0, 13, 2] = float("nan")
    for i in range(0, 40, 7):
        cache.append(k[:, :, i:i + 7], k[:, :, i:i + 7])
    assert_pyramid_is_scratch(cache)
    assert cache.pyramid.lc[0, 0, 13 // 4].item() == float("inf")


def _decode_case(seed=0, B=2, Hkv=2, G=3, D=16, n_prompt=61, steps=5, padded=True, **kw):
    gen = torch.Generator().manual_seed(seed)
    cfg = _cfg(**kw)
    cap = n_prompt + steps
    cache = PisaKVCache(B, Hkv, cap, D, dtype=torch.float32, device="cpu", config=cfg,
                        sparse_from=0)
    pad = None
    if padded:  # left padding of 0 and 9 tokens
        pad = torch.ones(B, n_prompt, dtype=torch.bool)
        pad[1, :9] = False
    k = torch.randn(B, Hkv, cap, D, generator=gen)
    v = torch.randn(B, Hkv, cap, D, generator=gen)
    q = torch.randn(B, Hkv * G, cap, D, generator=gen)
    cache.append(k[:, :, :n_prompt], v[:, :, :n_prompt], pad)
    return cache, q, k, v, n_prompt, steps


def _decode_steps(cache, q, k, v, n0, steps):
    """Per step ``s``: append the previous step's key (from the second step on) and yield
    ``(s, n, the step's query [B, Hq, 1, D], the cache's key mask over n keys or None)``."""
    for s in range(steps):
        n = n0 + s
        if s:
            cache.append(k[:, :, n - 1:n], v[:, :, n - 1:n])
        yield s, n, q[:, :, n - 1:n], (None if cache.key_mask is None
                                       else cache.key_mask[:, :n])


@pytest.mark.parametrize("padded", [False, True])
def test_decode_selects_as_the_scratch_selection(padded):
    cache, q, k, v, n0, steps = _decode_case(padded=padded)
    for s, n, qs, km in _decode_steps(cache, q, k, v, n0, steps):
        got = cache.select(qs)
        want = ts.select_blocks(qs, k[:, :, :n], True, 0.25, key_mask=km, causal_offset=n - 1,
                                **cache.decode_config.selection_options())
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {s}"
        assert_pyramid_is_scratch(cache)


@pytest.mark.parametrize("padded", [False, True])
def test_decode_attends_what_the_reference_attends(padded):
    cache, q, k, v, n0, steps = _decode_case(padded=padded, seed=1)
    for s in range(steps):
        n = n0 + s
        if s:
            cache.append(k[:, :, n - 1:n], v[:, :, n - 1:n])
        qs = q[:, :, n - 1:n]
        assert cache.decode_is_sparse(1, qs)
        out = cache.attend(qs, scale=0.25)
        km = None if cache.key_mask is None else cache.key_mask[:, :n]
        bi, bc = cache.select(qs, scale=0.25)
        want, _ = ref.sparse_attention(qs, k[:, :, :n], v[:, :, :n], None, True, 0.25, bi, bc,
                                       block_size=cache.config.block_size, query_tile=1,
                                       key_mask=km, causal_offset=n - 1)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
        assert int(bc.min()) >= 1  # every query attends at least its own leaf


def test_decode_selects_a_negative_scale_as_the_negated_queries():
    """The persistent pyramid's selection calls the Triton selection directly (no dispatch):
    a negative scale is folded into the queries there too (``geometry.positive_scale``), so
    a step selects as ``-q`` with ``|scale|`` (a review: the fold first sat in dispatch
    alone, which these calls skip)."""
    cache, q, k, v, n0, steps = _decode_case(padded=True, seed=3)
    differs = 0
    for s, n, qs, km in _decode_steps(cache, q, k, v, n0, steps):
        got = cache.select(qs, scale=-0.25)
        want = cache.select(-qs, scale=0.25)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {s}"
        differs += not torch.equal(got[0], cache.select(qs, scale=0.25)[0])
    assert differs  # the sign changes some step's blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_exact_regime_equals_dense(dtype):
    """top_k covering every leaf: the sparse decode is dense attention (GQA, left padding)."""
    cache, q, k, v, n0, steps = _decode_case(top_k=64, seed=2)
    cache2 = PisaKVCache(2, 2, n0 + steps, 16, dtype=dtype, device="cpu",
                         config=cache.config, sparse_from=0)
    cache2.append(k[:, :, :n0].to(dtype), v[:, :, :n0].to(dtype), cache.key_mask[:, :n0])
    for s in range(steps):
        n = n0 + s
        if s:
            cache2.append(k[:, :, n - 1:n].to(dtype), v[:, :, n - 1:n].to(dtype))
        qs = q[:, :, n - 1:n].to(dtype)
        out = cache2.attend(qs)
        mask = dense_mask(2, 1, n, True, n - 1, cache2.key_mask[:, :n])
        want = F.scaled_dot_product_attention(qs.float(), k[:, :, :n].to(dtype).float(),
                                              v[:, :, :n].to(dtype).float(), attn_mask=mask,
                                              enable_gqa=True)
        tol = 2e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_decode_never_reads_padded_keys():
    """Padded keys changed (to huge values and NaN) leave every output bit-identical."""
    outs = []
    for poison in (False, True):
        cache, q, k, v, n0, steps = _decode_case(seed=3)
        k, v = k.clone(), v.clone()
        if poison:
            k[1, :, :9] = 1e4
            v[1, :, :9] = float("nan")
        cache = PisaKVCache(2, 2, n0 + steps, 16, dtype=torch.float32, device="cpu",
                            config=cache.config, sparse_from=0)
        pad = torch.ones(2, n0, dtype=torch.bool)
        pad[1, :9] = False
        cache.append(k[:, :, :n0], v[:, :, :n0], pad)
        res = []
        for s in range(steps):
            n = n0 + s
            if s:
                cache.append(k[:, :, n - 1:n], v[:, :, n - 1:n])
            res.append(cache.attend(q[:, :, n - 1:n]))
        outs.append(torch.stack(res))
    assert torch.equal(outs[0], outs[1])


def test_dense_below_sparse_from_and_prefill():
    cache, q, k, v, n0, _ = _decode_case(padded=False, top_k=64)
    cache.sparse_from = n0 + 1
    assert not cache.decode_is_sparse(1)
    out = cache.attend(q[:, :, n0 - 1:n0])
    want = F.scaled_dot_product_attention(q[:, :, n0 - 1:n0], k[:, :, :n0], v[:, :, :n0],
                                          enable_gqa=True)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    # More queries than a decode step: pisa_attention's causal prefill (bottom-right).
    out = cache.attend(q[:, :, n0 - 20:n0])
    mask = dense_mask(2, 20, n0, True, n0 - 20)
    dense = F.scaled_dot_product_attention(q[:, :, n0 - 20:n0], k[:, :, :n0], v[:, :, :n0],
                                           attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, dense, atol=2e-5, rtol=2e-5)  # top_k: the exact regime


def test_reset_empties_the_pyramid():
    cache, q, k, v, n0, _ = _decode_case()
    cache.reset()
    assert cache.length == 0 and cache.key_mask is None
    cache.append(k[:, :, :10], v[:, :, :10])
    assert_pyramid_is_scratch(cache)


def test_bad_input_names_the_argument():
    cache = PisaKVCache(1, 2, 16, 8, dtype=torch.float32, device="cpu", config=_cfg())
    with pytest.raises(ValueError, match="key must be"):
        cache.append(torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8))
    with pytest.raises(ValueError, match="value must be"):
        cache.append(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8))
    with pytest.raises(ValueError, match="key_padding_mask"):
        cache.append(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.ones(1, 5))
    with pytest.raises(ValueError, match="exceed max_len"):
        cache.append(torch.randn(1, 2, 17, 8), torch.randn(1, 2, 17, 8))
    cache.append(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="Nq <= length"):
        cache.attend(torch.randn(1, 2, 5, 8))
    with pytest.raises(ValueError, match="query must be"):
        cache.attend(torch.randn(1, 3, 1, 8))
    with pytest.raises(ValueError, match="query must be"):
        cache.attend(torch.randn(1, 2, 1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_len"):
        PisaKVCache(1, 1, 0, 8, device="cpu")
    with pytest.raises(ValueError, match="sparse_from"):
        PisaKVCache(1, 1, 8, 8, device="cpu", sparse_from=-1)
    with pytest.raises(TypeError, match="config"):
        PisaKVCache(1, 1, 8, 8, device="cpu", config={"top_k": 2})
    with pytest.raises(ValueError, match="max_len must be an int >= 1"):
        PisaKVCache(1, 1, 8.0, 8, device="cpu")
    import numpy as np  # numpy sizes are sizes, as transformers' caches take them
    assert PisaKVCache(np.int64(1), 1, np.int64(8), 8, device="cpu").keys.shape[2] == 8
    if not torch.cuda.is_available():  # the default device is one this machine has
        assert PisaKVCache(1, 1, 8, 8, dtype=torch.float32).keys.device.type == "cpu"
    pyr = cache.pyramid
    with pytest.raises(ValueError, match="start < end"):
        tp.append_boxes(pyr, cache.keys, 3, 3)
    with pytest.raises(ValueError, match="laid out for"):
        ts.select_blocks(torch.randn(1, 2, 1, 8), cache.keys[:, :, :4], True, 0.3,
                         **{**cache.decode_config.selection_options(), "branching": 3},
                         causal_offset=3, pyramid=pyr)


@pytest.mark.parametrize("padded", [False, True])
def test_split_rescoring_selects_the_same(padded):
    """The decode rescoring spread over programs (``split``) picks what one program per tile
    picks, from the persistent pyramid, for one query and for a short tile of queries."""
    cache, q, k, v, n0, _ = _decode_case(padded=padded, seed=4, top_k=3)
    opts = cache.decode_config.selection_options()
    km = None if cache.key_mask is None else cache.key_mask[:, :n0]
    for nq, tile in ((1, 1), (5, 4)):
        qs = q[:, :, n0 - nq:n0]
        got = [ts.select_blocks(qs, k[:, :, :n0], True, 0.25, key_mask=km,
                                causal_offset=n0 - nq, pyramid=cache.pyramid,
                                tuning={"rescore": {"split": split, "split_leaves": 3}},
                                **{**opts, "query_tile": tile})
               for split in (False, True)]
        assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_cost_model_reads_the_bytes_of_a_dense_step():
    from pisa_compile.kv_cache import SPARSE_DECODE_BYTES
    cache, q, *_ = _decode_case()
    cache.sparse_from = None
    per_key = 2 * 2 * (16 + 16) * 4  # B * Hkv * (D + Dv) * itemsize
    cache.length = SPARSE_DECODE_BYTES["eager"] // per_key - 1
    assert not cache.decode_is_sparse(1, q)
    cache.length += 1
    assert cache.decode_is_sparse(1, q) and not cache.decode_is_sparse(17, q)


def test_append_refuses_another_dtype():
    cache = PisaKVCache(1, 2, 16, 8, dtype=torch.float16, device="cpu", config=_cfg())
    with pytest.raises(ValueError, match="key must be torch.float16"):
        cache.append(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).half())


def test_a_pool_wider_than_the_walks_registers_selects_as_the_reference():
    """beam 70: a one-level pool of 256 nodes, which from scratch would run the flat kernel;
    with a pyramid the walk takes it (every head its own boxes)."""
    gen = torch.Generator().manual_seed(5)
    cfg = _cfg(beam=70, top_k=3)
    cache = PisaKVCache(1, 3, 200, 8, dtype=torch.float32, device="cpu", config=cfg,
                        sparse_from=0)
    k = torch.randn(1, 3, 200, 8, generator=gen)
    cache.append(k, k)
    q = torch.randn(1, 6, 1, 8, generator=gen)
    got = cache.select(q, scale=0.3)
    want = ref.select_blocks(q, k, None, True, 0.3, causal_offset=199,
                             **cache.decode_config.selection_options())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_pyramid_is_kept_from_the_sparse_length_on():
    """Below ``sparse_from`` appends leave the pyramid alone; the first append at it catches
    the pyramid up over every key so far."""
    gen = torch.Generator().manual_seed(6)
    cache = PisaKVCache(1, 2, 64, 8, dtype=torch.float32, device="cpu", config=_cfg(),
                        sparse_from=30)
    k = torch.randn(1, 2, 64, 8, generator=gen)
    cache.append(k[:, :, :29], k[:, :, :29])
    assert cache.pyramid_length == 0 and int(cache.pyramid.cnt.sum()) == 0
    cache.append(k[:, :, 29:33], k[:, :, 29:33])
    assert cache.pyramid_length == 33
    assert_pyramid_is_scratch(cache)


def test_decode_honours_the_calls_padding():
    """A cache not told of the padding (a transformers cache: the mask comes with the call)
    adopts the call's key mask: it selects as a cache told of it (padded keys that look
    relevant do not steer the walk), and the output is the reference's under that selection."""
    gen = torch.Generator().manual_seed(7)
    cfg = _cfg(block_size=8, top_k=1)
    n = 120
    k = torch.randn(1, 2, n, 16, generator=gen)
    v = torch.randn(1, 2, n, 16, generator=gen)
    q = torch.randn(1, 4, 1, 16, generator=gen)
    k[:, :, :40] = q[:, :2].repeat_interleave(1, 1)[:, :, :1] * 3  # padding that looks relevant
    km = torch.ones(1, n, dtype=torch.bool)
    km[:, :40] = False
    cache = PisaKVCache(1, 2, n, 16, dtype=torch.float32, device="cpu", config=cfg,
                        sparse_from=0)
    cache.append(k, v)  # no padding given
    out = cache.decode(q, cache.keys[:, :, :n], cache.values[:, :, :n], km, n - 1, 0.25)
    bi, bc = cache.select(q, scale=0.25)
    told = PisaKVCache(1, 2, n, 16, dtype=torch.float32, device="cpu", config=cfg,
                       sparse_from=0)
    told.append(k, v, km)
    want_bi, want_bc = told.select(q, scale=0.25)
    assert torch.equal(bi, want_bi) and torch.equal(bc, want_bc)
    assert int(bi[bi >= 0].min()) >= 40 // 8  # no padded leaf: sinks from the first real key
    want, _ = ref.sparse_attention(q, k, v, None, True, 0.25, bi, bc, block_size=8,
                                   query_tile=1, key_mask=km, causal_offset=n - 1)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_select_under_a_calls_key_mask_scores_holed_leaves_under_it():
    """A cache told of no padding, selected under a call's key mask that holes one leaf: the
    exact scores read the call's mask, so the masked half of leaf 5 (made to look relevant)
    does not win it the pick, as under the reference. The pyramid's counts are the cache's
    (leaf 5 counted full), so the rescoring may not take them as the call's."""
    gen = torch.Generator().manual_seed(7)
    cfg = PisaConfig(block_size=8, top_k=1, branching=2, beam=16, sink_blocks=1,
                     local_blocks=1, shortlist=None, kernel="triton", min_seq_len=0)
    n = 96
    k = torch.randn(1, 2, n, 16, generator=gen)
    v = torch.randn(1, 2, n, 16, generator=gen)
    q = torch.randn(1, 4, 1, 16, generator=gen)
    k[:, :, 40:44] = q[:, ::2, 0:1] * 3  # half of leaf 5 looks relevant ...
    km = torch.ones(1, n, dtype=torch.bool)
    km[:, 40:44] = False  # ... and the call masks it
    cache = PisaKVCache(1, 2, n, 16, dtype=torch.float32, device="cpu", config=cfg,
                        sparse_from=0)
    cache.append(k, v)
    bi, bc = cache.select(q, scale=0.25, key_mask=km)
    want_bi, want_bc = ref.select_blocks(q, k, None, True, 0.25, causal_offset=n - 1,
                                         key_mask=km, **cache.decode_config.selection_options())
    assert torch.equal(bi, want_bi) and torch.equal(bc, want_bc), (bi[0, :, 0], want_bi[0, :, 0])


def test_decode_ranks_every_leaf_box_up_to_flat_leaves(monkeypatch):
    """Up to ``flat_leaves`` leaves a decode step ranks every leaf by its box in the flat
    kernel, reading the pyramid's leaf level (a walk's pool of 128 lost needles on a real
    model): the same blocks as the flat selection built from the keys, and a key planted
    along the step's query is selected; past ``flat_leaves`` the walk runs."""
    # 126 leaves: one level of 126 is a pool of 256 > WALK_MAX_POOL, the flat kernel's case.
    cache, q, k, v, n0, steps = _decode_case(padded=True, seed=6, n_prompt=503, steps=2,
                                             shortlist=8, top_k=2)
    launched = []
    real = ts.launcher
    monkeypatch.setattr(ts, "launcher", lambda kern, t: launched.append(kern) or real(kern, t))
    opts = cache.decode_config.selection_options()
    for s, n, qs, km in _decode_steps(cache, q, k, v, n0, steps):
        launched.clear()
        got = cache.select(qs)
        assert ts._flat_kernel in launched and ts._select_kernel not in launched
        want = ts.select_blocks(qs, k[:, :, :n], True, 0.25, key_mask=km, causal_offset=n - 1,
                                **opts)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {s}"
    # A needle: key 300 (leaf 75, far from the sinks and the local leaves) along the last
    # query of every head of KV head 0 in batch 0.
    n = cache.length
    qs = q[:, :, n - 1:n].clone()
    G = qs.shape[1] // k.shape[1]
    kk = cache.keys.clone()
    kk[0, 0, 300] = 6.0 * qs[0, :G, 0].mean(0) / qs[0, :G, 0].mean(0).norm()
    needle = PisaKVCache(*kk.shape[:2], kk.shape[2], kk.shape[3], dtype=kk.dtype, device="cpu",
                         config=cache.config, sparse_from=0)
    needle.append(kk[:, :, :n], cache.values[:, :, :n],
                  None if cache.key_mask is None else cache.key_mask[:, :n])
    idx, _ = needle.select(qs)
    assert 300 // cache.config.block_size in idx[0, 0, 0].tolist()
    launched.clear()
    walk = PisaKVCache(*kk.shape[:2], kk.shape[2], kk.shape[3], dtype=kk.dtype, device="cpu",
                       config=cache.config.replace(flat_leaves=0), sparse_from=0)
    walk.append(kk[:, :, :n], cache.values[:, :, :n],
                None if cache.key_mask is None else cache.key_mask[:, :n])
    walk.select(qs)
    assert ts._select_kernel in launched and ts._flat_kernel not in launched


def test_cost_model_waits_longer_for_the_flat_ranking(monkeypatch):
    """A step that ranks every leaf box costs more than a walk's: the cost model turns it
    sparse from :data:`SPARSE_DECODE_BYTES_FLAT` of K/V where :func:`runs_flat` says the
    selection runs the flat kernel, and from :data:`SPARSE_DECODE_BYTES` where it walks
    (both scaled down here, to lengths a CPU test holds)."""
    from pisa_compile import kv_cache
    assert kv_cache.SPARSE_DECODE_BYTES_FLAT["graph"] > kv_cache.SPARSE_DECODE_BYTES["graph"]
    assert kv_cache.SPARSE_DECODE_BYTES_FLAT["eager"] > kv_cache.SPARSE_DECODE_BYTES["eager"]
    per_key = 2 * 2 * (16 + 16) * 4  # B * Hkv * (D + Dv) * itemsize
    monkeypatch.setattr(kv_cache, "SPARSE_DECODE_BYTES", {"graph": 250 * per_key,
                                                          "eager": 260 * per_key})
    monkeypatch.setattr(kv_cache, "SPARSE_DECODE_BYTES_FLAT", {"graph": 1000 * per_key,
                                                               "eager": 1010 * per_key})
    cache, q, *_ = _decode_case(shortlist=8)  # 4-key leaves, flat_leaves 512
    cache.sparse_from = None
    opts = cache.decode_config.selection_options()
    # 64 leaves: one level fits the walk's registers; 250 leaves: the flat kernel.
    assert not ts.runs_flat(256, **opts) and ts.runs_flat(999, **opts)
    assert not ts.runs_flat(999, **{**opts, "flat_leaves": 0})
    for graph, walk_at, flat_at in ((True, 250, 1000), (False, 260, 1010)):
        cache.cuda_graph = graph
        cache.decode_config = cache.decode_config.replace(flat_leaves=512)
        for length, sparse in ((walk_at - 1, False), (walk_at, True),  # walks
                               (flat_at - 1, False), (flat_at, True)):  # flat
            cache.length = length
            assert cache.decode_is_sparse(1, q) == sparse, (graph, length)
        cache.decode_config = cache.decode_config.replace(flat_leaves=0)  # the walk
        cache.length = flat_at - 1
        assert cache.decode_is_sparse(1, q), graph


@settings(max_examples=12, deadline=None)
@given(nq=st.integers(1, 17), extra=st.integers(1, 60), left=st.integers(0, 30),
       masked=st.booleans(), kernel=st.sampled_from(["reference", "triton"]))
def test_a_decode_step_without_a_pyramid_is_dense_whatever_dense_tail(nq, extra, left, masked,
                                                                     kernel):
    """With no persistent pyramid a decode step (at most 16 queries after a cache) is dense
    SDPA even with ``dense_tail=0``: a selection rebuilt per step reads every key, as dense
    does, and was slower; it was also not aligned to a left-padded row's first token (a new
    user's finding). 17 queries are no decode step: lossy, they differ from dense. Causal with
    the cache's offset, with and without a left-padding key mask; the reference and the
    Triton interpreter."""
    from pisa_compile import pisa_attention, plan
    from pisa_compile.kernels import dispatch
    cfg = PisaConfig(min_seq_len=0, block_size=8, top_k=1, query_tile=8, sink_blocks=0,
                     local_blocks=1, dense_tail=0, kernel=kernel)
    g = torch.Generator().manual_seed(nq * 1000 + extra)
    nk = nq + extra + 64
    q = torch.randn(2, 4, nq, 16, generator=g)
    k, v = (torch.randn(2, 2, nk, 16, generator=g) for _ in range(2))
    km = None
    if masked:
        km = torch.ones(2, nk, dtype=torch.bool)
        km[1, :left] = False
    kw = dict(is_causal=True, causal_offset=nk - nq, key_mask=km, config=cfg)
    out = pisa_attention(q, k, v, enable_gqa=True, **kw)
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(2, nq, nk, True, nk - nq, km), enable_gqa=True)
    how = plan(q, k, v, **kw)
    if nq <= 16:
        assert how.reason.startswith(dispatch.DECODE_STEP), how
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        assert how.select is not None, how
        assert (out - want).abs().max() > 1e-3  # lossy: top_k=1 of at least 10 leaves


def test_a_decode_step_is_dense_under_dynamic_shapes():
    """Compiled with a symbolic cache length (``dynamic=True``, and automatic dynamic shapes
    after a second length), a 4-query step is still a decode step: the static query count
    guards on the keys outnumbering it (a review found it sparse there, 1.03-1.85 from dense,
    lossy: ``Nq < Nk`` was never proved for a symbolic ``Nk``)."""
    from pisa_compile import pisa_attention
    cfg = PisaConfig(min_seq_len=0, block_size=8, top_k=1, query_tile=8, sink_blocks=0,
                     local_blocks=1, dense_tail=0, kernel="reference")

    def f(q, k, v):
        return pisa_attention(q, k, v, is_causal=True, causal_offset=k.shape[2] - q.shape[2],
                              enable_gqa=True, config=cfg)

    g = torch.Generator().manual_seed(0)
    for dynamic in (True, None):
        torch._dynamo.reset()
        cf = torch.compile(f, backend="eager", dynamic=dynamic)
        for nk in (80, 96, 120):
            q = torch.randn(1, 4, 4, 16, generator=g)
            k, v = (torch.randn(1, 2, nk, 16, generator=g) for _ in range(2))
            want = F.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.ones(4, nk, dtype=torch.bool).tril(nk - 4),
                enable_gqa=True)
            torch.testing.assert_close(cf(q, k, v), want, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
