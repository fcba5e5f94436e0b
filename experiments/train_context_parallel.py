"""Context-parallel training with PISA: one sequence sharded across ranks (issue #17).

    torchrun --nproc_per_node 2 -m experiments.train_context_parallel --seq-len 4096
    torchrun --nproc_per_node 2 -m experiments.train_context_parallel --device cuda \\
        --seq-len 262144 --layers 4

A tiny Llama (``pisa_compile.samples.tiny_llama``, GQA, train mode) learns random bytes with
AdamW. Every rank holds the zig-zag part of each sequence (``zigzag_shard``: chunks ``r``
and ``2W - 1 - r`` of ``2W``) with its global positions, so RoPE is right; every attention
layer runs ``context_parallel_attention`` through the ``"pisa_context_parallel"`` attention
implementation (``pisa_compile.hf_context_parallel``). The loss is the global mean over
every predicted token (the sum over ranks of each rank's share), and the gradients are
summed over ranks (``all_reduce``), so a step equals one process on the whole sequence with
the same options. ``--out FILE`` (rank 0) saves losses and first-step gradients
(``torch.save``); the tests read it.
"""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as dist


def targets(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets of ``ids`` ``[B, N]``: ``ids[:, 1:]``, and -100 (ignored) at the
    last position."""
    return torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), -100)], 1)


def train(steps: int = 2, seq_len: int = 256, batch: int = 2, num_layers: int = 2,
          config=None, group: Optional[dist.ProcessGroup] = None, lr: float = 1e-3,
          device: str = "cpu", attn: Optional[str] = None, log=print,
          fetch_budget: Optional[float] = None) -> dict[str, Any]:
    """Train ``tiny_llama(num_layers)`` on a sequence sharded over ``group`` for ``steps``.

    Args:
        config: the ``PisaConfig`` of ``context_parallel_attention`` (default ``CP_CONFIG``).
        group: the process group the sequence is sharded over (default: the world); a
            group of one rank is single-process PISA on the whole sequence.
        attn: None for context-parallel PISA, or a transformers attention implementation
            (``"sdpa"``) to train the whole sequence densely in this process instead (the
            reference), whatever ``group``.
        fetch_budget: ``context_parallel_attention``'s fetch cap (None: every chosen block).

    Returns:
        ``losses`` (global mean loss per step), ``grads`` (name -> float32 CPU tensor, the
        summed gradient of step 0).

    Raises:
        ValueError: a ``seq_len`` that is not a multiple of ``2 * world * block_size``.
    """
    from pisa_compile import hf_context_parallel
    from pisa_compile.context_parallel import CP_CONFIG, zigzag_shard
    from pisa_compile.samples import tiny_llama

    config = CP_CONFIG if config is None else config
    world, rank = (1, 0) if attn else (dist.get_world_size(group), dist.get_rank(group))
    unit = 2 * world * config.block_size
    if seq_len % unit:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of 2 * world * block_size = "
                         f"{unit}")
    dev = (torch.device(device, torch.cuda.current_device()) if device == "cuda"
           else torch.device(device))
    model = tiny_llama(max_positions=seq_len, num_layers=num_layers).train().to(dev)
    model.set_attn_implementation(attn or hf_context_parallel.register(group, config,
                                                                       fetch_budget))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 256, (batch, seq_len), generator=g).to(dev)
        pos = torch.arange(seq_len, device=dev).expand(batch, seq_len)
        tgt = targets(ids)
        ids, pos, tgt = (zigzag_shard(t, rank, world, dim=1) for t in (ids, pos, tgt))
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        # This rank's share of the global mean: the sum over ranks is the mean.
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(),
                                                 ignore_index=-100, reduction="sum")
        loss = loss / (batch * (seq_len - 1))
        loss.backward()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total, group=group)
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
        losses.append(total.item())
        if step == 0:
            grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        log(f"rank {rank} step {step} loss {losses[-1]:.6f}")
    return dict(losses=losses, grads=grads)


def main(argv: Optional[list[str]] = None) -> int:
    from pisa_compile.context_parallel import CP_CONFIG

    p = argparse.ArgumentParser(prog="python -m experiments.train_context_parallel",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096, help="global tokens per sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--top-k", type=int, default=CP_CONFIG.top_k)
    p.add_argument("--fetch-budget", type=float, default=None,
                   help="cap each rank's fetch at this fraction of ring attention's K/V bytes "
                        "(0 < F <= 1; lossy; default: every chosen block)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=None, help="rank 0 saves the results here (torch.save)")
    a = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("run it under torchrun: torchrun --nproc_per_node 2 -m "
                "experiments.train_context_parallel ...")
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    if a.batch < 1:
        p.error(f"--batch must be >= 1, got {a.batch}")
    if a.fetch_budget is not None and not 0 < a.fetch_budget <= 1:
        p.error(f"--fetch-budget must be in (0, 1], got {a.fetch_budget}")
    world = int(os.environ.get("WORLD_SIZE", 1))
    unit = 2 * world * CP_CONFIG.block_size
    if a.seq_len < unit or a.seq_len % unit:
        p.error(f"--seq-len must be a positive multiple of 2 * world * block_size = {unit}, "
                f"got {a.seq_len}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available in this torch build or machine")
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=5))
    try:
        res = train(a.steps, a.seq_len, a.batch, a.layers, CP_CONFIG.replace(top_k=a.top_k),
                    device=a.device, fetch_budget=a.fetch_budget)
        if dist.get_rank() == 0 and a.out:
            torch.save(res, a.out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
