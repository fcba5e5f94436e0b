"""Masks the pass could not prove, read at run time, and windows on the Triton kernels
(issue #14), on the CPU through Triton's interpreter.

- ``ops.mask_structure`` is sound (whatever it returns stands for exactly the mask it read)
  and finds causal AND padding masks at offsets 0 and ``Nk - Nq``, bool or float.
- ``pisa_attention`` with such an explicit mask (what a model hands attention when its mask
  was built in another graph) runs the structured path (a counter says so) and in the exact
  regime equals dense SDPA; any other mask runs dense SDPA under it.
- A sliding window with a key mask runs the Triton attention kernels over the window's
  blocks (``plan`` says ``triton-window``), forward and backward equal to dense under the
  window's mask.
"""

from __future__ import annotations

import pytest

from tests.interpreter import use_interpreter

use_interpreter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

pytest.importorskip("triton")

from pisa_compile import PisaConfig, pisa_attention  # noqa: E402
from pisa_compile.kernels.geometry import dense_mask  # noqa: E402
from pisa_compile.kernels.window import window_blocks  # noqa: E402
from pisa_compile.ops import mask_structure, plan  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
EXACT = PisaConfig(block_size=16, top_k=64, min_seq_len=0, kernel="triton")


def _padding(B, Nk, pads, left):
    pos = torch.arange(Nk)[None, :]
    pad = torch.tensor(pads)[:, None]
    return pos >= pad if left else pos < Nk - pad


@st.composite
def masks(draw):
    """A structured mask (causal at offset 0 or ``Nk - Nq``, with padding) or a look-alike
    (a window, a strict diagonal, one flipped entry, a per-head mask, a finite bias)."""
    B = draw(st.integers(1, 3))
    Nq = draw(st.integers(1, 60))
    Nk = draw(st.integers(Nq, 80))
    off = draw(st.sampled_from([0, Nk - Nq]))
    km = _padding(B, Nk, [draw(st.integers(0, Nk)) for _ in range(B)], draw(st.booleans()))
    m = dense_mask(B, Nq, Nk, True, off, km).clone()
    kind = draw(st.sampled_from(["structured", "window", "strict", "flip", "heads", "bias",
                                 "nan"]))
    if kind == "window":
        m &= dense_mask(B, Nq, Nk, True, off, window=draw(st.integers(1, Nk)))
    elif kind == "strict":  # j < i + offset
        m &= dense_mask(B, Nq, Nk, True, off - 1)
    elif kind == "flip":
        i, j = draw(st.integers(0, Nq - 1)), draw(st.integers(0, Nk - 1))
        m[draw(st.integers(0, B - 1)), 0, i, j] ^= True
    elif kind == "heads":
        m = torch.cat([m, m], dim=1)
    as_float = draw(st.booleans())
    if as_float:
        dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
        fill = draw(st.sampled_from([torch.finfo(dtype).min, float("-inf")]))
        m = torch.zeros(m.shape, dtype=dtype).masked_fill(~m, fill)
        if kind == "bias":
            m[0, 0, 0, 0] -= 1.5 if m[0, 0, 0, 0] == 0 else 0.0
        elif kind == "nan":  # a NaN entry turns its row NaN: never a mask
            m[0, 0, -1, 0] = float("nan")
    return m, Nq, Nk, kind, (km, off)


@settings(max_examples=200, deadline=None)
@given(masks())
def test_mask_structure_is_sound_and_finds_causal_padding(case):
    m, Nq, Nk, kind, (km, off) = case
    found = mask_structure(m, Nq, Nk)
    if kind == "nan" and m.is_floating_point():
        assert found is None
    if found is not None:  # sound: the structure stands for exactly this mask
        key_mask, offset = found
        want = m[:, 0] if m.dtype == torch.bool else m[:, 0] == 0
        got = dense_mask(m.shape[0], Nq, Nk, True, offset, key_mask)[:, 0]
        assert torch.equal(got, want), (kind, offset)
    elif kind == "structured":
        pytest.fail(f"a causal (offset {off}) padding mask was not found")


