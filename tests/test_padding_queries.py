"""Padding queries vote for nothing in the selection where the pass proves self-attention
(``query_mask``; ``lowering/tokens.py``; DESIGN.md "Rewrite rules").

A query tile's blocks are the union of its rows' votes. Before, the padding queries of a
right-padded row voted too, so a sequence's real rows selected other blocks in a padded batch
than alone (a new user measured 0.08 at the last real positions). The op cannot tell padding
queries from its arguments (an equal-length cross-attention under a key mask looks the
same), so the pass hands it a queries' mask only where q and k are proved one token sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import pisa_compile
from pisa_compile import PisaConfig, pisa_attention
from pisa_compile.ops import self_attention_query_mask
from tests.hf_models import tiny_llama
from tests.select_check import alone_and_right_padded
from tests.strategies import sparse_configs
from tests.test_structured_masks import structured

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# Lossy on purpose: 2 of up to 16 leaves per tile, so a vote changes the output.
LOSSY = dict(min_seq_len=0, block_size=16, query_tile=16, top_k=2, dense_tail=0,
             sink_blocks=1, local_blocks=1)
SUFFIX = "self-attention: padding queries do not vote"
ALIGNED = ", rows start at their first token"


# -- the op ------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(case=structured(), cfg=sparse_configs(), data=st.data())
def test_masked_queries_do_not_steer_the_other_rows(case, cfg, data):
    """Noise in the rows ``query_mask`` marks as padding leaves every other row
    bit-identical (causal or not, GQA up to 7, any padding, the dense tail included)."""
    q, k, v, km, causal, off = case
    B, Nq = q.shape[0], q.shape[2]
    seed = data.draw(st.integers(0, 2**31 - 1))
    qm = torch.rand(B, Nq, generator=torch.Generator().manual_seed(seed)) > 0.3

    def run(x):
        return pisa_attention(x, k, v, is_causal=causal, causal_offset=off, key_mask=km,
                              enable_gqa=True, config=cfg, query_mask=qm)

    q2 = torch.where(qm[:, None, :, None], q, torch.randn_like(q) * 10)
    real = qm[:, None, :, None].expand(-1, q.shape[1], -1, v.shape[-1])
    assert torch.equal(run(q2)[real], run(q)[real])


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "causal"])
@pytest.mark.parametrize("L", [200, 263])
def test_a_sequence_selects_alike_alone_and_right_padded(L, causal):
    """The reference path: a sequence of ``L`` tokens alone, and right-padded to 300 with
    the padding queries marked, gives bit-identical real rows (a constant fill in place of
    NaN would still vote); unmarked, the padding queries' votes change them."""
    alone, padded, unmarked = alone_and_right_padded(PisaConfig(**LOSSY), causal, L, seed=L)
    assert torch.equal(padded, alone)
    assert not torch.equal(unmarked, alone)


def test_self_attention_query_mask():
    """Leading and trailing runs of masked keys are padding queries; masked keys between real
    ones are not; with a cache the queries are the last ``Nq`` keys' tokens."""
    km = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1],     # left padding, one hidden real key
                       [1, 1, 1, 1, 1, 0, 0, 0],     # right padding
                       [0, 0, 0, 0, 0, 0, 0, 0],     # nothing real
                       [1, 1, 1, 1, 1, 1, 1, 1]])
    want = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 1, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(self_attention_query_mask(km, 8), want)
    assert torch.equal(self_attention_query_mask(km.bool(), 3), want[:, 5:])
    with pytest.raises(ValueError, match="n_queries=9 must be at most"):
        self_attention_query_mask(km, 9)


