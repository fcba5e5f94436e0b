"""Dynamic shapes, recompiles, the compile caches, and the pass's own cost.

- Five prompt lengths recompile at most twice (static first graph, then one dynamic one).
- A second process with the same ``TORCHINDUCTOR_CACHE_DIR`` hits the FX graph cache (and
  AOTAutograd's cache) for a graph with the rewritten PISA op in it.
- The pass is idempotent: run again on its own output it finds nothing and changes nothing.
- The pass costs little next to the whole compile (< 5% here; README has the zoo numbers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch._dynamo.utils import counters

import pisa_compile
from pisa_compile.lowering import rewrite_graph

from .test_zoo import SPARSE_EXACT, ZOO, _out, build, inputs

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _case(cid):
    return next(c for c in ZOO if c.id == cid)


@pytest.mark.parametrize("cid", ["llama-sdpa"])
def test_five_lengths_recompile_at_most_twice(cid):
    case = _case(cid)
    model = build(case).eval()
    compiled = torch.compile(model, backend="pisa", options={"min_seq_len": 0})
    with torch.no_grad():
        for n in (12, 16, 20, 28, 36):
            kw, valid = inputs(case, seed=n, n=n)
            torch.testing.assert_close(_out(compiled(**kw))[valid], _out(model(**kw))[valid],
                                       rtol=1e-4, atol=1e-4)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 2, graphs
    assert counters["pisa"] == {"rewritten": 2 * graphs}, dict(counters["pisa"])


_CHILD = textwrap.dedent("""
    import json, math, sys, torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, 2, 16).permute(2, 0, 3, 1, 4)
            s = (q @ k.transpose(-2, -1)) / math.sqrt(16)
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            return F.softmax(s, dim=-1) @ v + F.scaled_dot_product_attention(q, k, v)

    torch.manual_seed(0)
    m = Attn()
    x = torch.randn(2, 40, 32)
    out = torch.compile(m, backend="pisa", options=json.loads(sys.argv[1]))(x)
    torch.testing.assert_close(out, m(x), rtol=1e-4, atol=1e-5)
    print(json.dumps({"pisa": dict(counters["pisa"]), "inductor": dict(counters["inductor"]),
                      "aot": dict(counters["aot_autograd"])}))
""")


def test_second_process_hits_fx_graph_cache(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, str(script), json.dumps(SPARSE_EXACT)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["pisa"] == second["pisa"] == {"rewritten": 2}
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert first["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1, second
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second
    assert second["inductor"].get("fxgraph_cache_bypass", 0) == 0, second
    assert second["aot"].get("autograd_cache_bypass", 0) == 0, second


def _capture(model, kw):
    """The Dynamo graphs of ``model(**kw)`` (FX, before any rewrite)."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=grab)(**kw)
    return graphs


@pytest.mark.parametrize("cid", ["llama-eager", "t5-eager", "gpt2-sdpa", "gemma2-softcap-eager"])
def test_pass_is_idempotent(cid):
    case = _case(cid)
    (gm,) = _capture(build(case).eval(), inputs(case)[0])
    cfg = pisa_compile.PisaConfig(min_seq_len=0)  # the test sizes: SDPA sites are rewritten
    first = rewrite_graph(gm, cfg)
    assert len(first) == case.sites
    assert sum(s.rewritten for s in first) == case.rewritten
    code = gm.code
    second = rewrite_graph(gm, cfg)
    assert gm.code == code
    # Rewritten sites are gone; the ones left dense are found again, with the same reason.
    assert [(s.form, s.reason) for s in second] == [(s.form, s.reason) for s in first
                                                    if not s.rewritten]


def test_pass_time_is_small_share_of_compile(monkeypatch):
    """Time spent in the rewrite pass vs the whole first call (Dynamo + pass + Inductor)."""
    import pisa_compile.lowering as lowering
    spent = []
    real = lowering.rewrite_graph

    def timed(gm, config, apply=True):
        t = time.perf_counter()
        try:
            return real(gm, config, apply)
        finally:
            spent.append(time.perf_counter() - t)

    monkeypatch.setattr(lowering, "rewrite_graph", timed)
    shares = {}
    for cid in ("llama-eager", "t5-eager"):
        case = _case(cid)
        model = build(case).eval()
        kw, _ = inputs(case)
        torch._dynamo.reset()
        spent.clear()
        t = time.perf_counter()
        with torch.no_grad():
            torch.compile(model, backend="pisa", options=SPARSE_EXACT)(**kw)
        total = time.perf_counter() - t
        shares[cid] = sum(spent) / total
    assert all(s < 0.05 for s in shares.values()), shares
