"""Context-parallel PISA against one GPU's PISA (issue #17): forward and backward of one
attention call over a sequence sharded zig-zag across ``W`` ranks, side by side with the
single-process op on the whole sequence (rank 0, the same config), in the same processes;
the bytes each rank receives against ring attention's; and the largest difference of the
gathered output from the single-process output.

    python -m benchmarks.bench_context_parallel --nproc 2 --lengths 131072 262144 \\
        --json profiles/bench_context_parallel.json
    python -m benchmarks.bench_context_parallel --nproc 2 --device cpu --tiny --lengths 1024

Per length (standard shape: B=1, Hq=32, Hkv=8, D=128, bf16; ``--tiny``: 4/2 heads of 16,
fp32, the CPU smoke run), medians of ``--reps`` after a warm-up call:

- ``single_ms``: ``pisa_attention`` forward and backward on the whole sequence, rank 0 alone
  (the others wait at a barrier);
- ``cp_ms``: ``context_parallel_attention`` forward and backward on every rank's zig-zag
  part, the slowest rank's time (barrier, then each rank's device synchronised);
- ``speedup``: ``single_ms / cp_ms``;
- ``bytes_received``: per rank, one forward: the other ranks' leaf summaries, the index
  exchange and the fetched K/V blocks (``counters["pisa"]["cp_*_bytes"]``); its backward
  sends back as many bytes of gradients as the blocks;
- ``ring_bytes``: what ring attention's forward passes each rank: the other ``W - 1`` ranks'
  K and V (its backward passes K, V and their gradients around again);
- ``max_abs_diff``: the gathered context-parallel output against the single-process
  output (``fetch_budget`` None: the same selection, so bf16 rounding only).

The config is ``context_parallel.CP_CONFIG`` (pooled leaves: context parallelism cannot
score other ranks' keys exactly), in both rows. Spawns its ranks itself
(``torch.multiprocessing``; NCCL on CUDA, one GPU per rank; gloo on the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import _ranks


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _inputs(n: int, tiny: bool, dev: torch.device, seed: int):
    """The whole sequence's q, k, v and output gradient, equal on every rank."""
    hq, hkv, d = (4, 2, 16) if tiny else (32, 8, 128)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, go = (torch.randn(1, h, n, d, generator=g, device=dev, dtype=dtype)
                   for h in (hq, hkv, hkv, hq))
    return q, k, v, go


def _fwd_bwd(fn, leaves, go) -> tuple[float, torch.Tensor]:
    """Seconds of one forward and backward of ``fn(*leaves)`` (the caller synchronises)."""
    xs = [x.detach().requires_grad_() for x in leaves]
    t0 = time.perf_counter()
    out = fn(*xs)
    out.backward(go)
    _sync(out.device)
    return time.perf_counter() - t0, out.detach()


def _worker(rank: int, world: int, init: str, args) -> None:
    from torch._dynamo.utils import counters

    from pisa_compile.context_parallel import (CP_CONFIG, context_parallel_attention,
                                               zigzag_shard, zigzag_unshard)
    from pisa_compile.ops import pisa_attention
    cfg = CP_CONFIG
    rows = []
    with _ranks.group(rank, world, init, args.device) as dev:
        for n in args.lengths:
            q, k, v, go = _inputs(n, args.tiny, dev, seed=n)

            def single(q, k, v):
                return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=cfg)

            def cp(q, k, v):
                return context_parallel_attention(q, k, v, enable_gqa=True, config=cfg,
                                                  fetch_budget=args.fetch_budget)

            # One GPU: rank 0 alone, the others at the barrier.
            single_s, single_out = [], None
            if rank == 0:
                for _ in range(args.reps + 1):
                    s, single_out = _fwd_bwd(single, (q, k, v), go)
                    single_s.append(s)
            dist.barrier()
            part = [zigzag_shard(t, rank, world, dim=2) for t in (q, k, v, go)]
            cp_s, cp_out = [], None
            for i in range(args.reps + 1):
                counters["pisa"].clear()
                dist.barrier()
                s, cp_out = _fwd_bwd(cp, part[:3], part[3])
                slowest = torch.tensor([s], dtype=torch.float64, device=dev)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                cp_s.append(float(slowest))
            received = {key: int(counters["pisa"][key]) for key in
                        ("cp_summary_bytes", "cp_index_bytes", "cp_block_bytes")}
            every = [None] * world
            dist.all_gather_object(every, received)
            shards = [torch.empty_like(cp_out) for _ in range(world)]
            dist.all_gather(shards, cp_out)
            if rank == 0:
                whole = zigzag_unshard(shards, dim=2)
                kv_local = 2 * k.numel() * k.element_size() // world
                single_ms = 1e3 * statistics.median(single_s[1:])
                cp_ms = 1e3 * statistics.median(cp_s[1:])
                row = dict(n=n, world=world, shape=list(q.shape) + [k.shape[1]],
                           dtype=str(q.dtype), fetch_budget=args.fetch_budget,
                           single_ms=round(single_ms, 3), cp_ms=round(cp_ms, 3),
                           speedup=round(single_ms / cp_ms, 3),
                           bytes_received=every,
                           ring_bytes=(world - 1) * kv_local,
                           share_of_ring=[round(sum(r.values()) / ((world - 1) * kv_local), 4)
                                          for r in every],
                           max_abs_diff=float((whole.float() - single_out.float()).abs().max()))
                print(row, flush=True)
                rows.append(row)
            del q, k, v, go, part, single_out, cp_out, shards
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if rank == 0:
            _ranks.save(args, "bench_context_parallel", dev, rows, config=repr(cfg))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _ranks.add_options(ap)
    ap.add_argument("--lengths", type=int, nargs="+", default=[262144])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fetch-budget", type=float, default=None,
                    help="context_parallel_attention's fetch_budget (None: every chosen block)")
    ap.add_argument("--tiny", action="store_true", help="4/2 heads of 16, fp32 (CPU smoke)")
    args = ap.parse_args(argv)
    args.argv = argv
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    from pisa_compile.context_parallel import CP_CONFIG
    unit = 2 * args.nproc * max(CP_CONFIG.block_size, CP_CONFIG.query_tile)
    bad = [n for n in args.lengths if n < 1 or n % unit]
    if bad:
        ap.error(f"--lengths must be multiples of 2 * nproc * block size = {unit}, got {bad}")
    _ranks.spawn(ap, args, _worker)


if __name__ == "__main__":
    main()