def test_select_blocks_takes_the_queries_mask():
    """``select_blocks`` with ``query_mask`` gives the blocks ``pisa_attention`` attends:
    its output equals dense attention under that selection (and without the mask the
    selection differs)."""
    from pisa_compile import select_blocks
    from pisa_compile.kernels.reference import dense_attention
    from tests.strategies import selection_mask
    g = torch.Generator().manual_seed(3)
    N, L = 300, 200
    q = torch.randn(1, 4, N, 16, generator=g)
    k, v = (torch.randn(1, 2, N, 16, generator=g) for _ in range(2))
    q[:, :, L:] = 5 * k.repeat_interleave(2, 1)[:, :, 20:20 + N - L]
    keep = torch.ones(1, N, dtype=torch.bool)
    keep[:, L:] = False
    qm = self_attention_query_mask(keep, N)
    cfg = PisaConfig(**LOSSY)
    bi, _ = select_blocks(q, k, enable_gqa=True, config=cfg, key_mask=keep, query_mask=qm)
    bi0, _ = select_blocks(q, k, enable_gqa=True, config=cfg, key_mask=keep)
    assert not torch.equal(bi, bi0)
    sel = selection_mask(bi, N, N, cfg, 2) & keep[:, None, None, :]
    want = dense_attention(q.double(), k.double(), v.double(), attn_mask=sel).float()
    out = pisa_attention(q, k, v, key_mask=keep, enable_gqa=True, config=cfg, query_mask=qm)
    torch.testing.assert_close(out[:, :, :L], want[:, :, :L], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bad, err, match", [
    (torch.ones(2, 64, dtype=torch.bool), ValueError, r"query_mask must be \[B=1, Nq=64\]"),
    (torch.ones(1, 64), ValueError, "bool or integer"),
    ([True] * 64, TypeError, "query_mask must be a Tensor"),
])
def test_bad_query_mask_is_named(bad, err, match):
    q = torch.randn(1, 2, 64, 16)
    with pytest.raises(err, match=match):
        pisa_attention(q, q, q, is_causal=True, query_mask=bad)


def test_query_mask_refuses_an_explicit_mask():
    q = torch.randn(1, 2, 64, 16)
    with pytest.raises(ValueError, match="attn_mask and query_mask"):
        pisa_attention(q, q, q, attn_mask=torch.ones(64, 64, dtype=torch.bool),
                       query_mask=torch.ones(1, 64, dtype=torch.bool))


# -- the pass ----------------------------------------------------------------------------------

def _llama(impl: str):
    return tiny_llama(impl, max_positions=1024).eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_sequence_alone_and_in_a_right_padded_batch(impl):
    """A transformers Llama, lossy: a 200-token sequence alone and as the right-padded row
    of a 256-token batch gives the same logits on its real rows (0.12 apart before), and the
    report says why. The forward appends to a DynamicCache (``use_cache`` is on): the proof
    follows k through ``cat([past, k])``."""
    model = _llama(impl)
    N, L = 256, 200
    ids = torch.randint(0, 100, (2, N), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, N, dtype=torch.long)
    am[1, L:] = 0
    ids[1, :L] = ids[0, :L]
    with torch.no_grad():
        rep = pisa_compile.explain(model, ids, attention_mask=am, options=LOSSY)
        f = torch.compile(model, backend="pisa", options=LOSSY)
        alone = f(ids[1:, :L], attention_mask=am[1:, :L]).logits
        batch = f(ids, attention_mask=am).logits
    assert len(rep.rewritten) == 2 and all(SUFFIX in s.selection for s in rep.sites), str(rep)
    torch.testing.assert_close(batch[1, :L], alone[0], atol=1e-5, rtol=1e-5)


def test_the_zoo_marks_self_attention_only():
    """Across the zoo (sparse, exact options): every causal LM's and BERT's padded
    self-attention site gets the queries' mask; T5's cross-attention (encoder padding, the
    decoder's queries) never does, nor any site without a key mask."""
    from tests.test_zoo import SPARSE_EXACT, ZOO, build, inputs
    marked = {}
    for case in ZOO:
        if case.id.startswith(("gemma2", "mistral")):
            continue  # windows select nothing; softcapping stays dense
        model = build(case).eval()
        kw, _ = inputs(case)
        with torch.no_grad():
            rep = pisa_compile.explain(model, **kw, options=SPARSE_EXACT)
        for s in rep.sites:
            marked[case.id, s.node] = (s.mask, SUFFIX in s.selection)
    for (cid, node), (mask, mark) in marked.items():
        if cid.startswith("t5"):
            assert not mark, (cid, node, mask)
        else:
            assert mark == mask.endswith("padding"), (cid, node, mask)
    assert sum(m for _, m in marked.values()) == 16, marked
    assert any(c.startswith("t5") and m.endswith("->padding") for (c, _), (m, _) in
               marked.items()), "T5's cross-attention is no longer a padding site: no test"


