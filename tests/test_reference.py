"""Properties of the PISA op on its reference path (DESIGN.md "The algorithm"): the exact
regime equals SDPA, sparse output equals SDPA under the selection's block mask, no leaks,
the selection's structure, gradients, bad input, and the op under torch.library/compile."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import pytest
from hypothesis import given, settings, strategies as st

from pisa_compile import PisaConfig, pisa_attention, plan, select_blocks
from pisa_compile.kernels import reference
from pisa_compile.kernels.geometry import block_width, forced_ranges, query_offset
from tests.select_check import opcheck_stages
from tests.strategies import (Problem, oracle, problems, selection_mask, sparse_configs,
                              tolerance)

EXACT = PisaConfig(block_size=16, top_k=64, min_seq_len=0, kernel="reference")


def _run(p: Problem, config: PisaConfig) -> torch.Tensor:
    return pisa_attention(p.q, p.k, p.v, attn_mask=p.attn_mask, is_causal=p.is_causal,
                          enable_gqa=True, config=config)


def _select(p: Problem, config: PisaConfig):
    return select_blocks(p.q, p.k, attn_mask=p.attn_mask, is_causal=p.is_causal,
                         enable_gqa=True, config=config)


def _has_key(p: Problem) -> torch.Tensor:
    return p.visibility().expand(p.q.shape[0], p.q.shape[1], -1, -1).any(-1)


# (a) exact regime ------------------------------------------------------------------------

@settings(max_examples=40)
@given(p=problems())
def test_exact_regime_equals_sdpa(p: Problem):
    """top_k covers every leaf: the sparse path must equal SDPA (and the float64 oracle)."""
    out = _run(p, EXACT)
    ref = oracle(p).to(p.q.dtype)
    torch.testing.assert_close(out, ref, **tolerance(p.q.dtype))
    sdpa = F.scaled_dot_product_attention(p.q, p.k, p.v, attn_mask=p.attn_mask,
                                          is_causal=p.is_causal, enable_gqa=True)
    # SDPA averages rows masked only by finfo.min; PISA (like SDPA with -inf) gives zeros there.
    rows = _has_key(p)
    torch.testing.assert_close(out[rows], sdpa[rows], **tolerance(p.q.dtype))


@settings(max_examples=15)
@given(p=problems(max_n=120))
def test_short_sequences_are_sdpa(p: Problem):
    """``Nk < min_seq_len`` is plain SDPA under the op's mask rules: equal to SDPA on every
    row that sees a key, zero on a row that sees none (SDPA itself averages a row masked
    only by ``finfo.min``), and equal to the float64 oracle."""
    cfg = PisaConfig(min_seq_len=p.k.shape[2] + 1)
    out = _run(p, cfg)
    sdpa = F.scaled_dot_product_attention(p.q, p.k, p.v, attn_mask=p.attn_mask,
                                          is_causal=p.is_causal, enable_gqa=True)
    rows = _has_key(p)
    torch.testing.assert_close(out[rows], sdpa[rows], **tolerance(p.q.dtype))
    assert not out[~rows].any()
    torch.testing.assert_close(out, oracle(p).to(p.q.dtype), **tolerance(p.q.dtype))


def test_dense_decode_step_passes_sdpa_no_mask(monkeypatch):
    """A decode step on the dense path (one query at the end of its cache, no padding) sees
    every key: SDPA gets no mask and keeps its fused GQA kernels; with padding it gets the
    mask, with the G query heads of a KV head as rows (K/V not expanded: the mask is far
    smaller). A per-head mask expands K/V instead. All equal the float64 oracle."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((attn_mask is not None, kw.get("is_causal"), kw.get("enable_gqa"),
                     k.shape[1]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 30, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cfg = PisaConfig(min_seq_len=100)
    out = pisa_attention(q, k, v, is_causal=True, causal_offset=29, enable_gqa=True, config=cfg)
    km = torch.ones(2, 30, dtype=torch.bool)
    km[1, :5] = False
    padded = pisa_attention(q, k, v, is_causal=True, causal_offset=29, enable_gqa=True,
                            key_mask=km, config=cfg)
    per_head = km[:, None, None, :].expand(2, 4, 1, 30).clone()
    per_head[0, 3, 0, 7] = False
    masked = pisa_attention(q, k, v, attn_mask=per_head, enable_gqa=True, config=cfg)
    assert seen == [(False, False, True, 2), (True, None, None, 2), (True, None, False, 4)]
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, sdpa(q, kk, vv))
    torch.testing.assert_close(padded, sdpa(q, kk, vv, attn_mask=km[:, None, None, :]))
    torch.testing.assert_close(masked, sdpa(q, kk, vv, attn_mask=per_head))


