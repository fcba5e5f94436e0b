"""Data-parallel training under ``backend="pisa"`` against one GPU (issue #17): tokens per
second of DDP over ``W`` ranks against rank 0 training alone, in the same processes, and
the attention sites each backend call rewrote (Dynamo's DDPOptimizer splits the graph at
gradient-bucket boundaries, so the backend sees pieces).

    python -m benchmarks.bench_ddp --nproc 2 --seq-len 16384 --json profiles/bench_ddp.json
    python -m benchmarks.bench_ddp --nproc 2 --device cpu --tiny --seq-len 256  # gloo smoke

The model is ``bench_generate``'s Llama-1B-shaped 4-layer stack (hidden 2048, 32 query and 8
KV heads of 64, SwiGLU 8192; bf16, random init, train mode; ``--tiny``: 2 layers of 64,
fp32), each rank one sequence of ``--seq-len`` random tokens per step with the tokenizer's
all-ones ``attention_mask``, SGD. Rows, medians of ``--steps`` after two warm-up steps:

- ``single_step_ms``: rank 0 alone, the model compiled with ``backend="pisa"`` (the others
  wait at a barrier); ``single_tokens_per_s``: ``seq_len / step``;
- ``ddp_step_ms``: every rank, ``DistributedDataParallel`` then ``torch.compile(backend=
  "pisa")``, the slowest rank's step; ``ddp_tokens_per_s``: ``W * seq_len / step``;
- ``scaling``: ``ddp_tokens_per_s / single_tokens_per_s`` (#17's goal: 1.8 on 2 GPUs);
- ``sites``: per row, the sites rewritten and left dense (``counters["pisa"]``) and the
  backend calls (graph pieces).

``--options`` are the backend's (JSON); the default lowers ``min_seq_len`` to 0, since the
defaults leave SDPA calls under 32K keys to Inductor. Spawns its ranks
(``torch.multiprocessing``; NCCL on CUDA, one GPU each; gloo on the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import _ranks


def _steps(model, ids, n_steps: int, dev: torch.device, world: int) -> list[float]:
    """Seconds per training step (the slowest rank's with ``world > 1``), warm-up excluded."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    times = []
    for i in range(n_steps + 2):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                     use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
        if world > 1:
            dist.all_reduce(s, op=dist.ReduceOp.MAX)
        if i >= 2:
            times.append(float(s))
    return times


def _measure(rank: int, world: int, dev: torch.device, args) -> dict:
    """Rank 0's row (other ranks: ``{}``). The models and DDP's reducer live only here, so
    they are gone (with Dynamo's caches, reset by ``_ranks.group``) before the process group
    is torn down."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.bench_generate import _model
    from pisa_compile.backend import pisa_backend
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, 128 if args.tiny else 32000, (1, args.seq_len), generator=g).to(dev)
    row = dict(seq_len=args.seq_len, world=world, options=args.options)

    def compiled(m):
        torch._dynamo.reset()
        counters.clear()
        return torch.compile(m, backend=pisa_backend, options=args.options)

    def sites():
        return dict(rewritten=int(counters["pisa"]["rewritten"]),
                    left_dense=int(counters["pisa"]["left_dense"]),
                    graphs=int(counters["stats"]["unique_graphs"]))

    if rank == 0:
        t = _steps(compiled(_model(args.tiny, args.device).train()), ids, args.steps, dev, 1)
        row.update(single_step_ms=round(1e3 * statistics.median(t), 2), single_sites=sites())
    dist.barrier()
    ddp = DDP(_model(args.tiny, args.device).train(),
              device_ids=[rank] if dev.type == "cuda" else None)
    t = _steps(compiled(ddp), ids, args.steps, dev, world)
    every = [None] * world
    dist.all_gather_object(every, sites())
    if rank != 0:
        return {}
    ddp_ms = 1e3 * statistics.median(t)
    single_tps = args.seq_len / (row["single_step_ms"] / 1e3)
    ddp_tps = world * args.seq_len / (ddp_ms / 1e3)
    row.update(ddp_step_ms=round(ddp_ms, 2), ddp_sites=every,
               single_tokens_per_s=round(single_tps), ddp_tokens_per_s=round(ddp_tps),
               scaling=round(ddp_tps / single_tps, 3))
    return row


def _worker(rank: int, world: int, init: str, args) -> None:
    with _ranks.group(rank, world, init, args.device) as dev:
        row = _measure(rank, world, dev, args)
        if rank == 0:
            print(row, flush=True)
            _ranks.save(args, "bench_ddp", dev, [row])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _ranks.add_options(ap)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--options", type=json.loads, default={"min_seq_len": 0},
                    help="the pisa backend's options as JSON")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke)")
    args = ap.parse_args(argv)
    args.argv = argv
    if args.steps < 1 or args.seq_len < 2:
        ap.error(f"--steps must be >= 1 and --seq-len >= 2, got {args.steps}, {args.seq_len}")
    if not isinstance(args.options, dict):
        ap.error(f"--options must be a JSON object, got {args.options!r}")
    _ranks.spawn(ap, args, _worker)


if __name__ == "__main__":
    main()
