"""The static cache's persistent pyramid (``PisaStaticKVCache``, ``PisaStaticCache``): its
length lives on the device, so the update and the decode selection read no host length.

In Triton's interpreter (CPU, fp32): the pyramid after appends at a device length equals the
pyramid built from scratch; a decode step over the whole static buffer selects what the
growing cache (``PisaKVCache``, host length) selects over its filled part, and attends what
the reference attends under that selection; ``generate()`` with ``PisaStaticCache`` decodes
every step from the pyramid and, in the exact regime, gives dense attention's tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.interpreter import use_interpreter

use_interpreter()

import torch  # noqa: E402

pytest.importorskip("triton")
from hypothesis import given, settings, strategies as st  # noqa: E402

from pisa_compile import PisaConfig, PisaKVCache  # noqa: E402
from pisa_compile.kernels import reference as ref  # noqa: E402
from pisa_compile.kv_cache import PisaStaticKVCache  # noqa: E402
from tests.pyramid_check import assert_pyramid_is_scratch  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # log2(0), interpreter
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def _cfg(**kw):
    base = dict(block_size=4, top_k=2, branching=2, beam=2, sink_blocks=1, local_blocks=1,
                shortlist=None, kernel="triton", min_seq_len=0)
    return PisaConfig(**{**base, **kw})


def _static(B, Hkv, cap, D, config):
    keys = torch.zeros(B, Hkv, cap, D)
    return PisaStaticKVCache(keys, torch.zeros_like(keys), torch.zeros((), dtype=torch.long),
                             config=config, sparse_from=0)


def _assert_capacity_counts(cache: PisaStaticKVCache):
    """Every node of every capacity level counts the keys it holds below the length, and a
    node past it holds none (the static decode walks the capacity's levels)."""
    from pisa_compile.kernels.geometry import level_sizes
    p, n = cache.pyramid, int(cache.length)
    span = p.block_size
    for lev, (off, size) in enumerate(zip(p.level_offsets(), level_sizes(
            p.capacity, p.block_size, p.branching, p.beam))):
        start = torch.arange(size) * span
        want = (n - start).clamp(0, span).float()
        got = p.cnt[:, :, off:off + size]
        assert torch.equal(got, want.expand_as(got)), f"level {lev} after {n} keys"
        span *= p.branching


def _as_grown(cache: PisaStaticKVCache):
    """What ``assert_pyramid_is_scratch`` reads, with the device length read back."""
    return SimpleNamespace(pyramid=cache.pyramid, length=int(cache.length), key_mask=None,
                           keys=cache.keys)


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), C=st.sampled_from([4, 8]),
       g=st.sampled_from([2, 3]), beam=st.integers(1, 3),
       chunks=st.lists(st.integers(1, 37), min_size=1, max_size=6), seed=st.integers(0, 2 ** 16))
def test_pyramid_after_device_length_appends_equals_scratch(B, Hkv, C, g, beam, chunks, seed):
    """Over lengths, chunk sizes that cross leaf and node boundaries, batch sizes: each
    level's launch covers the most nodes a chunk can touch and stores only the touched ones."""
    gen = torch.Generator().manual_seed(seed)
    cap = sum(chunks) + int(torch.randint(0, 9, (1,), generator=gen))
    cache = _static(B, Hkv, cap, 8, _cfg(block_size=C, branching=g, beam=beam, top_k=1))
    for n in chunks:
        cache.append(torch.randn(B, Hkv, n, 8, generator=gen),
                     torch.randn(B, Hkv, n, 8, generator=gen))
        assert_pyramid_is_scratch(_as_grown(cache))
        _assert_capacity_counts(cache)
    assert int(cache.length) == sum(chunks)


def test_append_writes_at_the_device_length():
    cache = _static(1, 2, 20, 4, _cfg())
    k = torch.randn(1, 2, 20, 4)
    cache.append(k[:, :, :7], -k[:, :, :7])
    cache.append(k[:, :, 7:8], -k[:, :, 7:8])
    assert int(cache.length) == 8
    assert torch.equal(cache.keys[:, :, :8], k[:, :, :8])
    assert torch.equal(cache.values[:, :, :8], -k[:, :, :8])
    assert not cache.keys[:, :, 8:].any()


