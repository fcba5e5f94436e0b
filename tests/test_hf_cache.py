"""``generate(past_key_values=PisaCache(...))`` on a model compiled with ``backend="pisa"``: the
decode steps run the persistent pyramid's sparse decode (a counter says so), and in the exact
regime the greedy tokens are dense attention's (tiny Llama, Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest

from tests.interpreter import use_interpreter

use_interpreter()

import torch  # noqa: E402

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("PisaCache needs transformers >= 5", allow_module_level=True)

from pisa_compile import PisaConfig  # noqa: E402
from pisa_compile.hf_cache import PisaCache, PisaLayer  # noqa: E402
from tests.hf_models import tiny_generation_llama  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.mark.parametrize("dense_tail", [64, 0])
def test_generate_with_pisa_cache_decodes_sparsely_and_exactly(fresh_dynamo, dense_tail):
    """Also with ``dense_tail=0`` (a new user's finding: the steps then read their mask at
    run time and selected from scratch, the pyramid unused)."""
    from torch._dynamo.utils import counters
    m = tiny_generation_llama()
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, :7] = 0  # left padding
    new = 5
    dense = m.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False)
    # top_k covers every leaf: the exact regime, so the tokens must be dense's.
    pc = PisaConfig(block_size=4, top_k=64, kernel="triton", min_seq_len=0,
                    dense_tail=dense_tail)
    m.forward = torch.compile(m.forward, backend="pisa", dynamic=True,
                              options=dict(min_seq_len=0, kernel="triton",
                                           dense_tail=dense_tail))
    cache = PisaCache(40 + new, config=pc, sparse_from=0)
    with torch._dynamo.config.patch(recompile_limit=64):
        out = m.generate(input_ids=ids, attention_mask=am, max_new_tokens=new,
                         do_sample=False, past_key_values=cache)
    assert torch.equal(out, dense)
    # Every decode step of both layers read the pyramid (the last token is not decoded).
    assert counters["pisa"]["sparse_decode"] == (new - 1) * 2
    assert cache.get_seq_length() == 40 + new - 1


@pytest.mark.parametrize("padded,model_config", [(False, False), (True, False), (True, True)])
def test_every_decode_step_reads_the_pyramid(fresh_dynamo, padded, model_config):
    """Unpadded (transformers passes no mask for one query) and left-padded batches, B equal
    to the KV heads (a symbol of its own would hide the GQA ratio): every step sparse. With
    ``model_config`` of a model without windows every layer is a ``PisaLayer`` that skips
    the window check."""
    from torch._dynamo.utils import counters
    m = tiny_generation_llama()
    ids = torch.randint(3, 128, (2, 33), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    if padded:
        am[0, :5] = 0
    new = 4
    dense = m.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False)
    pc = PisaConfig(block_size=4, top_k=64, kernel="triton", min_seq_len=0)
    m.forward = torch.compile(m.forward, backend="pisa", dynamic=True,
                              options=dict(min_seq_len=0, kernel="triton"))
    cache = PisaCache(33 + new, config=pc, sparse_from=0,
                      model_config=m.config if model_config else None)
    if model_config:
        assert len(cache.layers) == 2 and all(type(x) is PisaLayer for x in cache.layers)
    with torch._dynamo.config.patch(recompile_limit=64):
        out = m.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False,
                         past_key_values=cache)
    assert all(x.cache.full_attention == model_config for x in cache.layers)
    assert torch.equal(out, dense)
    assert counters["pisa"]["sparse_decode"] == (new - 1) * 2
    assert counters["pisa"]["left_dense"] == 0


def test_a_cache_no_attention_reads_warns_once(fresh_dynamo, monkeypatch):
    """``torch.compile(model)`` then ``generate()`` runs the module's original forward (a
    new user's trial): the decode steps append to the cache and nothing reads its pyramid.
    After 8 such steps the cache says so, once; the recipe that compiles ``model.forward``
    reads the pyramid every step and is not warned."""
    import warnings

    from pisa_compile import kv_cache
    monkeypatch.setattr(kv_cache, "_TOLD_UNREAD", False)
    m = tiny_generation_llama()
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
              do_sample=False)
    pc = PisaConfig(block_size=4, top_k=64, kernel="triton", min_seq_len=0)
    opts = dict(min_seq_len=0, kernel="triton")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(m, backend="pisa", options=opts).generate(
            **kw, past_key_values=PisaCache(40, config=pc, sparse_from=0))
    unread = [w for w in caught if "no attention read the pyramid" in str(w.message)]
    assert len(unread) == 1, [str(w.message) for w in caught]
    monkeypatch.setattr(kv_cache, "_TOLD_UNREAD", False)
    m.forward = torch.compile(m.forward, backend="pisa", dynamic=True, options=opts)
    with warnings.catch_warnings(record=True) as caught, \
            torch._dynamo.config.patch(recompile_limit=64):
        warnings.simplefilter("always")
        m.generate(**kw, past_key_values=PisaCache(40, config=pc, sparse_from=0))
    assert not [w for w in caught if "no attention read the pyramid" in str(w.message)]


def test_sparse_from_off_the_triton_path_warns_that_steps_are_dense(fresh_dynamo,
                                                                    monkeypatch):
    """A new user's finding: ``PisaCache(sparse_from=0)`` with ``kernel="auto"`` on the CPU
    decoded densely (logits bit-identical to a ``DynamicCache``'s, with ``top_k=1``) and
    said nothing, so a quality check measured dense attention. It now warns once, naming
    the reason; without ``sparse_from`` (the cost model's choice) it stays quiet."""
    import warnings

    from pisa_compile.kernels import dispatch
    monkeypatch.setattr(dispatch, "_warned", set())
    m = tiny_generation_llama()
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    kw = dict(input_ids=ids, max_new_tokens=3, do_sample=False)
    lossy = PisaConfig(block_size=4, top_k=1, sink_blocks=0, local_blocks=1, min_seq_len=0,
                       dense_tail=0)

    def told(sparse_from):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m.generate(**kw, past_key_values=PisaCache(40, config=lossy,
                                                       sparse_from=sparse_from))
        return [str(w.message) for w in caught if "decode steps run dense" in str(w.message)]

    assert told(None) == []
    said = told(0)
    assert len(said) == 1 and "cpu tensors" in said[0] and "sparse_from" in said[0], said
    assert told(0) == []  # once


def test_pisa_cache_bad_input():
    with pytest.raises(ValueError, match="max_cache_len"):
        PisaCache(0)
    cache = PisaCache(8, config=PisaConfig(kernel="reference"))
    k = torch.randn(1, 2, 6, 4)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="max_cache_len=8 is too small"):
        cache.update(k, k, 0)
    with pytest.raises(TypeError, match="PisaConfig"):
        PisaCache(8, config={"top_k": 2})
    with pytest.raises(ValueError, match="sparse_from"):
        PisaCache(8, sparse_from=-1)
    with pytest.raises(NotImplementedError, match="crop"):
        cache.layers[0].crop(2)
    with pytest.raises(ValueError, match="max_cache_len"):
        PisaCache(True)
    import numpy as np
    # numpy ints, as PisaStaticCache and transformers' StaticCache take them (a new user's)
    numpy_sized = PisaCache(np.int64(8), config=PisaConfig(kernel="reference"))
    numpy_sized.update(k, k, 0)
    with pytest.raises(ValueError, match="max_cache_len=8 is too small"):
        numpy_sized.update(k, k, 0)


def test_an_encoder_decoder_model_takes_it_inside_encoder_decoder_cache(fresh_dynamo):
    """T5 (random init, greedy, 20 new tokens over a 200-token encoder input, eager): with
    ``EncoderDecoderCache(PisaCache(n), DynamicCache())`` as documented, the tokens equal the
    default cache's, and the PisaCache holds the decoder's own tokens, not the encoder's 200
    (the cache's routing; its sparse decode has the tests above)."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                   num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                   pad_token_id=0, eos_token_id=1, initializer_factor=10.0)
    m = T5ForConditionalGeneration(cfg).eval()
    ids = torch.randint(2, 128, (2, 200))
    kw = dict(input_ids=ids, max_new_tokens=20, do_sample=False)
    pisa = PisaCache(64, config=PisaConfig(kernel="reference"))
    with torch.no_grad():
        ref = m.generate(**kw)
        out = m.generate(**kw, past_key_values=EncoderDecoderCache(pisa,
                                                                   DynamicCache(config=cfg)))
    assert torch.equal(out, ref)
    assert pisa.get_seq_length() == out.shape[1] - 1  # the decoder's own tokens, not 200


def _tiny_mistral(window: int):
    """A seeded random-init Mistral whose every layer has a ``window``-token sliding window
    (2 layers, 4 query and 2 KV heads of 16, SDPA)."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=512, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2, sliding_window=window)
    cfg._attn_implementation = "sdpa"
    return transformers.MistralForCausalLM(cfg).eval()


@pytest.mark.parametrize("prompt,model_config,beams",
                         [(100, False, 1), (12, False, 1), (100, True, 1), (100, False, 2)])
def test_window_layers_are_never_selected_inside(fresh_dynamo, prompt, model_config, beams):
    """A new user's finding: ``PisaCache`` took a sliding window's decode mask for padding and
    selected inside the window (top_k=1: scores 0.25-0.74 from dense, other tokens). With
    ``model_config`` the window layers are transformers' own; without it the prefill's
    window mask (a prompt past the window) or a step's moved window start (a prompt inside
    it, 30 tokens past it) turns the layer's steps dense before any sparse step selects
    inside a window. ``top_k=1`` of 4-key blocks is lossy wherever it selects; the prompt
    inside the window takes ``top_k=64`` (exact, sparse until the window's start first
    moves: lengths 13 to 24, 12 steps a layer, then dense). Beam search (a review's
    finding) reorders the cache after every forward: the window found stays found."""
    from torch._dynamo.utils import counters
    from transformers.cache_utils import DynamicSlidingWindowLayer
    window, new = 24, (8 if prompt > 24 else 30)
    m = _tiny_mistral(window)
    ids = torch.randint(3, 128, (2, prompt), generator=torch.Generator().manual_seed(3))
    am = torch.ones_like(ids)
    am[1, :5] = 0
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False,
              output_scores=True, return_dict_in_generate=True, num_beams=beams)
    dense = m.generate(**kw)
    inside = prompt < window and not model_config
    pc = PisaConfig(block_size=4, top_k=64 if inside else 1, local_blocks=1, kernel="triton",
                    min_seq_len=0)
    m.forward = torch.compile(m.forward, backend="pisa", dynamic=True,
                              options=dict(min_seq_len=0, kernel="triton", block_size=4))
    cache = PisaCache(prompt + new, config=pc, sparse_from=0,
                      model_config=m.config if model_config else None)
    with torch._dynamo.config.patch(recompile_limit=64):
        out = m.generate(**kw, past_key_values=cache)
    assert torch.equal(out.sequences, dense.sequences)
    for a, b in zip(out.scores, dense.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert counters["pisa"]["sparse_decode"] == (12 * 2 if inside else 0)
    if model_config:
        assert all(type(layer) is DynamicSlidingWindowLayer for layer in cache.layers)
    else:
        assert all(layer.cache.not_padding for layer in cache.layers)


def test_a_deep_copy_decodes_from_its_own_pyramid(fresh_dynamo):
    """transformers' prompt reuse deep-copies a prefilled cache (a new user's finding: the
    copy's buffers were not registered, so its steps ran dense, silently): the copy's
    continuation decodes sparsely and equals the original's."""
    import copy
    from torch._dynamo.utils import counters
    m = tiny_generation_llama()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    pc = PisaConfig(block_size=4, top_k=2, kernel="triton", min_seq_len=0)  # lossy: sparse
    m.forward = torch.compile(m.forward, backend="pisa", dynamic=True,
                              options=dict(min_seq_len=0, kernel="triton"))
    cache = PisaCache(60, config=pc, sparse_from=0)
    kw = dict(max_new_tokens=5, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    with torch._dynamo.config.patch(recompile_limit=64), torch.no_grad():
        m(ids, past_key_values=cache)  # prefill the shared prompt
        twin = copy.deepcopy(cache)
        more = torch.cat([ids, torch.randint(3, 128, (1, 3))], dim=1)
        counters.clear()
        a = m.generate(input_ids=more, past_key_values=cache, **kw)
        from_original = counters["pisa"]["sparse_decode"]
        counters.clear()
        b = m.generate(input_ids=more, past_key_values=twin, **kw)
    assert from_original > 0 and counters["pisa"]["sparse_decode"] == from_original
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(x, y)


def test_pisa_cache_is_not_croppable_and_its_batch_is_fixed():
    """A new user's findings: transformers checks ``is_croppable`` before assisted decoding
    (then ``crop`` raised after the prefill), and a new batch size after ``reset()`` failed
    with an internal class's shape message."""
    cache = PisaCache(16, config=PisaConfig(kernel="reference"))
    k = torch.randn(2, 2, 6, 4)
    cache.update(k, k, 0)
    assert cache.is_croppable is False
    cache.reset()
    with pytest.raises(ValueError, match="batch 2.*fixed"):
        cache.update(k[:1], k[:1], 0)
    with pytest.raises(ValueError, match="got a LlamaConfig"):
        PisaCache(tiny_generation_llama().config, 8)
    with pytest.raises(TypeError, match="model_config"):
        PisaCache(8, model_config={"sliding_window": 4})
    import numpy as np
    PisaCache(8, sparse_from=np.int64(4))  # numpy ints, as max_cache_len takes them


def _layer_step(layer, mask, window=None):
    """One decode step on a bare ``PisaLayer``: append a token, decode one query under
    ``mask`` extended by the new key (or under the last ``window`` keys). Returns the
    extended mask and the sparse output (None: the step ran dense)."""
    c = layer.cache
    B, H, _, D = c.keys.shape
    kk = torch.randn(B, H, 1, D)
    layer.update(kk, kk)
    n = c.length
    if window is not None:
        mask = (torch.arange(n) >= n - window).expand(B, n)
    else:
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.bool)], 1)
    out = c.decode(torch.randn(B, H, 1, D), c.keys[:, :, :n], c.values[:, :, :n], mask, n - 1,
                   D ** -0.5)
    return mask, out


