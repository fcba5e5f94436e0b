"""Context-parallel PISA inside a transformers model: an attention implementation that
routes every attention layer to :func:`~pisa_compile.context_parallel.context_parallel_attention`
(DESIGN.md "Context parallelism").

Each rank runs the model on its zig-zag part of the sequence, with the global positions of
those tokens as ``position_ids`` (RoPE) and its part of the labels::

    name = hf_context_parallel.register(group=None, config=CP_CONFIG)
    model.set_attn_implementation(name)
    positions = torch.arange(N)[None]  # required: every layer checks them
    ids, pos = (zigzag_shard(t, rank, world, dim=1) for t in (input_ids, positions))
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits

Compute the loss from the logits with targets shifted before sharding, each rank's share of
the global mean (``experiments/train_context_parallel.py``): the model's own ``labels=``
would shift within the shard, pairing the end of one chunk with the start of the next.
Decode (a KV cache, ``generate()``) is refused. The model's own mask is not built (the
layout is causal by construction). Padding (zeros in
``attention_mask`` on any rank), sliding windows, logit soft-capping, attention sinks,
packed sequences and dropout are refused by name; a model's other mask functions (Gemma 3's
bidirectional image tokens) are not applied.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .config import PisaConfig
from .context_parallel import (CP_CONFIG, check_config, check_fetch_budget,
                               context_parallel_attention, zigzag_shard)

__all__ = ["ATTN_IMPLEMENTATION", "register"]

ATTN_IMPLEMENTATION = "pisa_context_parallel"
_settings: dict = {"group": None, "config": CP_CONFIG, "fetch_budget": None}


def register(group: Optional[dist.ProcessGroup] = None,
             config: Optional[PisaConfig] = None,
             fetch_budget: Optional[float] = None) -> str:
    """Register the ``"pisa_context_parallel"`` attention implementation with transformers
    (its ``AttentionInterface`` and ``AttentionMaskInterface``) and set the process group and
    options every such layer uses; call again to change them.

    Args:
        group: the process group over which the sequence is sharded (default: the world).
        config: options for :func:`~pisa_compile.context_parallel.context_parallel_attention`;
            default ``CP_CONFIG``.
        fetch_budget: as :func:`~pisa_compile.context_parallel.context_parallel_attention`'s
            (None: fetch every chosen block).

    Returns:
        The name to pass to ``model.set_attn_implementation`` (or ``attn_implementation=``).

    Raises:
        ImportError: transformers is not installed (or too old to have both interfaces).
        TypeError: ``config`` is not a :class:`~pisa_compile.PisaConfig` (as
            ``context_parallel_attention``).
        ValueError: ``config`` has options context parallelism cannot run
            (``context_parallel.check_config``), or ``fetch_budget`` is not None or in
            ``(0, 1]``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_config(CP_CONFIG if config is None else config, "register")
    check_fetch_budget(fetch_budget, "register")
    _settings.update(group=group, config=CP_CONFIG if config is None else config,
                     fetch_budget=fetch_budget)
    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION


@torch.compiler.disable  # its host read would break the graph with a warning
def _no_mask(*args, attention_mask: Optional[Tensor] = None, **kwargs) -> None:
    # The zig-zag layout is causal by construction; the model's [N, N] mask would be built
    # from the local positions, which are not contiguous (transformers even reads their jump
    # as a packed sequence). So a model's own mask function is not applied: windows,
    # soft-capping and sinks reach the attention, which refuses them; a mask function beyond
    # those (Gemma 3's bidirectional image tokens) is not seen.
    # Padding lands on some ranks only (right padding: rank 0's last chunk): every rank
    # learns whether any has it (or another mask) and refuses together, instead of one
    # raising while the others wait in the first attention call.
    code = 0
    if attention_mask is not None:
        code = 2 if attention_mask.dim() != 2 else int(bool((attention_mask == 0).any()))
    if dist.is_initialized():
        code = _max_over_ranks(code, attention_mask)
    if code == 2:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: attention_mask must be the tokenizer's "
                         "[B, N_local] mask of ones (some rank passed another shape)")
    if code:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: padding (an attention_mask with zeros, on "
                         "some rank) is not supported; pass unpadded sequences of one length")
    return None


_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "cu_seq_lens_q", "cu_seq_lens_k")


def _max_over_ranks(value: int, like: Optional[Tensor]) -> int:
    """The largest of every rank's ``value`` (``all_reduce``), so that all ranks take the
    same branch. NCCL reduces CUDA tensors only: the flag goes to ``like``'s device (the
    model's, not the current one) where that is CUDA."""
    group = _settings["group"]
    dev = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        dev = like.device if like is not None and like.is_cuda else torch.device(
            "cuda", torch.cuda.current_device())
    flag = torch.tensor([value], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


@torch.compiler.disable
def _check_positions(position_ids: Optional[Tensor], n_local: int) -> None:
    """The rank's ``position_ids`` must be its zig-zag part of ``0 .. N - 1`` (else RoPE and
    the layout disagree: each rank's own ``0 .. N_local - 1``, or a packed sequence's resets,
    would be silently wrong). Checked at every layer (a cached verdict could go stale, and
    ranks that cached differently would wait for each other); the verdict is all-reduced, so
    every rank refuses together."""
    group = _settings["group"]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ok = position_ids is not None and position_ids.shape[-1] == n_local
    if ok:
        whole = torch.arange(world * n_local, device=position_ids.device)
        expected = zigzag_shard(whole, rank, world, dim=0)
        ok = bool((position_ids.reshape(-1, n_local) == expected).all())
    if _max_over_ranks(int(not ok), position_ids):
        raise ValueError(
            f"{ATTN_IMPLEMENTATION}: position_ids must be each rank's zig-zag part of the "
            "global positions, zigzag_shard(torch.arange(N)[None], rank, world, dim=1), on "
            "every rank (without them each rank's RoPE starts at 0; packed sequences are not "
            "supported)")


def _attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Optional[Tensor], scaling: Optional[float] = None,
               dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function contract: ``query`` ``[B, Hq, N_local, D]``,
    ``key``/``value`` ``[B, Hkv, N_local, D]``; returns ``[B, N_local, Hq, Dv]`` and no
    weights."""
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{ATTN_IMPLEMENTATION}: only causal self-attention is supported "
                         f"({type(module).__name__} is not causal)")
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"{ATTN_IMPLEMENTATION}: {type(module).__name__} passes {name}="
                             f"{kwargs[name]!r}, which context-parallel PISA does not support "
                             "(plain causal attention only)")
    if dropout:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: attention dropout must be 0 (set the "
                         f"model's attention_dropout to 0 or call model.eval()), got {dropout}")
    if attention_mask is not None:  # the mask function builds none: this one is the caller's
        raise ValueError(f"{ATTN_IMPLEMENTATION}: a {attention_mask.dim()}-D attention_mask "
                         "was passed; only the tokenizer's [B, N_local] mask of ones is accepted")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: {query.shape[2]} queries over "
                         f"{key.shape[2]} keys: a KV cache (decode, generate()) is not "
                         "supported; call the model with use_cache=False")
    _check_positions(kwargs.get("position_ids"), query.shape[2])
    out = context_parallel_attention(query, key, value, scale=scaling,
                                     enable_gqa=query.shape[1] != key.shape[1],
                                     group=_settings["group"], config=_settings["config"],
                                     fetch_budget=_settings["fetch_budget"])
    return out.transpose(1, 2).contiguous(), None
