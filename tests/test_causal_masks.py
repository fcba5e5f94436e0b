"""Explicit causal masks become ``is_causal=True`` (pisa_compile.lowering.masks), and masks
that only look causal stay masks. Each case: compiled equals eager (exact regime), and the
report says what happened to the mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import pisa_compile

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

B, H, N, D = 2, 4, 24, 16
# Below min_seq_len an SDPA site stays in the graph; the test sizes are far below the default.
REWRITE = {"min_seq_len": 0}


def _qkv(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g) for _ in range(3))


def _mask_of(fn, *args):
    """The report's mask column for the single site, after checking compiled == eager."""
    ref = fn(*args)
    out = torch.compile(fn, backend="pisa", options=REWRITE)(*args)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    report = pisa_compile.explain(fn, *args, options=REWRITE)
    assert [s.decision for s in report.sites] == ["rewritten"], str(report)
    return report.sites[0].mask


def _arange_mask(q, shift=0, q_len=None):
    n = q.shape[2]
    kv = torch.arange(n, device=q.device) + 0
    qi = torch.arange(q_len or n, device=q.device) + shift
    return (kv[None, None, None, :] <= qi[None, None, :, None]).expand(q.shape[0], -1, n, n)


def test_arange_mask_as_transformers_builds_it():
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_arange_mask(q))
    assert _mask_of(f, *_qkv()).endswith("->is_causal")


def test_transformers_sdpa_mask_and_eager_mask():
    """transformers' own builders with the is_causal shortcut off (as under torch.compile
    before torch 2.14): bool for SDPA, finfo.min float for eager attention."""
    masking = pytest.importorskip("transformers.masking_utils")

    def sdpa(q, k, v):
        m = masking.sdpa_mask(batch_size=q.shape[0], q_length=q.shape[2],
                              kv_length=k.shape[2], allow_is_causal_skip=False, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    def eager(q, k, v):
        m = masking.eager_mask(batch_size=q.shape[0], q_length=q.shape[2],
                               kv_length=k.shape[2], dtype=q.dtype, device=q.device)
        s = q @ k.transpose(-1, -2) * D ** -0.5 + m
        return s.softmax(-1) @ v

    assert _mask_of(sdpa, *_qkv()).endswith("->is_causal")
    assert _mask_of(eager, *_qkv()).endswith("->is_causal")


@pytest.mark.parametrize("form", ["tril_bool", "tril_eq0", "triu_fill", "where_float"])
def test_hand_written_causal_masks(form):
    def f(q, k, v):
        n = q.shape[2]
        s = q @ k.transpose(-1, -2) / D ** 0.5
        if form == "tril_bool":
            s = s.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf"))
        elif form == "tril_eq0":
            s = s.masked_fill(torch.tril(torch.ones(n, n)) == 0, float("-inf"))
        elif form == "triu_fill":
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        else:
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            s = s + torch.where(causal, 0.0, torch.finfo(s.dtype).min)
        return F.softmax(s, dim=-1) @ v
    assert _mask_of(f, *_qkv()).endswith("->is_causal")


@pytest.mark.parametrize("form", ["shifted", "strict", "broadcast_row", "tril_diag1", "padding",
                                  "inplace_and"])
def test_lookalikes_keep_their_mask(form):
    """Not SDPA's causal mask: a shifted diagonal, ``<``, one broadcast query row, tril with
    diagonal 1, causal AND key padding (written in place into a ones tensor, or ``&=``). The
    site is still rewritten: a shifted diagonal as its exact causal offset, the others with
    the mask (compiled equals eager either way)."""
    def f(q, k, v):
        n = q.shape[2]
        kv = torch.arange(n)[None, :]
        if form == "shifted":
            m = _arange_mask(q, shift=1)
        elif form == "strict":
            m = (kv < torch.arange(n)[:, None]) | torch.eye(n, dtype=torch.bool)
        elif form == "broadcast_row":
            m = (kv <= torch.arange(1)[:, None] + n).expand(n, n)
        elif form == "tril_diag1":
            m = torch.ones(n, n, dtype=torch.bool).tril(1)
        elif form == "inplace_and":
            m = torch.ones(n, n, dtype=torch.bool).tril()
            m &= kv < n - 2
        else:
            pad = torch.ones(q.shape[0], 1, 1, n, dtype=torch.bool)
            pad[0, ..., -3:] = False
            m = _arange_mask(q) & pad
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    mask = _mask_of(f, *_qkv())
    if form in ("shifted", "tril_diag1"):
        assert mask.endswith("->causal(offset=1)"), mask
    else:
        assert "->" not in mask, mask


def test_causal_conversion_in_the_sparse_regime_matches_is_causal():
    """With selection active, the converted site computes exactly pisa_attention(is_causal)."""
    n = 256
    cfg = dict(min_seq_len=0, block_size=16, top_k=2, query_tile=16)
    q, k, v = _qkv(n)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_arange_mask(q))
    out = torch.compile(f, backend="pisa", options=cfg)(q, k, v)
    want = pisa_compile.pisa_attention(q, k, v, is_causal=True,
                                       config=pisa_compile.PisaConfig(**cfg))
    torch.testing.assert_close(out, want)


