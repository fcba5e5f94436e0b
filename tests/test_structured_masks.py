"""Structured masks on the op: a key mask ``[B, Nk]`` (padding) and a causal offset (a KV
cache), read by the kernels per key instead of as an ``Nq x Nk`` mask (issue #14).

Properties, on the reference path (the Triton kernels are diffed against it in
``test_triton_select.py`` / ``test_triton_attention.py``): the exact regime equals dense
attention under the mask the structure stands for; sparse output equals dense under the
selection; padded keys and keys past a row's causal position never reach that row
(bit-identical outputs when they change); bad arguments name themselves.
"""

from __future__ import annotations

import math
import unittest.mock

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import pisa_compile
from pisa_compile import PisaConfig, pisa_attention, select_blocks
from pisa_compile.kernels.geometry import dense_mask
from pisa_compile.kernels.reference import dense_attention
from pisa_compile.ops import is_decode_step
from tests.strategies import selection_mask, sparse_configs

EXACT = PisaConfig(block_size=16, top_k=64, min_seq_len=0, kernel="reference")


@st.composite
def structured(draw, max_n: int = 200):
    """``(q, k, v, key_mask, is_causal, causal_offset)``: left or right padding per batch row,
    and a causal offset up to ``Nk - 1`` (queries at the end of a cache, or in its middle)."""
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3, 7]))
    Nk = draw(st.integers(1, max_n))
    causal = draw(st.booleans())
    Nq = draw(st.integers(1, Nk)) if causal else draw(st.integers(1, max_n))
    off = draw(st.integers(0, Nk - 1)) if causal else 0
    D = draw(st.sampled_from([16, 32]))
    pads = [draw(st.integers(0, Nk)) for _ in range(B)]
    left = draw(st.booleans())
    pos = torch.arange(Nk)[None, :]
    pad = torch.tensor(pads)[:, None]
    key_mask = pos >= pad if left else pos < Nk - pad
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, Hkv * G, Nq, D, generator=gen)
    k = torch.randn(B, Hkv, Nk, D, generator=gen)
    v = torch.randn(B, Hkv, Nk, D, generator=gen)
    return q, k, v, key_mask, causal, off


def _run(case, cfg):
    q, k, v, km, causal, off = case
    return pisa_attention(q, k, v, is_causal=causal, enable_gqa=True, config=cfg, key_mask=km,
                          causal_offset=off)


def _dense(case, extra=None):
    q, k, v, km, causal, off = case
    vis = dense_mask(q.shape[0], q.shape[2], k.shape[2], causal, off, km)
    if extra is not None:
        vis = vis & extra
    return dense_attention(q.double(), k.double(), v.double(), attn_mask=vis).float()


@settings(max_examples=40, deadline=None)
@given(case=structured())
def test_exact_regime_equals_dense(case):
    torch.testing.assert_close(_run(case, EXACT), _dense(case), atol=2e-5, rtol=2e-5)


@settings(max_examples=40, deadline=None)
@given(case=structured(), cfg=sparse_configs())
def test_sparse_equals_dense_under_the_selection(case, cfg):
    q, k, v, km, causal, off = case
    bi, _ = select_blocks(q, k, is_causal=causal, enable_gqa=True, config=cfg, key_mask=km,
                          causal_offset=off)
    sel = selection_mask(bi, q.shape[2], k.shape[2], cfg, q.shape[1] // k.shape[1])
    torch.testing.assert_close(_run(case, cfg), _dense(case, sel), atol=2e-5, rtol=2e-5)


@settings(max_examples=40, deadline=None)
@given(case=structured(), cfg=sparse_configs(), data=st.data())
def test_padded_and_future_keys_do_not_leak(case, cfg, data):
    """Noise in padded keys changes nothing; noise in keys past position ``i + offset``
    changes no output at or before query ``i``."""
    q, k, v, km, causal, off = case
    out = _run(case, cfg)
    pad = ~km[:, None, :, None]
    k2 = torch.where(pad, torch.randn_like(k) * 10, k)
    v2 = torch.where(pad, torch.randn_like(v) * 10, v)
    assert torch.equal(_run((q, k2, v2, km, causal, off), cfg), out)
    if causal:
        i = data.draw(st.integers(0, q.shape[2] - 1))
        k3, v3 = k.clone(), v.clone()
        k3[:, :, i + off + 1:] = torch.randn_like(k3[:, :, i + off + 1:]) * 10
        v3[:, :, i + off + 1:] = torch.randn_like(v3[:, :, i + off + 1:]) * 10
        out3 = _run((q, k3, v3, km, causal, off), cfg)
        assert torch.equal(out3[:, :, : i + 1], out[:, :, : i + 1])


@settings(max_examples=40, deadline=None)
@given(case=structured(), cfg=sparse_configs())
def test_an_explicit_mask_selects_as_its_structure(case, cfg):
    """The same mask as an ``Nq x Nk`` tensor (what a graph break hands the op) and as
    structure give the same output on every row that sees a key: in particular a left-padded
    row's sink leaves start at its first real key under both (they once stayed at leaf 0,
    all padding, under the tensor). A tensor carries no query positions: the op places the
    queries last (offset ``Nk - Nq``), so the causal offset here is that one. Not for a
    non-causal call with fewer queries than keys: as a key mask it is cross-attention (no
    local leaves), as a tensor it may be a cache's causal mask (local leaves at the end)."""
    q, k, v, km, causal, _ = case
    assume(causal or q.shape[2] >= k.shape[2] or is_decode_step(q.shape[2], k.shape[2]))
    off = k.shape[2] - q.shape[2] if causal else 0
    case = (q, k, v, km, causal, off)
    vis = dense_mask(q.shape[0], q.shape[2], k.shape[2], causal, off, km)  # [B, 1, Nq, Nk]
    explicit = pisa_attention(q, k, v, attn_mask=vis, enable_gqa=True, config=cfg)
    rows = vis.any(-1, keepdim=True).expand_as(explicit)
    torch.testing.assert_close(explicit[rows], _run(case, cfg)[rows], atol=2e-5, rtol=2e-5)


@settings(max_examples=25, deadline=None)
@given(case=structured(), cfg=sparse_configs())
def test_nan_in_padded_keys_reaches_no_output_or_gradient(case, cfg):
    """NaN in padded keys and values (a cache's garbage) leaves every output and gradient as
    it was: the reference multiplies no hidden key by its zero weight (0 * NaN is NaN), as
    the Triton kernels never load one. (A new user's finding, December 2026.)"""
    q, k, v, km, causal, off = case
    # A decode step runs dense SDPA, which spreads a masked value's NaN as SDPA and Inductor
    # do (0 * NaN; docs/limits.md): the promise is the sparse path's.
    assume(not is_decode_step(q.shape[2], k.shape[2]))
    pad = ~km[:, None, :, None]

    def run(k_, v_):
        leaves = [t.clone().requires_grad_() for t in (q, k_, v_)]
        out = _run((*leaves, km, causal, off), cfg)
        out.sum().backward()
        return out.detach(), *(t.grad for t in leaves)

    want = run(k, v)
    got = run(torch.where(pad, float("nan"), k), torch.where(pad, float("nan"), v))
    live = km[:, None, :, None].expand_as(k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2][live], want[2][live]) and torch.equal(got[3][live], want[3][live])


