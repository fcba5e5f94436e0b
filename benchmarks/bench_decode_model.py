"""Per-token decode time of a Llama-3.2-1B-shaped 4-layer stack with ``PisaKVCache`` against
the same stack with dense SDPA over a static cache, both replayed from CUDA graphs, side by
side in one process (issue #16's end-to-end setting, with a hand-written model: transformers'
``generate()`` does not drive ``PisaKVCache`` yet).

The stack: hidden 2048, 32 query / 8 KV heads of 64, SwiGLU 8192, RMSNorm, bf16, random
weights, no rotary embedding (a few elementwise ops per token, the same for both). Per
``(B, N)``: the caches hold ``N`` random keys and values (the prompt), then one decode step
(QKV projection, the cache append, attention over ``N + 1`` keys, output projection, MLP, per
layer) is captured in a CUDA graph and replayed (``triton.testing.do_bench``, median ms).

    python -m benchmarks.bench_decode_model --batches 1 8 --lengths 8192 32768 131072 \\
        --json profiles/bench_decode_model.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_decode import capture
from pisa_compile import PisaConfig, PisaKVCache

HIDDEN, HQ, HKV, HD, FFN, LAYERS = 2048, 32, 8, 64, 8192, 4


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, (HQ + 2 * HKV) * HD, bias=False)
        self.o = nn.Linear(HQ * HD, HIDDEN, bias=False)
        self.up = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)
        self.n1, self.n2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)

    def forward(self, x, attend):
        B = x.shape[0]
        q, k, v = self.qkv(self.n1(x)).view(B, 1, HQ + 2 * HKV, HD).transpose(1, 2).split(
            [HQ, HKV, HKV], dim=1)
        a = attend(q, k, v).transpose(1, 2).reshape(B, 1, HQ * HD)
        x = x + self.o(a)
        g, u = self.up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Dense:
    """A static cache read by dense SDPA (``enable_gqa``) over its first ``n`` keys."""

    def __init__(self, B, cap):
        self.k = torch.zeros(B, HKV, cap, HD, device="cuda", dtype=torch.bfloat16)
        self.v = torch.zeros_like(self.k)
        self.n = 0

    def __call__(self, q, k, v):
        self.k[:, :, self.n:self.n + 1] = k
        self.v[:, :, self.n:self.n + 1] = v
        self.n += 1
        return F.scaled_dot_product_attention(q, self.k[:, :, :self.n], self.v[:, :, :self.n],
                                              enable_gqa=True)


class Pisa:
    def __init__(self, B, cap, sparse_from):
        self.c = PisaKVCache(B, HKV, cap, HD, device="cuda", config=PisaConfig(),
                             sparse_from=sparse_from, cuda_graph=True)

    def __call__(self, q, k, v):
        self.c.append(k, v)
        return self.c.attend(q)


def _fill(caches, N, B):
    for c in caches:
        for i in range(0, N, 16384):
            m = min(16384, N - i)
            k = torch.randn(B, HKV, m, HD, device="cuda", dtype=torch.bfloat16)
            if isinstance(c, Dense):
                c.k[:, :, i:i + m], c.v[:, :, i:i + m] = k, k.flip(-1)
                c.n = i + m
            else:
                c.c.append(k, k.flip(-1))


def _step_ms(layers, caches, x, N):
    from triton.testing import do_bench

    def step():
        for c in caches:  # the graph replays the step at N + 1 keys
            if isinstance(c, Dense):
                c.n = N
            else:
                c.c.length = N
        h = x
        for layer, c in zip(layers, caches):
            h = layer(h, c)
        return h

    g, out = capture(step, warmup=2)
    eager = do_bench(step)
    return do_bench(g.replay), eager, out


def run(B, N, layers):
    x = torch.randn(B, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    row = dict(B=B, N=N)
    outs = {}
    for name, make in (("dense", lambda: Dense(B, N + 8)),
                       ("pisa", lambda: Pisa(B, N + 8, 0)),
                       ("pisa_auto", lambda: Pisa(B, N + 8, None))):
        caches = [make() for _ in layers]
        _fill(caches, N, B)
        graph, eager, out = _step_ms(layers, caches, x, N)
        row[f"{name}_graph_ms"], row[f"{name}_eager_ms"] = graph, eager
        outs[name] = out.float()
        del caches
        torch.cuda.empty_cache()
    row["speedup_graph"] = row["dense_graph_ms"] / row["pisa_graph_ms"]
    row["speedup_auto_graph"] = row["dense_graph_ms"] / row["pisa_auto_graph_ms"]
    row["speedup_eager"] = row["dense_eager_ms"] / row["pisa_eager_ms"]
    row["rel_diff_vs_dense"] = ((outs["pisa"] - outs["dense"]).norm()
                                / outs["dense"].norm()).item()
    return row


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    layers = [Layer().cuda().to(torch.bfloat16).eval() for _ in range(LAYERS)]
    rows = []
    with torch.no_grad():
        for B in a.batches:
            for N in a.lengths:
                rows.append(run(B, N, layers))
                print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(command="python -m benchmarks.bench_decode_model " + " ".join(argv),
                           device=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