def test_llama_with_explicit_mask_is_causal():
    """transformers' Llama with the SDPA is_causal shortcut disabled (as under torch < 2.14)
    builds the arange mask; both sites become is_causal and the logits equal eager."""
    transformers = pytest.importorskip("transformers")
    masking = pytest.importorskip("transformers.masking_utils")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 40))
    mp = pytest.MonkeyPatch()
    mp.setattr(masking, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    try:
        ref = model(ids).logits
        out = torch.compile(model, backend="pisa", options=REWRITE)(ids).logits
        report = pisa_compile.explain(model, ids, options=REWRITE)
    finally:
        mp.undo()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert [s.decision for s in report.sites] == ["rewritten"] * 2, str(report)
    assert all(s.mask.endswith("->is_causal") for s in report.sites), str(report)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _sites_and_check(model, **kw):
    """The report's mask column per site, after checking compiled logits == eager's."""
    ref = model(**kw).logits
    out = torch.compile(model, backend="pisa", options=REWRITE)(**kw).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    report = pisa_compile.explain(model, options=REWRITE, **kw)
    assert [s.decision for s in report.sites] == ["rewritten"] * 2, str(report)
    return [s.mask for s in report.sites]


def test_llama_without_a_cache_proves_its_packed_sequence_mask():
    """transformers >= 5.2x with ``use_cache=False`` and no ``attention_mask`` builds its mask
    from ``arange`` position ids, with a packed-sequence test (``diff(pos) != 1``, a running
    sum, equal sequence ids): causal, the usual call of a training loop. It was read as an
    explicit mask (dense on CUDA under a gradient)."""
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 40))
    masks = _sites_and_check(model, input_ids=ids, use_cache=False)
    assert all(m.endswith("->is_causal") for m in masks), masks


def test_llama_with_packed_position_ids_keeps_its_mask():
    """Position ids that restart (two packed sequences of 20): the mask is block-diagonal
    causal, not causal, and the ids are a graph input the pass cannot read: it stays a mask,
    and the logits equal eager's."""
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 40))
    pos = torch.arange(20).repeat(2)[None].expand(2, -1)
    masks = _sites_and_check(model, input_ids=ids, position_ids=pos, use_cache=False)
    assert all("->" not in m for m in masks), masks


A = torch.arange


def _sdpa_with(mk):
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mk(q.shape[2], k.shape[2]))
    return f


def _ifloordiv(nq, nk):
    i = A(nk)
    kv, qi = i[None, :], i[:, None]
    i //= 2  # kv and qi are views of i
    return kv <= qi