def test_explicit_structured_mask_runs_the_structured_path_exactly(fresh_dynamo):
    """Causal AND left padding, given as a bool mask (as from another graph): the exact regime
    equals SDPA under the mask on every row that sees a key, through the structured path."""
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, N = 2, 2, 3, 90
    q = torch.randn(B, Hkv * G, N, 16, generator=g)
    k, v = (torch.randn(B, Hkv, N, 16, generator=g) for _ in range(2))
    km = _padding(B, N, [0, 13], True)
    m = dense_mask(B, N, N, True, 0, km)
    counters.clear()
    out = pisa_attention(q, k, v, attn_mask=m, enable_gqa=True, config=EXACT)
    assert counters["pisa"]["runtime_mask_structured"] == 1, dict(counters["pisa"])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    rows = m[:, 0].any(-1)  # [B, N]
    diff = (out - want).abs().amax(-1).amax(1)
    assert diff[rows].max() < 1e-5
    # Rows of padding only (they see no key) come out zero, never NaN.
    assert torch.equal(out.transpose(1, 2)[~rows], torch.zeros_like(out.transpose(1, 2)[~rows]))


@pytest.mark.parametrize("bias", [False, True])
def test_explicit_other_mask_runs_as_planned_before(fresh_dynamo, bias):
    """A strict diagonal (``j < i``), or a mask with a finite bias, is no structure the op
    has: with ``kernel="triton"`` the reference selection and the Triton kernels under the
    mask (``kernel="auto"`` on CUDA: dense SDPA), here in the exact regime: SDPA's output."""
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 90, 16, generator=g) for _ in range(3))
    m = dense_mask(1, 90, 90, True, -1)
    m[:, :, 0, 0] = True  # row 0 sees key 0 (no empty row for SDPA)
    if bias:  # causal, with one finite bias entry
        m = torch.zeros(1, 1, 90, 90).masked_fill(~dense_mask(1, 90, 90, True, 0), -torch.inf)
        m[0, 0, 40, 3] = -1.5
    counters.clear()
    out = pisa_attention(q, k, v, attn_mask=m, config=EXACT)
    assert counters["pisa"]["runtime_mask_unstructured"] == 1, dict(counters["pisa"])
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m))


def test_structured_mask_under_compile_from_a_graph_input(fresh_dynamo):
    """The mask as an input of the compiled graph (nothing to prove there): the op reads it at
    run time, and the compiled call equals the eager dense one."""
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 70, 16, generator=g)
    k, v = (torch.randn(2, 2, 70, 16, generator=g) for _ in range(2))
    m = dense_mask(2, 70, 70, True, 0, _padding(2, 70, [5, 0], True))

    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    counters.clear()
    got = torch.compile(f, backend="pisa", options=dict(min_seq_len=0, kernel="triton",
                                                         block_size=16, top_k=64))(q, k, v, m)
    assert counters["pisa"]["runtime_mask_structured"] == 1, dict(counters["pisa"])
    rows = m[:, 0].any(-1)
    diff = (got - f(q, k, v, m)).abs().amax(-1).amax(1)
    assert diff[rows].max() < 1e-5


def _grads(f, q, k, v, w):
    for t in (q, k, v):
        t.grad = None
    out = f(q, k, v)
    (out * w).sum().backward()
    return out.detach(), [t.grad.clone() for t in (q, k, v)]


