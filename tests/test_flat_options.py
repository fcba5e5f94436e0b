"""The ``flat_leaves`` option as a user meets it: ``explain`` says whether a site's selection is
the flat scan or the pyramid walk, options that the others leave unused warn once at
construction (never a preset's own values), and ``flat_leaves`` is bounded. CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import pisa_compile
from pisa_compile import PisaConfig
from pisa_compile.config import MAX_FLAT_LEAVES, PRESETS, split_options
from pisa_compile.kernels.geometry import cdiv, flat_beam, level_sizes


def _sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _hand(q, k, v):
    return (q @ k.mT * 0.25).softmax(-1) @ v


def _quiet(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with every warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


# -- 1. flat scan or pyramid walk -------------------------------------------------------------

def test_selection_kind_states_flat_or_walk_by_the_leaf_count():
    c = PisaConfig()
    assert c.selection_kind(512 * 64) == "flat scan (512 leaves <= flat_leaves 512)"
    assert c.selection_kind(512 * 64 + 1) == "pyramid walk (513 leaves, 4 levels; flat_leaves 512)"
    assert c.selection_kind(2048 * 64) == "pyramid walk (2048 leaves, 6 levels; flat_leaves 512)"
    assert c.selection_kind(1) == "flat scan (1 leaf <= flat_leaves 512)"
    assert c.selection_kind(None) == ("flat scan up to 512 leaves (32768 keys), pyramid walk "
                                      "past")
    fast = PisaConfig.preset("fast")
    assert fast.selection_kind(2048 * 64) == "pyramid walk (2048 leaves, 7 levels; flat_leaves=0)"
    # No flat scan, but a pyramid of one level: every leaf is in the first pool, no walk.
    assert fast.selection_kind(2048) == "single-level pool (all 32 leaves <= branching * beam = 32)"
    assert c.replace(flat_leaves=64).selection_kind(110 * 64) == (
        "single-level pool (all 110 leaves <= branching * beam = 120)")
    unused = PisaConfig(shortlist=None).selection_kind(2048 * 64)
    assert unused.startswith("pyramid walk (2048 leaves, 6 levels; flat_leaves unused: ")
    assert "shortlist" in unused


@pytest.mark.parametrize("kw", [{}, dict(flat_leaves=0), dict(shortlist=None),
                                dict(bound_block=None), dict(flat_leaves=40, block_size=16),
                                dict(beam=4, flat_leaves=100)])
def test_selection_kind_is_the_rule_the_kernels_use(kw):
    """Past the walk's own one-level pool (``L > branching * beam``), a call is a flat scan
    exactly where ``geometry.flat_beam`` raises the beam to one level."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shortlist=None with flat_leaves set warns
        c = PisaConfig(**kw)
    for n_keys in range(1, 700 * c.block_size, 37 * c.block_size // 8):
        kind = c.selection_kind(n_keys)
        assert kind.startswith(("flat scan (", "pyramid walk (", "single-level pool (")), kind
        one_level = len(level_sizes(n_keys, c.block_size, c.branching, c.effective_beam)) == 1
        assert kind.startswith("single-level") == (one_level and not kind.startswith("flat"))
        if not one_level:
            raised = flat_beam(n_keys, c.block_size, c.branching, c.effective_beam,
                               c.effective_flat_leaves, leaf_scoring=c.leaf_scoring,
                               shortlist=c.effective_shortlist,
                               bound_block=c.effective_bound_block) != c.effective_beam
            assert kind.startswith("flat scan") == raised, (n_keys, kind)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("fn", [_sdpa_causal, _hand], ids=["sdpa", "hand-written"])
def test_explain_states_flat_scan_or_walk(fn):
    q = torch.randn(1, 2, 256, 16)  # 64 leaves of 4 keys
    opts = dict(min_seq_len=0, dense_tail=0, block_size=4, top_k=4, beam=4)
    (site,) = pisa_compile.explain(fn, q, q, q, options={**opts, "flat_leaves": 64}).sites
    assert site.selection == "flat scan (64 leaves <= flat_leaves 64)"
    report = pisa_compile.explain(fn, q, q, q, options={**opts, "flat_leaves": 32})
    assert report.sites[0].selection == "pyramid walk (64 leaves, 4 levels; flat_leaves 32)"
    assert "selection: pyramid walk (64 leaves, 4 levels; flat_leaves 32)" in str(report)
    (site,) = pisa_compile.explain(fn, q, q, q, options={**opts, "preset": "fast"}).sites
    assert site.selection == "pyramid walk (64 leaves, 4 levels; flat_leaves=0)"


@pytest.mark.usefixtures("fresh_dynamo")
def test_explain_selection_symbolic_length_and_dense_sites():
    q = torch.randn(1, 2, 256, 16)
    torch._dynamo.mark_dynamic(q, 2)
    (site,) = pisa_compile.explain(_sdpa_causal, q, q, q,
                                   options=dict(min_seq_len=0, dense_tail=0)).sites
    assert site.selection == "flat scan up to 512 leaves (32768 keys), pyramid walk past"
    # A site that runs plain SDPA (below min_seq_len) selects nothing, so says nothing.
    (site,) = pisa_compile.explain(_hand, *torch.randn(3, 1, 2, 64, 16)).sites
    assert site.rewritten and site.note.startswith("runs plain SDPA")
    assert site.selection == "" and "selection" not in site.explanation


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("top_k, exact", [(64, True), (16, True), (15, False)])
def test_explain_says_when_every_leaf_is_selected(top_k, exact):
    """A user reading the report learns whether the sparse path is lossy at that length:
    ``top_k`` covering every leaf (16 here) is DESIGN.md's exact regime (a new user could
    not tell before)."""
    q = torch.randn(1, 2, 256, 16)
    (site,) = pisa_compile.explain(_sdpa_causal, q, q, q, options=dict(
        min_seq_len=0, block_size=16, top_k=top_k)).sites
    assert site.selection.endswith(f"; exact: top_k {top_k} covers all 16 leaves") == exact, \
        site.selection
    assert ("exact" in site.selection) == exact


@pytest.mark.usefixtures("fresh_dynamo")
def test_explain_selection_of_module_sites_reads_their_key_length():
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 100, 32)  # [L, B, E] = [100, 2, 32] inside: 25 leaves of 4
    opts = dict(min_seq_len=0, dense_tail=0, block_size=4, flat_leaves=24, top_k=4, beam=4)
    (site,) = pisa_compile.explain(lambda x: mha(x, x, x, need_weights=False)[0], x,
                                   options=opts).sites
    assert site.selection == "pyramid walk (25 leaves, 3 levels; flat_leaves 24)"


