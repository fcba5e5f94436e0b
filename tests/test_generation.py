"""``model.generate()`` under ``backend="pisa"``: greedy tokens equal eager, and the
decode step (one query, keys from the cache, masks from transformers) is rewritten to the
PISA op, which runs it dense (a decode step with no persistent pyramid:
``ops.is_decode_step``).

Options ``min_seq_len=0, block_size=16, top_k=64``: the prompt's sparse path runs
(``pisa::attention``) and selects every block, so greedy tokens must match eager exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from pisa_compile.kernels import dispatch

from .test_zoo import SPARSE_EXACT, ZOO, build

transformers = pytest.importorskip("transformers")

GEN = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def llama():
    case = next(c for c in ZOO if c.id == "llama-sdpa")
    model = build(case).eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 128, (2, 12), generator=g)
    am = torch.ones_like(ids)
    am[1, :3] = 0                                    # left padding, as generate() wants
    ref = model.generate(input_ids=ids, attention_mask=am, **GEN)
    return model, ids, am, ref


@pytest.fixture()
def spy(monkeypatch, caplog):
    """Counts the PISA op's calls by query length, and captures the rewrite log lines."""
    calls: list[int] = []
    real = dispatch.attention_forward

    def counting(q, *args, **kwargs):
        calls.append(q.shape[2])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(dispatch, "attention_forward", counting)
    caplog.set_level(logging.INFO, logger="pisa_compile")
    return calls, caplog


def _decode_sites(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "pisa_compile" and "q=[2, 4, 1, 16]" in r.getMessage()]


def test_generate_dynamic_cache(llama, spy):
    model, ids, am, ref = llama
    calls, caplog = spy
    forward = model.forward
    model.forward = torch.compile(forward, backend="pisa", options=SPARSE_EXACT)
    try:
        out = model.generate(input_ids=ids, attention_mask=am, **GEN)   # DynamicCache
    finally:
        model.forward = forward
    assert torch.equal(out, ref)
    # Prefill, the first decode step, then one dynamic-length decode graph (Dynamo's
    # automatic dynamic shapes): every site of every graph rewritten, none left dense.
    assert counters["pisa"]["left_dense"] == 0 and counters["pisa"]["rewritten"] >= 4
    decode = _decode_sites(caplog)
    assert decode and all(": rewritten" in line for line in decode), decode
    # The sparse attention ran for the prompt (12 queries), per layer; the 7 decode steps
    # are dense (until December 2026 they ran it with dense_tail=0, unaligned and slower).
    assert calls == [12, 12], calls


def test_generate_static_cache(llama, spy):
    """``cache_implementation="static"``: transformers compiles the decode step itself with
    our ``CompileConfig(backend="pisa")`` (``_compile_all_devices`` lets it do so on CPU);
    it never compiles the prefill."""
    model, ids, am, ref = llama
    calls, caplog = spy
    cc = transformers.CompileConfig(backend="pisa", mode=None, options=SPARSE_EXACT,
                                    fullgraph=True)
    cc._compile_all_devices = True
    out = model.generate(input_ids=ids, attention_mask=am, cache_implementation="static",
                         compile_config=cc, **GEN)
    assert torch.equal(out, ref)
    assert counters["pisa"] == {"rewritten": 2}, dict(counters["pisa"])  # one decode graph
    assert counters["stats"]["unique_graphs"] == 1
    decode = _decode_sites(caplog)
    assert len(decode) == 2 and all(": rewritten" in line for line in decode), decode
    assert calls == [], calls  # decode steps: dense (the prefill runs eagerly, uncompiled)


def test_generate_with_the_dense_tail(llama, spy):
    """The default ``dense_tail`` (64) with a 100-token left-padded prompt: the prompt runs
    the sparse op once per layer, every decode step runs dense SDPA (the op is never called
    with one query), and greedy tokens equal eager (the selection is exact here: ``top_k``
    covers every block)."""
    model, _, _, _ = llama
    calls, _ = spy
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 128, (2, 100), generator=g)
    am = torch.ones_like(ids)
    am[1, :7] = 0
    ref = model.generate(input_ids=ids, attention_mask=am, **GEN)
    opts = {k: v for k, v in SPARSE_EXACT.items() if k != "dense_tail"}
    forward = model.forward
    model.forward = torch.compile(forward, backend="pisa", options=opts)
    try:
        out = model.generate(input_ids=ids, attention_mask=am, **GEN)
    finally:
        model.forward = forward
    assert torch.equal(out, ref)
    # Under the key mask the rows are aligned to their first token (ops._aligned): the sparse
    # op runs all 100 rows, and each row's last ones (a 64-query tail, rounded to 16-query
    # tiles of its own tokens) are taken from the dense tail's call.
    assert calls == [100, 100], calls
