"""Unmodified Hugging Face models under ``torch.compile(backend="pisa")``.

Small random models (hidden 64, 2 layers, batch 2, sequence 24), offline. For each model and
attention implementation ("eager" hand-written attention, "sdpa"):

- the number of attention sites rewritten / left dense equals the table below (the README's
  zoo table), with the reason for every site left dense;
- ``fullgraph=True`` compiles (no graph break);
- in the exact regime the logits equal eager, with the default options (``Nk < min_seq_len``:
  the op is SDPA) and with ``min_seq_len=0, block_size=16, top_k=64`` (the sparse path runs,
  every block selected);
- a training step (forward + backward, sparse path in exact coverage) gives the eager
  gradients of every parameter.

Left padding (causal LMs) makes the padded query rows fully masked. Logits and losses are
compared on the non-padded positions only (no other position reads a padded row); what the
padded rows get is tested in ``test_structured_masks.py`` (eager's average of ``v`` where a
``finfo.min`` mask became structure, zeros as SDPA's where a bool mask did).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import pytest
import torch
from torch._dynamo.utils import counters

import pisa_compile

transformers = pytest.importorskip("transformers")

V, B, N, N_DEC = 128, 2, 24, 10
# dense_tail 0: every query row takes the sparse path (the zoo's prompts are short).
SPARSE_EXACT = {"min_seq_len": 0, "block_size": 16, "top_k": 64, "dense_tail": 0}
_COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=128)


def _llama():
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(num_key_value_heads=2,
                                                                   **_COMMON)


def _qwen2():
    return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(num_key_value_heads=2,
                                                                   **_COMMON)


def _mistral():  # sliding window (8) shorter than the sequence (24)
    return transformers.MistralForCausalLM, transformers.MistralConfig(
        num_key_value_heads=2, sliding_window=8, **_COMMON)


def _gemma2(softcap: Optional[float]):
    def make():
        return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
            num_key_value_heads=2, head_dim=16, sliding_window=8,
            attn_logit_softcapping=softcap, **_COMMON)
    return make


def _gpt2():
    return transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=128, attn_pdrop=0.0,
        resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def _bert():
    return transformers.BertModel, transformers.BertConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0)


def _t5():
    return transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0)


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the zoo table."""

    name: str
    make: Callable
    impl: str
    sites: int            # attention sites (self + cross)
    rewritten: int        # under torch.no_grad (inference)
    train_rewritten: int  # with grad enabled (training step)
    dense_reason: str = ""   # substring of the reason of every site left dense
    kind: str = "causal"     # "causal" (left padding), "encoder" (right padding), "seq2seq"

    @property
    def id(self) -> str:
        return f"{self.name}-{self.impl}"


_T5_GRAD = "the mask requires grad"
_SOFTCAP = "logit softcapping"
ZOO = [
    Case("llama", _llama, "eager", 2, 2, 2),
    Case("llama", _llama, "sdpa", 2, 2, 2),
    Case("qwen2", _qwen2, "eager", 2, 2, 2),
    Case("qwen2", _qwen2, "sdpa", 2, 2, 2),
    Case("mistral", _mistral, "eager", 2, 2, 2),
    Case("mistral", _mistral, "sdpa", 2, 2, 2),
    Case("gpt2", _gpt2, "eager", 2, 2, 2),
    Case("gpt2", _gpt2, "sdpa", 2, 2, 2),
    Case("bert", _bert, "eager", 2, 2, 2, kind="encoder"),
    Case("bert", _bert, "sdpa", 2, 2, 2, kind="encoder"),
    # 2 encoder self, 2 decoder self, 2 cross. With grad enabled the self-attention masks
    # carry the learned relative position bias (requires grad): left dense.
    Case("t5", _t5, "eager", 6, 6, 2, _T5_GRAD, kind="seq2seq"),
    Case("t5", _t5, "sdpa", 6, 6, 2, _T5_GRAD, kind="seq2seq"),
    Case("gemma2-softcap", _gemma2(50.0), "eager", 2, 0, 0, _SOFTCAP),
    Case("gemma2-nocap", _gemma2(None), "eager", 2, 2, 2),
]


def build(case: Case, train: bool = False):
    cls, cfg = case.make()
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation=case.impl)
    return model.train(train)


