"""``generate(past_key_values=PisaCache(...))`` with ``backend="pisa"`` on the GPU: sparse decode
from the pyramid runs, and in the exact regime the greedy tokens and scores are dense's.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from pisa_compile import PisaConfig  # noqa: E402
from pisa_compile.backend import pisa_backend  # noqa: E402
from pisa_compile.hf_cache import PisaCache  # noqa: E402
from tests.hf_models import padded_prompt  # noqa: E402

pytestmark = pytest.mark.gpu


def test_generate_exact_regime_on_gpu(fresh_dynamo):
    """fp32 under PyTorch's default matmul precision: the scores are dense's to 2e-3. (Until
    9f18f0a this test gave the backend the default top_k, so its prefill was sparse: the
    0.146 it saw was PISA's approximation, not the cache.) The prefill's mask reaches the
    attention from the graph before the cache's break: proved, or read at run time, never
    the reference selection."""
    from torch._dynamo.utils import counters

    from pisa_compile.samples import tiny_llama
    m = tiny_llama(8192, num_layers=2).cuda()
    new = 8
    kw = padded_prompt("cuda", new=new)
    dense = m.generate(**kw)
    pc = PisaConfig(top_k=64, kernel="triton", min_seq_len=0)  # 47 leaves: all selected
    # The backend by function: on a machine where the package is not installed, the name
    # "pisa" has no entry point.
    m.forward = torch.compile(m.forward, dynamic=True, backend=lambda gm, ex: pisa_backend(
        gm, ex, options=dict(min_seq_len=0, kernel="triton", top_k=64)))
    with torch._dynamo.config.patch(recompile_limit=64):
        out = m.generate(**kw, past_key_values=PisaCache(3000 + new, config=pc, sparse_from=0))
    assert counters["pisa"]["sparse_decode"] == (new - 1) * 2
    assert not any(k.startswith("reference_") for k in counters["pisa"]), dict(counters["pisa"])
    assert counters["pisa"]["runtime_mask_unstructured"] == 0, dict(counters["pisa"])
    for a, b in zip(out.scores, dense.scores):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
    assert torch.equal(out.sequences, dense.sequences)


def test_static_cache_generate_in_cuda_graphs(fresh_dynamo):
    """``PisaStaticCache`` with the decode steps compiled by ``generate`` itself in CUDA graphs
    (``compile_config``, ``triton.cudagraphs``; the forward left uncompiled: a forward
    compiled without graphs takes the steps over, ``experiments/static_graph_probe.py``):
    the steps decode from the pyramid while the graphs are recorded, the second call (the
    compile config set on ``model.generation_config`` instead of passed) replays them (the
    decode op's Python never runs), and in the exact regime the tokens and scores are dense
    attention's (fp32)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from pisa_compile.hf_cache import PisaStaticCache
    from pisa_compile.samples import tiny_llama
    m = tiny_llama(8192, num_layers=2).cuda()
    new = 8
    kw = padded_prompt("cuda", new=new)
    dense = m.generate(**kw)
    opts = dict(min_seq_len=0, kernel="triton", top_k=64)  # 47 leaves: all selected
    cache = PisaStaticCache(m.config, 3000 + new, pisa_config=PisaConfig(**opts),
                            sparse_from=0)
    cc = CompileConfig(backend=pisa_backend, mode=None,
                       options={**opts, "triton.cudagraphs": True})
    runs = []
    for i in range(2):  # the second call replays the graphs the first one recorded
        cache.reset()
        before = counters["pisa"]["sparse_decode"], counters["pisa"]["cached_decode_calls"]
        if i == 0:
            out = m.generate(**kw, past_key_values=cache, compile_config=cc)
        else:  # set once on the model: generate() then takes one argument, the cache
            m.generation_config.compile_config = cc
            out = m.generate(**kw, past_key_values=cache)
        runs.append((counters["pisa"]["sparse_decode"] - before[0],
                     counters["pisa"]["cached_decode_calls"] - before[1]))
        for a, b in zip(out.scores, dense.scores):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
        assert torch.equal(out.sequences, dense.sequences)
    # Recorded from the pyramid (every call of the op sparse), then replayed (no call).
    assert runs[0][0] >= 2 and runs[0][0] == runs[0][1], (runs, dict(counters["pisa"]))
    assert runs[1] == (0, 0), (runs, dict(counters["pisa"]))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert not any(k.startswith("reference_") for k in counters["pisa"]), dict(counters["pisa"])