def test_short_sequences_run_dense_with_the_same_mask():
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    km = torch.tensor([[1] * 9, [0, 0, 0] + [1] * 6])  # integer, as a tokenizer returns it
    case = (q, k, v, km.bool(), True, 4)
    out = pisa_attention(q, k, v, is_causal=True, enable_gqa=True, key_mask=km,
                         causal_offset=4, config=PisaConfig(min_seq_len=1000))
    torch.testing.assert_close(out, _dense(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(key_mask=torch.ones(2, 9, dtype=torch.bool)), ValueError, r"key_mask must be \[B=1"),
    (dict(key_mask=torch.ones(1, 9)), ValueError, "bool or integer"),
    (dict(key_mask=[[1] * 9]), TypeError, "key_mask must be a Tensor"),
    (dict(key_mask=torch.ones(1, 9, dtype=torch.bool), attn_mask=torch.ones(9, 9).bool()),
     ValueError, "cannot both be set"),
    (dict(causal_offset=-1, is_causal=True), ValueError, "causal_offset must be >= 0"),
    (dict(causal_offset=2), ValueError, "needs is_causal=True"),
    (dict(causal_offset=1.5, is_causal=True), TypeError, "causal_offset must be an int"),
])
def test_bad_structure_names_the_argument(kwargs, err, match):
    q = k = v = torch.randn(1, 2, 9, 16)
    with pytest.raises(err, match=match):
        pisa_attention(q, k, v, config=EXACT, **kwargs)


# -- the pass proves the masks models build ----------------------------------------------------

transformers = pytest.importorskip("transformers")

FAMILIES = {  # tiny configs of each attention family (GQA everywhere, Mistral's window)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4096)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
}
OPTS_EXACT = dict(min_seq_len=0, block_size=16, top_k=64)
OPTS_SPARSE = dict(min_seq_len=0, block_size=8, top_k=1, query_tile=8)


def _tiny(family: str, impl: str, layers: int = 2):
    cfg_name, model_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **extra)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return getattr(transformers, model_name)(cfg).eval()


def _left_padded(B=3, N=70, pads=(0, 9, 33), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (B, N), generator=g)
    am = (torch.arange(N)[None] >= torch.tensor(pads)[:, None]).long()
    return ids, am


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_masks_become_structure(family, impl):
    """transformers' causal-and-padding mask (bool for SDPA, finfo.min for eager) is proved
    from the graph and passed as ``is_causal`` + ``key_mask``: no explicit mask reaches the
    op. Compiled equals eager on every real token (exact regime)."""
    model = _tiny(family, impl)
    ids, am = _left_padded()
    report = pisa_compile.explain(model, ids, attention_mask=am, options=OPTS_EXACT)
    assert report.sites and all(s.rewritten for s in report.sites), str(report)
    assert all(s.mask.endswith("->is_causal+padding") for s in report.sites), str(report)
    assert all("explicit mask" not in s.note for s in report.sites), str(report)
    with torch.no_grad():
        want = model(ids, attention_mask=am).logits
        got = torch.compile(model, backend="pisa", options=OPTS_EXACT)(
            ids, attention_mask=am).logits
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
def test_padding_tokens_do_not_leak_through_the_model():
    """Sparse regime: changing the padding tokens leaves every real token's logits
    bit-identical (they reach no real query, neither in attention nor in the selection)."""
    model = _tiny("qwen2", "sdpa")
    ids, am = _left_padded()
    ids2 = torch.where(am.bool(), ids, (ids * 7 + 3) % 97)
    f = torch.compile(model, backend="pisa", options=OPTS_SPARSE)
    with torch.no_grad():
        a, b = f(ids, attention_mask=am).logits, f(ids2, attention_mask=am).logits
    real = am.bool()
    assert torch.equal(a[real], b[real])
    assert not torch.equal(a[~real], b[~real])  # the padding rows did change


