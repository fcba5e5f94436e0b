"""The op boundary: ``torch.library`` ops ``pisa::*`` and the public functions over them.

Everything above this file (the rewrite pass, user code) calls :func:`pisa_attention` or
:func:`select_blocks`; everything below it (``kernels/``) is reached only from here.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import PisaConfig
from .kernels import dispatch

__all__ = ["pisa_attention", "select_blocks", "kernel_for", "max_blocks", "uses_dense"]


# -- shape helpers shared by the fake impls and the kernels (SymInt-safe) ---------------

def max_blocks(n_queries, n_keys, config: PisaConfig):
    """Width of ``block_indices``: the most leaf blocks one query tile can attend."""
    return dispatch.max_blocks(n_queries, n_keys, config)


def uses_dense(n_keys, config: PisaConfig) -> bool:
    """True where the op is plain SDPA (exact regime by shape; DESIGN.md "Exact regime")."""
    return dispatch.uses_dense(n_keys, config)


def _cfg(block_size, top_k, branching, beam, sink_blocks, local_blocks, query_tile,
         leaf_scoring, min_seq_len, kernel) -> PisaConfig:
    return PisaConfig(block_size, top_k, branching, beam, sink_blocks, local_blocks,
                      query_tile, leaf_scoring, min_seq_len, kernel)


# -- ops ------------------------------------------------------------------------------------
# Two implementations of one contract: `pisa::*` run the PyTorch reference (any device);
# `pisa::*_triton` launch the Triton kernels (through `dispatch.launcher`, ready for
# `triton_op`).
# Selection and attention are separate ops: the selection carries no gradient.
#
# The Triton ops are opaque custom ops for now. As `triton_op`s (Inductor traces their bodies)
# they compiled on the H200 only after two fixes (bool masks, fp64 scalars) and still failed
# under torch.compile there, with the error not captured before the device time ran out; the
# opaque ops run the same GPU-tested kernels. PISA_TRITON_OP=1 selects `triton_op` (diagnostics).
_TRITON_DEFINE = (torch.library.triton_op if os.environ.get("PISA_TRITON_OP") == "1"
                  else torch.library.custom_op)


def _select_fake(q, k, is_causal, block_size, top_k, branching, beam, sink_blocks, local_blocks,
                 query_tile, leaf_scoring):
    B, Hkv, Nq, Nk = q.shape[0], k.shape[1], q.shape[2], k.shape[2]
    n_tiles = (Nq + query_tile - 1) // query_tile
    M = dispatch.block_width(Nk, block_size, top_k, sink_blocks, local_blocks, query_tile)
    return (q.new_empty((B, Hkv, n_tiles, M), dtype=torch.int32),
            q.new_empty((B, Hkv, n_tiles), dtype=torch.int32))


@torch.library.custom_op("pisa::select_blocks", mutates_args=())
def _select_blocks_op(
    q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: float,
    block_size: int, top_k: int, branching: int, beam: int, sink_blocks: int,
    local_blocks: int, query_tile: int, leaf_scoring: str,
) -> tuple[Tensor, Tensor]:
    cfg = _cfg(block_size, top_k, branching, beam, sink_blocks, local_blocks, query_tile,
               leaf_scoring, 0, "reference")
    return dispatch.select_blocks(q, k, attn_mask, is_causal, scale, cfg, "reference")


@_select_blocks_op.register_fake
def _(q, k, attn_mask, is_causal, scale, block_size, top_k, branching, beam, sink_blocks,
      local_blocks, query_tile, leaf_scoring):
    return _select_fake(q, k, is_causal, block_size, top_k, branching, beam, sink_blocks,
                        local_blocks, query_tile, leaf_scoring)


@_TRITON_DEFINE("pisa::select_blocks_triton", mutates_args=())
def _select_blocks_triton_op(
    q: Tensor, k: Tensor, is_causal: bool, scale: float,
    block_size: int, top_k: int, branching: int, beam: int, sink_blocks: int,
    local_blocks: int, query_tile: int, leaf_scoring: str,
) -> tuple[Tensor, Tensor]:
    # No attn_mask: masked selection needs the mask's leaf states (the reference op does it).
    cfg = _cfg(block_size, top_k, branching, beam, sink_blocks, local_blocks, query_tile,
               leaf_scoring, 0, "triton")
    return dispatch.select_blocks(q, k, None, is_causal, scale, cfg, "triton")


def _attn_cfg(block_size: int, query_tile: int) -> PisaConfig:
    return PisaConfig(block_size=block_size, query_tile=query_tile)


def _define_attention(suffix: str, define, impl: str):
    """``pisa::attention{suffix}`` and its ``_backward``, registered with ``define``
    (``custom_op`` or ``triton_op``) over the ``impl`` kernels, with the autograd rule."""

    @define(f"pisa::attention{suffix}", mutates_args=())
    def forward(
        q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], block_indices: Tensor,
        block_counts: Tensor, is_causal: bool, scale: float, block_size: int, query_tile: int,
    ) -> tuple[Tensor, Tensor]:
        return dispatch.attention_forward(q, k, v, attn_mask, is_causal, scale, block_indices,
                                          block_counts, _attn_cfg(block_size, query_tile), impl)

    @define(f"pisa::attention{suffix}_backward", mutates_args=())
    def backward_op(
        grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
        out: Tensor, lse: Tensor, block_indices: Tensor, block_counts: Tensor,
        is_causal: bool, scale: float, block_size: int, query_tile: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return dispatch.attention_backward(grad_out, q, k, v, attn_mask, out, lse, block_indices,
                                           block_counts, is_causal, scale,
                                           _attn_cfg(block_size, query_tile), impl)

    def setup_context(ctx, inputs, output):
        q, k, v, attn_mask, block_indices, block_counts, is_causal, scale, *shape_args = inputs
        ctx.save_for_backward(q, k, v, attn_mask, *output, block_indices, block_counts)
        ctx.is_causal, ctx.scale, ctx.shape_args = is_causal, scale, shape_args

    def backward(ctx, grad_out, _grad_lse):
        q, k, v, attn_mask, out, lse, block_indices, block_counts = ctx.saved_tensors
        dq, dk, dv = backward_op(grad_out.contiguous(), q, k, v, attn_mask, out, lse,
                                 block_indices, block_counts, ctx.is_causal, ctx.scale,
                                 *ctx.shape_args)
        # The selection is fixed (DESIGN.md "Attention"): no gradient for it or the mask.
        return dq, dk, dv, None, None, None, None, None, None, None

    torch.library.register_autograd(f"pisa::attention{suffix}", backward,
                                    setup_context=setup_context)
    return forward, backward_op


_attention_op, _attention_backward_op = _define_attention(
    "", torch.library.custom_op, "reference")
_attention_triton_op, _attention_triton_backward_op = _define_attention(
    "_triton", _TRITON_DEFINE, "triton")


def _attention_fake(q, k, v, attn_mask, block_indices, block_counts, is_causal, scale,
                    block_size, query_tile):
    B, Hq, Nq = q.shape[:3]
    out = q.new_empty((B, Hq, Nq, v.shape[-1]))
    lse = q.new_empty((B, Hq, Nq), dtype=torch.promote_types(q.dtype, torch.float32))
    return out, lse


def _attention_backward_fake(grad_out, q, k, v, attn_mask, out, lse, block_indices,
                             block_counts, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _select_triton_fake(q, k, is_causal, scale, *config_args):
    return _select_fake(q, k, is_causal, *config_args)


_attention_op.register_fake(_attention_fake)
_attention_backward_op.register_fake(_attention_backward_fake)
if _TRITON_DEFINE is torch.library.custom_op:  # a triton_op is its own fake kernel
    _attention_triton_op.register_fake(_attention_fake)
    _attention_triton_backward_op.register_fake(_attention_backward_fake)
    _select_blocks_triton_op.register_fake(_select_triton_fake)


# -- public API ----------------------------------------------------------------------------

def _check_inputs(q: Tensor, k: Tensor, v: Optional[Tensor], attn_mask: Optional[Tensor],
                  is_causal: bool, enable_gqa: bool, config: PisaConfig) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, N, D], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    B, Hq, _, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, Hkv, Nk, D={D}], got shape {tuple(k.shape)}")
    if v is not None and (v.shape[0] != B or v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]):
        raise ValueError(
            f"v must be [B={B}, Hkv={k.shape[1]}, Nk={k.shape[2]}, Dv], got shape {tuple(v.shape)}")
    Hkv = k.shape[1]
    if Hq != Hkv and not enable_gqa:
        raise ValueError(f"q has {Hq} heads but k has {Hkv}: pass enable_gqa=True for GQA")
    if Hq % Hkv != 0:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k heads ({Hkv}) for GQA")
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask must be on q's device ({q.device}), got {attn_mask.device}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"attn_mask must be bool or floating point, got dtype {attn_mask.dtype}")
        if attn_mask.dim() > 4:
            raise ValueError(f"attn_mask must have at most 4 dims, got shape {tuple(attn_mask.shape)}")
        target = (B, Hq, q.shape[2], k.shape[2])
        try:
            fits = tuple(torch.broadcast_shapes(attn_mask.shape, target)) == target
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"[B, Hq, Nq, Nk] = {list(target)}")
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot both be set (as in SDPA)")
    if is_causal and config.local_blocks < 1 and not uses_dense(k.shape[2], config):
        raise ValueError("is_causal=True needs PisaConfig.local_blocks >= 1")


def _mask4(attn_mask: Optional[Tensor]) -> Optional[Tensor]:
    if attn_mask is None:
        return None
    while attn_mask.dim() < 4:
        attn_mask = attn_mask.unsqueeze(0)
    return attn_mask


def _op_args(config: PisaConfig) -> tuple:
    """The selection ops' config arguments, in schema order."""
    return (config.block_size, config.top_k, config.branching, config.effective_beam,
            config.sink_blocks, config.local_blocks, config.query_tile, config.leaf_scoring)


