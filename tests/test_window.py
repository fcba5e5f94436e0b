"""Sliding windows (issue #14): the pass proves a model's sliding-window mask and hands the op
``window=W``; on CUDA the op runs exact windowed attention through FlexAttention over the
window's blocks (``kernels/window.py``), elsewhere dense SDPA with the window's mask.

On the CPU: the block lists equal the dense mask at block granularity (full and partial
blocks apart), FlexAttention over them equals SDPA under the window's mask (Hypothesis over
lengths, offsets, windows, GQA and padding), the block mask traces with a growing KV-cache
offset, and models with a window (Mistral, Gemma 2) compile to the op with the window as
structure and the eager logits. ``tests/gpu/test_masks_gpu.py`` runs the CUDA path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import pisa_compile
from pisa_compile import PisaConfig, pisa_attention
from pisa_compile.kernels.geometry import dense_mask
from pisa_compile.kernels.window import BLOCK, window_attention, window_block_mask
from pisa_compile.ops import plan

# FlexAttention runs uncompiled on the CPU (small shapes; CUDA compiles it).
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without")


def _dense_window(q, k, v, window, off, key_mask, scale):
    m = dense_mask(q.shape[0], q.shape[2], k.shape[2], True, off, key_mask, window=window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, enable_gqa=True)
    return torch.where(m.any(-1, keepdim=True), out, 0.0)  # SDPA's NaN rows: no key seen


@st.composite
def windowed(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3]))
    Nk = draw(st.integers(1, 300))
    Nq = draw(st.integers(1, Nk))
    window = draw(st.integers(1, Nk + 8))
    pads = [draw(st.integers(0, Nk)) for _ in range(B)]
    left = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, Nq, 16, generator=g)
    k = torch.randn(B, Hkv, Nk, 16, generator=g)
    v = torch.randn(B, Hkv, Nk, 8, generator=g)
    pos = torch.arange(Nk)[None, :]
    pad = torch.tensor(pads)[:, None]
    km = pos >= pad if left else pos < Nk - pad
    return q, k, v, window, Nk - Nq, (None if draw(st.booleans()) else km)


@settings(max_examples=25, deadline=None)
@given(windowed())
def test_window_attention_equals_dense_under_the_window(case):
    q, k, v, window, off, km = case
    got = window_attention(q, k, v, window=window, causal_offset=off, key_mask=km, scale=0.3,
                           enable_gqa=True)
    torch.testing.assert_close(got, _dense_window(q, k, v, window, off, km, 0.3),
                               atol=2e-6, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 2), Nq=st.integers(1, 700), Nk=st.integers(1, 700),
       window=st.integers(1, 800), off=st.integers(0, 900), pad=st.integers(0, 300),
       masked=st.booleans())
def test_block_lists_are_the_window_at_block_granularity(B, Nq, Nk, window, off, pad, masked):
    """A block is listed (for a batch row) iff some row of it sees some key of it; it is
    listed as full iff every real (row, key) pair inside it is visible, so FlexAttention may
    skip the mask there. (FlexAttention on the CPU applies the mask everywhere, so this test,
    not the output tests, is what checks the lists.)"""
    km = None
    if masked:
        km = torch.ones(B, Nk, dtype=torch.bool)
        km[-1, :min(pad, Nk)] = False
    bm = window_block_mask(B, Nq, Nk, window, off, km, torch.device("cpu"))
    m = dense_mask(B, Nq, Nk, True, off, km, window=window)[:, 0]  # [B, Nq, Nk]
    nqb, nkb = -(-Nq // BLOCK), -(-Nk // BLOCK)
    grow = (0, nkb * BLOCK - Nk, 0, nqb * BLOCK - Nq)
    seen = F.pad(m, grow).view(B, nqb, BLOCK, nkb, BLOCK)
    real = F.pad(torch.ones(Nq, Nk, dtype=torch.bool), grow).view(nqb, BLOCK, nkb, BLOCK)
    any_seen = seen.any(4).any(2)                       # [B, nqb, nkb]
    all_seen = (seen | ~real).all(4).all(2)
    for b in range(B):
        bb = b if bm.kv_num_blocks.shape[0] > 1 else 0
        listed = torch.zeros(nqb, nkb, dtype=torch.bool)
        full = torch.zeros(nqb, nkb, dtype=torch.bool)
        for mb in range(nqb):
            n, nf = int(bm.kv_num_blocks[bb, 0, mb]), int(bm.full_kv_num_blocks[bb, 0, mb])
            part = bm.kv_indices[bb, 0, mb, :n].long()
            whole = bm.full_kv_indices[bb, 0, mb, :nf].long()
            assert not set(part.tolist()) & set(whole.tolist())
            listed[mb, part] = True
            listed[mb, whole] = True
            full[mb, whole] = True
        assert torch.equal(listed, any_seen[b]), b
        assert torch.equal(full, any_seen[b] & all_seen[b]), b


def test_block_mask_traces_with_a_growing_cache_offset():
    """Under Dynamo and AOTAutograd with dynamic shapes (what a compiled decode loop sees), the
    block mask and FlexAttention trace in one graph and stay exact as the offset grows."""
    def f(q, k, v, km, off):
        return window_attention(q, k, v, window=16, causal_offset=off, key_mask=km, scale=0.25,
                                enable_gqa=True)

    cf = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for Nq, Nk in [(40, 100), (1, 101), (1, 102), (50, 300)]:
        q, k, v = torch.randn(2, 4, Nq, 16), torch.randn(2, 2, Nk, 16), torch.randn(2, 2, Nk, 16)
        km = torch.ones(2, Nk, dtype=torch.bool)
        km[1, :7] = False
        with torch.no_grad():
            got = cf(q, k, v, km, Nk - Nq)
        torch.testing.assert_close(got, _dense_window(q, k, v, 16, Nk - Nq, km, 0.25),
                                   atol=2e-6, rtol=1e-5)


def test_op_on_the_cpu_is_dense_sdpa_under_the_window():
    """``pisa_attention(window=...)`` on the CPU: dense SDPA with the window's mask (say so in
    the plan), gradients included; a window that hides nothing is no window."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 50, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 90, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 90, 16, generator=g, requires_grad=True)
    km = torch.ones(2, 90, dtype=torch.bool)
    km[0, :11] = False
    cfg = PisaConfig(min_seq_len=0)
    how = plan(q, k, v, None, True, config=cfg, window=20, causal_offset=40)
    assert how.attention == "sdpa" and "sliding window(20)" in how.reason
    got = pisa_attention(q, k, v, is_causal=True, causal_offset=40, window=20, key_mask=km,
                         enable_gqa=True, config=cfg)
    want = _dense_window(q, k, v, 20, 40, km, 16 ** -0.5)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)
    # The last row sits at key 89: a window of 90 reaches key 0 from every row (no tail: 50
    # queries would all be in the default one).
    assert plan(q, k, v, None, True, config=cfg.replace(dense_tail=0), window=90,
                causal_offset=40).attention != "sdpa"


