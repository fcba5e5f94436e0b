"""The public op on CUDA (Triton path) under torch.compile: fullgraph, dynamic shapes,
CUDA graphs (mode="reduce-overhead"), and a training step; checked against the reference."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from pisa_compile import PisaConfig, pisa_attention  # noqa: E402
from pisa_compile.ops import plan  # noqa: E402

# dense_tail=0: these tests check the sparse kernels on every row (decode included).
CFG = PisaConfig(block_size=64, top_k=4, query_tile=64, min_seq_len=0, dense_tail=0)
REF = CFG.replace(kernel="reference")


def _qkv(n, dtype=torch.bfloat16, grad=False, G=4):
    g = torch.Generator(device="cuda").manual_seed(n)
    mk = lambda h, d=64: torch.randn(1, h, n, d, device="cuda", dtype=dtype,  # noqa: E731
                                     generator=g).requires_grad_(grad)
    return mk(2 * G), mk(2), mk(2)


def _attn(q, k, v):
    return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=CFG)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("n", [1000, 4096, 16384])
def test_triton_path_matches_reference(n):
    """Selection: the bf16 kernel agrees with the fp32 reference on nearly every tile (near-ties
    may flip); attention: equal to the reference attention over the kernel's own selection."""
    from pisa_compile import select_blocks
    from pisa_compile.kernels import reference
    q, k, v = _qkv(n)
    assert plan(q, k, v, None, True, config=CFG) == ("triton", "triton", "")
    bi, bc = select_blocks(q, k, is_causal=True, enable_gqa=True, config=CFG)
    bi_r, bc_r = select_blocks(q.float(), k.float(), is_causal=True, enable_gqa=True, config=REF)
    same = (bi == bi_r).all(-1).float().mean().item()
    assert same > 0.9, f"only {same:.1%} of tiles select what the reference selects"
    out = _attn(q, k, v)
    ref, _ = reference.sparse_attention(q.float(), k.float(), v.float(), None, True,
                                        q.shape[-1] ** -0.5, bi, bc, **CFG.attention_options())
    assert _rel(out, ref) < 1e-2


def test_compile_fullgraph_and_cuda_graphs():
    torch._dynamo.reset()
    q, k, v = _qkv(4096)
    eager = _attn(q, k, v)
    for mode in (None, "reduce-overhead"):
        f = torch.compile(_attn, fullgraph=True, mode=mode)
        for _ in range(3):  # cudagraph warm-up, record, replay
            out = f(q, k, v)
        assert _rel(out, eager) < 1e-2


def test_compile_dynamic_recompiles_at_most_twice():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    f = torch.compile(_attn, dynamic=True, fullgraph=True)
    for n in (2048, 3000, 4096, 6000, 8192):
        q, k, v = _qkv(n)
        assert _rel(f(q, k, v), _attn(q, k, v)) < 1e-2
    assert counters["stats"]["unique_graphs"] <= 2


def test_compiled_training_step_matches_reference_grads():
    torch._dynamo.reset()
    from pisa_compile import select_blocks
    from pisa_compile.ops import _attention_op
    q, k, v = _qkv(4096, grad=True)
    go = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    out = torch.compile(_attn, fullgraph=True)(q, k, v)
    got = torch.autograd.grad(out, (q, k, v), go)
    # Reference gradients over the kernel's own selection (fp32 autograd through the op).
    bi, bc = select_blocks(q.detach(), k.detach(), is_causal=True, enable_gqa=True, config=CFG)
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, _ = _attention_op(q2, k2, v2, None, None, bi, bc, True, 0, q.shape[-1] ** -0.5,
                           CFG.block_size, CFG.query_tile, "reference")
    want = torch.autograd.grad(ref, (q2, k2, v2), go.float())
    for a, b in zip(got, want):
        assert _rel(a, b) < 3e-2


def test_decode_through_public_op():
    """A decode step (4 queries over a 32K cache) runs dense SDPA through the public op, also
    with ``dense_tail=0`` (``ops.is_decode_step``); the decode kernel's sparse path over the
    same selection, at the stage, matches the reference's."""
    q, k, v = _qkv(32768, G=4)
    q = q[:, :, -4:].contiguous()
    from pisa_compile import select_blocks
    from pisa_compile.kernels import dispatch, reference
    from pisa_compile.ops import _Attention
    out = pisa_attention(q, k, v, enable_gqa=True, config=CFG)
    assert plan(q, k, v, config=CFG).reason.startswith(dispatch.DECODE_STEP)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert _rel(out, want) < 1e-2
    bi, bc = select_blocks(q, k, enable_gqa=True, config=CFG)
    sparse, _ = _Attention.apply(q, k, v, None, None, bi, bc, False, 0, q.shape[-1] ** -0.5,
                                 CFG.block_size, CFG.query_tile, dispatch.DECODE, 0)
    ref, _ = reference.sparse_attention(q.float(), k.float(), v.float(), None, False,
                                        q.shape[-1] ** -0.5, bi, bc, **CFG.attention_options())
    assert _rel(sparse, ref) < 1e-2


