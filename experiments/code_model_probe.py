"""GPU: where a training step of the code model goes, PISA against dense, and how long the
evaluation forwards take (compile included) at each retrieval length.

    python -m experiments.code_model_probe [--length 16384] [--steps 12]
        [--mode reduce-overhead] [--options '{"local_blocks": 8}']

Prints, per attention: the median step time, a torch.profiler table of the last steps (GPU
time per kernel, self CPU time per op) and, for the evaluation model (``dynamic=True``), the
first and second forward time at each length.
"""

import argparse
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F
from benchmarks.overhead_probe import profile_tables

from experiments.code_model import (CodeModel, compile_model, load_bytes, pisa_shortfall,
                                     train_batch)


def timed(fn, n: int) -> list[float]:
    """Wall seconds of ``n`` calls of ``fn``, each between two CUDA syncs."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def step_times(attention: str, length: int, batch: int, steps: int, data,
               tables: bool = True, seg_tiles: tuple = (), options=None, mode=None) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    model = CodeModel().cuda()
    options = options if attention == "pisa" else None
    from torch._dynamo.utils import counters
    before = dict(counters["pisa"])
    compiled = compile_model(model, attention, options=options, mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def one():
        x, mark = train_batch(data, batch, length, rng)
        x = x.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = compiled(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = timed(one, steps)
    if attention == "pisa":  # a silent dense fallback would time dense as PISA
        _, why = pisa_shortfall(before, model.cfg.n_layers)
        if why:
            raise RuntimeError(why)
    print(f"== {attention} (mode {mode}, options {options}): first step {times[0]:.1f} s, median of the rest "
          f"{statistics.median(times[3:]) * 1e3:.1f} ms", flush=True)
    for seg in seg_tiles:  # dk/dv split of popular leaves (triton_attention.SEG_TILES)
        from pisa_compile.kernels import triton_attention
        old, triton_attention.SEG_TILES = triton_attention.SEG_TILES, seg
        times = timed(one, 8)
        triton_attention.SEG_TILES = old
        print(f"   SEG_TILES={seg}: median {statistics.median(times[2:]) * 1e3:.1f} ms",
              flush=True)
    if not tables:
        return
    profile_tables(one, 3, (("self_cuda_time_total", 14), ("self_cpu_time_total", 10)))


@torch.no_grad()
def eval_times(attention: str, lengths: list[int], data) -> None:
    model = CodeModel().cuda().eval()
    m = compile_model(model, attention, dynamic=True)
    for n in lengths:
        x = data[:n].long().cuda()[None]

        def fwd():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                m(x)
        row = timed(fwd, 2)
        print(f"eval {attention} {n}: first {row[0]:.2f} s, second {row[1] * 1e3:.1f} ms",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eval-lengths", default="4096,8192,16384,32768")
    ap.add_argument("--seg-tiles", default="", help="SEG_TILES values to time, e.g. 128,64,32")
    ap.add_argument("--pisa-only", action="store_true")
    ap.add_argument("--no-tables", action="store_true")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead")
    ap.add_argument("--options", default="{}", help="PISA options (JSON)")
    args = ap.parse_args()
    data = load_bytes("train", 8 << 20)
    kw = dict(tables=not args.no_tables, options=json.loads(args.options), mode=args.mode)
    step_times("pisa", args.length, args.batch, args.steps, data,
               seg_tiles=tuple(int(x) for x in args.seg_tiles.split(",") if x), **kw)
    if not args.pisa_only:
        step_times("dense", args.length, args.batch, args.steps, data, **kw)
    if not (args.pisa_only or args.no_eval):
        for attention in ("pisa", "dense"):
            eval_times(attention, [int(x) for x in args.eval_lengths.split(",")], data)


if __name__ == "__main__":
    main()