def test_dense_path_takes_masks_sdpa_refuses():
    """The dense path computes a float64 mask (or a half mask of another dtype than q) in
    float32, where SDPA would raise, and a GQA call with a mask equals the expanded heads."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 10, 8, generator=g)
    k, v = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    bias = torch.randn(1, 1, 10, 10, generator=g).double()
    bias[..., 2, :] = torch.finfo(torch.float64).min
    cfg = PisaConfig(min_seq_len=100)
    out = pisa_attention(q, k, v, attn_mask=bias, enable_gqa=True, config=cfg)
    with pytest.raises(RuntimeError, match="attn_mask dtype"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=bias.float())
    torch.testing.assert_close(out[:, :, [0, 1, 3, 4, 5, 6, 7, 8, 9]],
                               want[:, :, [0, 1, 3, 4, 5, 6, 7, 8, 9]])
    assert not out[:, :, 2].any()  # every key at finfo.min: masked, so zero
    half = pisa_attention(q.half(), k.half(), v.half(), attn_mask=bias.bfloat16(),
                          enable_gqa=True, config=cfg)
    torch.testing.assert_close(half.float(), out, atol=2e-2, rtol=2e-2)


# (b) sparse result = SDPA under the selection mask ---------------------------------------

@settings(max_examples=60)
@given(p=problems(), cfg=sparse_configs())
def test_sparse_equals_masked_dense(p: Problem, cfg: PisaConfig):
    out = _run(p, cfg)
    bi, bc = _select(p, cfg)
    sel = selection_mask(bi, p.q.shape[2], p.k.shape[2], cfg, p.G)
    torch.testing.assert_close(out, oracle(p, sel).to(p.q.dtype), **tolerance(p.q.dtype))


# (c) causality and masks: hidden keys change nothing -------------------------------------

@settings(max_examples=40)
@given(p=problems(dtypes=(torch.float32,), mask_kinds=("causal",), same_len=True),
       cfg=sparse_configs(), data=st.data(), explicit=st.booleans())
def test_future_keys_do_not_leak(p: Problem, cfg: PisaConfig, data, explicit: bool):
    """Perturbing keys and values after position ``i`` leaves outputs ``<= i`` bit-identical,
    for ``is_causal`` and for the same mask passed explicitly (as HF does)."""
    N = p.q.shape[2]
    i = data.draw(st.integers(0, N - 1))
    if explicit:
        p = Problem(p.q, p.k, p.v, torch.ones(N, N, dtype=torch.bool).tril(), False, "bool")
    out = _run(p, cfg)
    k2, v2 = p.k.clone(), p.v.clone()
    k2[:, :, i + 1:] = torch.randn_like(k2[:, :, i + 1:]) * 10
    v2[:, :, i + 1:] = torch.randn_like(v2[:, :, i + 1:]) * 10
    out2 = _run(Problem(p.q, k2, v2, p.attn_mask, p.is_causal, p.mask_kind), cfg)
    assert torch.equal(out[:, :, : i + 1], out2[:, :, : i + 1])


@settings(max_examples=30)
@given(p=problems(dtypes=(torch.float32,), mask_kinds=("key_padding", "bool")),
       cfg=sparse_configs())
def test_masked_keys_do_not_leak(p: Problem, cfg: PisaConfig):
    """Keys that no row of a tile can see never change that tile's outputs."""
    vis = p.visibility().expand(p.q.shape[0], p.q.shape[1], -1, -1)
    hidden_everywhere = ~vis.any(2).any(1)  # [B, Nk]: masked for every query and head
    k2, v2 = p.k.clone(), p.v.clone()
    noise_k, noise_v = torch.randn_like(k2) * 10, torch.randn_like(v2) * 10
    k2 = torch.where(hidden_everywhere[:, None, :, None], noise_k, k2)
    v2 = torch.where(hidden_everywhere[:, None, :, None], noise_v, v2)
    out = _run(p, cfg)
    out2 = _run(Problem(p.q, k2, v2, p.attn_mask, p.is_causal, p.mask_kind), cfg)
    assert torch.equal(out, out2)


# (d) selection structure ------------------------------------------------------------------

@settings(max_examples=60)
@given(p=problems(dtypes=(torch.float32,)), cfg=sparse_configs())
def test_selection_holds_forced_and_top_k(p: Problem, cfg: PisaConfig):
    bi, bc = _select(p, cfg)
    B, Hkv, T, M = bi.shape
    Nq, Nk = p.q.shape[2], p.k.shape[2]
    C, L = cfg.block_size, (Nk + cfg.block_size - 1) // cfg.block_size
    assert bi.dtype == torch.int32 and bc.dtype == torch.int32
    assert T == (Nq + cfg.query_tile - 1) // cfg.query_tile
    assert M == block_width(Nk, C, cfg.top_k, cfg.sink_blocks, cfg.local_blocks, cfg.query_tile)
    offset = query_offset(Nq, Nk, p.is_causal, explicit_mask=p.attn_mask is not None)
    n_sink, lo, hi = forced_ranges(torch.arange(T), Nq, Nk, offset, C,
                                   cfg.query_tile, cfg.sink_blocks, cfg.local_blocks)
    # Leaves each tile's rows can see at all (dense, test-side).
    vis = p.visibility().expand(B, p.q.shape[1], Nq, Nk)
    vis = F.pad(vis, (0, L * C - Nk, 0, T * cfg.query_tile - Nq))
    tile_sees = vis.view(B, Hkv, p.G, T, cfg.query_tile, L, C).any(-1).any(4).any(2)
    for b in range(B):
        for h in range(Hkv):
            for t in range(T):
                row = bi[b, h, t].tolist()
                n = int(bc[b, h, t])
                chosen = row[:n]
                assert all(x == -1 for x in row[n:])
                assert chosen == sorted(set(chosen)) and all(0 <= x < L for x in chosen)
                forced = set(range(n_sink)) | set(range(int(lo[t]), int(hi[t]) + 1))
                forced &= set(range(L))
                assert forced <= set(chosen)
                available = {x for x in range(L) if tile_sees[b, h, t, x]} - forced
                others = set(chosen) - forced
                assert others <= available
                assert len(others) == min(cfg.top_k, len(available))


