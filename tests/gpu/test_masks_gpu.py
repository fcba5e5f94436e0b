"""The calls users make with transformers' masks, compiled with ``backend="pisa"`` on CUDA:
every attention site is rewritten and no stage runs the PyTorch reference
(``counters["pisa"]["reference_*"]`` stays 0), and in the exact regime the outputs equal
dense attention's: ``model(ids)``, ``attention_mask`` of ones, a left-padded batch, and
greedy ``generate()`` with a ``DynamicCache`` (prefill and every decode step)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402

from pisa_compile.backend import pisa_backend  # noqa: E402

N = 2048
# Every leaf selected (2048 / 64 = 32 leaves): outputs must equal dense within bf16 rounding.
EXACT = dict(min_seq_len=0, block_size=64, top_k=64, query_tile=64)


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=N + 64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def _pisa(model):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend=lambda gm, ex: pisa_backend(gm, ex, options=EXACT))


def _stages():
    return {k: v for k, v in counters["pisa"].items() if k.startswith("reference_")}


def _close(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("form", ["no_mask", "ones", "left_padding"])
def test_masks_run_no_reference_stage(llama, form):
    B = 1 if form != "left_padding" else 2
    ids = torch.randint(0, 1000, (B, N), device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(1))
    kw = {}
    if form == "ones":
        kw["attention_mask"] = torch.ones(B, N, dtype=torch.long, device="cuda")
    elif form == "left_padding":
        am = torch.ones(B, N, dtype=torch.long, device="cuda")
        am[1, :700] = 0
        kw = dict(attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        dense = llama(ids, **kw).logits
        out = _pisa(llama)(ids, **kw).logits
    assert counters["pisa"]["rewritten"] == 2 and counters["pisa"]["left_dense"] == 0, \
        dict(counters["pisa"])
    assert _stages() == {}, _stages()
    real = slice(None) if form != "left_padding" else (1, slice(700, None))
    assert _close(out[real], dense[real]) < 2e-2


def test_generate_runs_no_reference_stage(llama):
    ids = torch.randint(0, 1000, (2, N), device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(2))
    am = torch.ones_like(ids)
    am[0, :300] = 0
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = llama.generate(input_ids=ids, attention_mask=am, **gen)
        forward = llama.forward
        llama.forward = _pisa(forward)
        try:
            out = llama.generate(input_ids=ids, attention_mask=am, **gen)
        finally:
            llama.forward = forward
    assert counters["pisa"]["left_dense"] == 0 and counters["pisa"]["rewritten"] >= 4
    assert _stages() == {}, _stages()
    # bf16 greedy decoding may flip a near-tied token; most must agree.
    new = out[:, N:] == ref[:, N:]
    assert new.float().mean() >= 0.75, (out[:, N:], ref[:, N:])


@pytest.mark.parametrize("form", ["no_mask", "ones", "left_padding"])
def test_sliding_window_model_equals_dense(form):
    """A Mistral-shaped stack with a 512-token window at 2048: every site is rewritten with
    the window as structure, runs no reference stage, and equals dense on every real token.
    Without ``attention_mask`` the sites run FlexAttention; with one (a key mask) PISA's
    Triton attention kernels over the window's blocks: traced FlexAttention gave wrong rows
    with left padding (0.31 relative error), so no site may plan it, nor dense SDPA."""
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=N + 64, sliding_window=512,
                        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    B = 2
    ids = torch.randint(0, 1000, (B, N), device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(3))
    am = torch.ones(B, N, dtype=torch.long, device="cuda")
    if form == "left_padding":
        am[1, :700] = 0
    kw = {} if form == "no_mask" else dict(attention_mask=am)
    with torch.no_grad():
        dense = model(ids, **kw).logits
        out = _pisa(model)(ids, **kw).logits
    assert counters["pisa"]["rewritten"] == 2 and counters["pisa"]["left_dense"] == 0, \
        dict(counters["pisa"])
    # Plans are counted per trace (several per site): every one took the same path.
    took = "flex_window" if form == "no_mask" else "triton_window"
    assert counters["pisa"][took] >= 2, dict(counters["pisa"])
    assert all(counters["pisa"][p] == 0 for p in ("flex_window", "triton_window", "window_sdpa")
               if p != took), dict(counters["pisa"])
    assert _stages() == {}, _stages()
    real = am.bool()
    assert _close(out[real], dense[real]) < 2e-2


def test_window_op_eager_matches_dense():
    """``pisa_attention(window=...)`` called eagerly on CUDA (compiled FlexAttention) against
    SDPA under the window's mask, with a KV-cache offset and padding, bf16."""
    from pisa_compile import PisaConfig, pisa_attention
    from pisa_compile.kernels.geometry import dense_mask
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(2, 8, 1000, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 2, 3000, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 2, 3000, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    km = torch.ones(2, 3000, dtype=torch.bool, device="cuda")
    km[1, :250] = False
    out = pisa_attention(q, k, v, is_causal=True, causal_offset=2000, window=700, key_mask=km,
                         enable_gqa=True, config=PisaConfig(min_seq_len=0))
    m = dense_mask(2, 1000, 3000, True, 2000, km, window=700)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                            enable_gqa=True)
    assert _close(out, want) < 1e-2


