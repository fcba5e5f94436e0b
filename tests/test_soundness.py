"""Soundness where a rewrite or the op could go silently wrong, each against the right value.

- An additive mask with scales or casts folded in after it still masks: future keys stay out
  of the selection (bit-identical outputs), and the exact regime equals eager.
- In-place writes between a site's first node and its last (into q, k, v, the mask or the
  scores, through any view) leave the site dense with the reason; the result equals eager.
- NaN and inf in q, k or the scale reach exactly the rows they reach in dense attention
  with masked keys left out (Hypothesis; reference and Triton under the interpreter), and
  gradients carry them. SDPA's backends differ at the edges (the fused CPU kernel returns
  zeros for a NaN query row; the math backend lets a masked NaN key spoil its row), so the
  oracle is the float64 dense attention of the tests.
- A finite additive bias counts in the selection: ``-1e4`` padding never displaces real keys.
- Empty problems (a zero batch, head or length) return what SDPA returns, eagerly and compiled.
- ``torch.func.grad``/``vjp``/``vmap`` over the op, and over a compiled model.
- ``nn.TransformerEncoderLayer``'s inference fast path is rewritten and equals eager.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import pisa_compile
from pisa_compile import PisaConfig, explain, pisa_attention, select_blocks
from pisa_compile.kernels.reference import dense_attention

EXACT = dict(min_seq_len=0, block_size=16, top_k=64)  # every block selected: equals SDPA
SPARSE = dict(min_seq_len=0, block_size=16, top_k=1, query_tile=16, sink_blocks=0,
              local_blocks=1)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


def _qkv(n=256, d=64, h=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, d, generator=g) for _ in range(3))


def _compiled(fn, options):
    torch._dynamo.reset()
    return torch.compile(fn, backend="pisa", options=options)


# -- additive masks with scales folded in ------------------------------------------------------

def _causal_min(n):
    i = torch.arange(n)
    return torch.where(i[None] <= i[:, None], 0.0, torch.finfo(torch.float32).min)


SCALED_MASKS = {
    "mask_then_div8": lambda q, k, v: ((q @ k.mT + _causal_min(q.shape[-2])) / 8).softmax(-1) @ v,
    "mask_then_mul": lambda q, k, v: ((q @ k.mT + _causal_min(q.shape[-2])) * 0.125)
    .softmax(-1) @ v,
    "mask_then_two_scales": lambda q, k, v: ((q @ k.mT + _causal_min(q.shape[-2])) / 2 / 4)
    .softmax(-1) @ v,
    "half_min_then_div": lambda q, k, v: ((q @ k.mT + _causal_min(q.shape[-2]) / 2) / 8)
    .softmax(-1) @ v,
}


@pytest.mark.parametrize("name", sorted(SCALED_MASKS))
def test_scaled_additive_mask_keeps_future_keys_out(name):
    fn = SCALED_MASKS[name]
    q, k, v = _qkv()
    f = _compiled(fn, SPARSE)
    out = f(q, k, v)
    k2 = k.clone()
    k2[:, :, 128:] = torch.randn(k2[:, :, 128:].shape) * 5  # keys queries < 128 must not see
    out2 = f(q, k2, v)
    assert torch.equal(out[:, :, :128], out2[:, :, :128])
    assert torch.equal(out, f(q, k, v))  # and the check is not vacuous: the run repeats
    assert not torch.equal(out[:, :, 128:], out2[:, :, 128:])


@pytest.mark.parametrize("name", sorted(SCALED_MASKS))
def test_scaled_additive_mask_exact_regime_equals_eager(name):
    fn = SCALED_MASKS[name]
    q, k, v = _qkv()
    torch.testing.assert_close(_compiled(fn, EXACT)(q, k, v), fn(q, k, v), atol=1e-5, rtol=1e-5)


def test_fp16_mask_cast_to_fp32_scores_still_masks():
    """fp16's finfo.min (-65504) added to fp16 scores masks; cast for fp32 q it must too."""
    q, k, v = _qkv(128)

    def fn(q, k, v):
        i = torch.arange(q.shape[-2])
        m = torch.where(i[None] <= i[:, None], 0.0, torch.finfo(torch.float16).min)
        s = (q.half() @ k.half().mT + m.half()) * 0.125
        return s.float().softmax(-1) @ v

    f = _compiled(fn, SPARSE)
    out = f(q, k, v)
    k2 = k.clone()
    k2[:, :, 64:] = 7.0
    assert torch.equal(out[:, :, :64], f(q, k2, v)[:, :, :64])