# (e) gradients -----------------------------------------------------------------------------

@settings(max_examples=30)
@given(p=problems(max_n=120, dtypes=(torch.float64,)), cfg=sparse_configs())
def test_gradients_match_masked_dense(p: Problem, cfg: PisaConfig):
    q, k, v = (t.clone().requires_grad_() for t in (p.q, p.k, p.v))
    bi, _ = _select(p, cfg)
    sel = selection_mask(bi, p.q.shape[2], p.k.shape[2], cfg, p.G)
    vis = p.visibility() & sel
    go = torch.randn(p.q.shape[:3] + (p.v.shape[-1],), dtype=torch.float64)
    out = pisa_attention(q, k, v, attn_mask=p.attn_mask, is_causal=p.is_causal,
                         enable_gqa=True, config=cfg)
    got = torch.autograd.grad(out, (q, k, v), go)
    # Autograd through SDPA's math on the selection mask; hidden rows get zero grad_out.
    allowed, bias = reference.mask_parts(p.attn_mask)
    mask = vis if bias is None else torch.where(vis, bias, float("-inf"))
    rows = vis.expand(p.q.shape[0], p.q.shape[1], -1, -1).any(-1, keepdim=True)
    q2, k2, v2 = (t.clone().requires_grad_() for t in (p.q, p.k, p.v))
    safe = torch.where(rows, mask, True) if bias is None else torch.where(rows, mask, 0.0)
    ref = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=safe, enable_gqa=True)
    want = torch.autograd.grad(ref, (q2, k2, v2), go * rows)
    for g1, g2 in zip(got, want):
        torch.testing.assert_close(g1, g2, atol=1e-8, rtol=1e-7)


# (g) bad inputs -----------------------------------------------------------------------------

@pytest.mark.parametrize("case, match", [
    ("heads", "multiple of k heads"),
    ("gqa_flag", "enable_gqa"),
    ("rank", "q must be 4-D"),
    ("dtype", "k.dtype must equal q.dtype"),
    ("int", "must be a floating-point"),
    ("mask_shape", "attn_mask of shape"),
    ("mask_batch", "attn_mask of shape"),
    ("mask_dtype", "attn_mask must be bool or floating"),
    ("causal_and_mask", "cannot both be set"),
    ("dropout", "dropout_p must be 0.0"),
    ("v_len", "v must be"),
    ("config", "config must be a PisaConfig"),
    ("scale", "scale must be a float or None"),
    ("scale_meta", "scale must be a float or None .*meta device"),
    ("causal_int", "is_causal must be a bool"),
    ("mask_grad", "attn_mask must not require grad"),
    ("scale_grad", "scale must not require grad"),
    ("k_none", "k must be a torch.Tensor, got NoneType"),
    ("v_none", "v must be a torch.Tensor, got NoneType"),
])
def test_bad_inputs_name_the_argument(case, match):
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    kwargs = dict(enable_gqa=True)
    if case == "heads":
        k, v = torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16)
    elif case == "gqa_flag":
        kwargs = {}
    elif case == "k_none":
        k = None
    elif case == "v_none":
        v = None
    elif case == "rank":
        q = torch.randn(4, 8, 16)
    elif case == "dtype":
        k = k.double()
    elif case == "int":
        q, k, v = (t.to(torch.int32) for t in (q, k, v))
    elif case == "mask_shape":
        kwargs["attn_mask"] = torch.ones(3, 5, dtype=torch.bool)
    elif case == "mask_batch":  # broadcasts, but to a larger batch than q's
        kwargs["attn_mask"] = torch.ones(3, 1, 8, 8, dtype=torch.bool)
    elif case == "mask_dtype":
        kwargs["attn_mask"] = torch.ones(8, 8, dtype=torch.int64)
    elif case == "causal_and_mask":
        kwargs.update(attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True)
    elif case == "dropout":
        kwargs["dropout_p"] = 0.1
    elif case == "v_len":
        v = torch.randn(1, 2, 9, 16)
    elif case == "config":
        kwargs["config"] = {"top_k": 3}
    elif case == "scale":
        kwargs["scale"] = "x"
    elif case == "scale_meta":  # no value to read (was: "Tensor.item() cannot be called ...")
        kwargs["scale"] = torch.tensor(0.25, device="meta")
    elif case == "causal_int":
        kwargs["is_causal"] = 1
    elif case == "scale_grad":  # its gradient would be dropped silently
        kwargs["scale"] = torch.tensor(0.25, requires_grad=True)
    elif case == "mask_grad":
        kwargs["attn_mask"] = torch.zeros(1, 1, 8, 8, requires_grad=True)
    for cfg in (PisaConfig(), PisaConfig(min_seq_len=0)):  # the dense and the sparse path
        with pytest.raises((ValueError, TypeError), match=match):
            pisa_attention(q, k, v, **{"config": cfg, **kwargs})
    # plan() refuses what the op refuses (it takes GQA as given, and no dropout or scale).
    if case not in ("gqa_flag", "dropout", "scale", "scale_meta", "scale_grad"):
        plan_kw = {n: x for n, x in kwargs.items() if n in ("attn_mask", "is_causal", "config")}
        with pytest.raises((ValueError, TypeError), match=match):
            plan(q, k, v, **plan_kw)


