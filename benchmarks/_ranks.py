"""What the benches over several ranks share (``bench_context_parallel``, ``bench_ddp``):
their common options, the spawn of one process per rank, each rank's process group, and the
JSON file rank 0 writes. Not a script."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def add_options(ap: argparse.ArgumentParser) -> None:
    """``--nproc``, ``--device`` and ``--json``."""
    ap.add_argument("--nproc", type=int, default=2, help="ranks (one GPU each on CUDA)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--json", help="rank 0 writes the rows here")


def spawn(ap: argparse.ArgumentParser, args: argparse.Namespace, worker) -> None:
    """Check ``--nproc`` against the GPUs (an ``ap.error`` names it), then run
    ``worker(rank, world, init_method, args)`` in one process per rank."""
    if getattr(args, "argv", None) is None:  # main(None): the command line's arguments
        args.argv = sys.argv[1:]
    if args.nproc < 2:
        ap.error(f"--nproc must be at least 2, got {args.nproc}")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        ap.error(f"--nproc {args.nproc} needs as many GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.nproc, f"file://{os.path.join(tmp, 'init')}", args),
                 nprocs=args.nproc)


@contextlib.contextmanager
def group(rank: int, world: int, init_method: str, device: str):
    """Join the process group (NCCL on CUDA, one GPU per rank; gloo on the CPU) and yield the
    rank's device; on leaving, tear the group down.

    The caller must have dropped what holds the group (a DDP module's reducer, compiled
    graphs) before it leaves: if the last reference goes after ``destroy_process_group``, the
    group's destructor joins gloo's worker threads while holding the GIL, and a thread still
    freeing the last collective's Python tensors waits for that GIL (a hang, or an abort).
    Hence Dynamo's caches reset, ``gc.collect()`` and, on a clean exit, a barrier before the
    teardown; on an error, the traceback's frames are cleared first."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=world)
    clean = False
    try:
        yield torch.device("cuda", rank) if cuda else torch.device("cpu")
        clean = True
    except BaseException as e:
        # The traceback keeps the caller's frames (and a DDP reducer) alive: drop them
        # before the teardown, then let spawn report the error.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        try:
            torch._dynamo.reset()
            gc.collect()
            if clean:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def save(args: argparse.Namespace, module: str, dev: torch.device, rows: list, **extra) -> None:
    """Rank 0's JSON file (``--json``): the device, torch, the command and the rows."""
    if not args.json:
        return
    with open(args.json, "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                       torch=torch.__version__, **extra,
                       command=f"python -m benchmarks.{module} " + " ".join(args.argv),
                       rows=rows), fh, indent=1)
