"""Do ``PisaStaticCache``'s decode steps replay from CUDA graphs inside ``generate()``?

Per variant (the prefill compiled with ``backend="pisa"`` or left eager; the steps compiled
by ``generate`` with ``compile_config``), a second ``generate()`` on the reset cache counts
the decode op's Python runs (``counters["pisa"]["sparse_decode"]``: 0 when every step
replays) and the CUDA-graph launches in a ``torch.profiler`` trace, and times a token.

    python -m experiments.static_graph_probe --json profiles/static_graph_probe.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from benchmarks.bench_generate import _model
    from pisa_compile import PisaConfig
    from pisa_compile.backend import pisa_backend
    from pisa_compile.hf_cache import PisaStaticCache
    rows = []
    # "pisa": the forward compiled without CUDA graphs, the steps by generate's compile_config;
    # "pisa+graphs": the forward compiled with them (generate's own compile breaks into it);
    # "eager": the forward not compiled, the steps by generate's compile_config.
    for prefill in ("pisa", "pisa+graphs", "eager"):
        torch._dynamo.reset()
        counters.clear()
        m = _model(False, "cuda")
        opts = dict(min_seq_len=0)
        if prefill == "pisa":
            m.forward = torch.compile(m.forward, backend=pisa_backend, dynamic=True,
                                      options=opts)
        elif prefill == "pisa+graphs":
            m.forward = torch.compile(m.forward, backend=pisa_backend,
                                      options={**opts, "triton.cudagraphs": True})
        ids = torch.randint(3, 32000, (args.batch, args.n), device="cuda")
        cache = PisaStaticCache(m.config, args.n + args.new_tokens, sparse_from=0,
                                pisa_config=PisaConfig())
        cc = CompileConfig(backend=pisa_backend, mode=None,
                           options={**opts, "triton.cudagraphs": True})
        kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                  do_sample=False, past_key_values=cache, compile_config=cc, pad_token_id=0)
        with torch.no_grad():
            for _ in range(2):
                cache.reset()
                m.generate(ids, **kw)
            before = counters["pisa"]["sparse_decode"]
            cache.reset()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                m.generate(ids, **kw)
            launches = sum(e.count for e in prof.key_averages() if "GraphLaunch" in e.key)
            after = counters["pisa"]["sparse_decode"]
            ts = []
            for new in (1, args.new_tokens):
                cache.reset()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                m.generate(ids, **{**kw, "max_new_tokens": new, "min_new_tokens": new})
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
        row = dict(prefill=prefill, n=args.n, batch=args.batch, new_tokens=args.new_tokens,
                   decode_op_python_runs=after - before, graph_launches=launches,
                   per_token_ms=round((ts[1] - ts[0]) / (args.new_tokens - 1) * 1e3, 3),
                   counters=dict(counters["pisa"]),
                   cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]),
                   graph_breaks={k[:160]: v for k, v in counters["graph_break"].items()})
        print(row, flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           command="python -m experiments.static_graph_probe", rows=rows),
                      fh, indent=1)


if __name__ == "__main__":
    main()