def test_masks_of_any_rank_and_dtype_on_both_paths():
    """A 1-D mask that broadcasts, and a float64 mask with float32 inputs, give the same
    output on the dense and the sparse (exact) path, and the sparse path's backward runs
    (its matmuls take one dtype)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 12, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 12, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 12, 8, generator=g, requires_grad=True)
    for mask in (torch.rand(12, generator=g) > 0.3,
                 torch.randn(1, 1, 12, 12, generator=g, dtype=torch.float64)):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(1, 2, 12, 12)
                                              if mask.dtype == torch.bool else mask.float())
        for cfg in (PisaConfig(), EXACT):
            out = pisa_attention(q, k, v, attn_mask=mask, config=cfg)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
            wants = torch.autograd.grad(want.square().sum(), (q, k, v), retain_graph=True)
            for a, b in zip(grads, wants):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nq, nk", [(8, 0), (0, 8)])
def test_empty_problems_behave_like_sdpa(nq, nk):
    q, k = torch.randn(1, 2, nq, 16), torch.randn(1, 2, nk, 16)
    out = pisa_attention(q, k, k, config=PisaConfig(min_seq_len=0))
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, k))


def test_zero_head_dim_is_a_clear_error():
    q = torch.randn(1, 2, 8, 0)
    with pytest.raises(ValueError, match="head dim D"):
        pisa_attention(q, q, q)


def test_device_mix_is_rejected():
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="k must be on q's device"):
        pisa_attention(q, k.to("meta"), v)


def test_meta_inputs_give_meta_outputs():
    """q, k and v all on the meta device: shapes only, on the dense and the sparse path."""
    q = torch.randn(1, 4, 64, 16, device="meta")
    k = torch.randn(1, 2, 64, 16, device="meta")
    for cfg in (PisaConfig(), PisaConfig(min_seq_len=0, block_size=16)):
        out = pisa_attention(q, k, k, is_causal=True, enable_gqa=True, config=cfg)
        assert out.is_meta and out.shape == (1, 4, 64, 16)
    idx, cnt = select_blocks(q, k, enable_gqa=True, config=PisaConfig(block_size=16))
    assert idx.is_meta and cnt.shape == (1, 2, 4)
    with pytest.raises(ValueError, match="scale must be .*meta device"):
        select_blocks(q, k, scale=torch.tensor(0.25, device="meta"), enable_gqa=True)


@pytest.mark.parametrize("field, value, match", [
    ("block_size", 48, "block_size must be a power of two"),
    ("top_k", 0, "top_k must be >= 1"),
    ("branching", 1, "branching must be in"),
    ("beam", 0, "beam must be >= 1"),
    ("shortlist", 0, "shortlist must be >= 1"),
    ("bound_block", 3, "bound_block must be a power of two"),
    ("query_tile", 3, "query_tile must be a power of two"),
    ("leaf_scoring", "max", "leaf_scoring must be one of"),
    ("kernel", "cuda", "kernel must be one of"),
    ("min_seq_len", -1, "min_seq_len must be >= 0"),
    ("top_k", 2.5, "top_k must be an int"),
    ("dense_tail", -1, "dense_tail must be >= 0"),
    ("dense_tail", None, "dense_tail must be an int"),
    ("top_k", None, "top_k must be an int"),
])
def test_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        PisaConfig(**{field: value})


def test_option_values_resolve_against_top_k_and_block_size():
    """beam and shortlist never go below top_k (a user raising top_k need not raise them),
    a shortlist means nothing without exact scores, and a sub-block is at most a leaf."""
    opts = PisaConfig(top_k=200).selection_options()
    assert (opts["beam"], opts["shortlist"]) == (200, 200)
    assert PisaConfig(top_k=16, shortlist=8).selection_options()["shortlist"] == 16
    assert PisaConfig(leaf_scoring="pooled", shortlist=32).selection_options()["shortlist"] == 0
    assert PisaConfig(shortlist=None).selection_options()["shortlist"] == 0
    assert PisaConfig(beam=None, top_k=8).selection_options()["beam"] == 8
    assert PisaConfig(block_size=8).selection_options()["bound_block"] == 8
    assert PisaConfig(bound_block=None).selection_options()["bound_block"] == 0


def test_presets():
    assert PisaConfig.preset("quality") == PisaConfig()
    fast = PisaConfig.preset("fast", top_k=8)
    assert fast.selection_args() == (64, 8, 2, 8, 1, 2, 64, "pooled", 0, 0, 0)
    assert fast.min_seq_len == 2048
    with pytest.raises(ValueError, match="unknown preset 'turbo'; expected one of"):
        PisaConfig.preset("turbo")
    with pytest.raises(ValueError, match="unknown preset \\['fast'\\]"):
        PisaConfig.from_options({"preset": ["fast"]})
    # None is the defaults, as for the other keys (a new user got "unknown preset None").
    assert PisaConfig.from_options({"preset": None, "top_k": 8}) == PisaConfig(top_k=8)
    hint = "unknown option\\(s\\) 'topk' \\(did you mean 'top_k'\\?\\); valid: block_size"
    with pytest.raises(TypeError, match="PisaConfig.preset: " + hint):
        PisaConfig.preset("fast", topk=8)
    with pytest.raises(TypeError, match="PisaConfig: " + hint):
        PisaConfig(topk=8)
    with pytest.raises(TypeError, match="PisaConfig: " + hint):
        PisaConfig().replace(topk=8)


def test_a_config_built_inside_a_compiled_function_traces():
    """``pisa_attention`` without a config builds ``PisaConfig()`` in the traced code, and a
    function may build or change one: one graph, no break (``fullgraph=True``)."""
    q = torch.randn(1, 2, 32, 16)

    def f(q):
        cfg = PisaConfig(min_seq_len=0, block_size=8, top_k=2).replace(top_k=3)
        return pisa_attention(q, q, q, is_causal=True) + pisa_attention(
            q, q, q, is_causal=True, config=cfg)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(q), f(q))


def test_causal_needs_a_local_block():
    q = torch.randn(1, 1, 64, 16)
    with pytest.raises(ValueError, match="local_blocks >= 1"):
        pisa_attention(q, q, q, is_causal=True, config=PisaConfig(local_blocks=0, min_seq_len=0))
    with pytest.raises(ValueError, match="local_blocks >= 1"):  # short calls too, not later
        pisa_attention(q, q, q, is_causal=True, config=PisaConfig(local_blocks=0))


# the op under torch.library and torch.compile ------------------------------------------------

SPARSE = PisaConfig(block_size=8, top_k=2, query_tile=8, min_seq_len=0, dense_tail=0,
                    kernel="reference")


@pytest.mark.parametrize("mask", [None, "bool", "float", "structure"])
def test_opcheck(mask):
    q = torch.randn(1, 4, 40, 16, requires_grad=True)
    k = torch.randn(1, 2, 40, 16, requires_grad=True)
    v = torch.randn(1, 2, 40, 8, requires_grad=True)
    m, causal = None, mask in (None, "structure")
    if mask == "bool":
        m = torch.rand(1, 1, 40, 40) > 0.2
    elif mask == "float":
        m = torch.randn(1, 4, 40, 40).masked_fill(torch.rand(1, 4, 40, 40) > 0.8, float("-inf"))
    km, off = None, 0
    if mask == "structure":
        km, off = torch.arange(40)[None] >= 5, 2
    opcheck_stages(q, k, v, m, km, causal, off, SPARSE, "reference")


def _attn(q, k, v):
    return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=SPARSE)


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    q, k, v = torch.randn(2, 4, 50, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
    got = torch.compile(_attn, fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, _attn(q, k, v))


def test_compile_dynamic_lengths():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    f = torch.compile(_attn, dynamic=True, fullgraph=True)
    for n in (40, 57, 90, 129, 200):
        q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
        torch.testing.assert_close(f(q, k, v), _attn(q, k, v))
    assert counters["stats"]["unique_graphs"] <= 2


def test_training_step_under_compile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 48)

    def step(x):
        q, k, v = proj(x).view(1, 30, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return pisa_attention(q, k, v, is_causal=True, config=SPARSE).square().mean()

    x = torch.randn(1, 30, 16)
    loss = torch.compile(step, fullgraph=True)(x)
    loss.backward()
    got = [p.grad.clone() for p in proj.parameters()]
    proj.zero_grad()
    step(x).backward()
    for g1, g2 in zip(got, (p.grad for p in proj.parameters())):
        torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-4)


def test_large_finite_bias_rows_match_eager():
    """Every key of some rows carries -1e9 (a common ``(1 - m) * -1e9`` mask): those rows
    average the values, as eager softmax does, in the output and in the gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    bias = torch.zeros(64, 64)
    bias[:3] = -1e9
    cfg = PisaConfig(block_size=16, top_k=8, min_seq_len=0, dense_tail=0)  # the sparse rows
    out = pisa_attention(q, k, v, attn_mask=bias, config=cfg)
    ref = ((q @ k.mT) / 4 + bias).softmax(-1) @ v
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    go = torch.randn_like(out)
    for g1, g2 in zip(torch.autograd.grad(out, (q, k, v), go),
                      torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(g1, g2, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("compiled", [False, True])
def test_dense_tail_rows_equal_the_oracle(compiled):
    """``dense_tail=8``, ``query_tile=4``, 37 queries, G=2, left padding as ``key_mask``,
    reference kernels, float64: each row's tail rows equal dense attention (output and
    gradients), the other rows equal the run without a tail (a sparse one: ``top_k=1``),
    eagerly and compiled with dynamic shapes. The tail is counted in each row's own tokens
    (the rows are aligned to their first token): 37 tokens round it up to 9 rows, the
    left-padded row's 32 to 8."""
    from pisa_compile.kernels.geometry import dense_mask
    g = torch.Generator().manual_seed(3)
    q0 = torch.randn(2, 4, 37, 8, generator=g, dtype=torch.float64)
    k0, v0 = (torch.randn(2, 2, 37, 8, generator=g, dtype=torch.float64) for _ in range(2))
    km = torch.ones(2, 37, dtype=torch.bool)
    km[1, :5] = False
    cfg = PisaConfig(block_size=4, top_k=1, query_tile=4, min_seq_len=0, dense_tail=8,
                     kernel="reference")

    def run(q, k, v, config):
        return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, key_mask=km,
                              config=config)

    torch._dynamo.reset()
    f = torch.compile(run, backend="aot_eager", dynamic=True, fullgraph=True) if compiled \
        else run
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    out = f(q, k, v, cfg)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), go)
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q0, k0, v0))
    dense = F.scaled_dot_product_attention(
        q2, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1),
        attn_mask=dense_mask(2, 37, 37, True, 0, km))
    sparse = run(q2, k2, v2, cfg.replace(dense_tail=0))
    head = torch.tensor([28, 29])[:, None, None, None]  # each row's first tail row
    want = torch.where(torch.arange(37)[:, None] >= head, dense, sparse)
    torch.testing.assert_close(out, want)
    assert (want[:, :, :28] - dense[:, :, :28]).abs().max() > 1e-3  # the head is sparse
    for a, b in zip(got, torch.autograd.grad(want, (q2, k2, v2), go)):
        torch.testing.assert_close(a, b)