def test_nanogpt_buffer_runs_no_reference_stage():
    """nanoGPT's registered ``tril`` buffer becomes ``is_causal`` (checked per call on the
    device): no reference stage, output equal to eager dense."""
    from tests.test_lowering import NanoGPTAttention
    torch.manual_seed(0)
    model = NanoGPTAttention(d_model=256, n_head=4, block=N).to("cuda", torch.bfloat16).eval()
    x = torch.randn(2, N, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        dense = model(x)
        out = _pisa(model)(x)
    assert counters["pisa"]["rewritten"] == 1, dict(counters["pisa"])
    assert _stages() == {}, _stages()
    assert _close(out, dense) < 2e-2


@pytest.mark.parametrize("grad, compiled", [(False, False), (True, False), (False, True),
                                            (True, True)])
def test_window_op_with_padding_inside_the_windows(grad, compiled):
    """Left padding that reaches into the windows (the Mistral model case): the op on CUDA,
    on transposed q/k/v as a model hands them, equals SDPA under the window's mask on every
    row that sees a key (bf16, prefill), eager and compiled, forward and backward. Eagerly it
    runs FlexAttention; compiled, PISA's Triton kernels over the window's blocks
    (FlexAttention traced into the graph gave row 700 of the padded sequence, its one visible
    key itself, a 3.7 error on the H200, 73b6227; plans made while Dynamo traces are not
    counted, so the error bound is what tells the paths apart)."""
    from pisa_compile import PisaConfig, pisa_attention
    from pisa_compile.kernels.geometry import dense_mask
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, N, h, 64, device="cuda", dtype=torch.bfloat16,
                           generator=g).transpose(1, 2).requires_grad_(grad)
               for h in (8, 2, 2))
    am = torch.ones(2, N, dtype=torch.long, device="cuda")
    am[1, :700] = 0

    def f(q, k, v, am):
        return pisa_attention(q, k, v, is_causal=True, window=512, key_mask=am.bool(),
                              enable_gqa=True, config=PisaConfig(min_seq_len=0))

    torch._dynamo.reset()
    counters.clear()
    with torch.set_grad_enabled(grad):
        out = (torch.compile(f, fullgraph=True) if compiled else f)(q, k, v, am)
    if not compiled:
        assert counters["pisa"]["flex_window"] >= 1, dict(counters["pisa"])
    km = am.bool()
    m = dense_mask(2, N, N, True, 0, km, window=512)
    rows = m[:, 0].any(-1)  # [B, N]
    # Rows with no key see every key here (no NaN to reach the gradients); never compared.
    # The reference is fp32 math SDPA: on the H200 (torch 2.11) bf16 SDPA's own gradients
    # under this bool mask were 1.36 away from fp32's after an eager FlexAttention call
    # with grad in the same process (the test's eager case), while PISA's stayed 0.0025.
    q32, k32, v32 = (t.detach().float().requires_grad_(grad) for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = torch.nn.functional.scaled_dot_product_attention(
            q32, k32, v32, attn_mask=m | ~rows[:, None, :, None], enable_gqa=True)
    err = (out.float() - want).abs().amax(-1).amax(1)  # [B, N]
    assert err[rows].max() < 5e-2, (err * rows).argmax().item()
    if grad:  # gradients through the rows that see a key
        go = torch.randn_like(out) * rows[:, None, :, None]
        got = torch.autograd.grad(out, (q, k, v), go)
        for a, b in zip(got, torch.autograd.grad(want, (q32, k32, v32), go.float())):
            assert _close(a, b) < 3e-2


def test_mask_read_at_run_time_trains_on_the_gpu():
    """A causal AND padding mask that reaches the compiled graph as an input (built in another
    graph: DDP's bucket split, FSDP2's per-layer graphs) with gradients wanted: the op reads
    it at run time and runs PISA's kernels, and its backward (the forward again, with
    autograd, inside ``pisa::structured_from_mask_backward``) gives fp32 SDPA's gradients in
    the exact regime (bf16). Right padding: every row sees a key."""
    import torch.nn.functional as F

    from pisa_compile.kernels.geometry import dense_mask
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(2, N, h, 64, device="cuda", dtype=torch.bfloat16,
                           generator=g).transpose(1, 2).requires_grad_()
               for h in (8, 2, 2))
    km = torch.arange(N, device="cuda")[None, :] < torch.tensor([[N], [N - 300]], device="cuda")
    m = dense_mask(2, N, N, True, 0, km)

    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(f, backend=lambda gm, ex: pisa_backend(gm, ex, options=EXACT))(
        q, k, v, m)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), go)
    assert counters["pisa"]["runtime_mask_structured"] == 2, dict(counters["pisa"])
    assert counters["pisa"]["runtime_mask_backward"] == 1, dict(counters["pisa"])
    assert not _stages(), _stages()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=m, enable_gqa=True)
    assert _close(out, want) < 1e-2
    for a, b in zip(got, torch.autograd.grad(want, (q32, k32, v32), go.float())):
        assert _close(a, b) < 3e-2