@pytest.mark.usefixtures("fresh_dynamo")
def test_generate_with_left_padding_runs_structure_in_every_step(caplog):
    """generate() after a left-padded prompt: the same tokens as eager dense, and every
    decode step's mask is proved as a causal offset (the cache length) plus padding."""
    import logging
    model = _tiny("qwen2", "sdpa", layers=1)
    ids, am = _left_padded(B=2, N=40, pads=(0, 11))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=am, max_new_tokens=5, do_sample=False)
        model.forward = torch.compile(model.forward, backend="pisa", options=OPTS_EXACT)
        with caplog.at_level(logging.INFO, logger="pisa_compile"):
            got = model.generate(ids, attention_mask=am, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)
    lines = [r.getMessage() for r in caplog.records if "pisa site" in r.getMessage()]
    assert any("->is_causal+padding" in m for m in lines), lines
    assert any("->causal(offset=" in m and "+padding" in m for m in lines), lines
    assert all("mask=bool:" not in m and "explicit mask" not in m for m in lines), lines


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("form", ["view", "eq0_fill", "two_data_masks"])
def test_hand_written_padding_masks(form):
    """``causal & pad[:, None, None, :]`` and ``masked_fill(pad[:, None, None, :] == 0, -inf)``
    on causal scores: structure, equal to eager. Two masked_fills of data masks (not
    structure) are intersected: also equal to eager."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 50, 16, generator=g) for _ in range(3))
    pad = torch.arange(50)[None] >= torch.tensor([0, 13])[:, None]

    def f(q, k, v, pad):
        n = q.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        if form == "view":
            m = causal & pad[:, None, None, :]
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
        s = (q @ k.transpose(-1, -2)) * 0.25
        if form == "two_data_masks":  # pad stands for a random [B, 1, N, N] mask here
            s = s.masked_fill(~causal, float("-inf")).masked_fill(~pad, float("-inf"))
            return s.softmax(-1) @ v
        s = s.masked_fill(~causal, float("-inf")).masked_fill(pad[:, None, None, :] == 0,
                                                                 float("-inf"))
        return s.softmax(-1) @ v

    if form == "two_data_masks":
        pad = torch.rand(2, 1, 50, 50, generator=g) > 0.3
        pad[..., 0] = True
    report = pisa_compile.explain(f, q, k, v, pad, options=OPTS_EXACT)
    want_mask = "bool" if form == "two_data_masks" else "is_causal+padding"
    assert [s.mask.split("->")[-1] for s in report.sites] == [want_mask], str(report)
    assert all(s.rewritten for s in report.sites)
    got = torch.compile(f, backend="pisa", options=OPTS_EXACT)(q, k, v, pad)
    rows = torch.arange(50)[None, None, :, None] >= torch.tensor([0, 13])[:, None, None, None]
    if form == "two_data_masks":
        rows = torch.ones_like(rows)
    want = f(q, k, v, pad)
    torch.testing.assert_close(got.masked_fill(~rows, 0), want.masked_fill(~rows, 0),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
def test_multihead_attention_key_padding_is_structure():
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 40, 32)
    kpm = torch.arange(40)[None] >= torch.tensor([40, 31])[:, None]  # True = padding
    report = pisa_compile.explain(mha, x, x, x, key_padding_mask=kpm, need_weights=False,
                                  options=OPTS_EXACT)
    assert [s.mask for s in report.sites] == ["key_padding_mask->padding"], str(report)
    with torch.no_grad():
        want = mha(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
        got = torch.compile(mha, backend="pisa", options=OPTS_EXACT)(
            x, x, x, key_padding_mask=kpm, need_weights=False)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# -- transformers <= 4.52's float masks ----------------------------------------------------
# Those versions build the mask in place: full(finfo.min) -> triu(1) (Mistral: or the window
# into the next step's bool instead) -> *= (j > position) ->
# [None, None].expand -> clone -> a slice set to masked_fill((mask + attention_mask) == 0,
# min), and on CUDA multiply by ~all(mask == min) (rows that see no key then see every key).
# CI runs transformers 5.x, so the same ops are written out here.
OPTS_EXACT_NO_TAIL = dict(OPTS_EXACT, dense_tail=0)

def _legacy_mask(am, n_q, dtype, window=None, unmask=False, fill=None, cover=None,
                 pad_fill=None):
    low = torch.finfo(dtype).min if fill is None else fill
    n_k = am.shape[-1]
    position = torch.arange(0, n_q)
    m = torch.full((n_q, n_k), low, dtype=dtype)
    hide = torch.arange(n_k) > position.reshape(-1, 1)
    if window is None:  # Llama's form; Mistral's widens `hide` by the window instead
        m = torch.triu(m, diagonal=1)
    else:
        hide.bitwise_or_(torch.arange(n_k) <= position.reshape(-1, 1) - window)
    m *= hide
    m = m[None, None, :, :].expand(am.shape[0], 1, -1, -1)
    m = m.clone()
    n = n_k if cover is None else cover
    pad = m[:, :, :, :n] + am[:, :n][:, None, None, :]
    pad = pad == 0
    m[:, :, :, :n] = m[:, :, :, :n].masked_fill(pad, low if pad_fill is None else pad_fill)
    if unmask:
        m = m.mul(~torch.all(m == low, dim=-1, keepdim=True))
    return m


class _LegacySdpa(torch.nn.Module):
    def __init__(self, late_write=False, **mask_kw):
        super().__init__()
        self.proj = torch.nn.Linear(32, 3 * 32)
        self.late_write, self.mask_kw = late_write, mask_kw

    def forward(self, x, am):
        B, N, _ = x.shape
        q, k, v = self.proj(x).view(B, N, 3, 2, 16).permute(2, 0, 3, 1, 4)
        m = _legacy_mask(am, N, x.dtype, **self.mask_kw)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m[:, :, :, :N])
        if self.late_write:  # the mask is written after the site read it
            m.mul_(0.5)
            out = out + m.amax() * 0
        return out


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("kw,want", [
    ({}, "->is_causal+padding"),
    (dict(window=12), "->is_causal+window(12)+padding"),
])
def test_transformers_4_float_masks_become_structure(kw, want):
    """The in-place float mask of transformers 4.48-4.52 is proved: causal, padding from the
    int ``attention_mask`` (nonzero attends), Mistral's window. Compiled equals eager on
    every row, the left-padded ones too (0 / 9 / 33 of 70: they see no key, and eager's
    ``finfo.min`` rows average ``v``), and so do the gradients (``ops.eager_empty_rows``)."""
    torch.manual_seed(0)
    model = _LegacySdpa(**kw)
    x = torch.randn(3, 70, 32, requires_grad=True)
    am = (torch.arange(70)[None] >= torch.tensor([0, 9, 33])[:, None]).long()
    report = pisa_compile.explain(model, x, am, options=OPTS_EXACT_NO_TAIL)
    assert [s.mask[-len(want):] for s in report.sites] == [want], str(report)
    got = torch.compile(model, backend="pisa", options=OPTS_EXACT_NO_TAIL)(x, am)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        want_out = model(x, am)  # the explicit ops' gradients (see ops.eager_empty_rows)
    torch.testing.assert_close(got, want_out, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, [x, model.proj.weight], g)
    want_grads = torch.autograd.grad(want_out, [x, model.proj.weight], g)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("kw", [
    dict(cover=39),                       # the padding fill covers 39 of 40 keys
    dict(late_write=True),                # written after the site read it
    dict(fill=float("-inf")),             # -inf * 0 is NaN: not a 0/fill mask
    dict(pad_fill=-1.0),                  # padding filled with a finite bias
    dict(unmask=True),                    # CUDA's fix: rows that see no key see every key
])
def test_transformers_4_lookalikes_keep_their_mask(kw):
    """Variants of the in-place mask that are not (provably) causal + padding stay explicit
    masks, and the compiled model still equals eager."""
    torch.manual_seed(0)
    model = _LegacySdpa(**kw).eval()
    x = torch.randn(2, 40, 32)
    am = (torch.arange(40)[None] >= torch.tensor([0, 7])[:, None]).long()
    report = pisa_compile.explain(model, x, am, options=OPTS_EXACT_NO_TAIL)
    assert len(report.sites) == 1 and "->" not in report.sites[0].mask, str(report)
    with torch.no_grad():
        got = torch.compile(model, backend="pisa", options=OPTS_EXACT_NO_TAIL)(x, am)
        want = model(x, am)
    real = am.bool()[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)


def _copy_then_write(q, k, v):  # .float() copies before the write
    n = q.shape[2]
    m = torch.full((n, n), -3e38, dtype=torch.float64).triu(1)
    c = m.float()
    m.mul_(torch.arange(n) > (torch.arange(n).reshape(-1, 1) + 1))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=c)


def _stale_row_test(q, k, v):  # ~all(m == min) tested before m changes
    n = q.shape[2]
    m = torch.full((n, n), torch.finfo(torch.float32).min)
    t = ~torch.all(m == torch.finfo(torch.float32).min, dim=-1, keepdim=True)
    m.mul_(torch.arange(n) > torch.arange(n).reshape(-1, 1))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m * t)


def _fix_then_widen(q, k, v):  # arithmetic after the rows-that-see-nothing fix
    n, low = q.shape[2], torch.finfo(torch.float32).min
    m = torch.full((n, n), low).triu(-1)
    m = m * ~torch.all(m == low, dim=-1, keepdim=True)
    m *= torch.arange(n) > torch.arange(n).reshape(-1, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _broadcast_row_cut(q, k, v):  # a [1, n] row broadcast, then cut to [n, n]
    n = q.shape[2]
    m = torch.full((n, n), torch.finfo(torch.float32).min)
    m = m * (torch.arange(n) > torch.arange(1).reshape(-1, 1))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m[:n])


def _broadcast_bool_cut(q, k, v):
    n = q.shape[2]
    y = (torch.arange(n)[None, :] <= torch.arange(1)[:, None]).expand(n, n)[:n]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=y)


def _write_through_cpu(q, k, v):  # .cpu() of a CPU tensor is the tensor itself
    n = q.shape[2]
    m = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
    m.cpu().zero_()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _write_through_foreach(q, k, v):
    n = q.shape[2]
    m = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
    torch._foreach_zero_([m])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _batch_cut_of_padding(q, k, v, am):  # batch 0's padding handed to every batch row
    m = _legacy_mask(am, q.shape[2], q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m[:1])


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("fn", [_copy_then_write, _stale_row_test, _fix_then_widen,
                                _broadcast_row_cut, _broadcast_bool_cut, _write_through_cpu,
                                _write_through_foreach, _batch_cut_of_padding],
                         ids=lambda f: f.__name__.strip("_"))
def test_in_place_and_broadcast_lookalikes_keep_their_mask(fn):
    """Masks whose values are not the structure they resemble (found in review; each was
    claimed as structure by a draft of the in-place rules): no structure in the report, and
    the compiled function equals eager on every row that sees a key."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 16) for _ in range(3))
    args = (q, k, v)
    if fn is _batch_cut_of_padding:
        args += ((torch.arange(32)[None] >= torch.tensor([0, 5])[:, None]).long(),)
    report = pisa_compile.explain(fn, *args, options=OPTS_EXACT_NO_TAIL)
    assert len(report.sites) == 1 and "->" not in report.sites[0].mask, str(report)
    got = torch.compile(fn, backend="pisa", options=OPTS_EXACT_NO_TAIL)(*args)
    want = fn(*args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal,off,window,G,Nq", [
    (True, 0, None, 1, 20), (True, 0, None, 7, 20), (True, 17, None, 2, 3),
    (True, 19, None, 1, 1), (True, 0, 4, 2, 20), (False, 0, None, 3, 12)])