D, H, DH = 32, 2, 16


def _heads(t):
    return t.reshape(t.shape[0], -1, H, DH).transpose(1, 2)


class _Form(torch.nn.Module):
    """Hand-written ways to get q and k for one SDPA call under a key mask ``keep``."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.q = torch.nn.Linear(D, D, bias=False)
        self.k = torch.nn.Linear(D, D, bias=False)
        self.qkv = torch.nn.Linear(D, 3 * D, bias=False)
        self.a = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x, y, keep):
        f = self.form
        if f.startswith("fused"):
            h = self.qkv(x)
            B, N = h.shape[:2]
            if f == "fused-split":                   # q | k | v along the features
                q, k, _ = (_heads(t) for t in h.split(D, dim=-1))
            elif f == "fused-unbind":                # ViT's [3, B, H, N, Dh]
                q, k, _ = h.view(B, N, 3, H, DH).permute(2, 0, 3, 1, 4).unbind(0)
            elif f == "fused-neox":                  # GPT-NeoX: heads first, then q | k | v
                t = h.view(B, N, H, 3 * DH).transpose(1, 2)
                q, k = t[..., :DH], t[..., DH:2 * DH]
            elif f == "fused-batch-chunk":           # first half of the batch -> second half
                a, b = h.chunk(2, dim=0)
                q, k = _heads(a[..., :D]), _heads(b[..., D:2 * D])
            elif f == "fused-batch-roll":            # the batch rolled by one
                q = _heads(torch.cat([h[1:], h[:1]], dim=0)[..., :D])
                k = _heads(h[..., D:2 * D])
            else:                                    # fused-streams: [2, B, N, 3D] by an int
                q, k = _heads(h[0][..., :D]), _heads(h[1][..., D:2 * D])
            return F.scaled_dot_product_attention(q, k, k, attn_mask=keep[:, None, None, :])
        if f == "gptj-rope":                         # rotate_every_two: stack, flatten
            def rot(t):
                return torch.stack((-t[..., 1::2], t[..., ::2]), -1).flatten(-2)
            q, k = _heads(rot(self.q(x))), _heads(rot(self.k(x)))
            return F.scaled_dot_product_attention(q, k, k, attn_mask=keep[:, None, None, :])
        if f in ("matmul-param", "matmul-left"):     # x @ W.T (Falcon), or A @ x and A @ y
            q, k = ((_heads(x @ self.q.weight.T), _heads(x @ self.k.weight.T))
                    if f == "matmul-param" else (_heads(self.a @ x), _heads(self.a @ y)))
            return F.scaled_dot_product_attention(q, k, k, attn_mask=keep[:, None, None, :])
        if f in ("conv1d", "conv1d-pairs"):          # GPT-2's addmm between views
            w = self.qkv.weight.T
            C = 2 if f == "conv1d-pairs" else 1      # pairs: one row holds two tokens
            flat = torch.addmm(torch.zeros(3 * D * C), x.reshape(-1, D * C),
                               torch.cat([w] * C, 0).repeat(1, C)).view(*x.shape[:-1], -1)
            q, k, _ = (_heads(t) for t in flat[..., :3 * D].split(D, dim=-1))
            return F.scaled_dot_product_attention(q, k, k, attn_mask=keep[:, None, None, :])
        if f in ("packed-cross", "stacked-cross"):   # q of x and k of y side by side
            if f == "packed-cross":
                q, k = torch.cat([self.q(x), self.k(y)], -1).split(D, -1)
            else:
                s = torch.stack([self.q(x), self.k(y)], -1)
                q, k = s[..., 0], s[..., 1]
            q, k = _heads(q), _heads(k)
            return F.scaled_dot_product_attention(q, k, k, attn_mask=keep[:, None, None, :])
        src = {"self": x, "cross": y, "flip": x.flip(1), "roll": x.roll(1, 1),
               "shared-row": x[:1].expand_as(x), "sliced": x[:, :1].expand_as(x)}
        if f in src:
            q, k = _heads(self.q(x)), _heads(self.k(src[f]))
        elif f == "in-place":                        # the root reordered between q and k
            h = x.clone()
            q = _heads(self.q(h))
            h.copy_(h.flip(1))
            k = _heads(self.k(h))
        elif f == "aten-in-place":                   # the same through an op overload
            h = x.clone()
            q = _heads(self.q(h))
            torch.ops.aten.copy_.default(h, h.flip(1))
            k = _heads(self.k(h))
        elif f == "axis":                            # numpy's axis= alias of cat's dim
            q = _heads(torch.cat([self.q(x), self.q(x)], axis=1))
            k = _heads(self.k(torch.cat([x, x], axis=1)))
            keep = torch.cat([keep, keep], 1)
        return F.scaled_dot_product_attention(q, k, k, attn_mask=keep[:, None, None, :])


_PROVED = ["self", "fused-split", "fused-unbind", "fused-neox", "gptj-rope", "matmul-param",
           "conv1d"]
_NOT = ["cross", "flip", "roll", "shared-row", "sliced", "in-place", "aten-in-place", "axis",
        "fused-batch-chunk", "fused-batch-roll", "fused-streams", "packed-cross",
        "stacked-cross", "matmul-left", "conv1d-pairs"]


@pytest.mark.parametrize("form", _PROVED + _NOT)
def test_only_one_token_sequence_is_self_attention(form):
    """Projections of one sequence (separate or fused, ViT-, NeoX-, GPT-J- and Falcon-style)
    are proved self-attention; keys from another sequence of the same length (also packed
    beside q along the features), from the same one reordered (flip, roll, a copy written
    in place, also through an aten overload), from other batch rows (halves, a roll, one
    row for all), from another stream of a stacked input, through a matmul whose left
    operand is the weight, or through a projection of token pairs (GPT-2's ``addmm`` over
    rows of two tokens) are not (a wrong proof silenced real rows: two reviews measured
    0.93-0.94 relative error on such rows). With ``axis=`` the cat is read as written (it
    once crashed the compile as a cat along dim 0)."""
    B = 4 if form == "fused-batch-chunk" else 2
    x = torch.randn(2, B, 64, D) if form == "fused-streams" else torch.randn(B, 64, D)
    y = torch.randn(B, 64, D)
    keep = torch.ones(B // 2 if form == "fused-batch-chunk" else B, 64, dtype=torch.bool)
    keep[:, 50:] = False
    model = _Form(form)
    rep = pisa_compile.explain(model, x, y, keep, options=LOSSY)
    assert rep.sites[0].rewritten and rep.sites[0].mask.endswith("->padding"), str(rep)
    assert (SUFFIX in rep.sites[0].selection) == (form in _PROVED), str(rep)
    with torch.no_grad():
        torch.compile(model, backend="pisa", options=LOSSY)(x, y, keep)


def test_multihead_attention_self_but_not_cross():
    """``nn.MultiheadAttention(x, x, x)`` with a bool key padding mask gets the queries'
    mask (alone and right-padded agree on the real rows); ``(x, y, y)`` does not."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    N, L = 256, 200
    x, y = torch.randn(2, N, 32), torch.randn(2, N, 32)
    x[1, :L] = x[0, :L]
    kpm = torch.zeros(2, N, dtype=torch.bool)
    kpm[1, L:] = True

    def self_attn(x, kpm):
        return mha(x, x, x, key_padding_mask=kpm, need_weights=False)[0]

    def cross_attn(x, y, kpm):
        return mha(x, y, y, key_padding_mask=kpm, need_weights=False)[0]

    assert SUFFIX in pisa_compile.explain(self_attn, x, kpm, options=LOSSY)[0].selection
    assert SUFFIX not in pisa_compile.explain(cross_attn, x, y, kpm, options=LOSSY)[0].selection
    f = torch.compile(self_attn, backend="pisa", options=LOSSY)
    with torch.no_grad():
        alone, batch = f(x[1:, :L], kpm[1:, :L]), f(x, kpm)
    torch.testing.assert_close(batch[1, :L], alone[0], atol=1e-5, rtol=1e-5)


