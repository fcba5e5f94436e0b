"""The Triton implementation behind the public API, on the CPU under Triton's interpreter.

``pisa_attention(..., config=PisaConfig(kernel="triton"))`` must agree with the reference
implementation: same selection, same output, same gradients (fp32/fp16; the interpreter's
bf16 ``tl.dot`` is unreliable).
"""

import os

import pytest
import torch

from pisa_compile import PisaConfig, pisa_attention, select_blocks
from pisa_compile.ops import plan
from tests.select_check import opcheck_stages

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cfg(kernel, **kw):
    base = dict(block_size=16, top_k=2, query_tile=16, min_seq_len=0, dense_tail=0)
    base.update(kw)
    return PisaConfig(kernel=kernel, **base)


@pytest.mark.parametrize("G, Nq, Nk, causal, dtype", [
    (1, 100, 100, True, torch.float32),
    (4, 77, 77, True, torch.float16),
    (6, 50, 50, False, torch.float32),
    (2, 40, 90, False, torch.float16),   # cross-attention shape
])
def test_triton_path_matches_reference(G, Nq, Nk, causal, dtype):
    torch.manual_seed(0)
    q = torch.randn(1, 2 * G, Nq, 32, device=DEV, dtype=dtype)
    k = torch.randn(1, 2, Nk, 32, device=DEV, dtype=dtype)
    v = torch.randn(1, 2, Nk, 24, device=DEV, dtype=dtype)
    tri, ref = _cfg("triton"), _cfg("reference")
    assert plan(q, k, v, None, causal, config=tri).attention in ("triton", "triton-decode")
    bi_t, bc_t = select_blocks(q, k, is_causal=causal, enable_gqa=True, config=tri)
    bi_r, bc_r = select_blocks(q, k, is_causal=causal, enable_gqa=True, config=ref)
    assert torch.equal(bi_t, bi_r) and torch.equal(bc_t, bc_r)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out_t = pisa_attention(qs, ks, vs, is_causal=causal, enable_gqa=True, config=tri)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_r = pisa_attention(qr, kr, vr, is_causal=causal, enable_gqa=True, config=ref)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_t, out_r, **tol)
    go = torch.randn_like(out_t)
    for g_t, g_r in zip(torch.autograd.grad(out_t, (qs, ks, vs), go),
                        torch.autograd.grad(out_r, (qr, kr, vr), go)):
        torch.testing.assert_close(g_t, g_r, atol=1e-2 if dtype == torch.float16 else 1e-4,
                                   rtol=1e-2 if dtype == torch.float16 else 1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_decode_kernel_over_a_selection_matches_reference(causal):
    """Few queries over more keys: ``pisa_attention`` runs such a call dense (a decode step,
    ``ops.is_decode_step``), so the decode kernel's sparse path (``triton-decode``, which a
    ``PisaKVCache`` step and the sparse rows of a short call take) is checked at the stage:
    the same blocks through the Triton kernel and the reference, output and gradients."""
    from pisa_compile.kernels import dispatch
    from pisa_compile.ops import _Attention
    torch.manual_seed(0)
    Nq, Nk = 5, 120
    q = torch.randn(1, 4, Nq, 32, device=DEV)
    k, v = torch.randn(1, 2, Nk, 32, device=DEV), torch.randn(1, 2, Nk, 24, device=DEV)
    cfg = _cfg("reference")
    offset = Nk - Nq if causal else 0
    bi, bc = select_blocks(q, k, is_causal=causal, enable_gqa=True, config=cfg,
                           causal_offset=offset)
    assert dispatch.attention_impl(Nq) == dispatch.DECODE
    outs, grads = [], []
    for impl in (dispatch.DECODE, dispatch.REFERENCE):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out, _ = _Attention.apply(qs, ks, vs, None, None, bi, bc, causal, offset, 32 ** -0.5,
                                  16, 16, impl, 0)
        outs.append(out)
        grads.append(torch.autograd.grad(out, (qs, ks, vs), torch.ones_like(out)))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
    for g_t, g_r in zip(*grads):
        torch.testing.assert_close(g_t, g_r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("top_k", [16, 17, 2048, 10**9])
def test_top_k_past_the_leaf_count_matches_reference(top_k):
    """``top_k`` at or past the call's L = 256 / 16 = 16 leaves: the reference's selection
    (every visible leaf) and output, which is dense attention. The Triton launch is planned
    for L leaves; it sized its pool from the beam (>= top_k): 2048 overflowed Triton's
    tensor size, 10**9 asked for 137 GB."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 256, 32, device=DEV)
    k, v = torch.randn(1, 2, 256, 32, device=DEV), torch.randn(1, 2, 256, 32, device=DEV)
    tri, ref = _cfg("triton", top_k=top_k), _cfg("reference", top_k=top_k)
    for causal in (False, True):
        bi_t, bc_t = select_blocks(q, k, is_causal=causal, enable_gqa=True, config=tri)
        bi_r, bc_r = select_blocks(q, k, is_causal=causal, enable_gqa=True, config=ref)
        assert torch.equal(bi_t, bi_r) and torch.equal(bc_t, bc_r)
        visible = torch.arange(16, device=DEV) + 1 if causal else torch.full((16,), 16)
        assert torch.equal(bc_t[0, 0].cpu(), visible.cpu())  # every visible leaf
        out = pisa_attention(q, k, v, is_causal=causal, enable_gqa=True, config=tri)
        torch.testing.assert_close(out, pisa_attention(q, k, v, is_causal=causal,
                                                       enable_gqa=True, config=ref),
                                   atol=2e-5, rtol=2e-5)
        dense = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(out, dense, atol=2e-5, rtol=2e-5)


def test_masked_triton_path_uses_reference_selection():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 64, 16, device=DEV) for _ in range(3))
    mask = torch.rand(1, 1, 64, 64, device=DEV) > 0.3
    out_t = pisa_attention(q, k, v, attn_mask=mask, config=_cfg("triton"))
    out_r = pisa_attention(q, k, v, attn_mask=mask, config=_cfg("reference"))
    torch.testing.assert_close(out_t, out_r, atol=2e-5, rtol=2e-5)


def test_unsupported_inputs_fall_back_with_one_warning():
    from pisa_compile.kernels import dispatch
    q = torch.randn(1, 1, 8, 16, dtype=torch.float64, device=DEV)
    dispatch._warned.clear()
    with pytest.warns(UserWarning, match="interpreter is unreliable|float64 inputs"):
        how = plan(q, q, q, config=_cfg("triton"))
    assert how.select == how.attention == "reference" and how.reason
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan(q, q, q, config=_cfg("triton")) == how  # warned once only
        # CPU tensors with kernel="auto" take the reference as asked: no warning.
        assert plan(q, q, q, config=_cfg("auto")).attention == "reference"


def test_triton_ops_under_compile_and_opcheck():
    """The ops on the Triton kernels under torch.compile (fullgraph, dynamic, backward) and
    opcheck."""
    cfg = _cfg("triton")
    torch._dynamo.reset()

    def f(q, k, v):
        return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=cfg)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for n in (70, 100):
        q, k, v = (torch.randn(1, h, n, 32, device=DEV, requires_grad=True) for h in (4, 2, 2))
        out = compiled(q, k, v)
        torch.testing.assert_close(out, f(q, k, v), atol=2e-5, rtol=2e-5)
        out.sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()
    q, k, v = (torch.randn(1, h, 40, 16, device=DEV, requires_grad=True) for h in (4, 2, 2))
    key_mask = torch.ones(1, 40, dtype=torch.bool, device=DEV)
    key_mask[:, :7] = False  # left padding
    for km, off in ((None, 0), (key_mask, 3)):
        opcheck_stages(q, k, v, None, km, True, off, cfg, "triton")


def test_launcher_wraps_kernels_only_while_traced(monkeypatch):
    """Eager calls launch the kernel itself (wrap_triton's eager path costs host time per
    launch); traced calls (fake tensors, as in a triton_op body under compile) get
    wrap_triton's traceable wrapper."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pisa_compile.kernels.runtime import launcher
    from pisa_compile.kernels.triton_attention import _fwd_kernel
    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: ("wrapped", kernel))
    assert launcher(_fwd_kernel, torch.zeros(2)) is _fwd_kernel
    with FakeTensorMode():
        fake = torch.zeros(2)
        assert launcher(_fwd_kernel, fake) == ("wrapped", _fwd_kernel)

    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):  # as make_fx's proxy mode over real tensors
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    with Passthrough():
        assert launcher(_fwd_kernel, torch.zeros(2)) == ("wrapped", _fwd_kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Nq", [3, 200], ids=["decode", "tail"])
def test_key_masked_dense_rows_take_the_split_k_kernel(monkeypatch, Nq, dtype):
    """The dense tail and decode calls under a key mask run the split-K kernel over every key
    block when nothing needs a gradient (SDPA under the mask otherwise), equal SDPA under
    the dense mask, and padding keys never reach the output: NaN there leaves it
    bit-identical."""
    from pisa_compile import ops
    calls = []
    real = ops._dense_split_k
    monkeypatch.setattr(ops, "_dense_split_k", lambda *a: calls.append(a) or real(*a))
    torch.manual_seed(0)
    B, Hkv, G, Nk, D = 3, 2, 4, 200, 32
    q = torch.randn(B, Hkv * G, Nq, D, device=DEV, dtype=dtype)
    k = torch.randn(B, Hkv, Nk, D, device=DEV, dtype=dtype)
    v = torch.randn(B, Hkv, Nk, D, device=DEV, dtype=dtype)
    key_mask = torch.ones(B, Nk, dtype=torch.bool, device=DEV)
    key_mask[0, :77] = False   # left padding
    key_mask[1, 150:] = False  # right padding
    key_mask[1, 20:40] = False  # and a hole: read per key
    key_mask[2, :] = False     # a row of padding only: zeros
    kw = dict(is_causal=True, enable_gqa=True, key_mask=key_mask, causal_offset=Nk - Nq)
    tri = _cfg("triton", dense_tail=16)
    out = pisa_attention(q, k, v, config=tri, **kw)
    n_calls = len(calls)
    assert n_calls == 1
    plan_kw = {n: kw[n] for n in ("is_causal", "key_mask", "causal_offset")}
    whole = "triton-decode" if Nq <= 16 else "triton"  # else: the sparse rows' kernel
    assert plan(q, k, v, config=tri, **plan_kw).attention == whole
    with torch.enable_grad():  # what plan() says for a call that wants gradients
        assert plan(q.clone().requires_grad_(), k, v, config=tri,
                                 **plan_kw).attention == ("sdpa" if Nq <= 16 else "triton")
    ref = pisa_attention(q, k, v, config=_cfg("reference", dense_tail=16), **kw)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, ref, **tol)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    k2, v2 = k.clone(), v.clone()
    k2[~key_mask[:, None, :].expand(-1, Hkv, -1)] = float("nan")
    v2[~key_mask[:, None, :].expand(-1, Hkv, -1)] = float("nan")
    assert torch.equal(pisa_attention(q, k2, v2, config=tri, **kw), out)
    with pytest.raises(RuntimeError, match="jvp"):  # forward-mode AD: refused, never zero
        torch.func.jvp(lambda x: pisa_attention(x, k, v, config=tri, **kw), (q,), (q,))
    n_calls = len(calls)
    qg = q.clone().requires_grad_()
    pisa_attention(qg, k, v, config=tri, **kw).sum().backward()  # SDPA, with gradients
    assert len(calls) == n_calls and torch.isfinite(qg.grad).all()

