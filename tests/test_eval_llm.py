"""The real-model evaluation (``benchmarks/eval_llm.py``) on a tiny model, on the CPU: its cases
are what they claim, dense and PISA in the exact regime score the same, a sparse option set
changes the result (so PISA really runs), and the attention-interface path it uses gives the
logits of ``torch.compile(backend="pisa")``."""

from __future__ import annotations

import pytest
import torch

from benchmarks import eval_llm
from pisa_compile import PisaConfig
from pisa_compile.samples import tiny_llama

pytest.importorskip("transformers")


class ByteTokenizer:
    """UTF-8 bytes as token ids (the tiny model's vocabulary of 256)."""

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_cases_have_the_length_the_depth_and_the_answer():
    tok = ByteTokenizer()
    cases = eval_llm.needle_cases(tok, 1024, repeats=2, seed=3)
    assert len(cases) == len(eval_llm.TASKS) * len(eval_llm.DEPTHS) * 2
    for c in cases:
        assert c.input_ids.shape == (1024,)
        text = tok.decode(c.input_ids.tolist())
        answer = tok.decode(c.input_ids[-c.n_answer:].tolist())
        assert answer.isdigit() and len(answer) == 5
        # The answer is planted once before the question, near its depth.
        at = text.index(answer)
        assert at < len(text) - 60
        if c.task != "multikey":
            assert abs(at / len(text) - c.depth) < 0.15, (c.task, c.depth, at / len(text))
    assert len({tuple(c.input_ids.tolist()) for c in cases}) == len(cases)


class OracleLM(torch.nn.Module):
    """Knows a fixed sequence: its logits point at the token ``shift`` places after the true
    next one (0: always right). The "cache" is the number of tokens seen."""

    def __init__(self, seq, shift=0):
        super().__init__()
        self.seq, self.shift = seq.tolist(), shift

    def forward(self, input_ids, logits_to_keep=0, past_key_values=None, use_cache=True):
        from types import SimpleNamespace
        start = past_key_values or 0
        n = input_ids.shape[1]
        logits = torch.zeros(1, n, 256)
        for j in range(n):
            pos = start + j + 1 + self.shift
            if pos < len(self.seq):
                logits[0, j, self.seq[pos]] = 40.0
        return SimpleNamespace(logits=logits[:, -(logits_to_keep or n):],
                               past_key_values=start + n)


def test_retrieval_and_loss_read_the_right_positions():
    """A model that always predicts the next token retrieves every case at loss ~0; one that
    predicts the token after it retrieves none."""
    case = eval_llm.needle_cases(ByteTokenizer(), 512, repeats=1, tasks=("code",))[0]
    right, wrong = OracleLM(case.input_ids), OracleLM(case.input_ids, shift=1)
    cpu = torch.device("cpu")
    assert eval_llm._retrieved(right, case, cpu)[::2] == (True, -1)
    ok, _, miss = eval_llm._retrieved(wrong, case, cpu)
    assert not ok and 0 <= miss < case.n_answer
    assert eval_llm._tail_loss(right, case.input_ids, cpu) < 1e-6
    assert eval_llm._tail_loss(wrong, case.input_ids, cpu) > 1.0


def test_bad_task_and_short_length_are_refused():
    with pytest.raises(ValueError, match="tasks"):
        eval_llm.needle_cases(ByteTokenizer(), 1024, tasks=("poetry",))
    with pytest.raises(ValueError, match="n_tokens"):
        eval_llm.needle_cases(ByteTokenizer(), 64)


def test_exact_regime_scores_as_dense_and_sparse_differs():
    model = tiny_llama(1024)
    exact = PisaConfig(min_seq_len=0, block_size=16, top_k=64, query_tile=16, kernel="reference")
    sparse = PisaConfig(min_seq_len=0, block_size=16, top_k=1, query_tile=16, local_blocks=1,
                        sink_blocks=0, kernel="reference")
    report = eval_llm.evaluate(model, ByteTokenizer(), [512], {"exact": exact, "sparse": sparse},
                               repeats=1, loss_windows_per_length=2)
    res = report["results"]
    assert set(res) == {"dense", "exact", "sparse"}
    dense, ex, sp = res["dense"]["512"], res["exact"]["512"], res["sparse"]["512"]
    assert dense["cases"] == ex["cases"] == len(eval_llm.TASKS) * len(eval_llm.DEPTHS)
    assert ex["retrieval"] == dense["retrieval"]
    assert abs(ex["loss_vs_dense"]) < 1e-4
    assert abs(sp["loss_vs_dense"]) > 1e-4