# -- rows aligned to their first real token ------------------------------------------------------

def _padded_batch(seed: int, N: int, rows: list[tuple[int, int]], Hq=4, Hkv=2, Dh=16):
    """``(q, k, v, keep, alone)``: each row ``(left, L)`` holds a sequence of ``L`` tokens
    after ``left`` padding tokens, then padding to ``N``; the padding tokens' q and k are
    loud noise (their votes and keys would change a misaligned selection). ``alone``: each
    row's ``(q, k, v)`` unpadded."""
    g = torch.Generator().manual_seed(seed)
    B = len(rows)
    q = 5 * torch.randn(B, Hq, N, Dh, generator=g)
    k, v = (5 * torch.randn(B, Hkv, N, Dh, generator=g) for _ in range(2))
    keep = torch.zeros(B, N, dtype=torch.bool)
    alone = []
    for b, (left, L) in enumerate(rows):
        xs = (torch.randn(1, Hq, L, Dh, generator=g), torch.randn(1, Hkv, L, Dh, generator=g),
              torch.randn(1, Hkv, L, Dh, generator=g))
        for x, y in zip((q, k, v), xs):
            x[b:b + 1, :, left:left + L] = y
        keep[b, left:left + L] = True
        alone.append(xs)
    return q, k, v, keep, alone