def _compiled_with_mask(cfg):
    """``pisa_attention`` compiled (fullgraph) on a 4096-token problem with an explicit
    ``[1, 1, N, N]`` causal bool mask, as HF passes it: ``(q, k, v, mask, out)``."""
    torch._dynamo.reset()
    q, k, v = _qkv(4096)
    n = q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()[None, None]

    def f(q, k, v, mask):
        return pisa_attention(q, k, v, attn_mask=mask, enable_gqa=True, config=cfg)

    return q, k, v, mask, torch.compile(f, fullgraph=True)(q, k, v, mask)


@pytest.mark.parametrize("kernel", ["auto", "triton"])
def test_explicit_causal_mask_under_compile_reads_its_structure(kernel):
    """An explicit [1, 1, N, N] causal bool mask handed to the compiled op (a graph input, as
    from another graph): its structure is read at run time and the call equals the
    ``is_causal`` call, with no reference stage; ``select_blocks`` still selects (through the
    reference's masked path)."""
    from torch._dynamo.utils import counters

    from pisa_compile import select_blocks
    cfg = CFG.replace(kernel=kernel)
    counters.clear()
    q, k, v, mask, out = _compiled_with_mask(cfg)
    assert counters["pisa"]["runtime_mask_structured"] == 1, dict(counters["pisa"])
    assert not any(key.startswith("reference_") for key in counters["pisa"]), counters["pisa"]
    want = pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=cfg)
    assert _rel(out, want) < 1e-2
    bi, _ = select_blocks(q, k, attn_mask=mask, enable_gqa=True, config=CFG)
    bi_c, _ = select_blocks(q, k, is_causal=True, enable_gqa=True, config=CFG)
    assert (bi == bi_c).all(-1).float().mean().item() > 0.9