def test_attention_interface_gives_the_compiled_logits():
    model = tiny_llama(1024)
    ids = torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(0))
    opts = dict(min_seq_len=0, block_size=16, top_k=2, query_tile=16, local_blocks=1)
    with torch.no_grad():
        compiled = torch.compile(model, backend="pisa", options=opts)(ids).logits
        eval_llm.use_attention(model, "t", PisaConfig(**opts))
        swapped = model(ids).logits
        eval_llm.use_attention(model, "dense", None)
        dense = model(ids).logits
    torch.testing.assert_close(swapped, compiled, atol=2e-4, rtol=2e-4)
    assert (swapped - dense).abs().max() > 1e-3  # top_k=2 is sparse: PISA really ran


@pytest.mark.parametrize("query_tile", [1, 16])
def test_ceiling_is_the_flat_exact_selection(query_tile):
    """The ceiling equals dense when its budget covers every leaf, and equals PISA's reference
    with exact leaves when the pyramid is one level (the flat scan) and the budget is tight."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 200, 16, generator=g)
    k = torch.randn(1, 2, 200, 16, generator=g)
    v = torch.randn(1, 2, 200, 16, generator=g)
    scale = 0.25
    full = PisaConfig(block_size=16, top_k=16, query_tile=query_tile)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             scale=scale, enable_gqa=True)
    torch.testing.assert_close(eval_llm.flat_exact_attention(q, k, v, scale, full, chunk=64),
                               dense)
    tight = PisaConfig(block_size=16, top_k=2, beam=16, query_tile=query_tile,
                       leaf_scoring="exact", min_seq_len=0, dense_tail=0, kernel="reference")
    from pisa_compile import pisa_attention
    ref = pisa_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True, config=tight)
    flat = eval_llm.flat_exact_attention(q, k, v, scale, tight, chunk=64)
    torch.testing.assert_close(flat, ref)
    assert (flat - dense).abs().max() > 1e-3
    # The last queries alone over every key (a decode step): the same rows as in the full run.
    tail = eval_llm.flat_exact_attention(q[:, :, -3:], k, v, scale, tight, chunk=64)
    if query_tile == 1:
        torch.testing.assert_close(tail, flat[:, :, -3:])
    torch.testing.assert_close(eval_llm.flat_exact_attention(q[:, :, -3:], k, v, scale, full),
                               dense[:, :, -3:])


def _qkv(seed, B):
    """q ``[B, 4, 256, 16]`` and k, v ``[B, 2, 256, 16]`` (G = 2)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 4, 256, 16, generator=g), torch.randn(B, 2, 256, 16, generator=g),
            torch.randn(B, 2, 256, 16, generator=g))


def test_mean_query_shortlist_keeps_the_ceiling_when_it_holds_every_leaf():
    """A shortlist as long as the leaf count changes nothing; a short one changes the output
    and still picks only among its own leaves (so it can lose what the full scan finds)."""
    q, k, v = _qkv(2, B=2)
    cfg = PisaConfig(block_size=8, top_k=3, query_tile=16)
    flat = eval_llm.flat_exact_attention(q, k, v, 0.25, cfg, chunk=64)
    full = eval_llm.flat_exact_attention(q, k, v, 0.25, cfg, chunk=64, mean_query_shortlist=32)
    torch.testing.assert_close(full, flat)
    short = eval_llm.flat_exact_attention(q, k, v, 0.25, cfg, chunk=64, mean_query_shortlist=3)
    assert (short - flat).abs().max() > 1e-4