def test_window_fallback_on_cuda_is_counted():
    """On CUDA (fake tensors here) a window FlexAttention refuses (a GQA group of 3) plans
    dense SDPA and is counted in ``window_sdpa``, which GPU tests assert stays 0; a window
    it takes is counted in ``flex_window``. CPU plans count nothing (models' tests compare
    the counters)."""
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode
    counters.clear()
    cfg = PisaConfig(min_seq_len=0)
    with FakeTensorMode():
        k = torch.empty(1, 2, 90, 16, device="cuda")
        for heads, key in ((6, "window_sdpa"), (4, "flex_window")):
            q = torch.empty(1, heads, 50, 16, device="cuda")
            how = plan(q, k, k, None, True, config=cfg, window=20, causal_offset=40)
            assert counters["pisa"][key] == 1, (key, how, dict(counters["pisa"]))
        assert how.attention == "flex-window"
    assert plan(torch.empty(1, 6, 50, 16), torch.empty(1, 2, 90, 16), torch.empty(1, 2, 90, 16),
                None, True, config=cfg, window=20, causal_offset=40).attention == "sdpa"
    assert dict(counters["pisa"]) == {"window_sdpa": 1, "flex_window": 1}


def test_report_note_says_where_a_window_runs_dense():
    """The rewrite's note names the dense fallback of a window site off CUDA, and nothing on
    CUDA, where FlexAttention runs it."""
    from pisa_compile.lowering.rewrite import _note
    cfg = PisaConfig(min_seq_len=0)
    assert "window's mask" in _note(4096, False, cfg, torch.device("cpu"), window=512)
    assert _note(4096, False, cfg, torch.device("cuda"), window=512) == ""
    assert "key mask" in _note(4096, False, cfg, torch.device("cuda"), window=512, padded=True)
    assert _note(4096, False, cfg, torch.device("cpu")) == ""