@settings(max_examples=30, deadline=None)
@given(cfg=sparse_configs(), causal=st.booleans(), tail=st.sampled_from([0, 4, 16]),
       data=st.data())
def test_a_padded_row_computes_as_its_sequence_alone(cfg, causal, tail, data):
    """Any left and right padding (not multiples of the block or the query tile), any
    selection config: each row's real outputs equal the sequence alone (bit-identical
    without a dense tail; the tail's rows within float rounding, its masked SDPA against the
    alone call's causal one). Causal, a left-padding row sees no key: zero."""
    N = data.draw(st.integers(120, 220))
    rows = []
    for _ in range(2):
        L = data.draw(st.integers(60, N))
        rows.append((data.draw(st.integers(0, N - L)), L))
    cfg = cfg.replace(dense_tail=tail)
    q, k, v, keep, alone = _padded_batch(data.draw(st.integers(0, 2**31 - 1)), N, rows)
    out = pisa_attention(q, k, v, is_causal=causal, key_mask=keep, enable_gqa=True, config=cfg,
                         query_mask=self_attention_query_mask(keep, N))
    for b, ((left, L), xs) in enumerate(zip(rows, alone)):
        want = pisa_attention(*xs, is_causal=causal, enable_gqa=True, config=cfg)[0]
        got = out[b, :, left:left + L]
        if tail == 0:
            assert torch.equal(got, want), (b, left, L)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if causal:
            assert not out[b, :, :left].any()


def test_left_padding_without_the_proof():
    """Without ``query_mask`` (no proof of self-attention): a causal left-padded row is
    still aligned and computes as its sequence alone (its padding queries see no key, so
    they vote for nothing), as for a mask read at run time; a non-causal one is not aligned
    and differs from the sequence alone (the test above can fail)."""
    cfg = PisaConfig(**LOSSY, kernel="reference")
    q, k, v, keep, alone = _padded_batch(5, 200, [(50, 150)])  # no right padding
    for causal in (True, False):
        want = pisa_attention(*alone[0], is_causal=causal, enable_gqa=True, config=cfg)[0]
        out = pisa_attention(q, k, v, is_causal=causal, key_mask=keep, enable_gqa=True,
                             config=cfg)
        if causal:
            assert torch.equal(out[0, :, 50:], want)
        else:
            assert not torch.allclose(out[0, :, 50:], want, atol=1e-3)
            out = pisa_attention(q, k, v, key_mask=keep, enable_gqa=True, config=cfg,
                                 query_mask=self_attention_query_mask(keep, 200))
            assert torch.equal(out[0, :, 50:], want)