def test_eager_empty_rows_equals_eager_finfo_min_attention(causal, off, window, G, Nq):
    """``ops.eager_empty_rows`` over the op's output gives every row, and the gradients of
    q, k and v, as eager attention under the same structure as a ``finfo.min`` float mask:
    rows that see no key (left padding, an all-padding batch row) are the mean of v."""
    from pisa_compile.ops import eager_empty_rows
    g = torch.Generator().manual_seed(3)
    B, Hkv, Nk, D = 3, 2, 20, 8
    q = torch.randn(B, Hkv * G, Nq, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    km = torch.arange(Nk)[None] >= torch.tensor([0, 6, Nk])[:, None]  # last row: all padding
    vis = dense_mask(B, Nq, Nk, causal, off, km, window=window)  # [B, 1, Nq, Nk]
    mask = torch.zeros(vis.shape, dtype=torch.float64).masked_fill(
        ~vis, torch.finfo(torch.float64).min)
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    want = ((q @ kk.transpose(-1, -2)) * D ** -0.5 + mask).softmax(-1) @ vv
    got = eager_empty_rows(dense_attention(q, k, v, attn_mask=vis), q, k, v, km,
                           is_causal=causal, causal_offset=off, window=window)
    assert (~vis.any(-1)).any()  # some rows see no key
    torch.testing.assert_close(got, want)
    gout = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, [q, k, v], gout),
                    torch.autograd.grad(want, [q, k, v], gout)):
        torch.testing.assert_close(a, b)


