"""Coverage beyond Inductor: one test per form of the catalogue (patterns.py's
docstring): the attention shapes Inductor's ``fuse_attention.py`` matches (its
``_sfdp_pattern_N``, spelled here at the torch level as models write them), GQA,
``nn.MultiheadAttention``, 3-D bmm and einsum. Each compiled == eager and counted rewritten
(or left dense with its reason). Written from the descriptions, not copied.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from .test_lowering import _qkv, check, repeat_kv

NEG = float("-inf")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _bnhd(t):            # Inductor's patterns take [B, N, H, D] and permute to [B, H, N, D]
    return t.permute(0, 2, 1, 3)


# sfdp 1-4 (+12, 28): matmul(q, kᵀ) .div / .mul scale .softmax [dropout off] .matmul(v)
def sfdp_1(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).div(4.0).softmax(dim=-1).matmul(v)


def sfdp_2(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).mul(0.25).softmax(dim=-1).matmul(v)


def sfdp_3_eval(q, k, v):
    w = torch.matmul(q, k.transpose(-2, -1)).div(4.0).softmax(dim=-1)
    return F.dropout(w, p=0.1, training=False).matmul(v)


# sfdp 5/6: softmax(q @ kᵀ / s + float mask) @ v
def sfdp_5(q, k, v, m):
    return torch.softmax(q @ k.transpose(-2, -1) / 4.0 + m, dim=-1) @ v


# sfdp 7-10: permuted [B,N,H,D] inputs, score upcast .to(float32), weights cast back,
# v.to(weights.dtype); 9/10 scale q first
def sfdp_7_8(q, k, v):
    q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    div = (q @ k.transpose(-2, -1) / 4.0).to(torch.float32)
    w = torch.softmax(div, dim=-1).to(torch.float16)
    return w @ v.to(w.dtype)


def sfdp_9_10(q, k, v):
    q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    q = q / 4.0
    w = torch.softmax((q @ k.transpose(-2, -1)).to(torch.float32), dim=-1).to(torch.float16)
    return w @ v.to(w.dtype)


# sfdp 11: permuted inputs, chained methods
def sfdp_11(q, k, v):
    q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    return torch.matmul(q, k.transpose(-2, -1)).div(4.0).softmax(dim=-1).matmul(v)


# sfdp 13: bmm on 3-D [B*H, N, D], no scale
def sfdp_13(q, k, v):
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))
    w = torch.bmm(q, k.transpose(1, 2)).softmax(dim=-1)
    return torch.bmm(F.dropout(w, p=0.0), v)


# sfdp 14/16 (BERT): (matmul / s + mask).softmax [dropout] .to(q.dtype) .matmul(v)
def sfdp_14_16(q, k, v, m):
    q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    w = (torch.matmul(q, k.transpose(-2, -1)).div(4.0) + m).softmax(dim=-1)
    return F.dropout(w, 0.1, training=False).to(dtype=q.dtype).matmul(v)


# sfdp 15/17/20 (DistilBERT): padding mask (mask == 0).view(b,1,1,S).expand_as(scores),
# masked_fill with a -inf tensor; 20 scales q first
def sfdp_15_17_20(q, k, v, pad):
    q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    scores = (q / 4.0) @ k.transpose(-2, -1)
    mask = (pad == 0).view(q.shape[0], 1, 1, k.shape[-2]).expand_as(scores)
    scores = scores.masked_fill(mask, torch.tensor(torch.finfo(scores.dtype).min))
    return torch.softmax(scores, dim=-1) @ v


# sfdp 18/19 (old HF GPT-2): k.permute(0,1,3,2); divide by a torch.full([]) tensor;
# where(causal, scores, full((), finfo.min)); + padding mask; .type(v.dtype)
def sfdp_18_19(q, k, v, m):
    w = torch.matmul(q, k.permute(0, 1, 3, 2))
    w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype, device=w.device)
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    w = torch.where(causal, w, torch.full((), torch.finfo(w.dtype).min, dtype=w.dtype))
    w = w + m
    return F.dropout(w.softmax(dim=-1).type(v.dtype), 0.0).matmul(v)


# sfdp 21-23/25-27 (T5): unscaled scores + float mask, .float().softmax().type_as(q)
def sfdp_21_t5(q, k, v, m):
    q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    score = torch.matmul(q, k.permute(0, 1, 3, 2))
    score = (score + m).type_as(q)
    return score.float().softmax(dim=-1).type_as(q).matmul(v)


# two additive masks (T5 eager in transformers 5: position bias, then the mask)
def t5_bias_and_mask(q, k, v, bias, m):
    w = torch.matmul(q, k.transpose(2, 3)) * 1.0
    w = w + bias
    w = w + m
    return F.softmax(w, dim=-1) @ v


def gqa_repeat_kv(q, k, v, m):
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    return F.softmax(q @ k.transpose(2, 3) * 0.25 + m, dim=-1) @ v


def einsum_bhqd(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def _float_mask(n=24):
    m = torch.zeros(2, 1, n, n)
    m[1, :, :, n - 5:] = torch.finfo(torch.float32).min
    return m


_PAD = torch.ones(2, 24)
_PAD[1, 19:] = 0


@pytest.mark.parametrize("fn,extra,dtype", [
    (sfdp_1, (), torch.float32), (sfdp_2, (), torch.float32),
    (sfdp_3_eval, (), torch.float32), (sfdp_5, (_float_mask(),), torch.float32),
    (sfdp_7_8, (), torch.float16), (sfdp_9_10, (), torch.float16),
    (sfdp_11, (), torch.float32), (sfdp_13, (), torch.float32),
    (sfdp_14_16, (_float_mask(),), torch.float32), (sfdp_15_17_20, (_PAD,), torch.float32),
    (sfdp_18_19, (_float_mask(),), torch.float32), (sfdp_21_t5, (_float_mask(),), torch.float32),
    (t5_bias_and_mask, (torch.randn(1, 4, 24, 24), _float_mask()), torch.float32),
    (gqa_repeat_kv, (_float_mask(),), torch.float32), (einsum_bhqd, (), torch.float32),
], ids=lambda x: getattr(x, "__name__", None) if callable(x) else "")
def test_inductor_form_rewritten(fn, extra, dtype):
    hkv = 2 if fn is gqa_repeat_kv else None
    q, k, v = (t.to(dtype) for t in _qkv(hkv=hkv))
    if fn.__name__.startswith(("sfdp_7", "sfdp_9", "sfdp_11", "sfdp_14", "sfdp_15", "sfdp_21")):
        q, k, v = (t.permute(0, 2, 1, 3).contiguous() for t in (q, k, v))   # [B, N, H, D]
    if dtype == torch.float16:
        ref = fn(q, k, v, *extra)
        out = torch.compile(fn, backend="pisa")(q, k, v, *extra)
        torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
        assert counters["pisa"] == {"rewritten": 1}, dict(counters["pisa"])
    else:
        check(fn, q, k, v, *extra)


def test_sfdp_dropout_in_training_left_dense():
    """Patterns 3/4/6/12/16/17/... in training: dropout active, left dense with that reason."""
    def fn(q, k, v):
        w = torch.matmul(q, k.transpose(-2, -1)).div(4.0).softmax(dim=-1)
        return torch.dropout(w, 0.1, True).matmul(v)
    torch.compile(fn, backend="pisa")(*_qkv())
    assert counters["pisa"] == {"left_dense": 1}


_KPM = torch.zeros(2, 24, dtype=torch.bool)
_KPM[1, 20:] = True
_CAUSAL_F = nn.Transformer.generate_square_subsequent_mask(24)


@pytest.mark.parametrize("kw", [
    dict(need_weights=False),
    dict(need_weights=True),                       # weights computed but never read
    dict(need_weights=False, attn_mask=torch.ones(24, 24, dtype=torch.bool).triu(1)),
    dict(need_weights=False, key_padding_mask=_KPM),
    dict(need_weights=False, attn_mask=_CAUSAL_F, is_causal=True),
], ids=["plain", "weights-unused", "bool-mask", "key-padding", "causal"])
def test_multihead_attention(kw):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 24, 32)

    def fn(x):
        return mha(x, x, x, **kw)[0]

    check(fn, x)


def test_multihead_attention_masks_of_mixed_dtypes_are_not_captured():
    """docs/limits.md: a float ``attn_mask`` beside a bool ``key_padding_mask`` (or the
    reverse) makes PyTorch warn in the module's forward, where Dynamo breaks the graph: no
    attention graph is captured. One dtype for both masks is captured."""
    from pisa_compile import explain
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 24, 32)
    kpm_float = torch.zeros(2, 24).masked_fill(_KPM, NEG)
    bool_mask = torch.ones(24, 24, dtype=torch.bool).triu(1)

    def sites(mask, kpm):
        fn = lambda x: mha(x, x, x, need_weights=False, attn_mask=mask,  # noqa: E731
                           key_padding_mask=kpm)[0]
        return len(explain(fn, x, options={"min_seq_len": 0}))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's deprecation of mixed mask dtypes
        assert (sites(_CAUSAL_F, _KPM), sites(bool_mask, kpm_float)) == (0, 0)
        assert (sites(_CAUSAL_F, kpm_float), sites(bool_mask, _KPM)) == (1, 1)


def test_multihead_attention_weights_returned_left_dense():
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 24, 32)
    check(lambda x: mha(x, x, x), x, expect="left dense")
