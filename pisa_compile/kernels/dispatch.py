"""Device dispatch: Triton kernels on CUDA (or the interpreter when asked), reference elsewhere."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..config import PisaConfig
from . import reference


def max_blocks(n_queries, n_keys, config: PisaConfig):
    """Width of ``block_indices``: forced blocks plus ``top_k``, capped at the leaf count."""
    n_leaves = (n_keys + config.block_size - 1) // config.block_size
    bound = config.sink_blocks + config.top_k + reference.max_local_blocks(config)
    if isinstance(n_leaves, int):
        return min(n_leaves, bound)
    return torch.sym_min(n_leaves, bound)


def uses_dense(n_keys, config: PisaConfig) -> bool:
    """``Nk < min_seq_len``: PISA is plain SDPA there (DESIGN.md "Exact regime")."""
    return n_keys < config.min_seq_len


def _backend(t: Tensor, config: PisaConfig):
    # Triton kernels arrive with the kernels issue; until then every device uses the reference.
    return reference


def select_blocks(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                  scale: float, config: PisaConfig) -> tuple[Tensor, Tensor]:
    return _backend(q, config).select_blocks(q, k, attn_mask, is_causal, scale, config)


def attention_forward(q, k, v, attn_mask, is_causal, scale, config):
    impl = _backend(q, config)
    block_indices, block_counts = impl.select_blocks(q, k, attn_mask, is_causal, scale, config)
    out, lse = impl.sparse_attention(q, k, v, attn_mask, is_causal, scale, block_indices,
                                     block_counts, config)
    return out, lse, block_indices, block_counts


def attention_backward(grad_out, q, k, v, attn_mask, out, lse, block_indices, block_counts,
                       is_causal, scale, config):
    return _backend(q, config).sparse_attention_backward(
        grad_out, q, k, v, attn_mask, out, lse, block_indices, block_counts, is_causal, scale,
        config)