# Every block selected and no dense tail: the structured path's own kernels run every row.
EXACT_NO_TAIL = EXACT.replace(dense_tail=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("form", ["bool", "float"])
def test_mask_read_at_run_time_has_gradients(fresh_dynamo, compiled, form):
    """With gradients wanted, a bool mask is still read at run time (causal AND padding:
    PISA's selection and kernels, no dense tail here) and its backward, which runs that
    forward again with autograd, gives dense SDPA's gradients in the exact regime, eager and
    compiled (the mask a graph input, as from another graph). A float mask with gradients
    is not read (most are finite biases: a read and a second forward for dense SDPA's
    result) and runs as planned under it. Right padding: every row sees a key, so SDPA's
    gradients are defined everywhere."""
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(4)
    B, Hkv, G, N = 2, 2, 2, 70
    q = torch.randn(B, Hkv * G, N, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(B, Hkv, N, 16, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(B, Hkv * G, N, 16, generator=g)
    m = dense_mask(B, N, N, True, 0, _padding(B, N, [0, 13], False))
    if form == "float":
        m = torch.zeros(B, 1, N, N).masked_fill(~m, -torch.inf)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    counters.clear()
    run = (torch.compile(f, backend="pisa", options=dict(
        min_seq_len=0, kernel="triton", block_size=16, top_k=64, dense_tail=0)) if compiled
        else lambda q, k, v: pisa_attention(q, k, v, attn_mask=m, enable_gqa=True,
                                            config=EXACT_NO_TAIL))
    out, grads = _grads(run, q, k, v, w)
    if form == "bool":
        assert counters["pisa"]["runtime_mask_structured"] == 2, dict(counters["pisa"])
        assert counters["pisa"]["runtime_mask_backward"] == 1, dict(counters["pisa"])
    else:
        assert not any(k.startswith("runtime_mask") for k in counters["pisa"]), \
            dict(counters["pisa"])
    want, want_grads = _grads(f, q, k, v, w)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for name, got, ref in zip("qkv", grads, want_grads):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=lambda e: f"d{name}: {e}")


@pytest.mark.parametrize("dense_tail", [0, 64])
def test_mask_read_at_run_time_trains_as_the_structured_call(dense_tail):
    """Sparse regime (``top_k=2``): the gradients through a causal AND left-padding mask read
    at run time equal those of the same call given ``is_causal`` and the ``key_mask``
    (the same selection, recomputed in the backward), with and without a dense tail."""
    from torch._dynamo.utils import counters
    cfg = PisaConfig(block_size=16, top_k=2, min_seq_len=0, kernel="triton",
                     dense_tail=dense_tail)
    g = torch.Generator().manual_seed(8)
    B, Hkv, G, N = 2, 2, 3, 160
    q = torch.randn(B, Hkv * G, N, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(B, Hkv, N, 16, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(B, Hkv * G, N, 16, generator=g)
    km = _padding(B, N, [0, 37], True)
    m = dense_mask(B, N, N, True, 0, km)
    counters.clear()
    out, grads = _grads(lambda q, k, v: pisa_attention(q, k, v, attn_mask=m, enable_gqa=True,
                                                       config=cfg), q, k, v, w)
    assert counters["pisa"]["runtime_mask_backward"] == 1, dict(counters["pisa"])
    want, want_grads = _grads(lambda q, k, v: pisa_attention(
        q, k, v, is_causal=True, key_mask=km, enable_gqa=True, config=cfg), q, k, v, w)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    for name, got, ref in zip("qkv", grads, want_grads):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=lambda e: f"d{name}: {e}")


def test_mask_read_at_run_time_refuses_a_float_mask_with_gradients():
    """What the plan reads at run time: a bool mask with or without gradients; a float mask
    only without (with gradients it is most often a finite bias)."""
    q, k, v = (torch.randn(1, 2, 90, 16) for _ in range(3))  # past the dense tail's 64 rows
    m = dense_mask(1, 90, 90, True, 0)
    bias = torch.zeros(1, 1, 90, 90).masked_fill(~m, -torch.inf)
    for qq in (q, q.clone().requires_grad_()):
        assert plan(qq, k, v, attn_mask=m, config=EXACT).attention == "runtime-mask"
    assert plan(q, k, v, attn_mask=bias, config=EXACT).attention == "runtime-mask"
    assert plan(q.clone().requires_grad_(), k, v, attn_mask=bias,
                config=EXACT).attention != "runtime-mask"


@st.composite
def windowed(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3]))
    Nk = draw(st.integers(1, 200))
    Nq = draw(st.integers(1, Nk + 30))  # more queries than keys too (top-left causal)
    window = draw(st.integers(1, Nk))
    km = _padding(B, Nk, [draw(st.integers(0, Nk)) for _ in range(B)], draw(st.booleans()))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(B, Hkv * G, Nq, 16, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, Nk, 16, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, Nk, 8, generator=g, requires_grad=True)
    return q, k, v, window, max(Nk - Nq, 0), km, draw(st.sampled_from([4, 16]))


@settings(max_examples=20, deadline=None)
@given(windowed())
def test_triton_window_equals_dense_under_the_window(case):
    q, k, v, window, off, km, C = case
    cfg = PisaConfig(min_seq_len=0, kernel="triton", block_size=C, dense_tail=0)
    how = plan(q, k, v, None, True, config=cfg, window=window, causal_offset=off, key_mask=km)
    m = dense_mask(q.shape[0], q.shape[2], k.shape[2], True, off, km, window=window)
    reaches_key_0 = q.shape[2] - 1 + off < window  # then the window hides nothing
    assert reaches_key_0 or how.attention == "triton-window", how
    out = pisa_attention(q, k, v, is_causal=True, window=window, causal_offset=off, key_mask=km,
                         scale=0.3, enable_gqa=True, config=cfg)
    rows = m.any(-1, keepdim=True)
    want = torch.where(rows, F.scaled_dot_product_attention(
        q, k, v, attn_mask=m | ~rows, scale=0.3, enable_gqa=True), 0.0)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    go = torch.randn_like(out) * rows
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go),
                    torch.autograd.grad(want, (q, k, v), go)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