def inputs(case: Case, seed: int = 1, n: int = N):
    """Model kwargs and a bool [B, n] mask of the positions whose outputs are compared."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, n), generator=g)
    am = torch.ones(B, n, dtype=torch.long)
    if case.kind == "encoder":
        am[1, n - 6:] = 0                    # right padding: no fully masked query row
        return dict(input_ids=ids, attention_mask=am), torch.ones(B, n, dtype=torch.bool)
    am[1, :5] = 0                            # left padding
    kw = dict(input_ids=ids, attention_mask=am)
    if case.kind == "seq2seq":
        kw["decoder_input_ids"] = ids[:, :N_DEC]
        return kw, torch.ones(B, N_DEC, dtype=torch.bool)
    return kw, am.bool()


def _out(res):
    return res.logits if hasattr(res, "logits") else res.last_hidden_state


def _pisa():
    return dict(counters["pisa"])


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("case", ZOO, ids=lambda c: c.id)
def test_zoo_inference_default_options(case):
    """fullgraph, counts and reasons, logits == eager (default options: SDPA regime). Below
    min_seq_len the SDPA sites stay in the graph (Inductor's SDPA); the hand-written ones
    become the op, which runs SDPA."""
    model = build(case).eval()
    kw, valid = inputs(case)
    with torch.no_grad():
        ref = _out(model(**kw))
        out = _out(torch.compile(model, backend="pisa", fullgraph=True)(**kw))
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)
    rewritten = 0 if case.impl == "sdpa" else case.rewritten
    want = {"rewritten": rewritten, "left_dense": case.sites - rewritten}
    assert _pisa() == {k: v for k, v in want.items() if v}, _pisa()
    assert counters["stats"]["unique_graphs"] == 1
    if rewritten < case.sites:
        with torch.no_grad():
            rep = pisa_compile.explain(model, **kw)
        assert len(rep) == case.sites, str(rep)
        short = [s for s in rep.left_dense if "< min_seq_len=32768" in s.reason]
        assert len(short) == case.rewritten - rewritten, str(rep)
        for site in rep.left_dense:
            assert site in short or case.dense_reason in site.reason, str(rep)


# One training step per model family (CI time): the hand-written path where it is the harder
# one (GQA repeat_kv, sliding window, GPT-2, Gemma-2), SDPA for Qwen2, BERT and T5.
TRAIN = ["llama-eager", "qwen2-sdpa", "mistral-eager", "gpt2-eager", "bert-sdpa", "t5-sdpa",
         "gemma2-nocap-eager"]


@pytest.mark.parametrize("case", [c for c in ZOO if c.id in TRAIN], ids=lambda c: c.id)
def test_zoo_training_sparse_exact(case):
    """A training step on the sparse path in exact coverage: logits and every parameter's
    gradient equal eager; counts with grad enabled (T5's learned bias stays dense)."""
    model = build(case, train=True)
    kw, valid = inputs(case, seed=2)

    def step(run):
        model.zero_grad(set_to_none=True)
        out = _out(run(**kw))
        loss = out[valid].float().square().mean()
        loss.backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                              if p.grad is not None}

    ref, ref_grads = step(model)
    compiled = torch.compile(model, backend="pisa", fullgraph=True, options=SPARSE_EXACT)
    out, grads = step(compiled)
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)
    assert ref_grads.keys() <= grads.keys()
    for name, g in grads.items():   # AOTAutograd gives zeros, not None, to unused params
        want = ref_grads.get(name, torch.zeros_like(g))
        torch.testing.assert_close(g, want, rtol=1e-3, atol=1e-5, msg=name)
    want = {"rewritten": case.train_rewritten, "left_dense": case.sites - case.train_rewritten}
    assert _pisa() == {k: v for k, v in want.items() if v}, _pisa()
    if case.train_rewritten < case.sites:
        rep = pisa_compile.explain(model, **kw, options=SPARSE_EXACT)
        assert len(rep.left_dense) == case.sites - case.train_rewritten, str(rep)
        for site in rep.left_dense:
            assert case.dense_reason in site.reason, str(rep)


@pytest.mark.parametrize("case", [c for c in ZOO if c.train_rewritten < c.rewritten],
                         ids=lambda c: c.id)
def test_zoo_inference_sparse_exact(case):
    """The sparse path (min_seq_len=0) in exact coverage, inference, where the training test
    leaves sites dense (T5's self-attention): logits == eager."""
    model = build(case).eval()
    kw, valid = inputs(case, seed=3)
    with torch.no_grad():
        ref = _out(model(**kw))
        out = _out(torch.compile(model, backend="pisa", options=SPARSE_EXACT)(**kw))
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)
    assert _pisa() == {"rewritten": case.rewritten}


def test_gemma2_sdpa():
    """Gemma-2 under "sdpa": transformers refuses it (softcapping needs eager or flex); where
    a version accepts it, SDPA has no softcap, so the sites are plain SDPA and rewritten."""
    case = Case("gemma2-softcap", _gemma2(50.0), "sdpa", 2, 2, 2)
    try:
        model = build(case).eval()
    except ValueError as err:
        assert "scaled_dot_product_attention" in str(err)
        return
    kw, valid = inputs(case)
    with torch.no_grad():
        rep = pisa_compile.explain(model, **kw)
    assert len(rep.rewritten) == 2, str(rep)
