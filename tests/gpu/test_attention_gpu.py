"""Triton PISA attention on CUDA: bf16/fp16 forward, backward and decode against the reference.

The reference runs in float32 on upcast inputs (the oracle), the kernels in bf16/fp16. Long
sequences (up to 32K) use a synthetic selection (sink + local + random earlier leaves), which
exercises the same kernels as PISA's own selection without paying for the PyTorch selection.
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
triton = pytest.importorskip("triton")

from pisa_compile import PisaConfig  # noqa: E402
from pisa_compile.kernels import reference as ref  # noqa: E402
from pisa_compile.kernels import triton_attention as ta  # noqa: E402
from pisa_compile.kernels import triton_decode as td  # noqa: E402
from tests.selections import synthetic_selection as _synthetic  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=5e-3, rtol=5e-3)}
GTOL = {torch.bfloat16: dict(atol=6e-2, rtol=6e-2), torch.float16: dict(atol=2e-2, rtol=2e-2)}


def synthetic_selection(B, Hkv, Nq, Nk, cfg, seed=0):
    return _synthetic(B, Hkv, Nq, Nk, cfg, seed=seed, device=DEV)


def _inputs(B, Hkv, G, Nq, Nk, D, Dv, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, Hkv * G, Nq, D, device=DEV, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, Nk, D, device=DEV, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, Nk, Dv, device=DEV, generator=g, dtype=dtype)
    return q, k, v


def _f32(*xs):
    return [None if x is None else (x.float() if x.is_floating_point() else x) for x in xs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("N", [4096, 32768])
def test_forward_long_causal(dtype, D, N):
    cfg = PisaConfig(block_size=64, top_k=8, query_tile=64, min_seq_len=0)
    q, k, v = _inputs(1, 2, 4, N, N, D, D, dtype)
    bi, bc = synthetic_selection(1, 2, N, N, cfg)
    out, lse = ta.sparse_attention(q, k, v, None, True, D ** -0.5, bi, bc,
                                   **cfg.attention_options())
    r_out, r_lse = ref.sparse_attention(*_f32(q, k, v), None, True, D ** -0.5, bi, bc,
                                        **cfg.attention_options())
    torch.testing.assert_close(out.float(), r_out, **TOL[dtype])
    torch.testing.assert_close(lse, r_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "float"])
@pytest.mark.parametrize("G,D,Dv", [(4, 128, 128), (6, 96, 64), (1, 256, 256)])
def test_backward_vs_fp32_reference(dtype, mask_kind, G, D, Dv):
    cfg = PisaConfig(block_size=64, top_k=4, query_tile=32, min_seq_len=0)
    N = 1000
    q, k, v = _inputs(1, 2, G, N, N, D, Dv, dtype, seed=G)
    causal, mask = mask_kind == "causal", None
    gm = torch.Generator(device=DEV).manual_seed(1)
    if mask_kind == "bool":
        mask = torch.rand(1, 1, N, N, device=DEV, generator=gm) > 0.2
        mask[..., 5, :] = False
    elif mask_kind == "float":
        mask = torch.randn(1, G * 2, N, N, device=DEV, generator=gm, dtype=dtype)
        mask = mask.masked_fill(torch.rand(1, 1, N, N, device=DEV, generator=gm) > 0.8,
                                float("-inf"))
    scale = D ** -0.5
    bi, bc = ref.select_blocks(q, k, mask, causal, scale, **cfg.selection_options())
    out, lse = ta.sparse_attention(q, k, v, mask, causal, scale, bi, bc, **cfg.attention_options())
    go = torch.randn_like(out)
    grads = ta.sparse_attention_backward(go, q, k, v, mask, out, lse, bi, bc, causal, scale,
                                         **cfg.attention_options())
    q32, k32, v32, m32, go32 = _f32(q, k, v, mask, go)
    r_out, r_lse = ref.sparse_attention(q32, k32, v32, m32, causal, scale, bi, bc,
                                        **cfg.attention_options())
    r_grads = ref.sparse_attention_backward(go32, q32, k32, v32, m32, r_out, r_lse, bi, bc,
                                            causal, scale, **cfg.attention_options())
    torch.testing.assert_close(out.float(), r_out, **TOL[dtype])
    for name, a, b in zip(("dq", "dk", "dv"), grads, r_grads):
        err = (a.float() - b).norm() / b.norm().clamp(min=1e-6)
        assert err < (2e-2 if dtype == torch.bfloat16 else 5e-3), f"{name}: rel err {err:.3g}"


def test_backward_long_sink_heavy_and_deterministic():
    # 32K causal: every tile chooses leaf 0 (the sink), so its dk/dv sums 512 tiles.
    cfg = PisaConfig(block_size=64, top_k=8, query_tile=64, min_seq_len=0)
    N, D = 32768, 128
    q, k, v = _inputs(1, 2, 4, N, N, D, D, torch.bfloat16)
    bi, bc = synthetic_selection(1, 2, N, N, cfg, seed=3)
    out, lse = ta.sparse_attention(q, k, v, None, True, D ** -0.5, bi, bc,
                                   **cfg.attention_options())
    go = torch.randn_like(out)
    g1 = ta.sparse_attention_backward(go, q, k, v, None, out, lse, bi, bc, True, D ** -0.5,
                                      **cfg.attention_options())
    g2 = ta.sparse_attention_backward(go, q, k, v, None, out, lse, bi, bc, True, D ** -0.5,
                                      **cfg.attention_options())
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)  # deterministic: no atomics in the sums
    q32, k32, v32, go32 = _f32(q, k, v, go)
    r_out, r_lse = ref.sparse_attention(q32, k32, v32, None, True, D ** -0.5, bi, bc,
                                        **cfg.attention_options())
    r = ref.sparse_attention_backward(go32, q32, k32, v32, None, r_out, r_lse, bi, bc, True,
                                      D ** -0.5, **cfg.attention_options())
    for name, a, b in zip(("dq", "dk", "dv"), g1, r):
        err = (a.float() - b).norm() / b.norm()
        assert err < 2e-2, f"{name}: rel err {err:.3g}"


@pytest.mark.parametrize("precision,tol", [("highest", 2e-5), ("high", 5e-3)])
def test_float32_follows_matmul_precision(precision, tol):
    """fp32 products in full precision under PyTorch's default "highest", TF32 under "high"."""
    cfg = PisaConfig(block_size=64, top_k=4, query_tile=64, min_seq_len=0)
    q, k, v = _inputs(2, 2, 2, 700, 700, 64, 64, torch.float32)
    bi, bc = ref.select_blocks(q, k, None, True, 0.125, **cfg.selection_options())
    r_out, r_lse = ref.sparse_attention(q, k, v, None, True, 0.125, bi, bc,
                                        **cfg.attention_options())
    go = torch.randn_like(r_out)
    r = ref.sparse_attention_backward(go, q, k, v, None, r_out, r_lse, bi, bc, True, 0.125,
                                      **cfg.attention_options())
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        out, lse = ta.sparse_attention(q, k, v, None, True, 0.125, bi, bc,
                                       **cfg.attention_options())
        g = ta.sparse_attention_backward(go, q, k, v, None, out, lse, bi, bc, True, 0.125,
                                         **cfg.attention_options())
    finally:
        torch.set_float32_matmul_precision(old)
    torch.testing.assert_close(out, r_out, atol=tol, rtol=tol)
    for a, b in zip(g, r):
        assert (a - b).norm() / b.norm() < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nq", [1, 4, 16])