@pytest.mark.parametrize("flat_leaves", [0, 512])
def test_decode_selects_and_attends_as_the_growing_cache(flat_leaves):
    """The static step (whole buffer, live keys masked, offset read on the device) picks the
    growing cache's blocks (filled view, host offset), through the walk and the flat ranking,
    and attends what the reference attends under them."""
    gen = torch.Generator().manual_seed(3)
    B, Hkv, G, D, n0, steps, cap = 2, 2, 3, 16, 61, 5, 80
    cfg = _cfg(flat_leaves=flat_leaves)
    grown = PisaKVCache(B, Hkv, cap, D, dtype=torch.float32, device="cpu", config=cfg,
                        sparse_from=0)
    static = _static(B, Hkv, cap, D, cfg)
    k, v = torch.randn(B, Hkv, cap, D, generator=gen), torch.randn(B, Hkv, cap, D, generator=gen)
    q = torch.randn(B, Hkv * G, cap, D, generator=gen)
    for s in range(steps):
        n = n0 + s
        lo = 0 if s == 0 else n - 1
        grown.append(k[:, :, lo:n], v[:, :, lo:n])
        static.append(k[:, :, lo:n], v[:, :, lo:n])
        qs = q[:, :, n - 1:n]
        want_idx, want_cnt = grown.select(qs, scale=0.25)
        out = static.decode(qs, static.keys, static.values, None, 0, 0.25)
        assert out is not None
        live = torch.arange(cap) < n
        from pisa_compile.kernels import triton_select
        idx, cnt = triton_select.select_blocks(
            qs, static.keys, True, 0.25, key_mask=live.expand(B, cap), pyramid=static.pyramid,
            key_length=static.length, **static.decode_config.selection_options())
        assert torch.equal(cnt, want_cnt), f"step {s}"
        for b in range(B):
            for h in range(Hkv):
                c = int(cnt[b, h, 0])
                assert torch.equal(idx[b, h, 0, :c], want_idx[b, h, 0, :c]), f"step {s}"
        ref_out, _ = ref.sparse_attention(qs, k[:, :, :n], v[:, :, :n], None, True, 0.25,
                                          want_idx, want_cnt, block_size=4, query_tile=1,
                                          causal_offset=n - 1)
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)


def test_rebuild_after_a_crop_forgets_the_cut_keys():
    gen = torch.Generator().manual_seed(5)
    cache = _static(1, 2, 48, 8, _cfg(block_size=4, branching=2, beam=1))
    cache.append(torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 40, 8))
    cache.length.sub_(6)  # transformers' StaticLayer.crop(-6)
    cache.rebuild()
    _assert_capacity_counts(cache)
    cache.append(torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 3, 8))
    assert_pyramid_is_scratch(_as_grown(cache))
    _assert_capacity_counts(cache)


def test_cost_model_reads_the_static_row(monkeypatch, caplog):
    """Without ``sparse_from`` a static cache in CUDA graphs keeps a pyramid from the
    ``"static"`` row's bytes of K/V (its dense step reads every slot under a mask), not the
    growing cache's ``"graph"`` row; without graphs, from the ``"eager"`` row; never below
    ``min_seq_len``. The
    thresholds are scaled down here to capacities a CPU test holds."""
    from pisa_compile import kv_cache
    per_key = 1 * 2 * (8 + 8) * 4  # B * Hkv * (D + Dv) * itemsize
    rows = {"graph": 1000 * per_key, "eager": 2000 * per_key, "static": 64 * per_key}
    for table in ("SPARSE_DECODE_BYTES", "SPARSE_DECODE_BYTES_FLAT"):
        monkeypatch.setattr(kv_cache, table, rows)
    # Below min_seq_len the backend leaves the sites dense: no pyramid, whatever the bytes,
    # and the user is told once.
    monkeypatch.setattr(kv_cache, "_TOLD_MIN_SEQ_LEN", False)
    for cap, graph, min_len, kept in ((63, True, 0, False), (64, True, 0, True),
                                      (64, False, 0, False), (64, True, 65, False),
                                      (64, True, 65, False)):
        keys = torch.zeros(1, 2, cap, 8)
        with caplog.at_level("WARNING", logger="pisa_compile"):
            cache = PisaStaticKVCache(keys, torch.zeros_like(keys),
                                      torch.zeros((), dtype=torch.long),
                                      config=_cfg(min_seq_len=min_len), cuda_graph=graph)
        assert (cache.pyramid is not None) == kept, (cap, graph, min_len)
    told = [r for r in caplog.records if "lower pisa_config's min_seq_len" in r.getMessage()]
    assert len(told) == 1, caplog.records


def test_no_pyramid_where_dense_is_cheaper():
    keys = torch.zeros(1, 2, 64, 8)
    cache = PisaStaticKVCache(keys, torch.zeros_like(keys), torch.zeros((), dtype=torch.long),
                              config=_cfg(), sparse_from=65)
    assert cache.pyramid is None
    cache.append(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8))
    assert int(cache.length) == 3 and cache.keys[:, :, :3].eq(1).all()
    q = torch.randn(1, 4, 1, 8)
    assert cache.decode(q, keys, cache.values, None, 0, 0.3) is None  # the caller runs dense


