"""Where a sparse decode step's time goes (issue #16): per-kernel GPU time of one
``PisaKVCache`` step (B=8, 128K keys, standard shape) under ``torch.profiler``, and the
selection's time under launch settings and pyramid shapes (CUDA-graph replays, do_bench).

    python -m experiments.decode_probe --json profiles/decode_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.bench_decode import graph_ms
from pisa_compile import PisaConfig, PisaKVCache
from pisa_compile.kernels import triton_select as ts

HQ, HKV, D = 32, 8, 128


def _cache(B, N, cfg):
    cache = PisaKVCache(B, HKV, N + 64, D, dtype=torch.bfloat16, device="cuda", config=cfg,
                        sparse_from=0)
    for i in range(0, N, 16384):
        m = min(16384, N - i)
        cache.append(torch.randn(B, HKV, m, D, device="cuda", dtype=torch.bfloat16),
                     torch.randn(B, HKV, m, D, device="cuda", dtype=torch.bfloat16))
    return cache


def kernels(cache, q):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        cache.attend(q)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            cache.attend(q)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append(dict(name=e.key[:60], us_per_step=t / 20))
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--N", type=int, default=131072)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = dict(B=a.B, N=a.N)
    base = PisaConfig()
    cache = _cache(a.B, a.N, base)
    q = torch.randn(a.B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    res["kernels"] = kernels(cache, q)
    print(json.dumps(res["kernels"], indent=0), flush=True)
    opts = cache.decode_config.selection_options()
    n = cache.length
    sweep = {}

    def sel(tuning):
        return lambda: ts.select_blocks(q, cache.keys[:, :, :n], True, D ** -0.5,
                                        causal_offset=n - 1, pyramid=cache.pyramid,
                                        tuning=tuning, **opts)

    cands = {"default": {}, "no_split": {"rescore": {"split": False}}}
    for per in (2, 4, 16, 32):
        cands[f"split_leaves{per}"] = {"rescore": {"split_leaves": per}}
    for w in (2, 8):
        cands[f"rescore_warps{w}"] = {"rescore": {"num_warps": w}}
        cands[f"select_warps{w}"] = {"num_warps": w}
    for name, tuning in cands.items():
        try:
            sweep[name] = graph_ms(sel(tuning))
        except Exception as e:  # a launch setting a kernel cannot take
            sweep[name] = repr(e)[:200]
        print(name, sweep[name], flush=True)
    res["select_sweep_ms"] = sweep
    # Pyramid shape: branching 4 (half the levels), and a narrower beam.
    shapes = {}
    for name, cfg in {"g4_beam30": base.replace(branching=4, beam=30),
                      "g2_beam28": base.replace(beam=28),
                      "g4_beam14": base.replace(branching=4, beam=14)}.items():
        del cache
        torch.cuda.empty_cache()
        cache = _cache(a.B, a.N, cfg)
        shapes[name] = dict(select_ms=graph_ms(lambda: cache.select(q)),
                            attend_ms=graph_ms(lambda: cache.attend(q)))
        print(name, shapes[name], flush=True)
    res["shapes"] = shapes
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
