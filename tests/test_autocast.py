"""``torch.autocast``: attention sites inside an autocast region, entered in the compiled code
or around the call (the usual mixed-precision training step), are rewritten with their
inputs cast as autocast casts them, and give what autocast gives eagerly. CPU autocast in
bfloat16, the exact regime (``top_k`` covers every block). Before this, every such site
whose q, k and v dtypes differed (Llama's rotary step hands SDPA float32 q and k beside a
bfloat16 v) was left dense.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import pisa_compile
from tests.hf_models import tiny_llama

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# The sparse path at these lengths (no dense tail), with every block selected.
EXACT = {"min_seq_len": 0, "top_k": 64, "block_size": 16, "dense_tail": 0}
BF16 = dict(rtol=2e-2, atol=2e-2)


def _llama(impl: str):
    return tiny_llama(impl)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 200), generator=g)
    am = torch.ones_like(ids)
    am[1, :30] = 0  # left padding: its rows see no key
    return ids, am


class _Inside(nn.Module):
    """The model's forward inside an autocast region of the compiled code."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, am):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(input_ids=ids, attention_mask=am).logits


@pytest.mark.parametrize("where", ["around", "inside"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_llama_under_autocast_is_rewritten_and_equals_eager(impl, where):
    """transformers' Llama (SDPA, and eager: hand-written with a float32 ``finfo.min`` mask)
    with left padding: every site rewritten, reported with ``+autocast(bfloat16)``, and every
    position's logits (the padded rows' included) equal eager autocast's within bfloat16
    rounding (Inductor's own difference there is one bfloat16 step)."""
    model = _llama(impl).eval()
    ids, am = _batch()
    if where == "inside":
        fn, args = _Inside(model), (ids, am)
        ambient = torch.autocast("cpu", enabled=False)
    else:
        def fn(i, a):
            return model(input_ids=i, attention_mask=a).logits
        args = (ids, am)
        ambient = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad(), ambient:
        ref = fn(*args)
        out = torch.compile(fn, backend="pisa", options=EXACT)(*args)
        report = pisa_compile.explain(fn, *args, options=EXACT)
    assert counters["pisa"]["rewritten"] == 2 and not counters["pisa"]["left_dense"], \
        dict(counters["pisa"])
    assert [s.decision for s in report.sites] == ["rewritten"] * 2, str(report)
    assert all("+autocast(bfloat16)" in s.form for s in report.sites), str(report)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), **BF16)


def test_training_step_under_autocast_matches_eager():
    """The usual mixed-precision step (float32 weights, autocast around forward and loss):
    the rewritten sites' gradients reach every weight as eager autocast's do (relative
    difference of each parameter's gradient, bfloat16 rounding)."""
    model = _llama("sdpa").train()
    ids, am = _batch()

    def step(fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100)).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref = step(model)
    loss, grads = step(torch.compile(model, backend="pisa", options=EXACT))
    assert counters["pisa"]["rewritten"] == 2, dict(counters["pisa"])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for name, g in grads.items():
        rel = float((g - ref[name]).norm() / ref[name].norm().clamp_min(1e-12))
        assert rel < 5e-2, (name, rel)


def _attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("built", [False, True], ids=["mask_input", "mask_built"])
@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e4],
                         ids=["finfo_min", "minus_1e4"])
def test_sdpa_float_mask_is_cast_with_its_inputs(fill, built):
    """SDPA with a float32 additive padding mask under autocast: autocast casts the mask to
    bfloat16 with q, k and v, where ``finfo(float32).min`` becomes ``-inf`` (a fully padded
    row is then SDPA's zeros) and ``-1e4`` stays finite (the row is a mean of v). The
    rewritten site does the same, with the mask handed in (an explicit mask, read as cast)
    and built in the graph from a key padding mask (structure: the fill is judged as cast);
    mixed q (float32) and v (bfloat16) dtypes as Llama's."""
    torch.manual_seed(0)
    proj = nn.Linear(16, 16)
    x = torch.randn(2, 4, 48, 16)
    pad = torch.ones(2, 48, dtype=torch.bool)
    pad[1, :20] = False
    mask = torch.zeros(2, 1, 48, 48).masked_fill(~pad[:, None, None, :], fill)
    if not built:
        mask[0, :, 5] = fill  # a row of batch row 0 that sees no key at all

    def fn(x, m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            v = proj(x)                       # bfloat16 under autocast
            q = x * 0.5                       # float32
            if built:  # causal AND padding: the left-padded rows see no key
                seen = torch.ones(48, 48, dtype=torch.bool).tril() & m[:, None, None, :]
                m = torch.zeros(2, 1, 48, 48).masked_fill(~seen, fill)
            return _attention(q, x, v, m)

    arg = pad if built else mask
    with torch.no_grad():
        ref = fn(x, arg)
        out = torch.compile(fn, backend="pisa", options=EXACT)(x, arg)
        report = pisa_compile.explain(fn, x, arg, options=EXACT)
    assert counters["pisa"]["rewritten"] == 1, dict(counters["pisa"])
    # -1e4 is no mask fill (a finite bias): it stays an explicit mask.
    proved = built and fill < -1e30
    mask = report.sites[0].mask
    assert mask.endswith("->is_causal+padding") if proved else "->" not in mask, str(report)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), **BF16)