def test_a_recompiled_dynamic_graph_still_aligns_padded_rows():
    """``pisa_attention`` with a key mask, compiled with dynamic shapes, traced at 70 tokens
    and recompiled at 130: the second graph gives q and k their own length symbols, and the
    alignment's test of equal lengths must guard, not demand a proof (a review: the
    left-padded row's rows 80-111 were 0.78 from eager, unaligned, in the second graph)."""
    import functools
    f = functools.partial(pisa_attention, is_causal=True, enable_gqa=True, config=PisaConfig(
        min_seq_len=0, block_size=16, top_k=2, query_tile=16, dense_tail=16, kernel="reference"))
    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
    gen = torch.Generator().manual_seed(0)
    for n in (70, 130):
        q = torch.randn(2, 4, n, 16, generator=gen)
        k, v = (torch.randn(2, 2, n, 16, generator=gen) for _ in range(2))
        km = torch.arange(n)[None] >= torch.tensor([[0], [11]])
        out = g(q, k, v, key_mask=km)
        torch.testing.assert_close(out, f(q, k, v, key_mask=km), atol=1e-5, rtol=1e-5)
        alone = f(q[1:, :, 11:], k[1:, :, 11:], v[1:, :, 11:])
        torch.testing.assert_close(out[1:, :, 11:], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_dense_tail_gets_a_contiguous_gradient(monkeypatch, dynamic):
    """The dense tail's output passes through ``_ContiguousGrad`` before the op's ``cat``:
    the gradient that reaches the tail's SDPA is contiguous, not the ``cat`` gradient's
    slice (compiled with Inductor on the H200, masked SDPA with repeated K/V lost dq, dk
    and dv from such a slice: profiles/tail_grad_probe.json), eagerly and compiled
    (aot_eager, static and dynamic shapes); and the identity's gradient is exact."""
    from pisa_compile import ops
    dense, seen = ops._dense, []

    def spy(*args, **kwargs):
        out = dense(*args, **kwargs)
        if out.requires_grad:
            out.register_hook(lambda g: seen.append(g.is_contiguous()))
        return out

    monkeypatch.setattr(ops, "_dense", spy)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 37, 8, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    km = torch.ones(2, 37, dtype=torch.bool)
    km[1, :5] = False
    cfg = PisaConfig(block_size=4, top_k=1, query_tile=4, min_seq_len=0, dense_tail=8,
                     kernel="reference")

    def run(q, k, v):
        return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, key_mask=km,
                              config=cfg)

    out = run(q, k, v)
    want = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert seen == [True]
    monkeypatch.setattr(ops, "_dense", dense)  # Dynamo refuses hooks that read strides
    torch._dynamo.reset()
    f = torch.compile(run, backend="aot_eager", dynamic=dynamic, fullgraph=True)
    out = f(q, k, v)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)), want):
        torch.testing.assert_close(a, b)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ops._ContiguousGrad.apply, (x,))
    grad = torch.randn(3, 8, dtype=torch.float64)[:, ::2]
    (g_x,) = torch.autograd.grad(ops._ContiguousGrad.apply(x), x, grad)
    assert not grad.is_contiguous() and g_x.is_contiguous() and torch.equal(g_x, grad)