def test_bad_input_names_the_argument():
    keys = torch.zeros(1, 2, 16, 8)
    with pytest.raises(ValueError, match="length must be one int64"):
        PisaStaticKVCache(keys, keys.clone(), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="keys and values"):
        PisaStaticKVCache(keys, torch.zeros(1, 2, 15, 8), torch.zeros((), dtype=torch.long))
    with pytest.raises(TypeError, match="PisaConfig"):
        PisaStaticKVCache(keys, keys.clone(), torch.zeros((), dtype=torch.long), config={})
    with pytest.raises(ValueError, match="length must be one int64"):
        PisaStaticKVCache(keys, keys.clone(), torch.zeros((), dtype=torch.int32))
    with pytest.raises(TypeError, match="length must be a torch.Tensor"):
        PisaStaticKVCache(keys, keys.clone(), 0)
    with pytest.raises(ValueError, match="floating buffers of one dtype"):
        PisaStaticKVCache(keys.long(), keys.long(), torch.zeros((), dtype=torch.long))
    with pytest.raises(ValueError, match="floating buffers of one dtype"):
        PisaStaticKVCache(keys, keys.half(), torch.zeros((), dtype=torch.long))
    from pisa_compile.kernels.triton_pyramid import append_boxes_at
    cache = _static(1, 2, 16, 8, _cfg())
    with pytest.raises(ValueError, match="n_new"):
        append_boxes_at(cache.pyramid, cache.keys, cache.length, 0)
    with pytest.raises(ValueError, match=r"key must be \[B=1, Hkv=2, n, 8\]"):
        cache.append(torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8))
    with pytest.raises(ValueError, match="value must be"):
        cache.append(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8, dtype=torch.float16))
    cache.append(torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8))  # nothing to write
    assert int(cache.length) == 0


# -- generate() --

transformers = pytest.importorskip("transformers")
from tests.hf_models import tiny_generation_llama  # noqa: E402


@pytest.mark.parametrize("padded", [False, True])
def test_generate_with_a_static_cache_decodes_from_the_pyramid(fresh_dynamo, padded):
    """Every decode step of both layers reads the pyramid, the greedy tokens are dense's
    (``top_k`` covers every leaf: the exact regime), and the cache serves a second call
    after ``reset()`` with the same tokens."""
    from torch._dynamo.utils import counters

    from pisa_compile.hf_cache import PisaStaticCache, PisaStaticLayer
    m = tiny_generation_llama()
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    if padded:
        am[1, :7] = 0  # left padding
    new = 5
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False)
    dense = m.generate(**kw)
    pc = PisaConfig(block_size=4, top_k=64, kernel="triton", min_seq_len=0)
    m.forward = torch.compile(m.forward, backend="pisa",
                              options=dict(min_seq_len=0, kernel="triton"))
    cache = PisaStaticCache(m.config, 40 + new + 3, pisa_config=pc, sparse_from=0)
    assert all(type(layer) is PisaStaticLayer for layer in cache.layers)
    out = m.generate(**kw, past_key_values=cache)
    assert torch.equal(out, dense)
    assert counters["pisa"]["sparse_decode"] == (new - 1) * 2
    assert int(cache.get_seq_length()) == 40 + new - 1
    cache.reset()
    assert int(cache.get_seq_length()) == 0
    assert torch.equal(m.generate(**kw, past_key_values=cache), dense)


def test_static_cache_bad_input():
    from pisa_compile.hf_cache import PisaStaticCache
    m = tiny_generation_llama()
    with pytest.raises(ValueError, match="max_cache_len"):
        PisaStaticCache(m.config, 0)
    with pytest.raises(ValueError, match="max_cache_len"):
        PisaStaticCache(m.config, 8.0)
    import numpy as np
    assert PisaStaticCache(m.config, np.int64(8)).layers[0].max_cache_len == 8  # as StaticCache
    with pytest.raises(TypeError, match="PisaConfig"):
        PisaStaticCache(m.config, 8, pisa_config={"top_k": 2})
    with pytest.raises(ValueError, match="sparse_from"):
        PisaStaticCache(m.config, 8, sparse_from=-1)
    with pytest.raises(NotImplementedError, match="beam search"):
        PisaStaticCache(m.config, 8).layers[0].reorder_cache(torch.tensor([0]))
    with pytest.raises(ValueError, match="offloading"):
        PisaStaticCache(m.config, 8, offloading=True)