@pytest.mark.usefixtures("fresh_dynamo")
def test_float16_empty_rows_are_left_to_the_op():
    """In float16 ``finfo.min + s`` keeps ``s / 32``, so eager's rows that see no key are not
    the mean of v: the pass adds no correction there and the op's zeros stand."""
    torch.manual_seed(0)
    model = _LegacySdpa().half().eval()
    x = torch.randn(2, 40, 32).half()
    am = (torch.arange(40)[None] >= torch.tensor([0, 7])[:, None]).long()
    report = pisa_compile.explain(model, x, am, options=OPTS_EXACT_NO_TAIL)
    assert [s.mask[-len("->is_causal+padding"):] for s in report.sites] == [
        "->is_causal+padding"], str(report)
    with torch.no_grad():
        got = torch.compile(model, backend="pisa", options=OPTS_EXACT_NO_TAIL)(x, am)
        want = model(x, am)
    real = am.bool()[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], atol=2e-3, rtol=2e-3)
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))


def _random_float_mask(fill_mixed=False):
    """A ``[2, 1, 24, 24]`` finfo.min mask with no structure: random holes, row 3 of batch 0
    and row 7 of batch 1 fully masked (row 5 of batch 1 mixes -inf in, with ``fill_mixed``)."""
    g = torch.Generator().manual_seed(5)
    hide = torch.rand(2, 1, 24, 24, generator=g) < 0.4
    hide[0, :, 3] = hide[1, :, 7] = True
    m = torch.zeros(hide.shape).masked_fill(hide, torch.finfo(torch.float32).min)
    if fill_mixed:
        m[1, :, 5] = torch.finfo(torch.float32).min
        m[1, :, 5, :4] = float("-inf")
    return m


def _explicit_sdpa(q, k, v, m):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _explicit_added(q, k, v, m):
    return ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + m).softmax(-1) @ v


def _explicit_masked_fill(q, k, v, m):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(m != 0, torch.finfo(s.dtype).min).softmax(-1) @ v


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("fn", [_explicit_sdpa, _explicit_added, _explicit_masked_fill],
                         ids=lambda f: f.__name__.strip("_"))
def test_explicit_finite_fill_rows_that_see_no_key_match_eager(fn):
    """A mask the pass cannot prove stays explicit; where its fill is finite (``finfo.min``
    added, or ``masked_fill`` with it), eager gives a row that sees no key the mean of v
    (uniform weights), and so does the compiled site (``ops.eager_empty_rows`` with
    ``attn_mask``), gradients included: the added fill passes the scores' gradient, the
    replaced one none."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 16, requires_grad=True) for _ in range(3))
    m = _random_float_mask()
    report = pisa_compile.explain(fn, q, k, v, m, options=OPTS_EXACT_NO_TAIL)
    assert [s.decision for s in report.sites] == ["rewritten"], str(report)
    assert "->" not in report.sites[0].mask, str(report)
    got = torch.compile(fn, backend="pisa", options=OPTS_EXACT_NO_TAIL)(q, k, v, m)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        want = fn(q, k, v, m)
    empty = torch.zeros(2, 1, 24, 1, dtype=torch.bool)
    empty[0, :, 3] = empty[1, :, 7] = True
    assert not torch.equal(got * empty, torch.zeros_like(got))  # those rows are not zeros
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    gout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, [q, k, v], gout),
                    torch.autograd.grad(want, [q, k, v], gout)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _explicit_added_then_scaled(q, k, v, m):
    return (((q @ k.transpose(-1, -2)) + m) * q.shape[-1] ** -0.5).softmax(-1) @ v


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("case", ["scale_after_mask", "float32_mask_float16_q"])
def test_explicit_empty_rows_are_judged_on_the_mask_as_added(case):
    """Found in review: a scale after the mask (folded into it, which turns ``finfo.min``
    into ``-inf``) and a float32 mask beside float16 q (summed in float32, where the fill is
    absorbed) hid the rows that see no key; they equal eager's mean of v now."""
    torch.manual_seed(0)
    dtype = torch.float16 if case == "float32_mask_float16_q" else torch.float32
    q, k, v = (torch.randn(2, 2, 24, 16, dtype=dtype) for _ in range(3))
    m = _random_float_mask()
    fn = _explicit_added_then_scaled if case == "scale_after_mask" else _explicit_sdpa
    got = torch.compile(fn, backend="pisa", options=OPTS_EXACT_NO_TAIL)(q, k, v, m)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        want = fn(q, k, v, m)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    assert got[0, :, 3].abs().sum() > 0  # an empty row: the mean of v, not zeros