def test_short_calls_in_the_dense_tail_share_one_dynamic_graph():
    """Calls of at most ``dense_tail`` queries run plain SDPA; compiled with dynamic shapes,
    lengths on either side of the tail compile one graph each, not one per length (the
    plan's text must not format a symbolic ``Nq``)."""
    from torch._dynamo.utils import counters
    cfg = PisaConfig(dense_tail=16, block_size=8, query_tile=8, top_k=1, min_seq_len=0,
                     kernel="reference")

    def f(q, k, v):
        return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=cfg,
                              causal_offset=k.shape[2] - q.shape[2])

    torch._dynamo.reset()
    counters.clear()
    g = torch.compile(f, dynamic=True, backend="aot_eager")
    for n in (96, 5, 6, 7, 9, 17, 18, 19, 23):
        q, k, v = torch.randn(2, 4, n, 8), torch.randn(2, 2, 96, 8), torch.randn(2, 2, 96, 8)
        torch.testing.assert_close(g(q, k, v), f(q, k, v))
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


# exact leaf scores only for the candidates ------------------------------------------------

def _all_leaf_scores(p, sel, q_rows, k, mu_leaf, cnt_leaf, bias_leaf, pool, st, cand, row_ok,
                     t0, t1, scale, boxes=None):
    """The straightforward ``reference._leaf_scores``: exact scores for every leaf of the
    pool (the whole pool's keys gathered), then the shortlist's candidates."""
    r = reference
    B, H, nt, P = pool.shape
    if boxes is None or (sel.exact and not sel.shortlist):
        mu, bad = r._finite_nodes(r._gather_nodes(mu_leaf, pool), pool >= 0)
        term = r._node_term(p, bias_leaf, cnt_leaf, pool, t0, t1)
        pooled = r._lse_scores(q_rows, mu, term.masked_fill(bad[..., None, :], float("-inf")),
                               scale)
    else:
        pooled, bad = r._sub_block_scores(p, q_rows, boxes, pool, t0, t1, scale)
    if sel.exact and sel.shortlist:
        best = r._top(pooled, cand & (st == r.CLEAN), row_ok, sel.shortlist, bad)
        cand = cand & (best | (st == r.PARTIAL))
    exact_leaf = (st == r.PARTIAL) | ((st == r.CLEAN) & sel.exact)
    k_pos = pool.clamp(min=0)[..., None] * p.C + torch.arange(p.C)
    k_pos = torch.where(pool[..., None] >= 0, k_pos, -1).view(B, H, nt, P * p.C)
    kk = r._gather_nodes(F.pad(k, (0, 0, 0, p.L * p.C - p.Nk)), k_pos.clamp(min=0))
    s = torch.matmul(q_rows, kk.float().transpose(-1, -2)) * scale + r._bias_rows(p, k_pos, t0, t1)
    vis = r._visible_rows(p, k_pos, t0, t1)
    exact = torch.logsumexp(s.masked_fill(~vis, float("-inf")).view(B, H, nt, -1, P, p.C), -1)
    seen_bad = (~torch.isfinite(kk).all(-1) & vis.any(-2)).view(B, H, nt, P, p.C).any(-1)
    return (torch.where(exact_leaf[..., None, :], exact, pooled),
            torch.where(exact_leaf, seen_bad, bad), cand)


