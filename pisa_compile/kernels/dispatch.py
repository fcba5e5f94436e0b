"""The one place that picks a kernel: the Triton kernels or the PyTorch reference.

``pisa_compile.ops`` decides which implementation a call uses (``ops.kernel_for``) and calls
these functions with ``impl="triton"`` or ``impl="reference"``. Each stage runs inside a
``torch.profiler`` range named in :data:`STAGES` (in eager execution; a compiled graph
shows the Triton kernels by name instead).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Optional

import torch
from torch import Tensor

from ..config import PisaConfig
from . import reference

# Profiler ranges, one per PISA stage (pisa_compile.profile tabulates them by these names).
STAGES = ("pisa.pyramid", "pisa.select", "pisa.attention_fwd", "pisa.attention_bwd", "pisa.decode")
# Stages whose range always sits inside another's: the pyramid is built by the selection.
NESTED_IN = {"pisa.pyramid": "pisa.select"}
MAX_HEAD_DIM = 256
# Up to this many queries attend through the split-K decode kernel (flash-decoding style).
DECODE_MAX_QUERIES = 16


def max_blocks(n_queries, n_keys, config: PisaConfig):
    """Width of ``block_indices``: forced blocks plus ``top_k``, capped at the leaf count."""
    return block_width(n_keys, config.block_size, config.top_k, config.sink_blocks,
                       config.local_blocks, config.query_tile)


def block_width(n_keys, block_size, top_k, sink_blocks, local_blocks, query_tile):
    """:func:`max_blocks` from plain ints; SymInt-safe, for fake kernels (where Dynamo may
    hand the config fields over as symbols, so no PisaConfig can be built)."""
    n_leaves = (n_keys + block_size - 1) // block_size
    bound = sink_blocks + top_k + reference.local_bound(local_blocks, query_tile, block_size)
    # Python's min, not sym_min: a symbolic length then costs one range guard and the width
    # stays a plain int, which the kernels need as a compile-time tile size.
    return min(n_leaves, bound)


def uses_dense(n_keys, config: PisaConfig) -> bool:
    """``Nk < min_seq_len`` (or no keys at all): PISA is plain SDPA there (DESIGN.md
    "Exact regime")."""
    return n_keys < config.min_seq_len or n_keys == 0


# Environment facts, constant for a process: Dynamo evaluates them once while tracing instead
# of tracing into importlib or the CUDA runtime (torch 2.11 breaks the graph on `find_spec`).
@torch.compiler.assume_constant_result
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@torch.compiler.assume_constant_result
def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@torch.compiler.assume_constant_result
def triton_targets_gpu(index: int) -> bool:
    """Whether the kernels support CUDA device ``index`` (compute capability >= 8.0)."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _tracing(t: Tensor) -> bool:
    # Profiler ranges cannot be traced into a graph (triton_op bodies are traced by AOT).
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return isinstance(t, (FakeTensor, FunctionalTensor)) or torch.compiler.is_compiling()


def launcher(kernel, t: Tensor):
    """``kernel`` itself for a call on real tensors, ``wrap_triton(kernel)`` while a graph is
    traced (a ``triton_op`` body) or a dispatch mode is active. Eager ``wrap_triton`` goes
    through a higher-order op and pytree flattening: hundreds of microseconds of host time per
    launch on the H200 (``tests/benchmarks/overhead_probe.py --cprofile``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    if _tracing(t) or _get_current_dispatch_mode() is not None:
        return torch.library.wrap_triton(kernel)
    return kernel


def stage_range(name: str, t: Tensor):
    """A profiler range for one PISA stage (a no-op while a graph is being traced)."""
    return contextlib.nullcontext() if _tracing(t) else torch.profiler.record_function(name)


def select_blocks(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                  scale: float, config: PisaConfig, impl: str) -> tuple[Tensor, Tensor]:
    """``(block_indices, block_counts)`` of :func:`reference.select_blocks`; the pyramid is
    built inside the selection, so one range covers both."""
    with stage_range("pisa.select", q):
        if impl == "triton":
            from . import triton_select
            return triton_select.select_blocks(q, k, attn_mask, is_causal, scale, config)
        return reference.select_blocks(q, k, attn_mask, is_causal, scale, config)


def attention_forward(q, k, v, attn_mask, is_causal, scale, block_indices, block_counts,
                      config: PisaConfig, impl: str) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`reference.sparse_attention`; few queries take the decode kernel."""
    if impl == "triton":
        if q.shape[2] <= DECODE_MAX_QUERIES:
            from .triton_decode import decode_attention
            with stage_range("pisa.decode", q):
                return decode_attention(q, k, v, attn_mask, is_causal, scale, block_indices,
                                        block_counts, config)
        from .triton_attention import sparse_attention
        with stage_range("pisa.attention_fwd", q):
            return sparse_attention(q, k, v, attn_mask, is_causal, scale, block_indices,
                                    block_counts, config)
    with stage_range("pisa.attention_fwd", q):
        return reference.sparse_attention(q, k, v, attn_mask, is_causal, scale, block_indices,
                                          block_counts, config)


def attention_backward(grad_out, q, k, v, attn_mask, out, lse, block_indices, block_counts,
                       is_causal, scale, config: PisaConfig, impl: str):
    """``(dq, dk, dv)`` of :func:`reference.sparse_attention_backward`."""
    with stage_range("pisa.attention_bwd", q):
        if impl == "triton":
            from .triton_attention import sparse_attention_backward
            return sparse_attention_backward(grad_out, q, k, v, attn_mask, out, lse,
                                             block_indices, block_counts, is_causal, scale,
                                             config)
        return reference.sparse_attention_backward(grad_out, q, k, v, attn_mask, out, lse,
                                                   block_indices, block_counts, is_causal,
                                                   scale, config)