def test_explicit_other_mask_under_compile_runs_dense_sdpa():
    """A mask with no structure the op has (a strict diagonal): dense SDPA under it, exact."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    q, k, v = _qkv(4096)
    n = q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril(-1)
    mask[0, 0] = True
    mask = mask[None, None]
    out = torch.compile(lambda q, k, v, m: pisa_attention(
        q, k, v, attn_mask=m, enable_gqa=True, config=CFG), fullgraph=True)(q, k, v, mask)
    assert counters["pisa"]["runtime_mask_unstructured"] == 1, dict(counters["pisa"])
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                            enable_gqa=True)
    assert _rel(out, want) < 1e-2


@pytest.mark.parametrize("where", ["q", "k", "k_inf"])
def test_nan_and_inf_reach_the_rows_that_see_them(where):
    """The fused kernels (selection, attention, decode) on the GPU: a NaN in q spoils its row,
    a NaN or inf key every row that sees it (it ranks first in the selection), and no other
    row; the float64 dense oracle decides which rows."""
    from pisa_compile.kernels.reference import dense_attention
    q, k, v = _qkv(4096)
    t = q if where == "q" else k
    t[0, 1, 3000, 5] = float("inf") if where == "k_inf" else float("nan")
    want = torch.isnan(dense_attention(q.double(), k.double(), v.double(), is_causal=True))
    assert want.any() and not want.all()
    assert torch.equal(torch.isnan(_attn(q, k, v)), want)
    qd = q[:, :, -4:].contiguous()  # decode: the last 4 queries over the whole cache
    want_d = torch.isnan(dense_attention(qd.double(), k.double(), v.double()))
    got_d = pisa_attention(qd, k, v, enable_gqa=True, config=CFG)
    assert torch.equal(torch.isnan(got_d), want_d)


def test_dense_tail_rows_are_dense_and_the_rest_unchanged():
    """The default ``dense_tail`` on the fused path at 8K, bf16, GQA 4: the last rows (64,
    rounded up to a query tile) equal dense SDPA, the rows before them equal the call
    without a tail bit for bit, and a 1-query call (decode) runs dense SDPA."""
    q, k, v = _qkv(8192)
    cfg = CFG.replace(dense_tail=64)
    out = pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=cfg)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True)
    assert _rel(out[:, :, -64:], want[:, :, -64:]) < 1e-2
    assert _rel(out[:, :, :-64], want[:, :, :-64]) > 1e-2  # sparse: top_k=4 of 128 leaves
    assert torch.equal(out[:, :, :-64], _attn(q, k, v)[:, :, :-64])
    assert plan(q[:, :, -1:], k, v, config=cfg).attention == "sdpa"


def test_dense_tail_flash_matches_the_masked_path_under_compile(monkeypatch):
    """The tail without a key mask runs FlashAttention aligned bottom-right (no mask; a spy
    sees it return a tensor): its output and gradients equal SDPA under the tail's explicit
    mask, eager and compiled (fullgraph, static and dynamic shapes); with padding
    (``key_mask``) the masked path runs and agrees too."""
    from pisa_compile import ops
    from pisa_compile.kernels.geometry import dense_mask
    flash = ops._flash_lower_right
    ran = []

    def spy(*args):
        out = flash(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(ops, "_flash_lower_right", spy)
    q, k, v = _qkv(4096, grad=True)
    cfg = CFG.replace(dense_tail=64)
    km = torch.ones(1, 4096, dtype=torch.bool, device="cuda")
    km[0, :100] = False

    def f(q, k, v, key_mask):
        return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=cfg,
                              key_mask=key_mask)

    for key_mask in (None, km):
        for fn in (f, torch.compile(f, fullgraph=True),
                   torch.compile(f, fullgraph=True, dynamic=True)):
            torch._dynamo.reset()
            ran.clear()
            out = fn(q, k, v, key_mask)[:, :, -64:]
            assert ran == ([] if key_mask is not None else [True]), ran
            go = torch.randn_like(out)
            got = torch.autograd.grad(out, (q, k, v), go)
            m = dense_mask(1, 64, 4096, True, 4096 - 64, key_mask, "cuda")
            want_out = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, -64:], k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                attn_mask=m)
            want = torch.autograd.grad(want_out, (q, k, v), go)
            assert _rel(out, want_out) < 1e-2
            for a, b in zip(got, want):
                assert _rel(a, b) < 3e-2


@pytest.mark.parametrize("fold", [True, False], ids=["gqa_fold", "repeat_kv"])
def test_dense_sdpa_gradients_from_a_slice_under_compile(fold):
    """The op's masked dense SDPA as the tail's rows of a ``cat``, behind ``_ContiguousGrad``
    as in ``pisa_attention``: compiled gradients equal eager ones. Without the identity,
    Inductor gave the repeat-K/V form 0.93 relative error in dq, dk and dv
    (profiles/tail_grad_probe.json); the fold form failed inside the op in 2 of 4 runs."""
    from pisa_compile import ops
    from pisa_compile.kernels.geometry import dense_mask
    q, k, v = _qkv(4096, grad=True)
    km = torch.ones(1, 4096, dtype=torch.bool, device="cuda")
    km[0, :100] = False
    m = dense_mask(1, 64, 4096, True, 4096 - 64, km, "cuda")

    def f(q, k, v):
        tail = ops._ContiguousGrad.apply(ops._dense_sdpa(
            q[:, :, -64:], k, v, m, False, 0.125, True, max_rows=64 if fold else 10 ** 6))
        return torch.cat([q[:, :, :-64] * 2, tail], 2)[:, :, -64:]

    go = torch.randn(1, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
    want = torch.autograd.grad(f(q, k, v), (q, k, v), go)
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v), (q, k, v), go)
    for a, b in zip(got, want):
        assert _rel(a, b) < 3e-2


def test_llama_training_step_under_cuda_autocast():
    """The usual mixed-precision step on CUDA (float32 weights, ``torch.autocast`` in bfloat16
    around the call): every site rewritten (Llama's rotary step hands SDPA float32 q and k
    beside a bfloat16 v), no reference stage, and in the exact regime the loss and every
    weight's gradient equal eager autocast's within bfloat16 rounding."""
    import transformers
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).cuda().train()
    ids = torch.randint(0, 256, (2, 4096), device="cuda")
    am = torch.ones_like(ids)
    am[1, :500] = 0
    labels = ids.masked_fill(am == 0, -100)
    exact = {"min_seq_len": 0, "top_k": 64, "dense_tail": 0}  # 64 blocks of 64: every key

    def step(fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(input_ids=ids, attention_mask=am, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref = step(model)
    # The backend by function: the device's checkout is not pip-installed (no entry point).
    from pisa_compile.backend import pisa_backend
    loss, grads = step(torch.compile(
        model, backend=lambda gm, ex: pisa_backend(gm, ex, options=exact)))
    assert counters["pisa"]["rewritten"] == 2 and not counters["pisa"]["left_dense"]
    assert not counters["pisa"]["reference_select"], dict(counters["pisa"])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for name, g in grads.items():
        assert _rel(g, ref[name]) < 5e-2, name