def _masks(kind, B, Hq, Nq, Nk, g):
    """Keys dropped for every query (their leaves stay CLEAN, so a shortlist is cut), and
    with "bool" a window (PARTIAL leaves at its edge) or with "float" an ALiBi-like bias."""
    drop = torch.rand(B, 1, 1, Nk, generator=g) < 0.2
    i, j = torch.arange(Nq)[:, None], torch.arange(Nk)
    if kind == "bool":
        return ~drop & (j > i - 120)
    if kind == "float":
        m = -0.01 * torch.arange(1, Hq + 1.0).view(1, Hq, 1, 1) * (Nk - j).float()
        return m.expand(B, Hq, Nq, Nk).masked_fill(drop, float("-inf"))
    return None


@pytest.mark.parametrize("case", [
    # (B, Hkv, G, Nq, Nk, causal, offset, key_mask, attn_mask, config options)
    (1, 2, 7, 700, 700, True, 0, True, None,  # ragged Nk, GQA 7, flat scan of 44 leaves
     dict(block_size=16, top_k=4, shortlist=8, bound_block=4, flat_leaves=512)),
    (2, 1, 3, 300, 300, False, 0, True, None,  # pyramid walk, a cut shortlist
     dict(block_size=8, top_k=3, shortlist=5, beam=6, bound_block=2, flat_leaves=0)),
    (1, 2, 2, 40, 517, True, 477, False, None,  # a few queries at the end of the keys
     dict(block_size=16, top_k=4, shortlist=6, bound_block=8)),
    (1, 1, 7, 200, 250, False, 0, False, "bool",
     dict(block_size=8, top_k=4, shortlist=4, bound_block=None)),
    (2, 2, 2, 180, 180, True, 0, True, "float", dict(block_size=8, top_k=4, shortlist=6)),
    (1, 2, 3, 257, 257, True, 0, False, None, dict(block_size=16, top_k=4, shortlist=None)),
    (1, 2, 3, 257, 257, False, 0, True, "bool", dict(block_size=16, top_k=4,
                                                     leaf_scoring="pooled")),
], ids=["flat-gqa7-ragged", "walk", "decode-offset", "bool-mask", "bias", "no-shortlist",
        "pooled"])