def test_a_window_triton_refuses_under_kernel_triton_warns_and_says_why(monkeypatch):
    """``kernel="triton"`` asks for PISA's window kernels; inputs they refuse (bfloat16 in the
    interpreter) run dense SDPA under the window's mask on the CPU, and the plan's reason and
    a warning name Triton's refusal, as the report's note says (a new user's trial read
    "Triton" in the report where dense SDPA ran, silently)."""
    from pisa_compile.kernels import dispatch
    from pisa_compile.lowering.rewrite import _note
    monkeypatch.setattr(dispatch, "_warned", set())
    cfg = PisaConfig(kernel="triton", min_seq_len=0)
    q = torch.randn(2, 4, 70, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 70, 16, dtype=torch.bfloat16)
    km = torch.ones(2, 70, dtype=torch.bool)
    km[0, :30] = False
    why = dispatch.triton_refusal(q, k, "triton")
    assert why is not None  # the premise: the interpreter refuses bfloat16
    with pytest.warns(UserWarning, match="dense SDPA under the window's mask instead"):
        how = plan(q, k, k, None, True, window=16, key_mask=km, config=cfg)
    assert how.attention == "sdpa" and f"not Triton: {why}" in how.reason, how
    assert "with a warning" in _note(70, False, cfg, torch.device("cpu"), window=16,
                                     padded=True)


def test_window_with_a_key_mask_under_compile_plans_dense_on_cuda(monkeypatch):
    """FlexAttention traced into a graph with a per-batch key mask gave wrong rows on the H200
    (``tests/gpu/test_masks_gpu.py``), its eager calls right: a traced window with a key
    mask (fake CUDA tensors, as the backend's compile_fx traces them) plans dense SDPA
    under the window's mask, counted in ``window_sdpa``; without a key mask, or with the
    switch that follows the bug turned on, FlexAttention."""
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pisa_compile.kernels import dispatch
    cfg = PisaConfig(min_seq_len=0)
    with FakeTensorMode():
        q = torch.empty(2, 4, 50, 16, device="cuda")
        k = torch.empty(2, 2, 90, 16, device="cuda")
        km = torch.ones(2, 90, dtype=torch.bool, device="cuda")
        go = dict(config=cfg, window=20, causal_offset=40)
        counters.clear()
        how = plan(q, k, k, None, True, key_mask=km, **go)
        assert how.attention == "sdpa" and "key mask" in how.reason, how
        assert counters["pisa"]["window_sdpa"] == 1
        assert plan(q, k, k, None, True, **go).attention == "flex-window"
        monkeypatch.setattr(dispatch, "TRACED_FLEX_WITH_KEY_MASK", True)
        assert plan(q, k, k, None, True, key_mask=km, **go).attention == "flex-window"