_warned: set[str] = set()


def _fall_back(reason: str) -> str:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"pisa_compile: {reason}; using the PyTorch reference kernels instead "
                      "(correct, slower)", stacklevel=3)
    return "reference"


def kernel_for(q: Tensor, v: Tensor, config: PisaConfig) -> str:
    """``"triton"`` or ``"reference"``: which implementation runs these inputs.

    ``kernel="auto"`` takes Triton on CUDA for float16/bfloat16 with head dims <= 256 on a GPU
    Triton targets (compute capability >= 8.0); other CUDA cases fall back to the reference
    with one warning that says why. ``kernel="triton"`` on the CPU runs Triton's interpreter
    (``TRITON_INTERPRET=1`` must be set before Triton is imported; tests only).
    """
    if config.kernel == "reference" or (q.device.type != "cuda" and config.kernel == "auto"):
        return "reference"
    if not dispatch.triton_available():
        return _fall_back("Triton is not installed")
    if q.device.type != "cuda":
        if not dispatch.triton_interpreting():
            return _fall_back("kernel='triton' on a CPU tensor needs TRITON_INTERPRET=1 set "
                              "before Triton is imported")
        if q.dtype not in (torch.float16, torch.float32):
            return _fall_back(f"Triton's interpreter is unreliable for {q.dtype}")
        return "triton"
    if q.dtype not in (torch.float16, torch.bfloat16) and not (
            config.kernel == "triton" and q.dtype == torch.float32):
        return _fall_back(f"{q.dtype} inputs (the Triton kernels take float16/bfloat16)")
    if max(q.shape[-1], v.shape[-1]) > dispatch.MAX_HEAD_DIM:
        return _fall_back(f"head dim {max(q.shape[-1], v.shape[-1])} > {dispatch.MAX_HEAD_DIM}")
    if not dispatch.triton_targets_gpu(q.device.index or 0):
        return _fall_back("a GPU older than compute capability 8.0")
    return "triton"


