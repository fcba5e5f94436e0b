"""Device dispatch: Triton kernels on CUDA (or the interpreter when asked), reference elsewhere."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..config import PisaConfig
from . import reference

# Profiler ranges, one per PISA stage (pisa_compile.profile tabulates them by these names).
STAGES = ("pisa.pyramid", "pisa.select", "pisa.attention_fwd", "pisa.attention_bwd", "pisa.decode")
_range = torch.profiler.record_function


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
    # The reference builds its pyramid inside the selection: one range covers both.
    with _range("pisa.select"):
        return _backend(q, config).select_blocks(q, k, attn_mask, is_causal, scale, config)


def attention_forward(q, k, v, attn_mask, is_causal, scale, config):
    impl = _backend(q, config)
    block_indices, block_counts = select_blocks(q, k, attn_mask, is_causal, scale, config)
    with _range("pisa.attention_fwd"):
        out, lse = impl.sparse_attention(q, k, v, attn_mask, is_causal, scale, block_indices,
                                         block_counts, config)
    return out, lse, block_indices, block_counts


def attention_backward(grad_out, q, k, v, attn_mask, out, lse, block_indices, block_counts,
                       is_causal, scale, config):
    with _range("pisa.attention_bwd"):
        return _backend(q, config).sparse_attention_backward(
            grad_out, q, k, v, attn_mask, out, lse, block_indices, block_counts, is_causal,
            scale, config)
