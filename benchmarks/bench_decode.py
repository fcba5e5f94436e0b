"""Decode over a persistent pyramid (``PisaKVCache``) against dense SDPA decode, side by side
in one process (issue #16's kernel goal).

The standard shape (bf16, Hq=32, Hkv=8, D=128), one query per sequence, a cache of ``N``
keys, batches ``B``. Per ``(B, N)``, with ``triton.testing.do_bench`` (median ms):

- ``dense_ms``: ``F.scaled_dot_product_attention(q, K[:N], V[:N], enable_gqa=True)`` over the
  cache's contiguous keys (the faster of the cache view and a contiguous copy);
- ``pisa_ms``: ``PisaKVCache.attend`` (selection from the pyramid, then the split-K decode
  kernel), launched eagerly, and ``pisa_graph_ms``: the same captured in a CUDA graph
  (no host time: the GPU's own time, what ``reduce-overhead`` would give);
- ``select_ms``: the selection alone; ``append_ms``: one token's pyramid update;
- ``rebuild_ms``: ``select_blocks`` of one query over every key (the pyramid and selection a
  step rebuilt before the persistent pyramid; ``pisa_attention`` ran it with ``dense_tail=0``
  until December 2026, and now runs such a step dense);
- ``bytes_pisa``/``bytes_dense``: bytes a step reads (model: boxes of the walk's pools, the
  keys of the leaves scored exactly, K/V of the attended blocks; dense: all of K/V), and
  ``pyramid_share``: the pyramid's bytes over the K/V cache's.

    python -m benchmarks.bench_decode --batches 1 8 --lengths 8192 16384 32768 65536 131072 \\
        --json profiles/bench_decode.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from pisa_compile import PisaConfig, PisaKVCache, select_blocks
from pisa_compile.kernels.geometry import block_width, cdiv, level_sizes
from pisa_compile.kernels.triton_pyramid import append_boxes
from pisa_compile.kernels.triton_select import pool_size, runs_flat
from pisa_compile.kv_cache import decode_config

HQ, HKV, D = 32, 8, 128


def capture(fn, warmup: int = 3):
    """``(graph, out)``: ``fn`` run ``warmup`` times on a side stream (lazy allocations and
    Triton compiles happen outside the capture), then captured once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def graph_ms(fn) -> float:
    """Median ms of replaying ``fn`` from a CUDA graph (``triton.testing.do_bench``)."""
    from triton.testing import do_bench
    g, _ = capture(fn)
    return do_bench(g.replay)


def step_bytes(cfg: PisaConfig, n: int, itemsize: int = 2) -> int:
    """Bytes one decode step reads per (batch row, KV head), upper bound: the boxes (max and
    min) it ranks (every leaf's where the flat kernel runs, else every level's pool), the
    keys of the leaves it scores exactly (the shortlist, or the walk's pool), and K/V of
    the ``block_width`` attended blocks."""
    C, beam = cfg.block_size, cfg.effective_beam
    forced = min(cfg.sink_blocks, cdiv(n, C)) + cfg.local_blocks
    P = pool_size(cfg.branching, beam, forced)
    if runs_flat(n, **decode_config(cfg).selection_options()):
        boxes = cdiv(n, C) * 2 * D * itemsize
        exact = min(cfg.effective_shortlist or cdiv(n, C), cdiv(n, C)) * C * D * itemsize
    else:
        levels = len(level_sizes(n, C, cfg.branching, beam))
        boxes = levels * P * 2 * D * itemsize
        exact = min(P, cdiv(n, C)) * C * D * itemsize
    M = block_width(n, C, cfg.top_k, cfg.sink_blocks, cfg.local_blocks, 1)
    return boxes + exact + M * C * 2 * D * itemsize


def run(B: int, N: int, cfg: PisaConfig) -> dict:
    from triton.testing import do_bench
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    cache = PisaKVCache(B, HKV, N + 64, D, dtype=dt, device=dev, config=cfg, sparse_from=0)
    for i in range(0, N, 16384):  # a prompt's worth of keys, appended in chunks
        m = min(16384, N - i)
        cache.append(torch.randn(B, HKV, m, D, device=dev, dtype=dt),
                     torch.randn(B, HKV, m, D, device=dev, dtype=dt))
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=dt)
    k, v = cache.keys[:, :, :N], cache.values[:, :, :N]
    kc, vc = k.contiguous(), v.contiguous()
    dense_view = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    dense = do_bench(lambda: F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True))
    pisa = do_bench(lambda: cache.attend(q))
    pisa_graph = graph_ms(lambda: cache.attend(q))
    sel = do_bench(lambda: cache.select(q))
    app = do_bench(lambda: append_boxes(cache.pyramid, cache.keys, N - 1, N))
    rebuild_cfg = cfg.replace(dense_tail=0, min_seq_len=0)
    rebuild = do_bench(lambda: select_blocks(q, kc, is_causal=True, causal_offset=N - 1,
                                             enable_gqa=True, config=rebuild_cfg))
    # Agreement with dense on these random keys (no quality measure: nothing to find).
    out = cache.attend(q).float()
    ref = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True).float()
    mem = cache.nbytes()
    bp, bd = step_bytes(cfg, N) * B * HKV, 2 * N * D * 2 * B * HKV
    auto = PisaKVCache(B, HKV, 16, D, dtype=dt, device=dev, config=cfg)
    auto.length = N  # the cost model reads only the shapes
    row = dict(B=B, N=N, cost_model_sparse_eager=auto.decode_is_sparse(1),
               dense_ms=min(dense, dense_view), dense_view_ms=dense_view,
               dense_contiguous_ms=dense, pisa_ms=pisa, pisa_graph_ms=pisa_graph, select_ms=sel,
               append_ms=app, rebuild_ms=rebuild,
               speedup_eager=min(dense, dense_view) / pisa,
               speedup_graph=min(dense, dense_view) / pisa_graph,
               bytes_pisa=bp, bytes_dense=bd,
               dense_GBps=bd / min(dense, dense_view) / 1e6,
               pisa_graph_GBps=bp / pisa_graph / 1e6,
               pyramid_share=mem["pyramid"] / mem["kv"],
               max_abs_diff_vs_dense=(out - ref).abs().max().item())
    del cache, kc, vc
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--options", type=json.loads, default={},
                    help='PisaConfig options as JSON, e.g. \'{"beam": 124}\'')
    ap.add_argument("--json", default=None)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    cfg = PisaConfig(**args.options)
    rows = []
    for B in args.batches:
        for N in args.lengths:
            row = run(B, N, cfg)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        res = dict(command="python -m benchmarks.bench_decode " + " ".join(argv),
                   device=torch.cuda.get_device_name(), torch=torch.__version__,
                   config=f"PisaConfig(**{args.options}) (decode: query_tile 1, boxes per "
                          "leaf; every leaf ranked up to flat_leaves, else the walk)",
                   rows=rows)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