def _select(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: float,
            config: PisaConfig, impl: str) -> tuple[Tensor, Tensor]:
    if impl == "triton" and attn_mask is None:
        return _select_blocks_triton_op(q, k, is_causal, scale, *_op_args(config))
    return _select_blocks_op(q, k, attn_mask, is_causal, scale, *_op_args(config))


def pisa_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
    config: Optional[PisaConfig] = None,
) -> Tensor:
    """Pyramid top-K sparse attention with the semantics of ``F.scaled_dot_product_attention``.

    Each query tile (``config.query_tile`` queries times the ``G = Hq / Hkv`` heads of one KV
    head) attends to its forced blocks plus the ``top_k`` leaf blocks chosen coarse-to-fine
    over a key pyramid (PISA; DESIGN.md "The algorithm"). In the exact regime (every visible
    leaf selected, or ``Nk < min_seq_len``) the result equals SDPA within dtype tolerance.

    Args:
        q: ``[B, Hq, Nq, D]`` float16, bfloat16, float32 or float64.
        k: ``[B, Hkv, Nk, D]``, same dtype and device as ``q``.
        v: ``[B, Hkv, Nk, Dv]``.
        attn_mask: bool (True = attend) or additive float, broadcastable to
            ``[B, Hq, Nq, Nk]``. A float entry of ``-inf`` or <= ``finfo.min / 2`` is masked.
        dropout_p: must be 0.0 (PISA has no dropout).
        is_causal: top-left causal mask as in SDPA; exclusive with ``attn_mask``.
        scale: softmax scale; default ``1 / sqrt(D)``.
        enable_gqa: allow ``Hq != Hkv`` (``Hq`` a multiple of ``Hkv``).
        config: :class:`PisaConfig`; default ``PisaConfig()``.

    Returns:
        ``[B, Hq, Nq, Dv]`` in ``q.dtype``. Rows with no visible key are zero, as in SDPA.
        Differentiable in ``q, k, v`` with the selection held fixed.

    Raises:
        TypeError, ValueError: a bad argument; the message names it and what was expected.
    """
    config = config or PisaConfig()
    if not isinstance(config, PisaConfig):
        raise TypeError(f"config must be a PisaConfig, got {type(config).__name__}")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0 (PISA kernels have no dropout), got {dropout_p}")
    _check_inputs(q, k, v, attn_mask, is_causal, enable_gqa, config)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError("attn_mask must not require grad: PISA gives no gradient for the mask")
    if uses_dense(k.shape[2], config) or q.shape[2] == 0:  # empty problems: as SDPA
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    attn_mask, scale = _mask4(attn_mask), float(scale)
    impl = kernel_for(q, v, config)
    block_indices, block_counts = _select(q, k, attn_mask, is_causal, scale, config, impl)
    op = _attention_triton_op if impl == "triton" else _attention_op
    out, _lse = op(q, k, v, attn_mask, block_indices, block_counts, is_causal, scale,
                   config.block_size, config.query_tile)
    return out