@pytest.mark.usefixtures("fresh_dynamo")
def test_an_explicit_row_of_mixed_fills_keeps_the_ops_zeros():
    """A row whose entries are all masked but not equal (``-inf`` beside ``finfo.min``):
    eager averages v over the ``finfo.min`` keys alone, an ``Nq x Nk x Dv`` product the
    correction does not pay for; the row keeps the op's zeros (NaN there would spread
    through the next layer's padded keys), and every other row equals eager."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 16) for _ in range(3))
    m = _random_float_mask(fill_mixed=True)
    got = torch.compile(_explicit_added, backend="pisa", options=OPTS_EXACT_NO_TAIL)(q, k, v, m)
    want = _explicit_added(q, k, v, m)
    assert torch.equal(got[1, :, 5], torch.zeros_like(got[1, :, 5]))
    keep = torch.ones(2, 1, 24, 1, dtype=torch.bool)
    keep[1, :, 5] = False
    torch.testing.assert_close(got * keep, want * keep, atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.float32, torch.bool])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
def test_hand_written_padding_of_any_dtype_is_structure(dtype, causal, fill):
    """``masked_fill(pad[:, None, None, :] == 0, fill)`` with the tokenizer's int mask (or a
    float or bool one) is proved padding; with a finite fill the rows that see no key (an
    all-padding batch row; left padding under the causal mask) equal eager too."""
    torch.manual_seed(0)
    n = 40
    q, k, v = (torch.randn(3, 2, n, 16, requires_grad=True) for _ in range(3))
    pad = (torch.arange(n)[None] >= torch.tensor([0, 9, n])[:, None]).to(dtype)

    def fn(q, k, v, pad):
        s = (q @ k.transpose(-1, -2)) * 0.25
        if causal:
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), fill)
        s = s.masked_fill(pad[:, None, None, :] == 0, fill)
        return s.softmax(-1) @ v

    report = pisa_compile.explain(fn, q, k, v, pad, options=OPTS_EXACT_NO_TAIL)
    want_mask = "->is_causal+padding" if causal else "->padding"
    assert [s.mask[-len(want_mask):] for s in report.sites] == [want_mask], str(report)
    got = torch.compile(fn, backend="pisa", options=OPTS_EXACT_NO_TAIL)(q, k, v, pad)
    want = fn(q, k, v, pad)
    seen = want.isfinite().all(-1, keepdim=True)  # -inf: eager's empty rows are NaN
    assert bool(seen.all()) == (fill != float("-inf"))  # the all-padding row sees no key
    torch.testing.assert_close(got * seen, want.nan_to_num() * seen, atol=1e-5, rtol=1e-4)
    if fill != float("-inf"):
        gout = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad(got, [q, k, v], gout),
                        torch.autograd.grad(want, [q, k, v], gout)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_an_attention_mask_with_its_own_batch_symbol_is_structure(impl, caplog):
    """Without duck sizing (as in a second dynamic compile in one process) the tokenizer's
    ``attention_mask`` gets a batch symbol of its own: the padding is still proved (the op
    reads ``attention_mask[:B]``, as the gather does), and the training loss, which reads
    the last left-padded row, equals eager."""
    import logging
    import torch.fx.experimental._config as fx_config
    caplog.set_level(logging.INFO, logger="pisa_compile")
    model = _tiny("llama", impl, layers=1).train()
    ids, am = _left_padded(N=40, pads=(0, 9, 25))
    labels = ids.masked_fill(am == 0, -100)
    want = model(input_ids=ids, attention_mask=am, labels=labels, use_cache=False).loss
    with unittest.mock.patch.object(fx_config, "use_duck_shape", False):
        got = torch.compile(model, backend="pisa", options=OPTS_EXACT, dynamic=True)(
            input_ids=ids, attention_mask=am, labels=labels, use_cache=False).loss
    sites = [r.getMessage() for r in caplog.records if "pisa site" in r.getMessage()]
    assert sites and all("->is_causal+padding: rewritten" in m for m in sites), sites
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("impl,opts", [("sdpa", OPTS_EXACT), ("eager", OPTS_SPARSE)])
def test_training_at_changing_lengths_under_dynamic_shapes(impl, opts):
    """One compiled model, ``dynamic=True``, trained on left-padded batches of 64, 72 and 90
    tokens with the dense tail on: the slices of q around the tail have symbolic lengths,
    and a backward saved them with the first length's strides (the second length failed
    ``assert_size_stride``). Each step's loss and gradients equal eager's (exact regime), or
    those of the same selection in the sparse one (the compiled loss is finite and moves)."""
    model = _tiny("llama", impl, layers=1).train()
    compiled = torch.compile(model, backend="pisa", options=dict(opts, dense_tail=16),
                             dynamic=True)
    losses = []
    for step, n in enumerate((64, 72, 90)):
        ids, am = _left_padded(N=n, pads=(0, 17, n - 9), seed=step)
        labels = ids.masked_fill(am == 0, -100)
        model.zero_grad()
        loss = compiled(input_ids=ids, attention_mask=am, labels=labels, use_cache=False).loss
        loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
        losses.append(loss.item())
        if opts is OPTS_EXACT:
            model.zero_grad()
            want = model(input_ids=ids, attention_mask=am, labels=labels, use_cache=False).loss
            want.backward()
            torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
            for a, p in zip(got, model.parameters()):
                torch.testing.assert_close(a, p.grad, atol=1e-4, rtol=1e-4)
    assert all(map(math.isfinite, losses)) and len(set(losses)) == 3


# A tokenizer's attention_mask laid out as [B, 1, 1, Nk] before (or after) its test, as a new
# user wrote it; values 0, 1 and 2 so that each test is read as written (``== 1`` masks the 2s,
# ``> 0`` and ``.bool()`` keep them).
_PADDING_SPELLINGS = {
    "index_bool": lambda am: am[:, None, None, :].bool(),
    "index_eq1": lambda am: am[:, None, None, :] == 1,
    "index_gt0": lambda am: am[:, None, None, :] > 0,
    "zero_lt_index": lambda am: 0 < am[:, None, None, :],
    "index_ge2": lambda am: am[:, None, None, :] >= 2,
    "index_ne1": lambda am: am[:, None, None, :] != 1,
    "unsqueeze_bool": lambda am: am.unsqueeze(1).unsqueeze(2).bool(),
    "view_gt0": lambda am: am.view(am.shape[0], 1, 1, am.shape[1]) > 0,
    "reshape_to_bool": lambda am: am.reshape(am.shape[0], 1, 1, -1).to(torch.bool),
    "bool_unsqueeze": lambda am: am.bool().unsqueeze(1).unsqueeze(1),
    "index_eq1_expand": lambda am: (am[:, None, None, :] == 1).expand(-1, 1, am.shape[1], -1),
    "not_index_lt1": lambda am: ~(am[:, None, None, :] < 1),
    "logical_not_index_le0": lambda am: torch.logical_not(am[:, None, None, :] <= 0),
}


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spelling", sorted(_PADDING_SPELLINGS))
def test_padding_spelled_after_its_layout_is_structure(spelling, causal):
    """``am[:, None, None, :].bool()``, ``== 1``, ``> 0``, ``unsqueeze``/``view``/``reshape``
    before the test, alone or AND a tril: proved padding (the op reads ``am`` with the same
    test when it runs), and equal to eager on every row that sees a key."""
    g = torch.Generator().manual_seed(3)
    n = 48
    q, k, v = (torch.randn(3, 2, n, 16, generator=g) for _ in range(3))
    am = torch.ones(3, n, dtype=torch.long)
    am[1, :11] = 0
    am[2, :5] = 0
    am[2, 20:30] = 2  # neither 0 nor 1
    layout = _PADDING_SPELLINGS[spelling]

    def f(q, k, v, am):
        m = layout(am)
        if causal:
            m = torch.logical_and(torch.ones(n, n, dtype=torch.bool).tril(), m)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

    report = pisa_compile.explain(f, q, k, v, am, options=OPTS_EXACT_NO_TAIL)
    want_mask = "is_causal+padding" if causal else "padding"
    assert [s.mask.split("->")[-1] for s in report.sites] == [want_mask], str(report)
    got = torch.compile(f, backend="pisa", options=OPTS_EXACT_NO_TAIL)(q, k, v, am)
    want = f(q, k, v, am)
    seen = want.isfinite().all(-1, keepdim=True)  # eager's rows that see no key are NaN
    torch.testing.assert_close(got * seen, want.nan_to_num() * seen, atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("dtype", [torch.long, torch.float32])
def test_a_negated_ordering_test_is_padding_on_non_float_keys_only(dtype):
    """Hand-written attention that fills where ``am <= 0`` attends where ``am > 0``: proved
    padding for an int ``am`` (``is_causal+padding`` with the tril). For a float ``am`` it
    stays an explicit mask: ``not (x <= 0)`` holds for a NaN where ``x > 0`` does not; a NaN
    key attends in eager, and so it does compiled."""
    g = torch.Generator().manual_seed(5)
    n = 48
    q, k, v = (torch.randn(3, 2, n, 16, generator=g) for _ in range(3))
    am = torch.ones(3, n, dtype=dtype)
    am[1, :11] = 0
    am[2, :5] = -1
    am[2, 20:30] = 2
    if dtype.is_floating_point:
        am[0, 7] = float("nan")

    def f(q, k, v, am):
        s = q @ k.transpose(-2, -1) * 0.25
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).tril().logical_not(), float("-inf"))
        s = s.masked_fill(am[:, None, None, :] <= 0, float("-inf"))
        return s.softmax(-1) @ v

    report = pisa_compile.explain(f, q, k, v, am, options=OPTS_EXACT_NO_TAIL)
    (site,) = report.sites
    assert site.rewritten, str(report)
    proved = site.mask.split("->")[-1] == "is_causal+padding"
    assert proved == (not dtype.is_floating_point), str(report)
    got = torch.compile(f, backend="pisa", options=OPTS_EXACT_NO_TAIL)(q, k, v, am)
    want = f(q, k, v, am)
    # A row that sees no key is NaN in eager (softmax over -inf) and zero compiled (SDPA's
    # rule, as every -inf-filled site): those rows are padded queries. 16 such rows.
    seen = want.isfinite().all(-1, keepdim=True)
    assert int((~seen).sum()) == 2 * (11 + 5)
    torch.testing.assert_close(got * seen, want.nan_to_num() * seen, atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_reshape_that_moves_keys_is_not_padding():
    """``am.t()`` laid out as ``[B, 1, 1, Nk]`` reads key ``j`` of row ``b`` from ``am[j, b]``:
    a square mask transposed is data, not the tokenizer's padding of ``am`` (the site may
    prove the transposed tensor's own padding, never ``am``'s); eager and compiled agree."""
    g = torch.Generator().manual_seed(4)
    n = 32
    q, k, v = (torch.randn(n, 2, n, 16, generator=g) for _ in range(3))
    am = torch.rand(n, n, generator=g) > 0.3
    am[:, 0] = True

    def f(q, k, v, am):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=am.t()[:, None, None, :])

    report = pisa_compile.explain(f, q, k, v, am, options=OPTS_EXACT_NO_TAIL)
    assert all(s.rewritten for s in report.sites), str(report)
    got = torch.compile(f, backend="pisa", options=OPTS_EXACT_NO_TAIL)(q, k, v, am)
    torch.testing.assert_close(got, f(q, k, v, am), atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("test, proved", [("ne_big", False), ("gt_big", False),
                                          ("ne_zero", True)])
def test_a_cast_after_the_layout_keeps_only_the_zero_test(test, proved):
    """An int mask cast to float after its layout rounds large values (16777217 -> 2**24):
    a threshold must be read on the cast values, so it stays an explicit mask; the zero test
    survives any int -> float cast and is padding. Equal to eager either way (a review's
    finding: the threshold was applied to the uncast ints)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, 48, 16, generator=g) for _ in range(3))
    am = torch.full((3, 48), 16777217)
    am[0, 10:20] = 16777216
    am[1, :7] = 0

    def f(q, k, v, am):
        x = am[:, None, None, :].float()
        m = {"ne_big": x != 16777216, "gt_big": x > 16777216, "ne_zero": x != 0}[test]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

    report = pisa_compile.explain(f, q, k, v, am, options=OPTS_EXACT_NO_TAIL)
    assert [s.mask.endswith("->padding") for s in report.sites] == [proved], str(report)
    got = torch.compile(f, backend="pisa", options=OPTS_EXACT_NO_TAIL)(q, k, v, am)
    want = f(q, k, v, am)
    seen = want.isfinite().all(-1, keepdim=True)
    torch.testing.assert_close(got * seen, want.nan_to_num() * seen, atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_key_written_through_an_in_place_result_is_not_padding():
    """``b = a.mul_(2)`` aliases ``a``: a key mask read from ``b`` after ``a.zero_()`` must
    not be proved (the op would read the zeros), and compiled equals eager (a review's
    finding, older than the reshape spellings)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, 48, 16, generator=g) for _ in range(3))
    am = torch.ones(3, 48, dtype=torch.long)
    am[1, :11] = 0
    am[2, 20:30] = 2

    def f(q, k, v, am):
        a2 = am.clone()
        b = a2.mul_(2)
        m = b[:, None, None, :] > 2
        a2.zero_()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

    report = pisa_compile.explain(f, q, k, v, am, options=OPTS_EXACT_NO_TAIL)
    assert not any(s.mask.endswith("padding") for s in report.sites), str(report)
    got = torch.compile(f, backend="pisa", options=OPTS_EXACT_NO_TAIL)(q, k, v, am)
    want = f(q, k, v, am)
    seen = want.isfinite().all(-1, keepdim=True)
    torch.testing.assert_close(got * seen, want.nan_to_num() * seen, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_cross_attention_keys_right_padded_select_as_alone(kernel):
    """Cross-attention (not causal, fewer queries than keys) forces no local leaves: they
    once sat on the last leaves of the padded keys, an encoder batch's right padding, and a
    decoder tile spent its forced budget on masked keys (a new user's trial: 1.23 apart from
    the keys alone). Now the right-padded keys select and attend as the keys alone."""
    cfg = PisaConfig(min_seq_len=0, block_size=8, top_k=1, query_tile=8, dense_tail=0,
                     kernel=kernel)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 24, 16, generator=g)
    k, v = (torch.randn(1, 4, 44, 16, generator=g) for _ in range(2))
    kp, vp = (torch.cat([t, torch.randn(1, 4, 20, 16, generator=g)], 2) for t in (k, v))
    km = torch.arange(64)[None] < 44
    alone = pisa_attention(q, k, v, config=cfg)
    padded = pisa_attention(q, kp, vp, key_mask=km, config=cfg)
    torch.testing.assert_close(padded, alone, atol=1e-6, rtol=1e-6)
    bi_alone = select_blocks(q, k, config=cfg)[0]
    bi_padded = select_blocks(q, kp, key_mask=km, config=cfg)[0]
    assert torch.equal(bi_alone, bi_padded)
    assert int(bi_padded.max()) < 44 // 8 + 1  # no leaf of padding only


def test_the_report_names_a_decode_step():
    """A site of one query over a cache says it runs dense as a decode step, whatever
    ``dense_tail`` (``ops.is_decode_step``), and that a PisaCache's pyramid would serve it."""
    import torch.nn.functional as F

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    (site,) = pisa_compile.explain(f, q, k, v, options=dict(min_seq_len=0, dense_tail=0)).sites
    assert site.rewritten and site.note.startswith("runs plain SDPA: a decode step (Nq=1 < "
                                                   "Nk=64; a PisaCache's pyramid"), site.note