def test_exact_scores_only_for_candidates(case, monkeypatch):
    """``_leaf_scores`` scores only the candidates exactly: every entry the pick reads
    (``cand``, ``bad`` and the scores of candidates, hence the tile scores) equals the
    straightforward version's bit for bit, and so does the selection."""
    B, Hkv, G, Nq, Nk, causal, offset, use_km, mask, opts = case
    g = torch.Generator().manual_seed(Nk)
    dt = torch.float64 if mask == "float" else torch.float32  # float64 inputs, a float bias
    q = torch.randn(B, Hkv * G, Nq, 16, generator=g, dtype=dt)
    k = torch.randn(B, Hkv, Nk, 16, generator=g, dtype=dt) + torch.randn(16, generator=g)
    k[0, 0, Nk // 3] = float("nan")  # a bad leaf
    km = None
    if use_km:
        km = torch.ones(B, Nk, dtype=torch.bool)
        km[-1, :Nk // 5] = False  # left padding
        km[0, Nk // 2:Nk // 2 + 5] = False
    attn_mask = _masks(mask, B, Hkv * G, Nq, Nk, g)
    attn_mask = attn_mask.to(dt) if mask == "float" else attn_mask
    cfg = PisaConfig(**{"leaf_scoring": "exact", "min_seq_len": 0, **opts})
    args = (q, k, attn_mask, causal, 0.3)
    kw = dict(**cfg.selection_options(), key_mask=km, causal_offset=offset)
    new, seen = reference._leaf_scores, {"calls": 0, "cut": False}

    def both(p, sel, q_rows, k, mu, cnt, bias, pool, st, cand, row_ok, t0, t1, scale,
             boxes=None):
        a = (p, sel, q_rows, k, mu, cnt, bias, pool, st)
        rest = (row_ok, t0, t1, scale, boxes)
        s, bad, c = new(*a, cand, *rest)
        s0, bad0, c0 = _all_leaf_scores(*a, cand, *rest)
        assert torch.equal(c, c0) and torch.equal(bad & c, bad0 & c)
        read = (~c | bad)[..., None, :]  # what tile_scores masks
        # Not bit-exact: the matmuls have fewer key columns than the old full-pool ones.
        torch.testing.assert_close(s.masked_fill(read, 0), s0.masked_fill(read, 0), rtol=1e-6,
                                   atol=1e-6, equal_nan=True)
        assert torch.equal(reference._top(s, c, row_ok, 3, bad),
                           reference._top(s0, c0, row_ok, 3, bad0))
        seen["calls"] += 1
        n_clean = (cand & (st == reference.CLEAN)).sum(-1).max()
        seen["cut"] |= bool(sel.shortlist) and int(n_clean) > sel.shortlist
        return s, bad, c

    monkeypatch.setattr(reference, "_leaf_scores", both)
    got = reference.select_blocks(*args, **kw)
    monkeypatch.setattr(reference, "_leaf_scores", _all_leaf_scores)
    want = reference.select_blocks(*args, **kw)
    assert seen["calls"] and (seen["cut"] or not cfg.effective_shortlist)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_exact_scoring_gathers_the_shortlist_not_the_pool(monkeypatch):
    """A flat scan's pool is every leaf; exact scoring gathers the keys of at most
    ``shortlist`` + PARTIAL leaves per tile (the shortlist's cost), not the pool's."""
    cfg = PisaConfig(block_size=16, top_k=8, shortlist=16, bound_block=4, flat_leaves=512,
                     min_seq_len=0)
    B, Hkv, G, N, D, C = 1, 2, 2, 2048, 16, 16
    q, k = torch.randn(B, Hkv * G, N, D), torch.randn(B, Hkv, N, D)
    L = N // C
    widths, pools = [], []
    visible_rows, leaf_scores = reference._visible_rows, reference._leaf_scores

    def spy_vis(p, k_pos, t0, t1):
        widths.append(k_pos.shape[-1])  # the exact scores' gathered keys per tile
        return visible_rows(p, k_pos, t0, t1)

    def spy_leaf(p, sel, q_rows, k, mu, cnt, bias, pool, *rest):
        pools.append(pool.shape[-1])
        return leaf_scores(p, sel, q_rows, k, mu, cnt, bias, pool, *rest)

    monkeypatch.setattr(reference, "_visible_rows", spy_vis)
    monkeypatch.setattr(reference, "_leaf_scores", spy_leaf)
    for causal in (True, False):
        widths.clear(), pools.clear()
        reference.select_blocks(q, k, None, causal, D ** -0.5, **cfg.selection_options())
        p = reference._Problem.make(q, k, None, causal, C, cfg.query_tile)
        n_partial = int((reference.leaf_states(p)[0] == reference.PARTIAL).sum(-1).max())
        assert pools and set(pools) == {L}  # the flat scan: every leaf in the pool
        assert widths and max(widths) <= (cfg.effective_shortlist + n_partial) * C < L * C


def test_a_scale_that_wants_a_gradient_runs_where_none_is_taken():
    """Under ``torch.no_grad()`` a learned scale is a number like any other: no gradient is
    dropped, so it is not refused (with grad mode on it is, see the bad-input test)."""
    q = torch.randn(1, 2, 16, 8)
    with torch.no_grad():
        out = pisa_attention(q, q, q, scale=torch.tensor(0.25, requires_grad=True))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, scale=0.25))