# -- 2. options that the others leave unused ---------------------------------------------------

def test_unused_options_warn_once_naming_option_value_and_why():
    with pytest.warns(UserWarning) as caught:
        PisaConfig.preset("fast", flat_leaves=512)
    assert len(caught) == 1 and caught[0].filename == __file__
    msg = str(caught[0].message)
    assert "flat_leaves=512 is ignored" in msg and "leaf_scoring='exact'" in msg
    assert "leaf_scoring='pooled'" in msg

    with pytest.warns(UserWarning) as caught:
        PisaConfig(leaf_scoring="pooled", shortlist=64, flat_leaves=1024)
    assert len(caught) == 1 and caught[0].filename == __file__  # one warning, both named
    msg = str(caught[0].message)
    assert "shortlist=64 is ignored" in msg and "flat_leaves=1024 is ignored" in msg

    with pytest.warns(UserWarning, match="flat_leaves=100 is ignored.*shortlist=None"):
        PisaConfig(shortlist=None, flat_leaves=100)
    with pytest.warns(UserWarning, match="shortlist=32 is ignored") as caught:
        PisaConfig(leaf_scoring="pooled").replace(shortlist=32)
    assert caught[0].filename == __file__
    with pytest.warns(UserWarning, match="shortlist=128 is ignored"):
        split_options({"preset": "fast", "shortlist": 128})  # 128 is not fast's value


def test_presets_defaults_and_off_values_do_not_warn():
    for name in PRESETS:
        cfg = _quiet(PisaConfig.preset, name)
        _quiet(cfg.replace, top_k=4)
        _quiet(PisaConfig.preset, name, top_k=4)
        _quiet(split_options, {"preset": name, "top_k": 4})
    _quiet(PisaConfig)
    _quiet(PisaConfig, leaf_scoring="pooled")  # shortlist and flat_leaves at their defaults
    _quiet(PisaConfig, leaf_scoring="pooled", shortlist=None, flat_leaves=0)  # off
    _quiet(PisaConfig.preset, "fast", flat_leaves=0, shortlist=None)
    _quiet(PisaConfig.preset, "quality", flat_leaves=1024, shortlist=64)  # used there
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warned = PisaConfig(leaf_scoring="pooled", shortlist=64)
    _quiet(warned.replace, top_k=8)  # warned when built; a copy warns only for its changes


def test_config_still_traces_without_graph_breaks():
    """A compiled function may build and copy a config (``pisa_attention``'s default,
    ``select_blocks``' ``replace``): the warning's bookkeeping must not break the graph."""
    torch._dynamo.reset()

    def f(x):
        c = PisaConfig().replace(min_seq_len=0)
        return x * PisaConfig(leaf_scoring="pooled").top_k + c.min_seq_len

    x = torch.randn(3)
    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(x), x * 16)
    torch._dynamo.reset()

    def g(x):  # a config that warns when built eagerly
        return x * PisaConfig(leaf_scoring="pooled", shortlist=64).top_k

    torch.testing.assert_close(torch.compile(g, backend="eager", fullgraph=True)(x), x * 16)
    torch._dynamo.reset()


# -- 3. flat_leaves is bounded -----------------------------------------------------------------

@pytest.mark.parametrize("value", [-1, MAX_FLAT_LEAVES + 1, 1 << 20])
def test_flat_leaves_out_of_range_is_a_clear_error(value):
    with pytest.raises(ValueError, match=r"PisaConfig\.flat_leaves must be in \[0, 4096\], "
                                         rf"got {value}"):
        PisaConfig(flat_leaves=value)
    with pytest.raises(ValueError, match="flat_leaves"):
        split_options({"flat_leaves": value})


def test_flat_leaves_range_ends_are_accepted():
    assert MAX_FLAT_LEAVES == 4096
    assert PisaConfig(flat_leaves=0).effective_flat_leaves == 0
    assert PisaConfig(flat_leaves=MAX_FLAT_LEAVES).effective_flat_leaves == 4096
    assert "4096" in PisaConfig.__doc__ and "L^2" in PisaConfig.__doc__