@pytest.mark.parametrize("tail", [0, 16])
def test_left_padded_row_on_the_triton_kernels(tail):
    """The Triton path (interpreter on the CPU, fp32): a row left-padded by 37 and
    right-padded by 13 equals the sequence alone, with gradients too."""
    cfg = PisaConfig(**{**LOSSY, "dense_tail": tail}, kernel="triton")
    q, k, v, keep, alone = _padded_batch(7, 256, [(37, 206), (0, 256)])
    for x in (q, k, v):
        x.requires_grad_(True)
    out = pisa_attention(q, k, v, is_causal=True, key_mask=keep, enable_gqa=True, config=cfg,
                         query_mask=self_attention_query_mask(keep, 256))
    xs = [x.clone().requires_grad_(True) for x in alone[0]]
    want = pisa_attention(*xs, is_causal=True, enable_gqa=True, config=cfg)
    torch.testing.assert_close(out[0, :, 37:243], want[0], atol=1e-5, rtol=1e-5)
    g = torch.randn_like(want)
    (out[:1, :, 37:243] * g).sum().backward()
    (want * g).sum().backward()
    for x, y in zip((q, k, v), xs):
        torch.testing.assert_close(x.grad[:1, :, 37:243], y.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_sequence_alone_and_in_a_left_padded_batch(impl):
    """A transformers Llama as ``generate()`` feeds it: a 200-token sequence alone, and
    left-padded by 37 in a batch of 237 (positions counted from its first token), give the
    same logits on its real rows, the dense tail on."""
    model = _llama(impl)
    N, L = 237, 200
    opts = {**LOSSY, "dense_tail": 16}
    ids = torch.randint(0, 100, (2, N), generator=torch.Generator().manual_seed(2))
    am = torch.ones(2, N, dtype=torch.long)
    am[1, :N - L] = 0
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        rep = pisa_compile.explain(model, ids, attention_mask=am, position_ids=pos,
                                   options=opts)
        f = torch.compile(model, backend="pisa", options=opts)
        alone = f(ids[1:, N - L:]).logits
        batch = f(ids, attention_mask=am, position_ids=pos).logits
    assert all(s.selection.endswith(SUFFIX + ALIGNED) for s in rep.sites), str(rep)
    torch.testing.assert_close(batch[1, N - L:], alone[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dense_tail", [16, 0])
def test_generate_on_a_left_padded_batch_gives_each_prompt_its_own_tokens(dense_tail):
    """``generate()`` on a left-padded batch (lossy prefill, the dense tail on or off; the
    decode steps are dense over the cache either way, ``ops.is_decode_step``): the padded
    prompt's greedy tokens and their scores are those of the prompt alone. Without the
    alignment the scores differ (up to 0.015 here, the tokens of this tiny model happen to
    agree): the check can fail. With ``dense_tail=0`` the steps ran the sparse op, unaligned,
    until December 2026."""
    from tests.hf_models import tiny_generation_llama
    model = tiny_generation_llama()
    N, L = 237, 200
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 128, (2, N), generator=g)
    am = torch.ones(2, N, dtype=torch.long)
    am[1, :N - L] = 0
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
               return_dict_in_generate=True)
    opts = {**LOSSY, "dense_tail": dense_tail}
    forward = model.forward
    model.forward = torch.compile(forward, backend="pisa", options=opts)
    try:
        with torch.no_grad():
            batch = model.generate(input_ids=ids, attention_mask=am, **gen)
            alone = model.generate(input_ids=ids[1:, N - L:],
                                   attention_mask=am[1:, N - L:], **gen)
    finally:
        model.forward = forward
    assert torch.equal(batch.sequences[1, N:], alone.sequences[0, L:])
    for s_batch, s_alone in zip(batch.scores, alone.scores):
        torch.testing.assert_close(s_batch[1], s_alone[0], atol=1e-4, rtol=1e-4)


def test_aligned_under_dynamic_shapes():
    """Under dynamic shapes the rows are still aligned: the op compiled with
    ``dynamic=True`` (Dynamo tracing into it), and a transformers Llama compiled once and
    called at a second prompt length (Dynamo's automatic dynamic shapes), each left-padded
    row against its sequence alone. (A test of the length once skipped the alignment on a
    symbolic one: 1.11 apart here.)"""
    cfg = PisaConfig(**{**LOSSY, "dense_tail": 16}, kernel="reference")

    def op(q, k, v, km):
        return pisa_attention(q, k, v, is_causal=True, key_mask=km, enable_gqa=True, config=cfg)

    g = torch.compile(op, backend="eager", dynamic=True)
    for N in (200, 237):
        q, k, v, keep, alone = _padded_batch(N, N, [(37, N - 37)])
        want = pisa_attention(*alone[0], is_causal=True, enable_gqa=True, config=cfg)[0]
        torch.testing.assert_close(g(q, k, v, keep)[0, :, 37:], want, atol=1e-5, rtol=1e-5)
    model = _llama("sdpa")
    f = torch.compile(model, backend="pisa", options={**LOSSY, "dense_tail": 16})
    for N, pad in ((200, 23), (237, 41)):
        ids = torch.randint(0, 100, (2, N), generator=torch.Generator().manual_seed(N))
        am = torch.ones(2, N, dtype=torch.long)
        am[1, :pad] = 0
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            alone = f(ids[1:, pad:]).logits[0]
            batch = f(ids, attention_mask=am, position_ids=pos).logits[1, pad:]
        torch.testing.assert_close(batch, alone, atol=1e-4, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(causal=st.booleans(), tail=st.sampled_from([0, 16, 64]), data=st.data())
def test_aligned_path_equals_sdpa_in_the_exact_regime(causal, tail, data):
    """Every leaf selected: the aligned path equals SDPA under the same mask, with masked
    keys between real ones, rows of no live key, all-live rows and rows shorter than the
    dense tail; rows that see no key are zero."""
    B, N = 3, data.draw(st.integers(40, 160))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    keep = torch.zeros(B, N, dtype=torch.bool)
    for b in range(B):
        kind = data.draw(st.sampled_from(["pads", "holes", "none", "all"]))
        if kind == "all":
            keep[b] = True
        elif kind != "none":
            lo = data.draw(st.integers(0, N - 1))
            hi = data.draw(st.integers(lo + 1, N))
            keep[b, lo:hi] = True
            if kind == "holes":
                keep[b] &= torch.rand(N, generator=g) > 0.3
    q = torch.randn(B, 4, N, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, 2, N, 16, generator=g, dtype=torch.float64) for _ in range(2))
    cfg = PisaConfig(min_seq_len=0, block_size=16, top_k=64, query_tile=16, dense_tail=tail,
                     kernel="reference")
    qm = None if causal and data.draw(st.booleans()) else self_attention_query_mask(keep, N)
    out = pisa_attention(q, k, v, is_causal=causal, key_mask=keep, enable_gqa=True,
                         config=cfg, query_mask=qm)
    mask = keep[:, None, None, :].expand(B, 1, N, N)
    if causal:
        mask = mask & torch.ones(N, N, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                          v.repeat_interleave(2, 1), attn_mask=mask)
    seen = mask.any(-1, keepdim=True)
    want = torch.where(seen, want, 0.0)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)


class _Unproved(torch.nn.Module):
    """Causal attention under a padding mask whose keys come from the sequence reversed:
    no proof of self-attention, yet the op aligns the rows (causal)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(D, D, bias=False), torch.nn.Linear(D, D, bias=False)

    def forward(self, x, keep):
        q, k = _heads(self.q(x)), _heads(self.k(x.flip(1)))
        N = x.shape[1]
        causal = torch.ones(N, N, dtype=torch.bool, device=x.device).tril()
        return F.scaled_dot_product_attention(q, k, k, attn_mask=causal & keep[:, None, None, :])


def test_report_says_a_causal_site_is_aligned_without_the_proof():
    keep = torch.ones(2, 64, dtype=torch.bool)
    keep[1, :9] = False
    rep = pisa_compile.explain(_Unproved(), torch.randn(2, 64, D), keep, options=LOSSY)
    site = rep.sites[0]
    assert site.rewritten and site.mask.endswith("padding"), str(rep)
    assert SUFFIX not in site.selection and site.selection.endswith(
        "; rows start at their first token"), str(rep)