def test_decode_long_cache(dtype, Nq):
    cfg = PisaConfig(block_size=64, top_k=16, query_tile=64, min_seq_len=0)
    Nk, D = 32768, 128
    q, k, v = _inputs(2, 8, 4, Nq, Nk, D, D, dtype)
    bi, bc = ref.select_blocks(q, k, None, False, D ** -0.5, **cfg.selection_options())
    out, lse = td.decode_attention(q, k, v, None, False, D ** -0.5, bi, bc,
                                   **cfg.attention_options())
    r_out, r_lse = ref.sparse_attention(*_f32(q, k, v), None, False, D ** -0.5, bi, bc,
                                        **cfg.attention_options())
    torch.testing.assert_close(out.float(), r_out, **TOL[dtype])
    torch.testing.assert_close(lse, r_lse, atol=1e-2, rtol=1e-3)
    out1, lse1 = ta.sparse_attention(q, k, v, None, False, D ** -0.5, bi, bc,
                                     **cfg.attention_options())
    torch.testing.assert_close(out, out1, **TOL[dtype])


def test_cuda_graph_capture():
    # No host sync and static shapes: forward + backward replay under a CUDA graph.
    cfg = PisaConfig(block_size=64, top_k=4, query_tile=64, min_seq_len=0)
    N, D = 2048, 64
    q, k, v = _inputs(1, 2, 2, N, N, D, D, torch.bfloat16)
    bi, bc = synthetic_selection(1, 2, N, N, cfg)
    go = torch.randn(q.shape[:3] + (D,), device=DEV, dtype=torch.bfloat16)

    def step():
        o, l = ta.sparse_attention(q, k, v, None, True, 0.125, bi, bc, **cfg.attention_options())
        return (o,) + ta.sparse_attention_backward(go, q, k, v, None, o, l, bi, bc, True, 0.125,
                                                   **cfg.attention_options())

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, static):
        assert torch.equal(a, b)


@pytest.mark.parametrize("G", [1, 4, 7])
@pytest.mark.parametrize("Nq", [1, 40])
def test_key_masked_decode_and_tail_rows_match_the_masked_reference(G, Nq):
    """A decode step (one row: SDPA with the mask and ``enable_gqa``) and a dense tail (the
    split-K kernel) under a key mask with left padding, a hole and a batch row of padding
    only: equal dense attention under the mask in float32, zeros on the empty row, and
    ``plan`` names the path that runs."""
    from pisa_compile import pisa_attention, plan
    from pisa_compile.kernels.geometry import dense_mask
    B, Hkv, Nk, D = 3, 2, 3000, 128
    q, k, v = _inputs(B, Hkv, G, Nq, Nk, D, D, torch.bfloat16)
    km = torch.ones(B, Nk, dtype=torch.bool, device=DEV)
    km[0, :700] = False
    km[1, 100:900] = False
    km[2] = False
    kw = dict(is_causal=True, causal_offset=Nk - Nq, key_mask=km)
    cfg = PisaConfig(min_seq_len=0, dense_tail=64)
    with torch.no_grad():
        out = pisa_attention(q, k, v, enable_gqa=True, config=cfg, **kw)
    vis = dense_mask(B, Nq, Nk, True, Nk - Nq, km)
    want = ref.dense_attention(*_f32(q, k, v), attn_mask=vis)
    torch.testing.assert_close(out.float(), want, **TOL[torch.bfloat16])
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert plan(q, k, v, config=cfg, **kw).attention == ("sdpa" if Nq == 1 else "triton-decode")