# -- in-place writes inside a site --------------------------------------------------------------

def _write_k(q, k, v):
    s = (q @ k.mT) * 0.25
    k.mul_(-3.0)
    return s.softmax(-1) @ v


def _write_q(q, k, v):
    s = (q @ k.mT) * 0.25
    q.mul_(2.0)
    return s.softmax(-1) @ v


def _write_scores(q, k, v):
    s = q @ k.mT
    s.div_(4)
    return s.softmax(-1) @ v


def _fill_scores_off_chain(q, k, v):
    m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    s = q @ k.mT
    s.mul_(0.25).masked_fill_(~m, float("-inf"))
    return s.softmax(-1) @ v


def _write_k_view(q, k, v):
    s = (q @ k.mT) * 0.25
    k.transpose(-1, -2)[..., 0, :] = 0.0  # a write through a view of k
    return s.softmax(-1) @ v


def _write_mask(q, k, v):
    m = torch.zeros(q.shape[-2], k.shape[-2])
    s = q @ k.mT * 0.25 + m
    m.fill_(-1e9)
    return s.softmax(-1) @ v


@pytest.mark.parametrize("fn", [_write_k, _write_q, _write_scores, _fill_scores_off_chain,
                                _write_k_view, _write_mask], ids=lambda f: f.__name__)
def test_in_place_writes_inside_a_site_leave_it_dense(fn):
    q, k, v = _qkv(64)
    want = fn(q.clone(), k.clone(), v.clone())
    got = _compiled(fn, EXACT)(q.clone(), k.clone(), v.clone())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    report = explain(fn, q.clone(), k.clone(), v.clone(), options=EXACT)
    assert len(report) == 1 and not report[0].rewritten, str(report)
    assert "write in place" in report[0].reason


def test_in_place_writes_outside_a_site_keep_it_rewritten():
    """A write before the scores (a KV-cache update) changes nothing the site reads later."""
    def fn(q, k, v):
        k.mul_(0.5)
        return (q @ k.mT * 0.25).softmax(-1) @ v
    q, k, v = _qkv(64)
    report = explain(fn, q, k.clone(), v, options=EXACT)
    assert report[0].rewritten, str(report)
    torch.testing.assert_close(_compiled(fn, EXACT)(q, k.clone(), v), fn(q, k.clone(), v),
                               atol=1e-5, rtol=1e-5)


# -- NaN and inf -----------------------------------------------------------------------------------

def _configs(exact: bool):
    kw = dict(EXACT) if exact else dict(SPARSE, block_size=8, query_tile=8, top_k=2)
    kw["dense_tail"] = 0  # the kernels on every row (the tail is SDPA's NaN rules)
    out = [PisaConfig(kernel="reference", **kw)]
    if not exact:  # box bounds (bound_block) meet NaN and inf keys on their own path
        out.append(PisaConfig(kernel="reference", bound_block=2, **kw))
    if INTERPRET:
        out.append(PisaConfig(kernel="triton", **kw))
    return out