def _split_mutation(nq, nk):
    i = A(nk)
    kv, qi = i[None, :], i[:, None]
    i.split(nk // 2)[0].zero_()
    return kv <= qi


def _mutated_zeros(nq, nk):
    z = torch.zeros(nq, nk)
    z[:, 0] = 3.0
    return torch.where(torch.ones(nq, nk, dtype=torch.bool).tril(), z, float("-inf"))


def _position_mask(pos, nq, nk, one=1):
    """transformers' packed-sequence causal mask over position ids ``pos`` (1-D, laid over a
    batch of 2): ``pos[kv] <= pos[q]`` and equal sequence ids (``diff(pos) != 1``, summed);
    ``[2, 1, nq, nk]``."""
    pos = pos.unsqueeze(0).expand(2, -1)
    seq = (torch.diff(pos, prepend=pos[:, :1] - one, dim=-1) != 1).cumsum(-1)
    b = A(2)[:, None, None, None]
    qi, kv = A(nq)[None, None, :, None], A(nk)[None, None, None, :]
    return (pos[b, kv] <= pos[b, qi]) & (seq[b, qi] == seq[b, kv])


def _packed_written_between(nq, nk):
    """The ids are written after the prepend was sliced from them: the diff's first entry
    is 6, so the packed-sequence test is not constant."""
    pos = A(nk)[None, :].expand(2, -1) + 0
    prep = pos[:, :1] - 1
    pos[:] = pos + 5
    ne = torch.diff(pos, prepend=prep, dim=-1) != 1
    b = A(2)[:, None, None, None]
    qi, kv = A(nq)[None, None, :, None], A(nk)[None, None, None, :]
    return (pos[b, kv] <= pos[b, qi]) & (ne[b, qi] == ne[b, kv])


def _packed_restart(nq, nk):
    """Positions restart half way: ``diff != 1`` there, two sequences."""
    pos = A(nk) + 0
    pos = torch.cat([pos[: nk // 2], pos[: nk - nk // 2]])
    return _position_mask(pos, nq, nk)


LOOKALIKES = {  # masks that look causal but are not: each must keep its mask
    "sub_alpha": lambda nq, nk: torch.sub(A(nk), 1, alpha=2)[None, :] <= (A(nq) - 1)[:, None],
    "arange_end_kw": lambda nq, nk: A(nk)[None, :] <= A(3, end=nq + 3)[:, None],
    "uint8_wrap": lambda nq, nk: ((A(nk, dtype=torch.uint8) + 200)[None, :]
                                  <= (A(nq, dtype=torch.uint8) + 200)[:, None]),
    "ifloordiv_alias": _ifloordiv,
    "split_view_mutation": _split_mutation,
    "invert_long_tril": lambda nq, nk: (~torch.ones(nq, nk, dtype=torch.long).tril()) == 0,
    "where_broadcast_cond": lambda nq, nk: torch.where(
        torch.ones(nq, 1, dtype=torch.bool).tril(), torch.zeros(nq, nk), float("-inf")),
    "bool_roundtrip": lambda nq, nk: torch.where(
        torch.ones(nq, nk, dtype=torch.bool).tril(), 0., float("-inf")).to(torch.bool)
    .to(torch.float32),
    "mutated_zeros": _mutated_zeros,
    "packed_restart": _packed_restart,
    "positions_times_two": lambda nq, nk: _position_mask(A(nk) * 2, nq, nk),
    # A float prepend promotes the diff to float32, which rounds positions past 2**24.
    "packed_float_prepend": lambda nq, nk: _position_mask(A(nk) + 2**25 + 1, nq, nk, 1.0),
    "packed_written_between": _packed_written_between,
    "packed_int32_overflow": lambda nq, nk: _position_mask(
        A(nk, dtype=torch.int32) + (2**31 - 4), nq, nk),
    "int32_overflow": lambda nq, nk: ((A(nk, dtype=torch.int32) + (2**31 - 4))[None, :]
                                      <= (A(nq, dtype=torch.int32) + (2**31 - 4))[:, None]),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_causal_lookalikes_keep_their_mask(name):
    n = 100 if name == "uint8_wrap" else N
    mask = _mask_of(_sdpa_with(LOOKALIKES[name]), *_qkv(n))
    if name == "arange_end_kw":  # kv <= q + 3: exactly causal with offset 3
        assert mask.endswith("->causal(offset=3)"), mask
    else:
        assert "->" not in mask, mask


def test_symbolic_offsets_are_signed():
    """Right-aligned masks (``arange(n) - n``) under dynamic shapes are not top-left causal."""
    def f(q, k, v):
        nq, nk = q.shape[2], k.shape[2]
        m = (A(nk) - nk)[None, :] <= (A(nq) - nq)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, 16, generator=g)
    k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(2))
    out = torch.compile(f, backend="pisa", dynamic=True, options=REWRITE)(q, k, v)
    torch.testing.assert_close(out, f(q, k, v), rtol=1e-4, atol=1e-5)
    assert dict(counters["pisa"]) == {"rewritten": 1}, dict(counters["pisa"])


def test_mask_moved_out_of_the_last_two_dims():
    """``tril(...)[:, None]`` puts the causal dims at -3 and -1: not a causal mask."""
    H = 24
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, 1, 16, generator=g)
    k, v = (torch.randn(1, H, H, 16, generator=g) for _ in range(2))

    def f(q, k, v):
        m = torch.ones(H, H, dtype=torch.bool).tril()[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert not _mask_of(f, q, k, v).endswith("->is_causal")


KEYWORD_FORMS = {  # once crashed the pass (the whole graph went dense); now proved causal
    "le_other": lambda nq, nk: torch.le(A(nk)[None, :], other=A(nq)[:, None]),
    "arange_end": lambda nq, nk: A(end=nk)[None, :] <= A(start=0, end=nq)[:, None],
    "add_input": lambda nq, nk: torch.add(input=A(nk), other=0)[None, :] <= A(nq)[:, None],
    "logical_and_other": lambda nq, nk: torch.logical_and(
        A(nk)[None, :] <= A(nq)[:, None], other=torch.ones(nq, nk, dtype=torch.bool)),
    "eq_other": lambda nq, nk: torch.eq(torch.tril(torch.ones(nq, nk)), other=1),
}


@pytest.mark.parametrize("name", sorted(KEYWORD_FORMS))
def test_keyword_argument_forms(name):
    assert _mask_of(_sdpa_with(KEYWORD_FORMS[name]), *_qkv()).endswith("->is_causal")


def test_half_mask_on_float_scores_is_cast_not_a_crash():
    def f(q, k, v):
        n = q.shape[2]
        c = A(n)[None, :] <= A(n)[:, None]
        m = torch.where(c, 0., torch.finfo(torch.float16).min).to(torch.float16)
        s = (q @ k.transpose(-1, -2) + m) * 1e-4  # -65504 * 1e-4 is no longer masking
        return s.softmax(-1) @ v
    assert not _mask_of(f, *_qkv()).endswith("->is_causal")


def test_packed_sequence_test_over_arange_positions_is_causal():
    """The packed-sequence mask over ``arange`` positions (one sequence) is causal."""
    mask = _mask_of(_sdpa_with(lambda nq, nk: _position_mask(A(nk) + 0, nq, nk)), *_qkv())
    assert mask.endswith("->is_causal"), mask


def test_position_gathers_out_of_range_are_not_proved():
    """Gathers of position ids past their end (or rows past their batch) raise in eager; a
    negative (symbolic) index would wrap around: none of them is proved, so compiled raises
    or equals eager."""
    def past_end(q, k, v):
        n = q.shape[2]
        pos = (A(n) + 0).unsqueeze(0).expand(2, -1)
        b = A(2)[:, None, None, None]
        kv, qi = A(n)[None, None, None, :], (A(n) + 1)[None, None, :, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pos[b, kv] <= pos[b, qi])

    with pytest.raises(IndexError):
        past_end(*_qkv())
    # The pass's own reading of the graph (running the compiled graph would abort the process
    # in Inductor's bounds check); the graph then runs eagerly and raises as eager does.
    from pisa_compile.config import split_options
    from pisa_compile.lowering.rewrite import rewrite_graph
    masks = []

    def read(gm, example_inputs):
        config, _ = split_options(REWRITE)
        masks.extend(s.mask for s in rewrite_graph(gm, config, apply=False))
        return gm.forward

    with pytest.raises(IndexError):
        torch.compile(past_end, backend=read)(*_qkv())
    assert masks == ["bool"], masks

    def shifted(q, k, v, off):
        n = q.shape[2]
        pos = (A(n) + 0).unsqueeze(0).expand(2, -1)
        b = A(2)[:, None, None, None]
        kv, qi = (A(n) + off)[None, None, None, :], (A(n) + off)[None, None, :, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pos[b, kv] <= pos[b, qi])

    q, k, v = _qkv()
    for off in (-4, 0):  # -4 wraps: rows 0..3 read positions 20..23
        torch._dynamo.reset()
        out = torch.compile(shifted, backend="pisa", dynamic=True, options=REWRITE)(q, k, v, off)
        torch.testing.assert_close(out, shifted(q, k, v, off), rtol=1e-4, atol=1e-5)