def test_a_float32_mask_beside_bfloat16_inputs_is_judged_as_cast():
    """q, k and v already bfloat16 under autocast, the mask float32 (built in the graph, causal
    AND padding, ``finfo(float32).min``): autocast still casts the mask, to ``-inf``, so the
    left-padded rows that see no key are SDPA's zeros, not eager float32's mean of v (a
    review's repro: 0.496 apart before)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 48, 16).bfloat16() for _ in range(3))
    pad = torch.ones(2, 48, dtype=torch.bool)
    pad[1, :20] = False

    def fn(q, k, v, pad):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seen = torch.ones(48, 48, dtype=torch.bool).tril() & pad[:, None, None, :]
            m = torch.zeros(2, 1, 48, 48).masked_fill(~seen, torch.finfo(torch.float32).min)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    with torch.no_grad():
        ref = fn(q, k, v, pad)
        out = torch.compile(fn, backend="pisa", options=EXACT)(q, k, v, pad)
        report = pisa_compile.explain(fn, q, k, v, pad, options=EXACT)
    assert report.sites[0].form == "sdpa+autocast(bfloat16)", str(report)
    assert torch.equal(ref[1, :, :20], torch.zeros_like(ref[1, :, :20]))
    torch.testing.assert_close(out.float(), ref.float(), **BF16)


def test_a_float32_bias_is_added_in_float32():
    """A hand-written site under autocast adds a float32 bias to bfloat16 scores in float32, as
    eager does: a bias with a large common offset (absolute-position ALiBi) keeps its
    differences (rounded to bfloat16 first, they were 0.75 apart from eager)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    bias = torch.randn(1, 2, 64, 64, generator=g) * 2 + 300

    def fn(q, k, v, bias):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s = (q @ k.transpose(-1, -2)) * 0.25 + bias
            return torch.softmax(s, dim=-1) @ v

    with torch.no_grad():
        ref = fn(q, k, v, bias)
        out = torch.compile(fn, backend="pisa", options=EXACT)(q, k, v, bias)
    assert counters["pisa"]["rewritten"] == 1, dict(counters["pisa"])
    torch.testing.assert_close(out.float(), ref.float(), **BF16)


def test_the_op_ignores_an_ambient_autocast():
    """``pisa_attention`` on bfloat16 inputs inside an autocast region computes what it
    computes outside (its body runs with autocast off), and its backward runs there (the
    reference backward mixed dtypes under autocast and raised in ``scatter_add_``)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 96, 16, generator=g).bfloat16().requires_grad_()
               for _ in range(3))
    km = torch.ones(1, 96, dtype=torch.bool)
    km[0, :10] = False
    cfg = pisa_compile.PisaConfig(min_seq_len=0, block_size=16, top_k=4, dense_tail=0)

    def run():
        out = pisa_compile.pisa_attention(q, k, v, is_causal=True, key_mask=km, config=cfg)
        return (out, *torch.autograd.grad(out.float().sum(), (q, k, v)))

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = run()
    for a, b in zip(inside, plain):
        assert torch.equal(a, b)


def test_a_region_with_autocast_off_runs_in_its_own_dtype():
    """A site inside ``autocast(enabled=False)`` nested in an enabled region is not cast: it
    runs in float32 (no ``+autocast`` in its form) and equals eager to float32 tolerance."""
    q, k, v = (torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(i))
               for i in range(3))

    def fn(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autocast("cpu", enabled=False):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    ref = fn(q, k, v)
    out = torch.compile(fn, backend="pisa", options=EXACT)(q, k, v)
    report = pisa_compile.explain(fn, q, k, v, options=EXACT)
    assert [s.form for s in report.sites] == ["sdpa"]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_scores_outside_the_region_stay_dense():
    """A hand-written site whose ``q @ k^T`` runs outside the region and ``p @ v`` inside is
    not what autocast does to one attention: left dense, with the dtype reason."""
    q, k, v = (torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(i))
               for i in range(3))

    def fn(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return p @ v

    ref = fn(q, k, v)
    out = torch.compile(fn, backend="pisa", options=EXACT)(q, k, v)
    report = pisa_compile.explain(fn, q, k, v, options=EXACT)
    assert [s.decision for s in report.sites] == ["left dense"], str(report)
    assert "dtype" in report.sites[0].reason
    torch.testing.assert_close(out, ref)


def test_checkpointed_attention_under_autocast_is_rewritten():
    """``torch.utils.checkpoint`` of an attention inside an autocast region: the body runs in
    the region's state, so its site is cast and rewritten; values and gradients equal eager
    autocast's."""
    proj = nn.Linear(16, 16)
    x = torch.randn(1, 2, 40, 16, requires_grad=True)

    def attn(x):
        return F.scaled_dot_product_attention(x * 0.5, x, proj(x), is_causal=True)

    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.utils.checkpoint.checkpoint(attn, x, use_reentrant=False)

    ref = fn(x)
    (gref,) = torch.autograd.grad(ref.float().sum(), x)
    out = torch.compile(fn, backend="pisa", options=EXACT)(x)
    (g,) = torch.autograd.grad(out.float().sum(), x)
    assert counters["pisa"]["rewritten"] == 1, dict(counters["pisa"])
    torch.testing.assert_close(out.float(), ref.float(), **BF16)
    torch.testing.assert_close(g, gref, **BF16)