def test_mean_query_shortlist_ranks_by_the_tile_mean_query():
    """Keys planted along the last tile's mean query put their leaf first in that tile's
    shortlist; a leaf the tile cannot see is never shortlisted."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 128, 16, generator=g)  # G = 2 heads on one KV head
    k = torch.randn(1, 1, 128, 16, generator=g)
    C, Tq = 8, 16
    mean = q[0, :, 112:128].mean(1).mean(0)  # the last tile's mean query, over both heads
    k[0, 0, 40:48] = 4 * mean / mean.norm()
    nt, L = 128 // Tq, 128 // C
    last = torch.arange(nt) * Tq + Tq - 1
    leaf = torch.arange(L)
    cand = (leaf[None] * C <= last[:, None]) & (leaf[None] < last[:, None] // C - 1)
    short = eval_llm._mean_query_shortlist(q.view(1, 1, 2, 128, 16), k, 0.25, cand, last, Tq,
                                           C, 1)
    assert short.shape == (1, 1, nt, L)
    assert bool(short[0, 0, -1, 5])
    assert not bool((short[0, 0] & ~cand).any())


def test_attention_interface_decodes_like_dense_in_the_exact_regime():
    """Decode steps reach the interface with one query over the cache: the causal diagonal is
    bottom-right there, so greedy tokens equal dense ones when every leaf is selected."""
    model = tiny_llama(1024)
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(4))
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eval_llm.use_attention(model, "dense", None)
        dense = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        eval_llm.use_attention(model, "exact", PisaConfig(min_seq_len=0, block_size=16,
                                                          top_k=64, query_tile=16))
        pisa = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
    assert torch.equal(pisa, dense)


def test_sub_block_oracle_unit_blocks_are_the_exact_ceiling():
    """1-key sub-blocks score each leaf by its exact LSE, pooled or bound alike: the same
    output as the exact ceiling; 4-key means differ, and a shortlist as long as the leaf count
    changes nothing."""
    q, k, v = _qkv(4, B=1)
    cfg = PisaConfig(block_size=8, top_k=3, query_tile=16)
    flat = eval_llm.flat_exact_attention(q, k, v, 0.25, cfg, chunk=64)
    for bound in (False, True):
        one = eval_llm.flat_exact_attention(q, k, v, 0.25, cfg, chunk=64, sub_block=1,
                                            sub_block_bound=bound)
        torch.testing.assert_close(one, flat)
        full = eval_llm.flat_exact_attention(q, k, v, 0.25, cfg, chunk=64, sub_block=4,
                                             sub_block_bound=bound, sub_block_shortlist=32)
        torch.testing.assert_close(full, flat)
    rough = eval_llm.flat_exact_attention(q, k, v, 0.25, cfg, chunk=64, sub_block=4)
    assert (rough - flat).abs().max() > 1e-4


def test_sub_block_bound_is_above_the_exact_leaf_score():
    """A leaf's bound score (LSE over sub-blocks of box bound + log S) is at least its exact
    LSE, on every visible leaf of every row."""
    g = torch.Generator().manual_seed(5)
    qc = torch.randn(1, 2, 3, 40, 16, generator=g)  # [B, Hkv, G, n, D]
    kf = torch.randn(1, 2, 100, 16, generator=g)
    qpos = torch.arange(60, 100)
    bound = eval_llm._sub_block_lse(qc, kf, 0.3, qpos, 8, 4, True)
    s = torch.einsum("bhgnd,bhkd->bhgnk", qc, kf) * 0.3
    s = s.masked_fill(torch.arange(100)[None, :] > qpos[:, None], float("-inf"))
    s = torch.nn.functional.pad(s, (0, 4), value=float("-inf"))
    exact = torch.logsumexp(s.view(1, 2, 3, 40, 13, 8), -1)
    seen = torch.isfinite(exact)
    assert (bound[seen] >= exact[seen] - 1e-4).all()


def test_every_option_set_and_ceiling_builds_a_valid_config():
    """The names eval_llm and bench_options/bench_stages take: each candidate resolves over its
    preset, and each ceiling splits into PisaConfig fields and oracle keywords."""
    from benchmarks.eval_llm import CANDIDATES, CEILINGS, ORACLE_KEYS, candidate_config

    for name in CANDIDATES:
        assert isinstance(candidate_config(name), PisaConfig), name
    assert candidate_config("defaults") == PisaConfig()
    assert candidate_config("quality") == PisaConfig(min_seq_len=2048)
    # measured before flat leaves: the defaults of then (shortlist 64, no flat scan)
    assert candidate_config("quality_k32") == PisaConfig(min_seq_len=2048, top_k=32,
                                                         shortlist=64, flat_leaves=0)
    for name, opts in CEILINGS.items():
        fields = {k: v for k, v in opts.items() if k not in ORACLE_KEYS}
        PisaConfig.preset("fast", **fields)  # raises on an unknown or bad field


@pytest.mark.parametrize("B,Hkv,G,Nq,Nk,C,Tq,top_k", [(1, 1, 2, 100, 100, 8, 4, 3),
                                                     (1, 2, 3, 1, 150, 8, 16, 4),
                                                     (2, 1, 7, 40, 130, 16, 16, 2),
                                                     (1, 2, 7, 24, 90, 8, 1, 3)])
def test_kernel_ceiling_equals_the_pytorch_ceiling(B, Hkv, G, Nq, Nk, C, Tq, top_k):
    """The ceiling through the rescoring and attention kernels (Triton's interpreter here)
    equals the PyTorch oracle: prefill, decode (one query over a cache), G = 7, per query (Tq = 1)."""
    cfg = PisaConfig.preset("fast", block_size=C, query_tile=Tq, top_k=top_k, min_seq_len=0)
    g = torch.Generator().manual_seed(Nk)
    q = torch.randn(B, Hkv * G, Nq, 16, generator=g)
    k, v = torch.randn(B, Hkv, Nk, 16, generator=g), torch.randn(B, Hkv, Nk, 16, generator=g)
    got = eval_llm.flat_exact_kernel_attention(q, k, v, 0.3, cfg)
    want = eval_llm.flat_exact_attention(q, k, v, 0.3, cfg)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # Not the whole causal attention: the budget of blocks binds.
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
        attn_mask=torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq))
    assert (got - dense).abs().max() > 1e-3


def test_pyramid_decode_rows_decode_from_the_cache(fresh_dynamo):
    """``pyramid_decode``: the case is prefilled into a PisaCache and every answer token after
    the first is decoded from its persistent pyramid (Triton's interpreter here; the tokens
    themselves are checked against dense ones in ``test_hf_cache.py``); in the exact regime
    the outcome is dense's."""
    import functools

    from torch._dynamo.utils import counters

    from pisa_compile.hf_cache import PisaCache
    model = tiny_llama(1024, num_layers=2)
    case = eval_llm.needle_cases(ByteTokenizer(), 256, repeats=1, tasks=("code",))[0]
    cpu = torch.device("cpu")
    eval_llm.use_attention(model, "dense", None)
    dense = eval_llm._retrieved(model, case, cpu)
    exact = PisaConfig(min_seq_len=0, block_size=16, top_k=64, query_tile=16, kernel="triton")
    eval_llm.use_attention(model, "exact+pyramid", exact)
    cache = functools.partial(PisaCache, config=exact, sparse_from=0)
    pyramid = eval_llm._retrieved(model, case, cpu, cache)
    assert (pyramid[0], pyramid[2]) == (dense[0], dense[2])
    assert counters["pisa"]["sparse_decode"] == (case.n_answer - 1) * 2
    with pytest.raises(ValueError, match="pyramid_decode"):
        eval_llm.evaluate(model, ByteTokenizer(), [256], {"exact": exact},
                          pyramid_decode=["fast"])


def test_evaluate_runs_pyramid_rows_with_a_cache(monkeypatch):
    """``evaluate(pyramid_decode=[name])`` adds a ``name+pyramid`` row whose cases get a
    ``PisaCache`` of that config with ``sparse_from=0`` (the other rows none), no loss, and
    a count of sparse steps."""
    from pisa_compile.hf_cache import PisaCache
    seen = {}

    def retrieved(model, case, device, cache=None):
        seen.setdefault(model.config._attn_implementation, set()).add(
            None if cache is None else (cache.func, cache.keywords["config"],
                                        cache.keywords["sparse_from"]))
        return True, 1.0, -1

    monkeypatch.setattr(eval_llm, "_retrieved", retrieved)
    monkeypatch.setattr(eval_llm, "_tail_loss", lambda model, ids, device: 1.0)
    cfg = PisaConfig(min_seq_len=0, block_size=16, kernel="reference")
    report = eval_llm.evaluate(tiny_llama(1024, num_layers=1), ByteTokenizer(), [256],
                               {"q": cfg}, repeats=1, loss_windows_per_length=1,
                               pyramid_decode=["q"])
    res = report["results"]
    assert set(res) == {"dense", "q", "q+pyramid"}
    assert seen["pisa_eval_q+pyramid"] == {(PisaCache, cfg, 0)}
    assert seen["pisa_eval_q"] == {None} and seen["sdpa"] == {None}
    row = res["q+pyramid"]["256"]
    assert row["loss"] is None and row["loss_vs_dense"] is None and row["retrieval"] == 1.0
    assert row["sparse_decode_steps"] == 0 and "sparse_decode_steps" not in res["q"]["256"]