def test_window_blocks_cover_exactly_the_window_leaves():
    """Each tile lists, ascending, every leaf some row of it sees and no other."""
    for Nq, Nk, window, off, C, Tq in [(100, 100, 30, 0, 16, 64), (1, 257, 100, 256, 16, 64),
                                        (70, 300, 5, 230, 4, 16), (64, 64, 64, 0, 16, 64)]:
        bi, bc = window_blocks(Nq, Nk, window, off, C, Tq, torch.device("cpu"))
        m = dense_mask(1, Nq, Nk, True, off, window=window)[0, 0]
        for t in range(bc.shape[0]):
            rows = m[t * Tq:(t + 1) * Tq].any(0)
            want = sorted({j // C for j in torch.nonzero(rows).flatten().tolist()})
            n = int(bc[t])
            assert bi[t, :n].tolist() == want
            assert (bi[t, n:] == -1).all()


def test_op_with_an_explicit_mask_traces_in_one_graph(fresh_dynamo):
    """``pisa_attention`` called with a mask inside a function compiled with ``fullgraph``:
    the run-time path traces (its config travels as plain values), and reads the mask."""
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 80, 16, generator=g)
    k, v = (torch.randn(1, 2, 80, 16, generator=g) for _ in range(2))
    m = dense_mask(1, 80, 80, True, 0)

    def f(q, k, v, m):
        return pisa_attention(q, k, v, attn_mask=m, enable_gqa=True, config=EXACT)

    counters.clear()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, m)
    assert counters["pisa"]["runtime_mask_structured"] == 1, dict(counters["pisa"])
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                   enable_gqa=True),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_triton_window_compiles_past_one_query_tile(fresh_dynamo, dynamic):
    """Compiled, the window's block lists come from an opaque op: Inductor failed to lower
    their index arithmetic once a call had more than one 64-query tile (a new user's trial),
    and they must follow a symbolic length and offset."""
    cfg = PisaConfig(min_seq_len=0, kernel="triton", block_size=16)

    def f(q, k, v, km, off):
        return pisa_attention(q, k, v, is_causal=True, window=8, key_mask=km,
                              causal_offset=off, config=cfg, enable_gqa=True)

    g = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for n, off in ((65, 0), (130, 0), (97, 3)):
        q = torch.randn(2, 4, n, 16)
        k, v = (torch.randn(2, 2, n + off, 16) for _ in range(2))
        km = _padding(2, n + off, [0, 11], True)
        torch.testing.assert_close(g(q, k, v, km, off), f(q, k, v, km, off), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("kernel", ["auto", "triton", "reference"])
def test_the_note_for_an_unproved_mask_on_each_device_and_kernel(device, kernel):
    """The report's note for an explicit mask the pass did not prove (no GPU needed: the note
    is built from the device's type): read at run time everywhere; its other masks dense SDPA
    only on CUDA with ``kernel='auto'``, the reference selection elsewhere; and which
    kernels run the structure."""
    from pisa_compile.lowering.rewrite import _note_and_selects
    cfg = PisaConfig(min_seq_len=0, kernel=kernel)
    note, selects = _note_and_selects(4096, True, cfg, torch.device(device))
    assert "explicit mask: read at run time" in note, note
    dense = device == "cuda" and kernel == "auto"
    assert ("any other mask dense SDPA under the mask" in note) == dense, note
    assert ("any other mask the PyTorch reference selection" in note) == (not dense), note
    assert selects == (not dense)
    runs = {("cpu", "triton"): "Triton's interpreter", ("cuda", "triton"): "where they take",
            ("cuda", "auto"): "(the Triton kernels)"}.get((device, kernel),
                                                        "(the PyTorch reference)")
    assert runs in note, note


@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_report_says_where_an_unproved_mask_goes(fresh_dynamo, kernel):
    """A mask the pass cannot prove (a graph input): with ``kernel='triton'`` on the CPU the
    op reads it at run time through Triton's interpreter, and the report says so; with
    ``kernel='reference'`` it is read too, and the PyTorch reference selects on the structure
    it finds (a new user read the first as the second)."""
    import pisa_compile
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    m = torch.rand(1, 1, 64, 64, generator=g) > 0.2

    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    opts = dict(min_seq_len=0, block_size=16, dense_tail=0, kernel=kernel)
    (site,) = pisa_compile.explain(f, q, k, v, m, options=opts).sites
    assert "read at run time" in site.note, site.note
    if kernel == "triton":
        assert "interpreter" in site.note, site.note
    else:  # off CUDA the reference's structured path reads it too
        assert "any other mask the PyTorch reference selection" in site.note, site.note
    # A call the dense tail takes whole keeps the mask on its SDPA call: not "plain" (a new
    # user read that as the mask dropped).
    (site,) = pisa_compile.explain(f, q, k, v, m, options={**opts, "dense_tail": 64}).sites
    assert site.note.startswith("runs SDPA under its explicit mask: every query in the "
                                "dense tail"), site.note


def test_a_left_padded_row_under_a_mask_read_at_run_time_computes_as_alone():
    """A causal AND left-padding bool mask, read at run time (no proof of self-attention
    reaches the op): the rows are aligned to their first real token, and the padding
    queries see no key, so they vote for nothing; lossy selection, the dense tail on: the
    padded row equals the sequence alone within float rounding."""
    from pisa_compile.kernels.geometry import dense_mask
    g = torch.Generator().manual_seed(11)
    N, left = 230, 53
    cfg = PisaConfig(block_size=16, top_k=2, query_tile=16, dense_tail=16, min_seq_len=0,
                     kernel="triton")
    q = torch.randn(1, 4, N, 16, generator=g)
    k, v = (torch.randn(1, 2, N, 16, generator=g) for _ in range(2))
    keep = torch.arange(N)[None, :] >= left
    mask = dense_mask(1, N, N, True, 0, keep)
    out = pisa_attention(q, k, v, attn_mask=mask, enable_gqa=True, config=cfg)
    want = pisa_attention(q[:, :, left:], k[:, :, left:], v[:, :, left:], is_causal=True,
                          enable_gqa=True, config=cfg)
    torch.testing.assert_close(out[:, :, left:], want, atol=1e-5, rtol=1e-5)
    assert not out[:, :, :left].any()


@pytest.mark.parametrize("dense_tail", [0, 32])
def test_a_mask_built_before_a_graph_break_runs_as_the_proved_one_on_the_cpu(fresh_dynamo,
                                                                             dense_tail):
    """A causal AND padding mask built in another graph (a cache update that breaks the graph,
    as ``PisaCache``'s does) with ``kernel='auto'`` on the CPU: read at run time, the call
    keeps its dense tail and aligns the left-padded row, as the proved mask does. Before, the
    reference selection ran under the raw mask: the tail's rows 0.89 from dense and the padded
    row 0.87-1.33 from its sequence alone (a new user's finding)."""
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(3)
    B, N, left = 2, 160, 37
    q = torch.randn(B, 4, N, 16, generator=g)
    k, v = (torch.randn(B, 2, N, 16, generator=g) for _ in range(2))
    am = torch.ones(B, N, dtype=torch.bool)
    am[0, :left] = False

    def attn(q, k, v, am, brk):
        mask = torch.ones(N, N, dtype=torch.bool).tril()[None, None] & am[:, None, None, :]
        if brk:
            torch._dynamo.graph_break()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    opts = dict(min_seq_len=0, block_size=16, top_k=2, query_tile=16, dense_tail=dense_tail)
    proved = torch.compile(attn, backend="pisa", options=opts)(q, k, v, am, False)
    counters.clear()
    broken = torch.compile(attn, backend="pisa", options=opts)(q, k, v, am, True)
    assert counters["pisa"]["runtime_mask_structured"] == 1
    torch.testing.assert_close(broken, proved, atol=1e-5, rtol=1e-5)
    alone = pisa_attention(q[:1, :, left:], k[:1, :, left:], v[:1, :, left:], is_causal=True,
                           enable_gqa=True, config=PisaConfig(**opts))
    torch.testing.assert_close(broken[:1, :, left:], alone, atol=1e-5, rtol=1e-5)
    if dense_tail:
        dense = attn(q, k, v, am, False)
        torch.testing.assert_close(broken[:, :, -dense_tail:], dense[:, :, -dense_tail:],
                                   atol=1e-5, rtol=1e-5)
