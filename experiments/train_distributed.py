"""Data-parallel training under ``backend="pisa"``: DDP or FSDP2 over ``torch.distributed``.

    torchrun --nproc_per_node 2 -m experiments.train_distributed --mode ddp [--steps 3]
    torchrun --nproc_per_node 2 -m experiments.train_distributed --mode fsdp2 --device cuda

A tiny Llama (``pisa_compile.samples.tiny_llama``, GQA, train mode) learns random bytes with
AdamW for a few steps. Every rank takes its slice of the same global batch, so the losses
and gradients equal one process on the whole batch (with the default, exact-regime options
PISA selects every block, i.e. equals dense attention). DDP wraps the model before
``torch.compile``: Dynamo's DDPOptimizer then splits the graph at gradient-bucket boundaries
(``--bucket-cap-mb``) and the backend sees each piece. FSDP2 shards each decoder layer and
the root (``fully_shard``), then compiles. At the end every rank's PISA report is printed:
backend calls, attention sites rewritten and left dense per call. Gloo on the CPU, NCCL on
CUDA. ``--out FILE`` (rank 0) saves losses, first-step gradients and reports with
``torch.save``; the tests read it.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
from typing import Any, Optional

import torch

# Every block selected (PISA equals dense); dense_tail=0, else short calls run plain SDPA.
EXACT = dict(min_seq_len=0, block_size=16, top_k=64, dense_tail=0)


def global_batch(step: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Random bytes of one step: int64 ``[batch, seq_len]``, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, 256, (batch, seq_len), generator=g)


_ATTENTION_OPS = {torch.nn.functional.scaled_dot_product_attention, torch.softmax,
                  torch.nn.functional.softmax, torch.Tensor.softmax, "softmax"}


def attention_nodes(gm: torch.fx.GraphModule) -> int:
    """SDPA and softmax calls in a Dynamo graph: each should be (part of) one attention site,
    so a site cut by a graph split shows up as a node the pass found no site for."""
    return sum(n.op in ("call_function", "call_method") and n.target in _ATTENTION_OPS
               for n in gm.graph.nodes)


class CountingBackend:
    """``backend="pisa"`` that records, per backend call, the attention nodes of the graph
    (:func:`attention_nodes`, before the rewrite), the sites the pass rewrote and left dense
    (from ``counters["pisa"]``) and their log lines."""

    def __init__(self, options: dict):
        self.options = options
        self.calls: list[dict] = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.utils import counters
        from pisa_compile.backend import pisa_backend

        nodes = attention_nodes(gm)
        lines: list[str] = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
        log = logging.getLogger("pisa_compile")
        before = dict(counters["pisa"])
        old_level = log.level
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        try:
            compiled = pisa_backend(gm, example_inputs, options=self.options)
        finally:
            log.removeHandler(handler)
            log.setLevel(old_level)
        delta = {k: counters["pisa"][k] - before.get(k, 0) for k in ("rewritten", "left_dense")}
        self.counters = counters["pisa"]  # the run-time paths, read in summary()
        sites = [s for s in lines if s.startswith("pisa site")]
        self.calls.append(dict(delta, nodes=nodes, sites=sites))
        return compiled

    def summary(self) -> dict:
        runtime = {k: int(v) for k, v in getattr(self, "counters", {}).items()
                   if k.startswith("runtime_mask")}
        return dict(backend_calls=len(self.calls), runtime=runtime,
                    rewritten=sum(c["rewritten"] for c in self.calls),
                    left_dense=sum(c["left_dense"] for c in self.calls),
                    attention_nodes=sum(c["nodes"] for c in self.calls),
                    per_call=[(c["nodes"], c["rewritten"], c["left_dense"]) for c in self.calls],
                    sites=[s for c in self.calls for s in c["sites"]])


def _wrap(model: torch.nn.Module, mode: str, device: torch.device,
          bucket_cap_mb: Optional[float]) -> torch.nn.Module:
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        kw = {} if bucket_cap_mb is None else dict(bucket_cap_mb=bucket_cap_mb)
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **kw)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if mode == "single":
        return model
    raise ValueError(f"mode must be 'ddp', 'fsdp2' or 'single', got {mode!r}")


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy of a tensor or of a sharded DTensor (gathered: a collective)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def train(mode: str = "single", steps: int = 3, seq_len: int = 64, batch: int = 4,
          num_layers: int = 2, attn: str = "sdpa", bucket_cap_mb: Optional[float] = None,
          options: Optional[dict] = None, lr: float = 1e-3, device: str = "cpu",
          compiled: bool = True, log=print) -> dict[str, Any]:
    """Train ``tiny_llama(num_layers)`` under ``backend="pisa"`` for ``steps`` steps.

    ``mode="single"`` runs the whole ``batch`` in this process; ``"ddp"``/``"fsdp2"`` need an
    initialised process group and take rows ``[rank * batch / world, ...)``. ``attn`` is the
    transformers attention implementation (``"sdpa"``, or ``"eager"`` for the hand-written
    matmul-softmax-matmul form). ``compiled=False`` runs the model eagerly (dense attention:
    the reference of the exact regime).

    Returns:
        ``losses`` (global mean loss per step, floats), ``grads`` (name -> float32 CPU
        tensor, the full averaged gradient of step 0), ``report`` (this rank's
        :meth:`CountingBackend.summary`).

    Raises:
        ValueError: a bad ``mode``, or ``batch`` not divisible by the world size.
    """
    from pisa_compile.samples import tiny_llama

    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if mode != "single" else (0, 1)
    if batch % world:
        raise ValueError(f"batch ({batch}) must be divisible by the world size ({world})")
    dev = (torch.device(device, torch.cuda.current_device()) if device == "cuda"
           else torch.device(device))
    torch._dynamo.reset()  # per-code caches would otherwise hold another run's graphs
    model = tiny_llama(max_positions=max(seq_len, 64), num_layers=num_layers).train().to(dev)
    model.set_attn_implementation(attn)
    wrapped = _wrap(model, mode, dev, bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    backend = CountingBackend(dict(EXACT if options is None else options))
    step_fn = torch.compile(wrapped, backend=backend) if compiled else wrapped
    per = batch // world
    losses, grads = [], {}
    for step in range(steps):
        ids = global_batch(step, batch, seq_len)[rank * per:(rank + 1) * per].to(dev)
        # The tokenizer's all-ones attention_mask, as a training loop passes it.
        loss = step_fn(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                       use_cache=False).loss
        loss.backward()
        # Equal rows per rank and no ignored labels: the mean of the ranks' means is the
        # global batch's mean, as the gradients (averaged by DDP and FSDP2) are.
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
        if step == 0:
            grads = {n: _full(p.grad).float() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        log(f"rank {rank} step {step} loss {losses[-1]:.6f}")
    return dict(losses=losses, grads=grads, report=backend.summary())


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.train_distributed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["ddp", "fsdp2"], required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="global batch (rows, all ranks)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket size, >= 1 (DDP's first bucket is 1 MiB and Dynamo's "
                        "DDPOptimizer asserts on smaller ones); small values split the "
                        "compiled graph more")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--kernel", choices=["auto", "triton"], default="auto",
                   help="PISA's kernel option; 'triton' on the CPU needs TRITON_INTERPRET=1 "
                        "(a mask read at run time then runs PISA's kernels, not the reference)")
    p.add_argument("--out", default=None, help="rank 0 saves the results here (torch.save)")
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    if a.seq_len < 2:  # a causal LM's shifted labels need two tokens (else the loss is NaN)
        p.error(f"--seq-len must be >= 2, got {a.seq_len}")
    if a.batch < 1 or a.batch % world:
        p.error(f"--batch must be a positive multiple of the world size ({world}), "
                f"got {a.batch}")
    if a.bucket_cap_mb is not None and a.bucket_cap_mb < 1:
        p.error(f"--bucket-cap-mb must be >= 1 (DDP's first bucket), got {a.bucket_cap_mb}")
    if a.kernel == "triton" and a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--kernel triton on the CPU needs TRITON_INTERPRET=1 in the environment")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available in this torch build or machine")

    dist = torch.distributed
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # A bounded wait: a rank stuck in a collective (say, graphs that differ between ranks)
    # fails within minutes instead of gloo's default 30.
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=5))
    try:
        res = train(a.mode, a.steps, a.seq_len, a.batch, a.layers, a.attn, a.bucket_cap_mb,
                    options=dict(EXACT, kernel=a.kernel), device=a.device)
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, res["report"])
        if dist.get_rank() == 0:
            for r, rep in enumerate(reports):
                print(f"rank {r}: {rep['backend_calls']} backend call(s), "
                      f"{rep['rewritten']} attention site(s) rewritten, "
                      f"{rep['left_dense']} left dense, "
                      f"{rep['attention_nodes']} attention node(s); "
                      f"per call (attention nodes, rewritten, left dense): "
                      f"{rep['per_call']}; run-time mask reads: {rep['runtime']}")
                for s in rep["sites"]:
                    print("   ", s)
            if a.out:
                torch.save(dict(res, reports=reports), a.out)
        # No site lost: every SDPA/softmax node of every graph became a rewritten site.
        ok = all(rep["rewritten"] == rep["attention_nodes"] > 0 and not rep["left_dense"]
                 for rep in reports)
        # Every rank past its last collective before any tears the group down: a rank still
        # in all_gather_object while rank 0 saves must not see its peer's socket close.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