@st.composite
def nan_problems(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(1, 96))
    causal = draw(st.booleans())
    where = draw(st.sampled_from(["q", "k", "k_inf"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, n, 16, generator=g)
    k = torch.randn(B, Hkv, n, 16, generator=g)
    v = torch.randn(B, Hkv, n, 16, generator=g)
    t = q if where == "q" else k
    b, h, i = (int(torch.randint(0, s, (), generator=g)) for s in t.shape[:3])
    t[b, h, i, int(torch.randint(0, 16, (), generator=g))] = (
        float("inf") if where == "k_inf" else float("nan"))
    return q, k, v, causal


@settings(max_examples=40)
@given(p=nan_problems(), exact=st.booleans())
def test_nan_and_inf_reach_the_rows_that_see_them(p, exact):
    """The rows dense attention makes NaN are NaN, and no other row is: in the exact regime
    and on the sparse path too (a NaN or inf key ranks first in the selection)."""
    q, k, v, causal = p
    want = torch.isnan(dense_attention(q, k, v, is_causal=causal))
    for cfg in _configs(exact):
        out = pisa_attention(q, k, v, is_causal=causal, enable_gqa=True, config=cfg)
        assert torch.equal(torch.isnan(out), want), cfg.kernel


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_nan_value_reaches_its_tile_and_the_tiles_that_select_its_block(kernel):
    """docs/limits.md: under ``is_causal`` a NaN value (key 100, leaf 6) reaches every row
    of its query tile, the 4 before it too (``0 * NaN`` in the block's product), no earlier
    tile, and a later tile exactly where its selection holds leaf 6 (keys rank it, not
    values)."""
    if kernel == "triton" and not INTERPRET:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    q, k, v = _qkv(256, d=16, h=1)
    v[0, 0, 100, 0] = float("nan")
    cfg = PisaConfig(kernel=kernel, min_seq_len=0, dense_tail=0, block_size=16, query_tile=16,
                     top_k=2)
    nan = torch.isnan(pisa_attention(q, k, v, is_causal=True, config=cfg)[0, 0]).any(-1)
    tiles = nan.view(16, 16)
    assert tiles[6].all() and not tiles[:6].any()
    holds = (select_blocks(q, k, is_causal=True, config=cfg)[0][0, 0] == 6).any(-1)
    assert torch.equal(tiles[7:].all(-1), holds[7:]) and torch.equal(tiles[7:].any(-1), holds[7:])
    assert not holds[7:].all()  # some tile that sees key 100 misses it


def test_nan_scale_gives_nan():
    q, k, v = _qkv(64)
    for cfg in _configs(False):
        assert torch.isnan(pisa_attention(q, k, v, is_causal=True, scale=float("nan"),
                                          config=cfg)).all()


@pytest.mark.parametrize("where", ["q", "k"])
def test_gradients_carry_nan(where):
    q, k, v = _qkv(64)
    (q if where == "q" else k)[0, 1, 20, 3] = float("nan")
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    dense_attention(*ref, is_causal=True).sum().backward()
    for cfg in _configs(True):
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        pisa_attention(*ts, is_causal=True, config=cfg).sum().backward()
        for a, b in zip(ts, ref):
            assert torch.isnan(a.grad).any() == torch.isnan(b.grad).any()
        nan_rows = torch.isnan(ts[0].grad).any(-1)
        if where == "q":  # dq is NaN on the NaN row only, as dense attention's
            assert torch.equal(nan_rows, torch.isnan(ref[0].grad).any(-1))
        else:
            # Every row that sees the NaN key has a NaN dq, and no row of another head. Dense
            # math's backward also makes the rows before it NaN (0 * NaN in the masked part of
            # the full product); PISA does so only for the rows of tiles that attend its block.
            sees = torch.zeros_like(nan_rows)
            sees[0, 1, 20:] = True
            assert bool((nan_rows | ~sees).all()) and not nan_rows[0, 0].any()


# -- finite additive biases ------------------------------------------------------------------------

@pytest.mark.parametrize("n_real", [700, 1000, 2000])
def test_finite_padding_bias_never_displaces_real_keys(n_real):
    """BERT's ``(1 - m) * -10000`` padding: a block of padding only is never picked while a
    real block is left out (it was 3.9 of 10.9 picks per tile before bias summaries)."""
    g = torch.Generator().manual_seed(n_real)
    N, C, top_k = 2048 + 512, 64, 8
    q, k = torch.randn(1, 2, N, 32, generator=g), torch.randn(1, 2, N, 32, generator=g)
    keep = (torch.arange(N) < n_real).float()
    bias = ((1 - keep) * -10000.0).view(1, 1, 1, N)
    cfg = PisaConfig(min_seq_len=0, block_size=C, top_k=top_k)
    bi, bc = select_blocks(q, k, attn_mask=bias, config=cfg)
    real_blocks = math.ceil(n_real / C)
    tiles = n_real // cfg.query_tile  # tiles of real queries only
    picked = bi[:, :, :tiles]
    padding_only = (picked >= real_blocks).sum(-1)
    real_picked = ((picked >= 0) & (picked < real_blocks)).sum(-1)
    assert bool(((padding_only == 0) | (real_picked == real_blocks)).all())


def test_bias_steers_selection_to_a_favoured_block():
    """A large positive bias on one block (the needle) gets it selected, as it gets the
    attention; pooled scores used to ignore it."""
    q, k, _ = _qkv(1024, 32, seed=3)
    bias = torch.zeros(1, 1, 1, 1024)
    bias[..., 300:316] = 30.0
    cfg = PisaConfig(min_seq_len=0, block_size=16, top_k=2, query_tile=16, sink_blocks=0,
                     local_blocks=1)
    bi, _ = select_blocks(q, k, attn_mask=bias, config=cfg)
    assert bool((bi[:, :, 20:] == 300 // 16).any(-1).all())  # every tile after the block


# -- empty problems ---------------------------------------------------------------------------------

EMPTY = {"H0": ((1, 0, 8, 16), (1, 0, 8, 16)), "B0": ((0, 2, 8, 16), (0, 2, 8, 16)),
         "Nq0": ((1, 2, 0, 16), (1, 2, 8, 16)), "Nk0": ((1, 2, 8, 16), (1, 2, 0, 16))}


@pytest.mark.parametrize("name", sorted(EMPTY))
def test_empty_problems_return_what_sdpa_returns(name):
    qs, ks = EMPTY[name]
    q, k, v = torch.randn(qs), torch.randn(ks), torch.randn(ks)
    want = F.scaled_dot_product_attention(q, k, v)
    for cfg in (PisaConfig(), PisaConfig(min_seq_len=0, block_size=4, top_k=1)):
        assert torch.equal(pisa_attention(q, k, v, config=cfg), want)
    bi, bc = select_blocks(q, k, config=PisaConfig(block_size=4, top_k=1, query_tile=4))
    assert bi.shape[:3] == (qs[0], ks[1], -(-qs[2] // 4)) and bc.shape == bi.shape[:3]
    assert bool((bc == 0).all()) and bool((bi == -1).all())
    f = _compiled(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), EXACT)
    assert torch.equal(f(q, k, v), want)


# -- activation checkpointing -------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["reference", "triton"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(kernel, use_reentrant):
    """``torch.utils.checkpoint`` around the op (transformers' ``gradient_checkpointing_enable``
    is non-reentrant by default): the same gradients as without it. The backward once read
    its saved tensors twice, which non-reentrant checkpointing refuses (CheckpointError)."""
    from torch.utils.checkpoint import checkpoint

    cfg = PisaConfig(min_seq_len=0, block_size=16, top_k=2, query_tile=16, dense_tail=0,
                     kernel=kernel)
    q, k, v = (t.requires_grad_() for t in _qkv(128, 16))

    def loss(q, k, v):
        return pisa_attention(q, k, v, is_causal=True, config=cfg).square().sum()

    loss(q, k, v).backward()
    want = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    checkpoint(loss, q, k, v, use_reentrant=use_reentrant).backward()
    for t, b in zip((q, k, v), want):
        torch.testing.assert_close(t.grad, b)


# -- torch.func ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dense_tail", [64, 0])
def test_func_grad_vjp_vmap_match_autograd(dense_tail):
    """With ``dense_tail=0`` the sparse op runs (40 queries are all in a 64-query tail: plain
    SDPA). A new user found ``torch.func.vjp`` over it raising "double backward": the vjp
    function runs after its transform exits, with ``create_graph`` on, over saved tensors
    of a dead level."""
    cfg = PisaConfig(min_seq_len=0, block_size=8, top_k=2, query_tile=8, dense_tail=dense_tail)
    q, k, v = _qkv(40, 16)

    def f(q, k=k, v=v):
        return pisa_attention(q, k, v, is_causal=True, config=cfg)

    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    f(q1, k1, v1).sum().backward()
    torch.testing.assert_close(torch.func.grad(lambda q: f(q).sum())(q), q1.grad)
    out, vjp = torch.func.vjp(f, q, k, v)
    for got, want in zip(vjp(torch.ones_like(out)), (q1.grad, k1.grad, v1.grad)):
        torch.testing.assert_close(got, want)
    batched = torch.func.vmap(lambda q: f(q[None])[0])(torch.stack([q[0], 2 * q[0]]))
    torch.testing.assert_close(batched[1], f(2 * q)[0])
    if dense_tail == 0:
        # Beneath the dead level a tensor that wants gradients could take a second
        # derivative of the vjp's result: that still raises.
        out, vjp = torch.func.vjp(f, q.clone().requires_grad_())
        with pytest.raises(RuntimeError, match="double backward"):
            vjp(torch.ones_like(out))


def test_vmap_folds_into_the_batch_and_matches_a_loop():
    """``torch.func.vmap`` over the sparse op (``dense_tail=0``), over q, k and v, over q
    alone at another dim with a key mask, and of per-example gradients: equal to a loop
    over the examples, and no warning (PyTorch's fallback looped and asked for an issue on
    its tracker about pisa's ops: a new user's finding)."""
    import warnings
    cfg = PisaConfig(min_seq_len=0, block_size=8, top_k=2, query_tile=8, dense_tail=0)
    g = torch.Generator().manual_seed(0)
    V, B, N, D = 3, 2, 48, 16
    q = torch.randn(V, B, 4, N, D, generator=g)
    k, v = (torch.randn(V, B, 2, N, D, generator=g) for _ in range(2))
    km = torch.rand(B, N, generator=g) > 0.2

    def f(q, k, v, km=None):
        return pisa_attention(q, k, v, is_causal=km is None, key_mask=km, enable_gqa=True,
                              config=cfg)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.func.vmap(f)(q, k, v)
        masked = torch.func.vmap(lambda q: f(q, k[0], v[0], km), in_dims=2)(q.movedim(0, 2))
        grads = torch.func.vmap(torch.func.grad(lambda q, k, v: f(q, k, v).pow(2).sum()))(
            q, k, v)
    torch.testing.assert_close(got, torch.stack([f(q[i], k[i], v[i]) for i in range(V)]))
    torch.testing.assert_close(masked, torch.stack([f(q[i], k[0], v[0], km) for i in range(V)]))
    for i in range(V):
        qi = q[i].clone().requires_grad_()
        f(qi, k[i], v[i]).pow(2).sum().backward()
        torch.testing.assert_close(grads[i], qi.grad)


def test_func_grad_over_a_compiled_model_and_compiled_grad():
    q, k, v = _qkv(64, 16)

    def loss(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    want = torch.func.grad(loss)(q)
    torch.testing.assert_close(torch.func.grad(_compiled(loss, EXACT))(q), want)
    torch.testing.assert_close(_compiled(torch.func.grad(loss), EXACT)(q), want)


def test_double_backward_raises():
    """A second derivative raises instead of coming back as zeros (a new user's gradient
    penalty lost its term silently: ``once_differentiable`` looked only at the incoming
    gradients, not at the saved q, k and v); one level of ``torch.func.grad`` still works.
    No dense tail: 40 queries would all be in it (plain SDPA, which raises on its own)."""
    cfg = PisaConfig(min_seq_len=0, block_size=8, top_k=2, query_tile=8, dense_tail=0)
    q, k, v = (t.requires_grad_() for t in _qkv(40, 16))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(pisa_attention(q, k, v, config=cfg).sum(), q, create_graph=True)

    def loss(q):
        return pisa_attention(q, k.detach(), v.detach(), config=cfg).sum()

    with pytest.raises(RuntimeError, match="double backward"):
        torch.func.grad(lambda q: torch.func.grad(loss)(q).pow(2).sum())(q.detach())
    assert torch.func.grad(loss)(q.detach()).abs().sum() > 0

    def vjp_norm(q):  # a vjp function run inside grad, after the vjp's level exited
        out, vjp = torch.func.vjp(lambda q: pisa_attention(q, k.detach(), v.detach(),
                                                           config=cfg), q)
        return vjp(torch.ones_like(out))[0].pow(2).sum()

    with pytest.raises(RuntimeError, match="double backward"):  # a review: zeros, silently
        torch.func.grad(vjp_norm)(q.detach())


# -- nn.TransformerEncoderLayer -----------------------------------------------------------------------

@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_transformer_encoder_fast_path_is_rewritten(norm_first, padding):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0,
                                       norm_first=norm_first, activation="gelu")
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 50, 64)
    kw = {}
    if padding:
        m = torch.zeros(2, 50, dtype=torch.bool)
        m[1, 40:] = True
        kw = dict(src_key_padding_mask=m)
    with torch.no_grad():
        want = enc(x, **kw)
        got = _compiled(enc, EXACT)(x, **kw)
        report = explain(enc, x, options=EXACT, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(report) == 2 and all(s.rewritten for s in report), str(report)
    assert report[0].form == "nn.TransformerEncoderLayer"


# -- small things -------------------------------------------------------------------------------------

def test_integral_numbers_are_accepted_as_options():
    np = pytest.importorskip("numpy")
    cfg = PisaConfig(top_k=np.int64(8), block_size=torch.tensor(32).item())
    assert type(cfg.top_k) is int and cfg == PisaConfig(top_k=8, block_size=32)
    with pytest.raises(ValueError, match="top_k must be an int"):
        PisaConfig(top_k=8.0)


def test_explain_says_when_a_site_runs_plain_sdpa():
    """An SDPA site below min_seq_len stays in the graph, and says why; a hand-written one
    becomes the op, whose note says it runs plain SDPA there."""
    q = torch.randn(1, 2, 64, 16)
    report = explain(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), q)
    assert not report[0].rewritten
    assert report[0].reason == "Nk=64 < min_seq_len=32768: the graph keeps its SDPA (Inductor)"
    assert "min_seq_len" in str(report)

    def hand(q):
        s = (q @ q.transpose(-2, -1)) * 0.25
        return s.softmax(-1) @ q
    (site,) = explain(hand, q).sites
    assert site.rewritten and site.note == "runs plain SDPA: Nk=64 < min_seq_len=32768"
    assert pisa_compile.plan(q, q, q, config=PisaConfig()).attention == "sdpa"


# -- NaN in keys no row may see, and NaN in masks -------------------------------------------------

def _configs_sparse_small():
    kw = dict(min_seq_len=0, block_size=8, query_tile=8, top_k=2)
    # bound_block: a NaN key must not reach a box some row scores (max/min propagate NaN).
    return [PisaConfig(kernel="reference", **kw),
            PisaConfig(kernel="reference", bound_block=2, **kw)] + (
        [PisaConfig(kernel="triton", **kw)] if INTERPRET else [])


@pytest.mark.parametrize("case", ["padding", "causal_beyond_queries", "packed_documents"])
def test_nan_in_keys_no_row_sees_changes_nothing(case):
    """A NaN key that a row may not see changes neither its output nor its tile's selection:
    padded keys, causal keys past the last query, and another document of a packed batch."""
    q, k, v = _qkv(96, 16)
    mask, causal = None, False
    if case == "padding":
        mask = (torch.arange(96) < 70).view(1, 1, 1, 96)
        bad_at = 80
    elif case == "causal_beyond_queries":
        q, causal, bad_at = q[:, :, :60].contiguous(), True, 80
    else:  # two documents split at key 50, each attending only itself
        doc = (torch.arange(96) >= 50).long()
        mask = (doc[:, None] == doc[None, :]).view(1, 1, 96, 96)
        bad_at = 45
    k_nan = k.clone()
    k_nan[0, 1, bad_at, 3] = float("nan")
    for cfg in _configs_sparse_small():
        if cfg.kernel == "triton" and mask is not None:
            continue  # masked selection runs the reference
        want = pisa_attention(q, k, v, attn_mask=mask, is_causal=causal, config=cfg)
        got = pisa_attention(q, k_nan, v, attn_mask=mask, is_causal=causal, config=cfg)
        rows = slice(50, 96) if case == "packed_documents" else slice(None)
        assert torch.equal(got[:, :, rows], want[:, :, rows]), cfg.kernel
        if case != "packed_documents":
            assert not torch.isnan(got).any()


def test_nan_in_a_float_mask_reaches_its_row():
    q, k, v = _qkv(64, 16)
    bias = torch.zeros(1, 1, 64, 64)
    bias[0, 0, 10, 5] = float("nan")
    want = torch.isnan(dense_attention(q, k, v, attn_mask=bias))
    for cfg in _configs_sparse_small():
        assert torch.equal(torch.isnan(pisa_attention(q, k, v, attn_mask=bias, config=cfg)),
                           want)


def test_zero_or_masked_float_mask_selects_as_the_bool_mask():
    """0 / -inf padding carries no finite bias: the selection is the bool mask's."""
    q, k, _ = _qkv(512, 32, seed=5)
    keep = (torch.arange(512) < 400).view(1, 1, 1, 512)
    cfg = PisaConfig(min_seq_len=0, block_size=16, top_k=3, query_tile=16)
    a = select_blocks(q, k, attn_mask=keep, config=cfg)
    b = select_blocks(q, k, attn_mask=torch.zeros(1, 1, 1, 512).masked_fill(~keep,
                                                                           float("-inf")),
                      config=cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# -- more in-place writes and scale signs ---------------------------------------------------------

def _relu_k_inplace(q, k, v):
    s = (q @ k.mT) * 0.25
    F.relu(k, inplace=True)
    return s.softmax(-1) @ v


def _write_through_mT(q, k, v):
    s = (q @ k.mT) * 0.25
    kt = k.mT
    kt.mul_(-3.0)
    return s.softmax(-1) @ v


@pytest.mark.parametrize("fn", [_relu_k_inplace, _write_through_mT], ids=lambda f: f.__name__)
def test_inplace_functions_and_attribute_views_leave_a_site_dense(fn):
    test_in_place_writes_inside_a_site_leave_it_dense(fn)


def test_negative_scale_after_an_additive_mask_stays_dense():
    def fn(q, k, v):
        m = torch.zeros(q.shape[-2], k.shape[-2])
        return ((q @ k.mT + m) * -0.125).softmax(-1) @ v
    q, k, v = _qkv(64)
    report = explain(fn, q, k, v, options=EXACT)
    assert not report[0].rewritten and "positive" in report[0].reason


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_a_row_that_sees_no_key_is_zero_whatever_sdpa_returns(monkeypatch, mask_kind):
    """The dense path zeroes a row whose every key is masked, whatever SDPA gives it: on the
    H200, fp16 SDPA under a bool mask gave such rows nonzero values (the batch row of
    padding only in ``test_key_masked_dense_rows_take_the_split_k_kernel`` ran 0.45 off).
    Here SDPA is replaced by one that averages V over every key for each row (what a
    kernel that ignores an all-masked row returns); the other rows keep their value."""
    from pisa_compile import ops
    real = F.scaled_dot_product_attention

    def averaging(q, k, v, attn_mask=None, **kw):
        out = real(q, k, v, attn_mask=attn_mask, **kw)
        if attn_mask is None:
            return out
        seen = (attn_mask if attn_mask.dtype == torch.bool else attn_mask > -math.inf).any(-1)
        mean = v.mean(-2, keepdim=True).expand(*out.shape[:-2], 1, v.shape[-1])
        return torch.where(seen.unsqueeze(-1).expand(out.shape), out, mean.expand(out.shape))
    monkeypatch.setattr(ops.F, "scaled_dot_product_attention", averaging)
    torch.manual_seed(0)
    B, Hkv, G, N, D = 3, 2, 4, 40, 8
    q = torch.randn(B, Hkv * G, N, D)
    k, v = torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)
    key_mask = torch.ones(B, N, dtype=torch.bool)
    key_mask[1, :10] = False
    key_mask[2] = False  # a row of padding only
    mask = key_mask[:, None, None, :].expand(B, 1, N, N)
    if mask_kind == "float":
        mask = torch.zeros(B, 1, N, N).masked_fill(~mask, torch.finfo(torch.float32).min)
    cfg = PisaConfig(min_seq_len=10 ** 6)  # below min_seq_len: the dense path
    out = pisa_attention(q, k, v, attn_mask=mask, enable_gqa=True, config=cfg)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    want = real(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                attn_mask=mask if mask_kind == "bool" else mask.masked_fill(
                    mask <= torch.finfo(torch.float32).min / 2, -math.inf))
    torch.testing.assert_close(out[:2], want[:2])