@pytest.mark.usefixtures("fresh_dynamo")
def test_backend_trace_of_a_padded_window_plans_dense_on_cuda(monkeypatch):
    """Through ``backend="pisa"`` the op runs under compile_fx's trace, where torch <= 2.11's
    ``is_compiling()`` is False: the plan must still see the trace. A Mistral model with
    left padding on the CPU, with plans recorded as if on CUDA (the device check is the
    only difference): every window plan with a key mask is dense SDPA."""
    from pisa_compile.kernels import dispatch
    seen = []
    real = dispatch.tracing

    def spy(t):
        out = real(t)
        seen.append(out)
        return out

    monkeypatch.setattr(dispatch, "tracing", spy)
    monkeypatch.setattr(dispatch, "_flex_refusal", lambda *a: None)  # as on CUDA
    model = _model("mistral", "sdpa")
    ids = torch.randint(1, 97, (2, 70), generator=torch.Generator().manual_seed(1))
    am = (torch.arange(70)[None] >= torch.tensor([0, 9])[:, None]).long()
    with torch.no_grad():
        want = model(ids, attention_mask=am).logits
        got = torch.compile(model, backend="pisa", options=dict(min_seq_len=0))(
            ids, attention_mask=am).logits
    assert seen and all(seen), seen
    real_rows = am.bool()
    torch.testing.assert_close(got[real_rows], want[real_rows], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(is_causal=True, window=0), ValueError, "window must be >= 1"),
    (dict(is_causal=True, window=True), TypeError, "window must be an int"),
    (dict(is_causal=True, window=2.5), TypeError, "window must be an int"),
    (dict(window=4), ValueError, "window needs is_causal=True"),
    (dict(attn_mask=torch.ones(9, 9, dtype=torch.bool), window=4), ValueError,
     "window needs is_causal=True and no attn_mask"),
])
def test_bad_window_names_the_argument(kwargs, err, match):
    q = torch.randn(1, 2, 9, 16)
    with pytest.raises(err, match=match):
        pisa_attention(q, q, q, config=PisaConfig(min_seq_len=0), **kwargs)


@pytest.mark.usefixtures("fresh_dynamo")
def test_window_from_numpy_and_under_dynamic_shapes():
    """Any integral window works: numpy ints, and a window Dynamo makes symbolic
    (``fullgraph=True, dynamic=True``): it is specialised, never a graph break."""
    import numpy as np
    q = torch.randn(1, 2, 30, 16)
    cfg = PisaConfig(min_seq_len=0)
    want = _dense_window(q, q, q, 5, 0, None, 0.25)
    torch.testing.assert_close(pisa_attention(q, q, q, is_causal=True, window=np.int64(5),
                                              config=cfg), want)
    f = torch.compile(lambda q, w: pisa_attention(q, q, q, is_causal=True, window=w,
                                                  config=cfg), fullgraph=True, dynamic=True)
    for w in (5, 9):
        torch.testing.assert_close(f(q, w), _dense_window(q, q, q, w, 0, None, 0.25))


transformers = pytest.importorskip("transformers")


def _model(kind: str, impl: str, window: int = 16):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  sliding_window=window)
    if kind == "mistral":
        cfg = transformers.MistralConfig(**common)
        cls = transformers.MistralForCausalLM
    else:  # Gemma 2: local and global layers alternate
        cfg = transformers.Gemma2Config(head_dim=16, attn_logit_softcapping=None, **common)
        cls = transformers.Gemma2ForCausalLM
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return cls(cfg).eval()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("kind,impl", [("mistral", "sdpa"), ("mistral", "eager"),
                                       ("gemma2", "eager")])