def test_a_second_prompt_with_padding_of_its_own_stays_sparse():
    """A review's finding: a second generate() on the same cache with a new left-padded
    segment per row (batched multi-turn) hid keys the cache had taken as real, and the layer
    went dense for good ("a sliding window?"). The segment's padding is now adopted from the
    next step's mask, and the pyramid rebuilt over it."""
    torch.manual_seed(0)
    B, H, D = 2, 1, 16
    layer = PisaLayer(64, PisaConfig(block_size=4, top_k=64, kernel="triton", min_seq_len=0),
                      0)
    am = torch.ones(B, 20, dtype=torch.bool)
    am[1, :5] = False
    k = torch.randn(B, H, 20, D)
    layer.update(k, k)
    for _ in range(3):
        am, out = _layer_step(layer, am)
        assert out is not None
    seg = torch.ones(B, 4, dtype=torch.bool)
    seg[0, :2] = False  # the new prompt's own left padding
    k = torch.randn(B, H, 4, D)
    layer.update(k, k)
    for _ in range(2):
        am, out = _layer_step(layer, torch.cat([am, seg], 1) if seg is not None else am)
        seg = None
        assert out is not None and layer.cache.not_padding is None
    torch.testing.assert_close(layer.cache.key_mask[:, :am.shape[1]], am)


