"""One helper for the decode benchmarks: a step captured in a CUDA graph and timed."""

from __future__ import annotations

import torch


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