def select_blocks(
    q: Tensor, k: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
    scale: Optional[float] = None, enable_gqa: bool = False, *, config: Optional[PisaConfig] = None,
) -> tuple[Tensor, Tensor]:
    """The leaf blocks each query tile attends (forced blocks included); PISA selection.

    Args: as :func:`pisa_attention` (``q`` ``[B, Hq, Nq, D]``, ``k`` ``[B, Hkv, Nk, D]``).
        ``min_seq_len`` is ignored here: the selection is always computed.

    Returns:
        ``block_indices``: int32 ``[B, Hkv, n_tiles, max_blocks]``, ascending leaf indices
        (leaf ``b`` holds keys ``[b*block_size, (b+1)*block_size)``), padded with -1.
        ``block_counts``: int32 ``[B, Hkv, n_tiles]``, the valid entries per tile.
        Tile ``t`` covers queries ``[t*query_tile, (t+1)*query_tile)``.

    Raises:
        TypeError, ValueError: a bad argument; the message names it and what was expected.
    """
    config = config or PisaConfig()
    if not isinstance(config, PisaConfig):
        raise TypeError(f"config must be a PisaConfig, got {type(config).__name__}")
    config = config.replace(min_seq_len=0)
    _check_inputs(q, k, None, attn_mask, is_causal, enable_gqa, config)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _select(q, k, _mask4(attn_mask), is_causal, float(scale), config,
                   kernel_for(q, q, config))