def test_beam_reordering_keeps_a_window_found():
    """A review's finding: transformers reorders the cache after every forward under beam
    search, and the reorder's reset forgot a window found at the prefill, so the next step
    selected inside it."""
    torch.manual_seed(0)
    B, H, D = 2, 1, 16
    layer = PisaLayer(64, PisaConfig(block_size=4, top_k=1, local_blocks=1, kernel="triton",
                                     min_seq_len=0), 0)
    k = torch.randn(B, H, 20, D)
    layer.update(k, k)
    layer.cache.mark_not_padding("a window (test)")
    assert _layer_step(layer, None, window=8)[1] is None
    layer.reorder_cache(torch.arange(B))
    assert layer.cache.not_padding == "a window (test)"
    assert _layer_step(layer, None, window=8)[1] is None


def test_only_a_window_like_prefill_mask_marks_a_cache():
    """A review's finding: any mask read at run time that was not causal padding marked the
    cache, so a prefix-LM's bidirectional prefix or image blocks (their decode rows are
    causal padding) lost sparse decode. Only a last row that hides a key an earlier row
    sees (a window) marks it."""
    from pisa_compile.ops import _hides_seen_keys
    n = 12
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = j <= i
    prefix = causal | (j < 5)  # bidirectional over a 5-token prefix
    window = causal & (j > i - 4)
    assert not _hides_seen_keys(causal[None, None])
    assert not _hides_seen_keys(prefix[None, None])
    assert _hides_seen_keys(window[None, None])
    fill = torch.finfo(torch.float32).min
    assert _hides_seen_keys(torch.zeros(1, 1, n, n).masked_fill(~window, fill))
    assert not _hides_seen_keys(torch.zeros(1, 1, n, n).masked_fill(~prefix, float("-inf")))