def test_static_layer_crop_rebuilds_the_pyramid():
    from pisa_compile.hf_cache import PisaStaticCache
    cache = PisaStaticCache(tiny_generation_llama().config, 48, sparse_from=0,
                            pisa_config=_cfg())
    layer = cache.layers[0]
    k = torch.randn(1, 2, 40, 16)
    layer.update(k, k)
    layer.crop(-6)
    assert int(layer.cumulative_length) == 34
    _assert_capacity_counts(layer.pisa)
    assert_pyramid_is_scratch(_as_grown(layer.pisa))


def test_static_cache_refuses_misplaced_arguments_and_a_long_prompt():
    from pisa_compile.hf_cache import PisaStaticCache
    m = tiny_generation_llama()
    with pytest.raises(TypeError, match="model's config"):
        PisaStaticCache(PisaConfig(), 48)
    with pytest.raises(TypeError, match="PisaConfig options"):
        PisaStaticCache(m.config, 48, top_k=4)
    # StaticCache drops keywords it does not know: a misspelt option was lost silently (a
    # new user's finding). StaticCache's own and its legacy ones still pass.
    with pytest.raises(TypeError, match="'sparse_form' .did you mean 'sparse_from'"):
        PisaStaticCache(m.config, 48, sparse_form=0)
    with pytest.raises(TypeError, match="'pisa_cfg' .did you mean 'pisa_config'"):
        PisaStaticCache(m.config, 48, pisa_cfg=PisaConfig())
    PisaStaticCache(m.config, 48, max_batch_size=1, offload_only_non_sliding=True)
    with pytest.raises(TypeError, match="pisa_config must be a PisaConfig"):
        PisaStaticCache(m.config, 48, pisa_config={"top_k": 2})
    with pytest.raises(ValueError, match="got a LlamaConfig$"):  # swapped: no JSON dump
        PisaStaticCache(8, m.config)
    import numpy as np
    PisaStaticCache(m.config, 48, sparse_from=np.int64(4))
    cache = PisaStaticCache(m.config, 8)
    k = torch.zeros(1, 2, 9, 16)
    with pytest.raises(ValueError, match="max_cache_len=8 is too small"):
        cache.layers[0].update(k, k)
    # A prompt that fits, then steps past the end: named, not index_copy_'s IndexError.
    cache.layers[0].update(k[:, :, :6], k[:, :, :6])
    cache.layers[0].update(k[:, :, :2], k[:, :, :2])
    with pytest.raises(ValueError, match=r"1 key\(s\) after 8 overflow max_cache_len=8"):
        cache.layers[0].update(k[:, :, :1], k[:, :, :1])
    assert int(cache.layers[0].cumulative_length) == 8  # the failed step wrote nothing


def test_an_eager_overflow_is_named_and_a_compiled_step_reads_no_length():
    """Eager appends count the keys on the host, so an overflow is a ValueError before any
    write; a compiled append traces in one graph (fullgraph: the flag it clears is a replayed
    store, not a break) and reads no length, and the next eager append reads the device
    length once, so an overflow after compiled steps is still named."""
    cache = _static(1, 2, 16, 8, _cfg())
    k = torch.randn(1, 2, 16, 8)
    cache.append(k[:, :, :12], k[:, :, :12])
    with pytest.raises(ValueError, match=r"5 key\(s\) after 12 overflow max_cache_len=16"):
        cache.append(k[:, :, :5], k[:, :, :5])
    assert int(cache.length) == 12  # nothing written
    step = torch.compile(cache.append, backend="eager", fullgraph=True)
    for i in range(4):
        step(k[:, :, i:i + 1], k[:, :, i:i + 1])
    assert int(cache.length) == 16
    with pytest.raises(ValueError, match="after 16 overflow"):
        cache.append(k[:, :, :1], k[:, :, :1])
    cache.length.zero_()
    cache.reset()
    cache.append(k, k)  # the whole capacity again after a reset
    assert int(cache.length) == 16
    with pytest.raises(IndexError):  # compiled: no host check, index_copy_'s own error
        step(k[:, :, :1], k[:, :, :1])


def test_a_deep_copy_registers_its_own_buffers():
    """transformers' prompt reuse deep-copies a prefilled cache: the copy's steps must find
    their own pyramid."""
    import copy

    from pisa_compile.hf_cache import PisaStaticCache
    from pisa_compile.kernels import persistent
    cache = PisaStaticCache(tiny_generation_llama().config, 48, sparse_from=0,
                            pisa_config=_cfg())
    k = torch.randn(1, 2, 20, 16)
    for layer in cache.layers:
        layer.update(k, k)
    dup = copy.deepcopy(cache)
    for old, new in zip(cache.layers, dup.layers):
        assert new.keys.data_ptr() != old.keys.data_ptr()
        assert new.pisa.keys is new.keys and new.pisa.length is new.cumulative_length
        assert persistent.lookup(new.keys) is new.pisa
        assert persistent.lookup(old.keys) is old.pisa