def test_right_padding_selects_as_the_sequence_alone(llama):
    """Lossy selection (4 of 32 leaves) on the Triton path: a 1500-token sequence alone and
    as the right-padded row of a 2048-token batch gives the same logits on its real rows
    (the padding queries vote for nothing where the pass proves self-attention), within
    bf16 rounding of the two runs, and no stage runs the reference."""
    lossy = dict(min_seq_len=0, block_size=64, top_k=4, query_tile=64, dense_tail=0)
    L = 1500
    ids = torch.randint(0, 1000, (2, N), device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(5))
    ids[1, :L] = ids[0, :L]
    am = torch.ones(2, N, dtype=torch.long, device="cuda")
    am[1, L:] = 0
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(llama, backend=lambda gm, ex: pisa_backend(gm, ex, options=lossy))
    with torch.no_grad():
        alone = f(ids[1:, :L], attention_mask=am[1:, :L]).logits[0]
        batch = f(ids, attention_mask=am).logits[1, :L]
    assert _stages() == {}, _stages()
    # The tile where padding starts (rows 1472..1499) is the one the padding voted in.
    tail = slice(L // 64 * 64, L)
    assert _close(batch[tail], alone[tail]) < 5e-3, _close(batch[tail], alone[tail])


def test_left_padding_computes_as_the_sequence_alone(llama):
    """Lossy selection on the Triton path, the dense tail on: a 1500-token sequence alone and
    left-padded by 548 (not a multiple of the block or the query tile) in a 2048-token
    batch, positions counted from its first token as ``generate()`` does, gives the same
    logits on its real rows within bf16 rounding of the two runs (the rows' tiles and
    leaves start at the first real token); no stage runs the reference."""
    lossy = dict(min_seq_len=0, block_size=64, top_k=4, query_tile=64, dense_tail=64)
    L = 1500
    ids = torch.randint(0, 1000, (2, N), device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(6))
    am = torch.ones(2, N, dtype=torch.long, device="cuda")
    am[1, :N - L] = 0
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(llama, backend=lambda gm, ex: pisa_backend(gm, ex, options=lossy))
    with torch.no_grad():
        alone = f(ids[1:, N - L:]).logits[0]
        batch = f(ids, attention_mask=am, position_ids=pos).logits[1, N - L:]
    assert _stages() == {}, _stages()
    assert _close(batch, alone) < 5e-3, _close(batch, alone)


def test_mask_read_at_run_time_with_the_reference_kernel_on_the_gpu():
    """``kernel="reference"`` on CUDA reads an unproved causal AND left-padding mask at run time
    too (before, only the Triton path did: the reference then selected under the raw mask,
    without the dense tail or the padded row's alignment, as on the CPU until 5 December
    2026). Lossy regime: the padded row equals its sequence alone, and the tail dense."""
    import torch.nn.functional as F

    from pisa_compile import PisaConfig, pisa_attention
    from pisa_compile.kernels.geometry import dense_mask
    g = torch.Generator(device="cuda").manual_seed(7)
    n, left, tail = 512, 37, 64
    q = torch.randn(2, 4, n, 64, device="cuda", generator=g)
    k, v = (torch.randn(2, 2, n, 64, device="cuda", generator=g) for _ in range(2))
    km = torch.arange(n, device="cuda")[None, :] >= torch.tensor([[left], [0]], device="cuda")
    m = dense_mask(2, n, n, True, 0, km)
    opts = dict(min_seq_len=0, block_size=16, top_k=2, query_tile=16, dense_tail=tail,
                kernel="reference")

    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(f, backend=lambda gm, ex: pisa_backend(gm, ex, options=opts))(q, k, v, m)
    assert counters["pisa"]["runtime_mask_structured"] == 1, dict(counters["pisa"])
    alone = pisa_attention(q[:1, :, left:], k[:1, :, left:], v[:1, :, left:], is_causal=True,
                           enable_gqa=True, config=PisaConfig(**opts))
    torch.testing.assert_close(out[:1, :, left:], alone, atol=1e-4, rtol=1e-4)
    dense = f(q, k, v, m)
    torch.testing.assert_close(out[:, :, -tail:], dense[:, :, -tail:], atol=1e-4, rtol=1e-4)