def test_sliding_window_models_hand_the_op_their_window(kind, impl):
    """The window (16 keys of 70) with left padding becomes ``window(16)`` structure: no
    explicit mask reaches the op, and the compiled logits equal eager on every real token."""
    model = _model(kind, impl)
    ids = torch.randint(1, 97, (2, 70), generator=torch.Generator().manual_seed(1))
    am = (torch.arange(70)[None] >= torch.tensor([0, 9])[:, None]).long()
    opts = dict(min_seq_len=0, block_size=16, top_k=64)
    report = pisa_compile.explain(model, ids, attention_mask=am, options=opts)
    assert report.sites and all(s.rewritten for s in report.sites), str(report)
    windowed = [s for s in report.sites if "window(16)" in s.mask]
    # Gemma 2: every other layer is global (causal + padding only).
    assert len(windowed) == (len(report.sites) if kind == "mistral" else 1), str(report)
    assert all(s.mask.endswith("+padding") for s in report.sites), str(report)
    with torch.no_grad():
        want = model(ids, attention_mask=am).logits
        got = torch.compile(model, backend="pisa", options=opts)(ids, attention_mask=am).logits
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("fresh_dynamo")
def test_generate_with_a_window_equals_eager(caplog):
    """generate() with a window shorter than the prompt, left padded: the same tokens as
    eager, and the prefill's mask is proved as the window. (transformers' sliding-window cache
    keeps only the window's keys for the decode steps, so there ``Nk <= window``: below any
    sensible ``min_seq_len``, plain SDPA with the defaults.)"""
    import logging
    model = _model("mistral", "sdpa", window=8)
    ids = torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    am = (torch.arange(30)[None] >= torch.tensor([0, 5])[:, None]).long()
    with torch.no_grad():
        want = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False)
        model.forward = torch.compile(model.forward, backend="pisa",
                                      options=dict(min_seq_len=0, block_size=16, top_k=64))
        with caplog.at_level(logging.INFO, logger="pisa_compile"):
            got = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    lines = [r.getMessage() for r in caplog.records if "pisa site" in r.getMessage()]
    assert any("->is_causal+window(8)+padding" in m for m in lines), lines
    assert any("k=[2, 2, 8, 16]" in m for m in lines), lines  # decode: the window's keys


@pytest.mark.usefixtures("fresh_dynamo")
def test_flex_path_through_the_backend_keeps_the_offset_symbolic(monkeypatch):
    """The CUDA path's trace, on the CPU: the window plan forced, the backend's graphs run by
    AOTAutograd (aot_eager in place of Inductor, which does not lower this on the CPU).
    ``generate()`` over a full cache (the window applies in every decode step, at a growing
    offset) gives eager's tokens without a recompile per step."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch._dynamo.utils import counters
    from transformers import DynamicCache

    import torch._inductor.compile_fx as cfx
    from pisa_compile.kernels import dispatch

    plan = dispatch.plan

    def forced(q, k, v, m, c, **kw):
        if kw.get("window") is not None and k.shape[2] >= kw.get("min_seq_len", 0):
            return dispatch.Plan(None, dispatch.WINDOW, "forced for the test")
        return plan(q, k, v, m, c, **kw)

    monkeypatch.setattr(dispatch, "plan", forced)
    monkeypatch.setattr(cfx, "compile_fx",
                        lambda gm, ex, config_patches=None: aot_eager(gm, ex))
    model = _model("mistral", "sdpa", window=8)
    ids = torch.randint(1, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    gen = dict(max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, past_key_values=DynamicCache(), **gen)
        model.forward = torch.compile(model.forward, backend="pisa",
                                      options=dict(min_seq_len=0, block_size=16, top_k=64))
        got = model.generate(ids, past_key_values=DynamicCache(), **gen)
    assert torch.equal(got, want)
    # A site per layer per model graph: the prefill, the first decode step, then one dynamic
    # graph (FlexAttention's own eager wrapper recompiles too on the CPU; not counted here).
    # An offset baked into the trace made it 8 graphs.
    assert counters["pisa"]["rewritten"] <= 3 * model.config.num_hidden_layers, \
        dict(counters["pisa"])
