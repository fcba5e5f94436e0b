"""The op boundary: the ``torch.library`` ops ``pisa::*`` and the public functions over them.

Everything above this file (the rewrite pass, user code) calls :func:`pisa_attention` or
:func:`select_blocks`; everything below it (``kernels/``) is reached only from here, through
``kernels.dispatch``. One op per stage: ``pisa::select_blocks`` (no gradient),
``pisa::attention`` and ``pisa::attention_backward`` (its registered autograd rule). Each takes
the implementation that :func:`plan` chose as a string argument, so the choice is made once,
at trace time, and is visible in the graph.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from .config import PisaConfig
from .kernels import dispatch, persistent
from .kernels.dispatch import Plan, unstructured_mask_runs_dense
from .kernels.runtime import DECODE_MAX_QUERIES
from .kernels.geometry import block_width, cdiv, dense_mask
from .kernels.window import WINDOW_QUERY_TILE, window_blocks

__all__ = ["pisa_attention", "select_blocks", "plan", "Plan", "check_causal_buffer",
           "eager_empty_rows", "self_attention_query_mask"]


# -- ops ------------------------------------------------------------------------------------
# Opaque custom ops over the kernels. `triton_op` (Inductor traces the launches) compiled on
# the H200 but failed under torch.compile there; it has not been shown to help, so the
# kernels stay behind custom ops, and Inductor compiles the rest of the graph.

def _autocast_off(body):
    """A custom op's body with autocast off on its inputs' device. A custom op is on no
    autocast list, so an ambient ``torch.autocast`` (a compiled graph called inside one)
    would otherwise recast the reference's own matmuls: its outputs drifted in precision and
    its backward mixed dtypes (``scatter_add_`` raised). Autocast's casts of the op's inputs
    are the caller's: the rewrite writes them out before the op."""
    @functools.wraps(body)
    def run(*args, **kwargs):
        dev = next((a.device.type for a in args if isinstance(a, Tensor)), None)
        if dev is None or not torch.is_autocast_enabled(dev):
            return body(*args, **kwargs)
        with torch.autocast(dev, enabled=False):
            return body(*args, **kwargs)
    return run


@torch.library.custom_op("pisa::select_blocks", mutates_args=())
@_autocast_off
def _select_blocks_op(
    q: Tensor, k: Tensor, attn_mask: Optional[Tensor], key_mask: Optional[Tensor],
    is_causal: bool, causal_offset: int, scale: float, block_size: int, top_k: int,
    branching: int, beam: int, sink_blocks: int, local_blocks: int, query_tile: int,
    leaf_scoring: str, shortlist: int, bound_block: int, flat_leaves: int, impl: str,
) -> tuple[Tensor, Tensor]:
    return dispatch.select_blocks(
        q, k, attn_mask, is_causal, scale, impl, block_size=block_size, top_k=top_k,
        branching=branching, beam=beam, sink_blocks=sink_blocks, local_blocks=local_blocks,
        query_tile=query_tile, leaf_scoring=leaf_scoring, shortlist=shortlist,
        bound_block=bound_block, flat_leaves=flat_leaves, key_mask=key_mask,
        causal_offset=causal_offset)


@_select_blocks_op.register_fake
def _(q, k, attn_mask, key_mask, is_causal, causal_offset, scale, block_size, top_k, branching,
      beam, sink_blocks, local_blocks, query_tile, leaf_scoring, shortlist, bound_block,
      flat_leaves, impl):
    B, Hkv, Nq, Nk = q.shape[0], k.shape[1], q.shape[2], k.shape[2]
    M = block_width(Nk, block_size, top_k, sink_blocks, local_blocks, query_tile)
    T = cdiv(Nq, query_tile)
    return (q.new_empty((B, Hkv, T, M), dtype=torch.int32),
            q.new_empty((B, Hkv, T), dtype=torch.int32))


@torch.library.custom_op("pisa::attention", mutates_args=())
@_autocast_off
def _attention_op(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], key_mask: Optional[Tensor],
    block_indices: Tensor, block_counts: Tensor, is_causal: bool, causal_offset: int,
    scale: float, block_size: int, query_tile: int, impl: str, window: int = 0,
) -> tuple[Tensor, Tensor]:
    return dispatch.attention_forward(q, k, v, attn_mask, is_causal, scale, block_indices,
                                      block_counts, impl, block_size=block_size,
                                      query_tile=query_tile, key_mask=key_mask,
                                      causal_offset=causal_offset, window=window)


@_attention_op.register_fake
def _(q, k, v, attn_mask, key_mask, block_indices, block_counts, is_causal, causal_offset,
      scale, block_size, query_tile, impl, window=0):
    B, Hq, Nq = q.shape[:3]
    out = q.new_empty((B, Hq, Nq, v.shape[-1]))
    lse = q.new_empty((B, Hq, Nq), dtype=torch.promote_types(q.dtype, torch.float32))
    return out, lse


@torch.library.custom_op("pisa::cached_decode", mutates_args=())
@_autocast_off
def _cached_decode_op(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
                      causal_offset: int, scale: float, kernel: str) -> Tensor:
    # At run time: keys that are a PisaKVCache's decode from its pyramid, the rest densely.
    from torch._dynamo.utils import counters
    counters["pisa"]["cached_decode_calls"] += 1  # tests: 0 while CUDA graphs replay the op
    owner = persistent.lookup(k)
    if owner is not None:
        km = None if key_mask is None else key_mask != 0
        out = owner.decode(q, k, v, km, causal_offset, scale)
        if out is not None:
            return out
    return _dense(q, k, v, None, key_mask, True, causal_offset, None, scale, True,
                  kernel=kernel).contiguous()


@_cached_decode_op.register_fake
def _(q, k, v, key_mask, causal_offset, scale, kernel):
    return q.new_empty((*q.shape[:3], v.shape[3]))


# The plans whose every row is dense: the dense tail's, and a decode step's.
_DENSE_ROWS = (dispatch.IN_DENSE_TAIL, dispatch.DECODE_STEP)

# PisaConfig's fields in the order pisa::structured_from_mask takes them (plain values: the
# op schema has no config type, and Dynamo traces attribute reads, not serialisation).
_CONFIG_FIELDS = ("block_size", "top_k", "branching", "beam", "sink_blocks", "local_blocks",
                  "query_tile", "leaf_scoring", "shortlist", "bound_block", "flat_leaves",
                  "min_seq_len", "dense_tail", "kernel")


@torch.library.custom_op("pisa::window_blocks", mutates_args=())
def _window_blocks_op(q: Tensor, n_keys: int, window: int, causal_offset: int,
                      block_size: int, query_tile: int) -> tuple[Tensor, Tensor]:
    # An opaque op: Inductor failed to lower this index arithmetic past one query tile
    # ("vr must not be None", torch 2.13). Small tensors, built eagerly on q's device.
    return window_blocks(q.shape[2], n_keys, window, causal_offset, block_size, query_tile,
                         q.device)


@_window_blocks_op.register_fake
def _(q, n_keys, window, causal_offset, block_size, query_tile):
    T = cdiv(q.shape[2], query_tile)
    M = cdiv(window + query_tile - 1, block_size) + 1
    return (q.new_empty((T, M), dtype=torch.int32), q.new_empty((T,), dtype=torch.int32))


# Reading a mask syncs with the host: Inductor's CUDA graphs (mode="reduce-overhead") leave
# these ops out of the captured partitions (a captured prefill then failed in cuDNN's
# allocation, profiles/static_graph_probe.json) and replay the rest of the graph.
_HOST_SYNC = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") \
    else {}


@torch.library.custom_op("pisa::structured_from_mask", mutates_args=(), **_HOST_SYNC)
@_autocast_off
def _structured_from_mask_op(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor, scale: float, block_size: int,
    top_k: int, branching: int, beam: Optional[int], sink_blocks: int, local_blocks: int,
    query_tile: int, leaf_scoring: str, shortlist: Optional[int], bound_block: Optional[int],
    flat_leaves: int, min_seq_len: int, dense_tail: int, kernel: str,
) -> Tensor:
    return _structured_from_mask(q, k, v, attn_mask, scale, _config_args(locals()))


def _config_args(args: dict) -> tuple:
    """The config fields among a runtime-mask op's arguments, in ``_CONFIG_FIELDS`` order."""
    return tuple(args[name] for name in _CONFIG_FIELDS)


def _structured_from_mask(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor, scale: float,
                          config: tuple) -> Tensor:
    """The body of ``pisa::structured_from_mask`` (and of its backward's recomputation, with
    autograd on): a mask the pass could not prove (built in another graph) that is causal AND
    a key mask runs on the structured path; anything else runs as the plan would have run
    it: dense SDPA under the mask (kernel="auto"), or the reference selection and the Triton
    kernels under the mask (kernel="triton")."""
    from torch._dynamo.utils import counters
    values = dict(zip(_CONFIG_FIELDS, config))
    cfg = PisaConfig(**values, _base=values)  # the user's config again: no second warning
    # No host sync inside a CUDA-graph capture: the unstructured path there.
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing:
        dispatch._warn_once("an explicit mask read at run time, inside a CUDA-graph capture",
                           "the captured graph runs it as an unstructured mask (dense SDPA "
                           "under it): a structure needs a host sync to read")
    found = None if capturing else mask_structure(attn_mask, q.shape[2], k.shape[2])
    if found is None:
        counters["pisa"]["runtime_mask_unstructured"] += 1
        owner = None if capturing else persistent.lookup(k)
        if owner is not None and hasattr(owner, "mark_not_padding") and _hides_seen_keys(
                attn_mask):
            # A cache's prefill under a window: its decode steps must not take the window's
            # mask for padding and select inside it.
            owner.mark_not_padding("the prefill's mask hides from its last query keys that "
                                   "earlier queries see")
        # As planned without reading the mask; in a capture as kernel="auto" plans it (dense
        # SDPA under the mask: the reference selection would sync).
        if capturing:
            cfg = cfg.replace(kernel="auto")
        how = _plan(q, k, v, attn_mask, False, config=cfg, window=None, causal_offset=0,
                    key_mask=None, read_mask=False)
        return _run(q, k, v, attn_mask, None, False, 0, None, scale, True, cfg,
                    how).contiguous()
    counters["pisa"]["runtime_mask_structured"] += 1
    key_mask, offset = found
    return pisa_attention(q, k, v, is_causal=True, causal_offset=offset,
                          key_mask=key_mask.expand(q.shape[0], k.shape[2]), scale=scale,
                          enable_gqa=True, config=cfg).contiguous()


def _hides_seen_keys(attn_mask: Tensor) -> bool:
    """Whether a mask's last query row hides a key some earlier row sees (one host sync): a
    sliding window's does; causal padding, a prefix-LM's bidirectional prefix and image
    blocks do not (their decode rows are causal padding). A float mask's entries at or
    below ``finfo.min / 2`` count as hidden (``-inf`` and transformers' finite fills)."""
    live = (attn_mask if attn_mask.dtype == torch.bool
            else attn_mask > torch.finfo(attn_mask.dtype).min / 2)
    return bool((live.any(dim=-2) & ~live[..., -1, :]).any())


@_structured_from_mask_op.register_fake
def _(q, k, v, attn_mask, scale, *config):
    return q.new_empty((*q.shape[:3], v.shape[3]))


if _CONFIG_FIELDS != PisaConfig.field_names():  # the op's schema lists them one by one
    raise ImportError(f"pisa::structured_from_mask lists {_CONFIG_FIELDS}, PisaConfig has "
                      f"{PisaConfig.field_names()}")


@torch.library.custom_op("pisa::structured_from_mask_backward", mutates_args=(), **_HOST_SYNC)
@_autocast_off
def _structured_from_mask_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor, scale: float,
    block_size: int, top_k: int, branching: int, beam: Optional[int], sink_blocks: int,
    local_blocks: int, query_tile: int, leaf_scoring: str, shortlist: Optional[int],
    bound_block: Optional[int], flat_leaves: int, min_seq_len: int, dense_tail: int,
    kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:
    # The forward again, with autograd (activation checkpointing's trade: one more forward
    # instead of saving its selection and lse): the mask is read again and the same
    # selection comes out, so these are the gradients of the output the forward returned
    # (a dense tail under a key mask may run SDPA where the forward ran the split-K kernel:
    # the same exact attention, 3e-7 apart in fp32). Not so if one of the two runs inside a
    # CUDA-graph capture and the other not (a capture reads no mask).
    from torch._dynamo.utils import counters
    counters["pisa"]["runtime_mask_backward"] += 1
    config = _config_args(locals())
    with _autograd_inside_op():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = _structured_from_mask(*leaves, attn_mask, scale, config)
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.contiguous()
                 for t, g in zip((q, k, v), grads))


@contextlib.contextmanager
def _autograd_inside_op():
    """Autograd on inside a custom op's implementation: ``torch.library`` runs it below the
    autograd dispatch keys (excluded in thread-local state), where no graph is recorded.
    Only the autograd keys leave the excluded set; autocast stays as the op found it."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradOther", "AutogradFunctionality", "AutogradNestedTensor"):
        key = getattr(torch._C.DispatchKey, name, None)
        if key is not None:
            excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                         excluded), torch.enable_grad():
        probe = torch.ones((), requires_grad=True) * 2
        if probe.grad_fn is None:  # private dispatcher state changed under us: say so
            raise RuntimeError("pisa_compile: the backward of an explicit mask read at run "
                               "time could not turn autograd on inside its op (torch "
                               f"{torch.__version__}); pass the mask as is_causal/key_mask")
        yield


@_structured_from_mask_backward_op.register_fake
def _(grad_out, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class _StructuredFromMask(torch.autograd.Function):
    """``pisa::structured_from_mask`` with its backward ``pisa::structured_from_mask_backward``
    (the forward recomputed with autograd, DESIGN.md "Rewrite rules"). No gradient for the
    mask (``pisa_attention`` refuses a mask that wants one), no double backward, and no jvp:
    forward-mode AD (``torch.func.jvp``) raises instead of getting a zero tangent."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, attn_mask, scale, config):
        return _structured_from_mask_op(q, k, v, attn_mask, scale, *config)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, attn_mask, scale, config = inputs
        ctx.save_for_backward(q, k, v, attn_mask)
        ctx.scale, ctx.config = scale, config

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, attn_mask = ctx.saved_tensors
        _refuse_double_backward(grad_out, (q, k, v))
        # Both ops' bodies run with autocast off (_autocast_off): forward and recomputation
        # alike, whatever autocast state the backward runs in.
        with torch.no_grad():
            dq, dk, dv = _structured_from_mask_backward_op(grad_out.contiguous(), q, k, v,
                                                           attn_mask, ctx.scale, *ctx.config)
        return dq, dk, dv, None, None, None


@torch.library.custom_op("pisa::attention_backward", mutates_args=())
@_autocast_off
def _attention_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
    key_mask: Optional[Tensor], out: Tensor, lse: Tensor, block_indices: Tensor,
    block_counts: Tensor, is_causal: bool, causal_offset: int, scale: float, block_size: int,
    query_tile: int, impl: str, window: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    return dispatch.attention_backward(grad_out, q, k, v, attn_mask, out, lse, block_indices,
                                       block_counts, is_causal, scale, impl,
                                       block_size=block_size, query_tile=query_tile,
                                       key_mask=key_mask, causal_offset=causal_offset,
                                       window=window)


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fold_vmap(op):
    """A ``torch.func.vmap`` rule for ``op``, whose tensors all lead with the batch dim ``B``
    (a mask's may be 1): the vmapped dim folds into ``B``, one call for every example.
    Without it PyTorch's fallback looped over the examples and warned that pisa's ops lack
    a batching rule (a new user's finding). The outputs are vmapped at dim 0."""

    def rule(info, in_dims, *args, **kwargs):
        V = info.batch_size
        first, d = next((a, d) for a, d in zip(args, in_dims) if isinstance(a, Tensor))
        B = first.shape[0] if d is None else first.shape[1 if d == 0 else 0]
        folded = []
        for a, d in zip(args, in_dims):
            if isinstance(a, Tensor):
                a = a.expand(V, *a.shape) if d is None else a.movedim(d, 0)
                a = a.expand(V, B, *a.shape[2:]).reshape(V * B, *a.shape[2:])
            folded.append(a)
        out = tuple(o.reshape(V, B, *o.shape[1:]) for o in op(*folded, **kwargs))
        return out, (0,) * len(out)

    op.register_vmap(rule)


for _op in (_select_blocks_op, _attention_op, _attention_backward_op):
    _fold_vmap(_op)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, key_mask, block_indices, block_counts, is_causal, causal_offset, \
        scale, *rest = inputs
    ctx.save_for_backward(q, k, v, attn_mask, key_mask, *output, block_indices, block_counts)
    ctx.is_causal, ctx.causal_offset, ctx.scale, ctx.rest = is_causal, causal_offset, scale, rest
    ctx.mark_non_differentiable(output[1])  # lse


def _refuse_double_backward(grad_out: Tensor, saved: tuple) -> None:
    """Raise where a backward would be differentiated again (``create_graph=True``, nested
    ``torch.func.grad``): ``once_differentiable`` looks only at the incoming gradients, so
    through the saved q, k and v the second derivative came back as zeros, silently."""
    if not torch.is_grad_enabled():
        return
    # A vjp function runs after its transform exits (create_graph on): the saved tensors are
    # then wrappers of a dead level, whose requires_grad was that level's. Only the values
    # beneath them can be differentiated again (inside an outer grad, through its level).
    dead = getattr(torch._C._functorch, "unwrap_if_dead", lambda t: t)
    tensors = [t for t in (grad_out, *saved) if isinstance(t, Tensor)]
    beneath = [dead(t) for t in tensors]
    stack = torch._C._functorch.get_interpreter_stack()
    if stack:
        # torch.func differentiates with grad mode on at every level: a second derivative
        # is asked for under two grad (or jvp) transforms, or through a dead level's values.
        ad = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)
        again = sum(i.key() in ad for i in stack) > 1 or any(
            u is not t and u.requires_grad for u, t in zip(beneath, tensors))
    else:
        again = any(u.requires_grad for u in beneath)
    if again:
        raise RuntimeError("pisa_compile: the attention's backward cannot be differentiated "
                           "again (double backward: create_graph=True or nested "
                           "torch.func.grad); use dense SDPA for such terms")


def _backward(ctx, grad_out, _grad_lse):
    # Unpacked once: under non-reentrant activation checkpointing a second unpack raises.
    saved = ctx.saved_tensors
    _refuse_double_backward(grad_out, saved[:3])
    return _backward_once(ctx, grad_out, _grad_lse, saved)


@torch.autograd.function.once_differentiable
def _backward_once(ctx, grad_out, _grad_lse, saved):
    q, k, v, attn_mask, key_mask, out, lse, block_indices, block_counts = saved
    dq, dk, dv = _attention_backward_op(grad_out.contiguous(), q, k, v, attn_mask, key_mask,
                                        out, lse, block_indices, block_counts, ctx.is_causal,
                                        ctx.causal_offset, ctx.scale, *ctx.rest)
    # The selection is fixed (DESIGN.md "Attention"): no gradient for it or the masks.
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("pisa::attention", _backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """``pisa::attention`` with the same backward, as an ``autograd.Function`` that defines
    ``setup_context``: ``torch.func.grad``/``vjp`` need one, and the wrapper that
    ``register_autograd`` generates has none in torch <= 2.13 (pytorch/pytorch#170834).
    ``pisa_attention`` calls this; the op keeps its registered rule for direct callers."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, attn_mask, key_mask, block_indices, block_counts, is_causal,
                causal_offset, scale, block_size, query_tile, impl, window=0):
        return _attention_op(q, k, v, attn_mask, key_mask, block_indices, block_counts,
                             is_causal, causal_offset, scale, block_size, query_tile, impl,
                             window)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


# -- public API ----------------------------------------------------------------------------

def _check_inputs(q: Tensor, k: Tensor, v: Optional[Tensor], attn_mask: Optional[Tensor],
                  is_causal: bool, enable_gqa: bool, config: PisaConfig, *,
                  v_optional: bool = False) -> None:
    """Raise a clear error for bad arguments; ``v`` may be None only with ``v_optional``
    (``select_blocks``)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None and name == "v" and v_optional:
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
    if D == 0:  # the default scale 1/sqrt(D) has no value
        raise ValueError(f"q's head dim D (its last dim) must be >= 1, got shape {tuple(q.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, Hkv, Nk, D={D}], got shape {tuple(k.shape)}")
    if v is not None and (v.shape[0] != B or v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]):
        raise ValueError(
            f"v must be [B={B}, Hkv={k.shape[1]}, Nk={k.shape[2]}, Dv], got shape {tuple(v.shape)}")
    Hkv = k.shape[1]
    if Hq != Hkv and not enable_gqa:
        raise ValueError(f"q has {Hq} heads but k has {Hkv}: pass enable_gqa=True for GQA")
    if Hkv == 0 and Hq != 0 or Hkv != 0 and Hq % Hkv != 0:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k heads ({Hkv}) for GQA")
    if not isinstance(is_causal, (bool, torch.SymBool)):  # as SDPA: an int passed one path only
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
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
            raise ValueError(
                "attn_mask and is_causal=True cannot both be set: SDPA documents the pair as "
                "an error (some of its kernels, the CPU's in torch 2.13, run it as causal AND "
                "mask); pass padding as key_mask= with is_causal=True, or the causal mask "
                "inside attn_mask")
    if is_causal and config.local_blocks < 1:  # also below min_seq_len: fails on short inputs
        raise ValueError("is_causal=True needs PisaConfig.local_blocks >= 1")


def _check_window(window, is_causal: bool, attn_mask: Optional[Tensor]) -> Optional[int]:
    """``window`` as a Python int (or None); a SymInt is specialised (a guard): the plan and
    the block lists take it as a constant."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"window must be an int or None, got {type(window).__name__}")
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1 (keys each query sees), got {window}")
    if not is_causal or attn_mask is not None:
        raise ValueError("window needs is_causal=True and no attn_mask (a causal sliding "
                         "window: query i sees keys i + causal_offset - window < j <= "
                         "i + causal_offset)")
    return window


def _effective_window(window, n_queries: int, causal_offset) -> Optional[int]:
    """``window``, or None where it hides nothing: every row's window reaches key 0."""
    if window is None or n_queries - 1 + causal_offset < window:
        return None
    return window


def _check_structure(q: Tensor, k: Tensor, attn_mask: Optional[Tensor],
                     key_mask: Optional[Tensor], is_causal: bool, causal_offset) -> Optional[Tensor]:
    """Check the structured mask arguments; returns ``key_mask`` as bool (or None)."""
    if isinstance(causal_offset, bool) or not isinstance(causal_offset, (int, torch.SymInt)):
        raise TypeError(f"causal_offset must be an int, got {type(causal_offset).__name__}")
    if causal_offset < 0:
        raise ValueError(f"causal_offset must be >= 0 (query i sees keys j <= i + "
                         f"causal_offset), got {causal_offset}")
    if causal_offset != 0 and not is_causal:
        raise ValueError("causal_offset needs is_causal=True")
    return _row_mask(key_mask, "key_mask", q, ("Nk", k.shape[2]), "True = attend",
                     "nonzero = attend", attn_mask,
                     "fold the key mask into attn_mask, or pass is_causal/causal_offset with "
                     "key_mask")


def _row_mask(mask, name: str, q: Tensor, length: tuple, meaning: str, nonzero: str,
              attn_mask: Optional[Tensor], instead: str) -> Optional[Tensor]:
    """A ``[B, N]`` per-row mask argument (``key_mask``, ``query_mask``) checked and read as
    bool (None stays None); ``length`` is ``(its name, N)``; ``instead``: what to do rather
    than pass it beside ``attn_mask``, which it excludes."""
    if mask is None:
        return None
    if attn_mask is not None and isinstance(mask, Tensor):
        raise ValueError(f"attn_mask and {name} cannot both be set: {instead}")
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a Tensor or None, got {type(mask).__name__}")
    B, (n_name, N) = q.shape[0], length
    if tuple(mask.shape) != (B, N):
        raise ValueError(f"{name} must be [B={B}, {n_name}={N}] ({meaning}), got shape "
                         f"{tuple(mask.shape)}")
    if mask.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {mask.device}")
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or mask.is_complex():
            raise ValueError(f"{name} must be bool or integer ({nonzero}), got dtype "
                             f"{mask.dtype}")
        mask = mask != 0
    return mask


def _check_mask_wants_no_grad(attn_mask: Optional[Tensor]) -> None:
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError("attn_mask must not require grad: PISA gives no gradient for the mask")


def _check_scale(scale, q: Tensor):
    """``scale``, or ``1 / sqrt(D)`` for None: a real number, or a 0-d tensor read once as
    one (SDPA takes no tensor: the dense path once failed on it)."""
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, bool) or not (
            isinstance(scale, (numbers.Real, torch.SymFloat, torch.SymInt))
            or (isinstance(scale, Tensor) and scale.dim() == 0)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    if isinstance(scale, Tensor) and scale.requires_grad and torch.is_grad_enabled():
        raise ValueError("scale must not require grad: PISA gives no gradient for the scale "
                         "(pass a float, or scale.detach())")
    if isinstance(scale, Tensor) and scale.is_meta:  # its value is read on the host
        raise ValueError("scale must be a float or None (or a 0-d tensor holding a value), got "
                         "a 0-d tensor on the meta device, which holds none")
    return float(scale) if isinstance(scale, Tensor) else scale


def _mask4(attn_mask: Optional[Tensor]) -> Optional[Tensor]:
    if attn_mask is None:
        return None
    while attn_mask.dim() < 4:
        attn_mask = attn_mask.unsqueeze(0)
    return attn_mask


def _config(config: Optional[PisaConfig]) -> PisaConfig:
    config = config or PisaConfig()
    if not isinstance(config, PisaConfig):
        raise TypeError(f"config must be a PisaConfig, got {type(config).__name__}")
    return config


def plan(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
         is_causal: bool = False, *, config: Optional[PisaConfig] = None,
         window: Optional[int] = None, causal_offset: int = 0,
         key_mask: Optional[Tensor] = None) -> Plan:
    """Which implementation runs each stage of ``pisa_attention(q, k, v, ...)``.

    Args: as :func:`pisa_attention` (shapes ``[B, H, N, D]``; ``Hq`` a multiple of ``Hkv``,
        as with ``enable_gqa=True``).

    Returns:
        A :class:`~pisa_compile.kernels.dispatch.Plan`: ``select`` and ``attention``
        (``"sdpa"``, ``"triton"``, ``"triton-decode"``, ``"flex-window"``,
        ``"triton-window"``, ``"runtime-mask"`` or ``"reference"``) and the ``reason``
        a stage does not take the fused Triton path. See ``kernels.dispatch.plan``.

    Raises:
        TypeError, ValueError: the arguments :func:`pisa_attention` would refuse (shapes,
            dtypes, devices, masks, ``window``, ``causal_offset``), with the same messages.
    """
    config = _config(config)
    _check_inputs(q, k, v, attn_mask, is_causal, True, config)
    key_mask = _check_structure(q, k, attn_mask, key_mask, is_causal, causal_offset)
    window = _check_window(window, is_causal, attn_mask)
    _check_mask_wants_no_grad(attn_mask)
    how = _plan(q, k, v, attn_mask, is_causal, config=config, window=window,
                causal_offset=causal_offset, key_mask=key_mask)
    if (how.reason in _DENSE_ROWS and how.attention == dispatch.SDPA
            and _masked_rows(q, k, v, key_mask, attn_mask,
                             _effective_window(window, q.shape[2], causal_offset),
                             few_rows=True, scale=None, kernel=config.kernel) == "split-k"):
        # as _dense runs it
        how = how._replace(attention=dispatch.DECODE,
                           reason=how.reason + ", under a key mask: split-K over every key")
    return how


def _plan(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, *,
          config: PisaConfig, window: Optional[int], causal_offset, key_mask,
          read_mask: bool = True) -> Plan:
    """:func:`plan` as :func:`pisa_attention` branches on it (the dense rows as SDPA);
    ``read_mask=False``: as if the op could not read an explicit mask at run time."""
    return dispatch.plan(q, k, v, _mask4(attn_mask), is_causal, kernel=config.kernel,
                         min_seq_len=config.min_seq_len, local_blocks=config.local_blocks,
                         bound_block=config.effective_bound_block,
                         window=_effective_window(window, q.shape[2], causal_offset),
                         dense_rows=_tail_rows(q.shape[2], is_causal, config),
                         decode=is_decode_step(q.shape[2], k.shape[2]),
                         key_padding=key_mask is not None,
                         mask_at_run_time=read_mask and attn_mask is not None
                         and _mask_checked_at_run_time(q, k, v, attn_mask, config))


def is_decode_step(n_queries, n_keys) -> bool:
    """Whether a call of ``n_queries`` queries over ``n_keys`` keys (ints or SymInts) is a
    decode step: at most ``DECODE_MAX_QUERIES`` queries, fewer than its keys (a cache before
    them, or a short cross-attention). A static query count (a decode graph's) guards on
    ``n_keys > n_queries`` where the keys are symbolic (a review found 4-query steps sparse
    once the cache length went dynamic: the bound was never proved); a symbolic one is a
    decode step only where that is known without a guard. With no persistent pyramid such
    a call runs dense whatever ``dense_tail``: a selection rebuilt per call reads every key,
    as dense does, and measured slower (20.8 against 0.96 ms at 128K, B=8,
    ``profiles/bench_decode.json``); dense is also exact, so a left-padded row's steps
    compute as its sequence alone (a sparse step was not aligned to its first token)."""
    if isinstance(n_queries, int):
        return n_queries <= DECODE_MAX_QUERIES and bool(n_queries < n_keys)
    return (statically_known_true(n_queries <= DECODE_MAX_QUERIES)
            and statically_known_true(n_queries < n_keys))


def _tail_rows(n_queries, is_causal: bool, config: PisaConfig):
    """How many of a call's last query rows the dense tail takes: all of a call of at most
    ``dense_tail`` queries; of a longer causal call the last ``dense_tail``, rounded up so
    that the sparse rows end on a query tile (their selection is then the one the call
    without a tail makes); none otherwise."""
    T = config.dense_tail
    if T == 0:
        return 0
    if n_queries <= T:
        return n_queries
    if not is_causal:
        return 0
    return n_queries - (n_queries - T) // config.query_tile * config.query_tile


def pisa_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
    config: Optional[PisaConfig] = None, key_mask: Optional[Tensor] = None,
    causal_offset: int = 0, window: Optional[int] = None, query_mask: Optional[Tensor] = None,
) -> Tensor:
    """Pyramid top-K sparse attention with the semantics of ``F.scaled_dot_product_attention``.

    Each query tile (``config.query_tile`` queries times the ``G = Hq / Hkv`` heads of one KV
    head) attends to its forced blocks plus the ``top_k`` leaf blocks chosen coarse-to-fine
    over a key pyramid (PISA; DESIGN.md "The algorithm"). In the exact regime (every visible
    leaf selected, or ``Nk < min_seq_len``) the result equals SDPA within dtype tolerance.
    An explicit ``attn_mask`` (bool; or float where no gradient is wanted) is read at run
    time (:func:`mask_structure`; a host sync on CUDA), except on CUDA with
    ``kernel="auto"`` where the Triton kernels refuse the inputs (dense SDPA under it):
    causal AND padding runs the structured path; any other mask runs dense SDPA under it
    (``kernel="auto"`` on CUDA) or the reference selection and the kernels under it
    (:func:`plan` gives the reason). With gradients its backward runs
    that forward again with autograd (no selection or ``lse`` is kept for it). The last
    ``config.dense_tail`` queries of a causal call, every call of that few queries, and a
    decode step (at most 16 queries, fewer than the keys, whatever ``dense_tail``:
    :func:`is_decode_step`; a ``PisaKVCache`` holding the keys decodes from its pyramid) are
    dense: with a ``key_mask``, a call of one query on CUDA through SDPA under
    the mask with ``enable_gqa``, and more rows without gradients on the Triton path through
    the split-K decode kernel over every key block; otherwise dense SDPA.

    Args:
        q: ``[B, Hq, Nq, D]`` float16, bfloat16, float32 or float64.
        k: ``[B, Hkv, Nk, D]``, same dtype and device as ``q``.
        v: ``[B, Hkv, Nk, Dv]``.
        attn_mask: bool (True = attend) or additive float, broadcastable to
            ``[B, Hq, Nq, Nk]``. A float entry of ``-inf`` or <= ``finfo.min / 2`` is masked.
        dropout_p: must be 0.0 (PISA has no dropout).
        is_causal: causal mask, top-left as in SDPA (with ``causal_offset``, query ``i`` sees
            keys ``j <= i + causal_offset``); exclusive with ``attn_mask``.
        scale: softmax scale; default ``1 / sqrt(D)``.
        enable_gqa: allow ``Hq != Hkv`` (``Hq`` a multiple of ``Hkv``).
        config: :class:`PisaConfig`; default ``PisaConfig()``.
        key_mask: ``[B, Nk]`` bool or integer (nonzero = the key may be attended), e.g. a
            tokenizer's ``attention_mask``: padding read by the kernels per key, never as an
            ``Nq x Nk`` mask. Exclusive with ``attn_mask``.
        causal_offset: int >= 0 (a KV cache's length: bottom-right alignment is
            ``Nk - Nq``); needs ``is_causal=True``.
        window: None, or a causal sliding window of this many keys (int >= 1;
            transformers' ``sliding_window``): query ``i`` sees keys ``j`` with
            ``i + causal_offset - window < j <= i + causal_offset``. Needs ``is_causal``.
            From ``min_seq_len`` keys on, on CUDA (fp16/bf16/fp32, head dims 16..256, GQA
            groups a power of two), such a call is exact windowed attention through
            FlexAttention (``O(N * window)``, no selection, no ``Nq x Nk`` mask); with a
            ``key_mask`` under ``torch.compile`` (traced FlexAttention gave wrong rows with
            padding on the H200), where FlexAttention refuses the inputs, or with
            ``kernel="triton"``, through PISA's Triton kernels over the window's leaf blocks;
            otherwise dense SDPA under the window's mask (which builds that mask). The
            selection options of ``config`` do not apply to it.
        query_mask: ``[B, Nq]`` bool or integer, or None: zero marks a padding query, which
            votes for nothing in its query tile's selection (its row of q reaches the
            selection as NaN), so what sits in the padding never changes which blocks the
            tile's real rows get. Its own output row is computed as any other. Needs the
            structured arguments (not ``attn_mask``). The pass hands it on where it proves
            self-attention under a key mask (:func:`self_attention_query_mask`).

    Returns:
        ``[B, Hq, Nq, Dv]`` in ``q.dtype``. Rows with no visible key are zero, as in SDPA.
        Differentiable in ``q, k, v`` with the selection held fixed.

    Raises:
        TypeError, ValueError: a bad argument; the message names it and what was expected.
        ValueError: on the Triton selection, a ``top_k``, ``beam`` or ``shortlist`` that
            makes a tile rank more than 1024 leaves at once (only past 1024 leaves).
    """
    config = _config(config)
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0 (PISA kernels have no dropout), got {dropout_p}")
    _check_inputs(q, k, v, attn_mask, is_causal, enable_gqa, config)
    key_mask = _check_structure(q, k, attn_mask, key_mask, is_causal, causal_offset)
    window = _check_window(window, is_causal, attn_mask)
    window = _effective_window(window, q.shape[2], causal_offset)
    scale = _check_scale(scale, q)
    _check_mask_wants_no_grad(attn_mask)
    query_mask = _check_query_mask(q, attn_mask, query_mask)
    how = _plan(q, k, v, attn_mask, is_causal, config=config, window=window,
               causal_offset=causal_offset, key_mask=key_mask)
    return _run(q, k, v, attn_mask, key_mask, is_causal, causal_offset, window, scale,
                enable_gqa, config, how, query_mask)


def _check_query_mask(q: Tensor, attn_mask: Optional[Tensor],
                      query_mask: Optional[Tensor]) -> Optional[Tensor]:
    """Check ``query_mask``; returns it as bool (or None)."""
    return _row_mask(query_mask, "query_mask", q, ("Nq", q.shape[2]), "False = a padding query",
                     "nonzero = a real query", attn_mask,
                     "query_mask goes with the structured arguments (is_causal, "
                     "causal_offset, key_mask)")


def self_attention_query_mask(key_mask: Tensor, n_queries: int) -> Tensor:
    """The queries' mask of a self-attention call under a key padding mask: query ``i`` is
    the token of key ``Nk - Nq + i`` (a KV cache's keys come first), and it is a padding
    query where that key lies in the row's leading or trailing run of masked keys (a
    tokenizer's left or right padding). Masked keys between real ones (a mask hiding some
    real tokens' keys) leave their queries voting: only the runs are padding.

    Args:
        key_mask: ``[B, Nk]`` bool or integer (nonzero = a real key).
        n_queries: ``Nq <= Nk``.

    Returns:
        ``[B, Nq]`` bool, False = a padding query (``pisa_attention``'s ``query_mask``). A
        row with no real key has none real.

    Raises:
        ValueError: ``n_queries`` > ``Nk`` (a traced call: a failed ``torch._check``).

    Method: the rewrite calls it where it proves q and k one token sequence
    (``lowering/tokens.py``); plain tensor ops, so it compiles with the graph.
    """
    live = key_mask != 0
    n_keys = live.shape[1]
    if isinstance(n_queries, int) and isinstance(n_keys, int) and n_queries > n_keys:
        raise ValueError(f"self_attention_query_mask: n_queries={n_queries} must be at most the "
                         f"keys, {n_keys} (query i is key Nk - Nq + i's token)")
    torch._check(n_queries <= n_keys, lambda: "self_attention_query_mask: more queries than keys")
    pos, first, last = _live_span(live)
    own = pos[n_keys - n_queries:]
    return (own >= first) & (own <= last)


def _live_span(live: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(pos [N], first [B, 1], last [B, 1])`` of a bool ``[B, N]`` key mask: each row's
    first and last live key (``N`` and ``-1`` for a row with none)."""
    n = live.shape[1]
    pos = torch.arange(n, device=live.device)
    return (pos, torch.where(live, pos, n).amin(1, keepdim=True),
            torch.where(live, pos, -1).amax(1, keepdim=True))


def _run(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
         key_mask: Optional[Tensor], is_causal: bool, causal_offset, window: Optional[int],
         scale, enable_gqa: bool, config: PisaConfig, how: Plan,
         query_mask: Optional[Tensor] = None) -> Tensor:
    """:func:`pisa_attention` on checked arguments, as the plan ``how`` says."""
    if how.attention == dispatch.WINDOW:
        from .kernels.window import window_attention
        return window_attention(q, k, v, window=window, causal_offset=causal_offset,
                                key_mask=key_mask, scale=float(scale), enable_gqa=enable_gqa)
    if how.attention == dispatch.TRITON_WINDOW:
        # The window's leaf blocks as the block lists: no selection, exact.
        block_indices, block_counts = _window_blocks_op(
            q.detach(), k.shape[2], window, causal_offset, config.block_size, WINDOW_QUERY_TILE)
        B, Hkv, T, M = q.shape[0], k.shape[1], *block_indices.shape
        block_indices = block_indices.expand(B, Hkv, T, M)
        block_counts = block_counts.expand(B, Hkv, T)
        out, _lse = _Attention.apply(q, k, v, None, key_mask, block_indices, block_counts,
                                     True, causal_offset, float(scale), config.block_size,
                                     WINDOW_QUERY_TILE, dispatch.attention_impl(q.shape[2]),
                                     window)
        return out
    # The tail has fewer than dense_tail + query_tile rows, a decode step at most
    # DECODE_MAX_QUERIES: a static bound for the GQA fold when Nq is symbolic.
    tail_bound = max(config.dense_tail + config.query_tile, DECODE_MAX_QUERIES)
    # A decode call (a decode step, the dense tail's, or any few-query call once a
    # PisaKVCache exists) reads a cache's pyramid where its keys are one; not below
    # min_seq_len, where the op is plain SDPA.
    whole_tail = how.reason in _DENSE_ROWS
    m4 = _mask4(attn_mask)
    if ((whole_tail or how.attention != dispatch.SDPA)
            and _cached_decode_applies(q, k, v, m4, is_causal, window, config)):
        if m4 is not None:  # one query: its bool mask row is a key mask
            key_mask = m4[:, 0, 0, :].expand(q.shape[0], k.shape[2])
        if not is_causal:  # one query that sees every (unmasked) key: the last position
            causal_offset = k.shape[2] - 1
        return _cached_decode_op(q, k, v, key_mask, causal_offset, float(scale), config.kernel)
    if how.attention == dispatch.RUNTIME_MASK:
        return _StructuredFromMask.apply(q, k, v, m4, float(scale),
                                         tuple(getattr(config, f) for f in _CONFIG_FIELDS))
    if how.attention == dispatch.SDPA:
        return _dense(q, k, v, attn_mask, key_mask, is_causal, causal_offset, window, scale,
                      enable_gqa, max_rows=tail_bound if whole_tail else None,
                      kernel=config.kernel)
    attn_mask, scale = _mask4(attn_mask), float(scale)
    if attn_mask is not None and attn_mask.dtype == torch.float64 and q.dtype != torch.float64:
        attn_mask = attn_mask.float()  # the backward's matmuls take one dtype
    if _rows_align(q, k, key_mask, query_mask, is_causal, causal_offset):
        return _aligned(q, k, v, key_mask, query_mask, is_causal, scale, enable_gqa, config,
                        how)
    tail = None
    if is_causal and config.dense_tail > 0:
        # The last rows (a prompt's question) attend densely; plan() left some sparse rows.
        head = q.shape[2] - _tail_rows(q.shape[2], is_causal, config)
        q_tail, q = q[:, :, head:], q[:, :, :head]
        if isinstance(head, torch.SymInt) and _needs_grad(q, k, v):
            # Saved for the backward, a slice of symbolic length gets a layout of Inductor's
            # own; AOTAutograd then fixes its strides to the first call's sizes (the next
            # length fails assert_size_stride, torch 2.13). A contiguous copy keeps its layout.
            q_tail, q = q_tail.contiguous(), q.contiguous()
        tail = _dense(q_tail, k, v, None, key_mask, True, causal_offset + head, None,
                      scale, enable_gqa, max_rows=tail_bound, kernel=config.kernel)
        if tail.requires_grad:
            tail = _ContiguousGrad.apply(tail)
    # The selection has no gradient: detached inputs keep it out of autograd (and torch.func).
    block_indices, block_counts = _select_blocks_op(
        _voting(q.detach(), query_mask), k.detach(), attn_mask, key_mask, is_causal, causal_offset, scale,
        *config.selection_args(), how.select)
    out, _lse = _Attention.apply(q, k, v, attn_mask, key_mask, block_indices, block_counts,
                                 is_causal, causal_offset, scale, config.block_size,
                                 config.query_tile, how.attention, 0)
    return out if tail is None else torch.cat([out, tail], dim=2)


def _rows_align(q: Tensor, k: Tensor, key_mask: Optional[Tensor],
                query_mask: Optional[Tensor], is_causal: bool, causal_offset) -> bool:
    """Whether the sparse rows run in :func:`_aligned`'s frames: a call under a key mask with
    as many queries as keys (no cache before them), causal (query ``i`` is then key ``i``'s
    position whatever the tensors hold) or proved self-attention (the pass handed a
    ``query_mask``). The frames regroup rows and keys alike, so any such call keeps its
    semantics; only where the rows are one token sequence does the regrouping make a row
    compute as its sequence alone. Under dynamic shapes the equal lengths are a guard, not a
    proof: a recompiled graph gives q and k their own length symbols, and a proof then
    failed and silently skipped the alignment (a review: a left-padded row 0.78 from its
    sequence alone once a graph traced at 70 tokens was recompiled at 130)."""
    if key_mask is None or not (is_causal or query_mask is not None):
        return False
    return guard_or_false(causal_offset == 0) and guard_or_false(q.shape[2] == k.shape[2])


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, :, index[b, j]]`` for ``x`` ``[B, H, N, D]`` and ``index`` ``[B, M]`` (int64):
    ``[B, H, M, D]``. Its backward scatters into zeros and keeps only ``index``: a plain
    ``gather`` keeps ``x`` for its backward, which held q, k and v beside their copies in
    eager training (a review measured 11.5 -> 14.6 MiB saved for a small layer)."""
    if not x.requires_grad:
        return _rows(x, index)
    return _GatherRows.apply(x, index)


def _rows(x: Tensor, index: Tensor) -> Tensor:
    B, H, _, D = x.shape
    return x.gather(2, index[:, None, :, None].expand(B, H, index.shape[1], D))


class _GatherRows(torch.autograd.Function):
    """:func:`_gather_rows` with a backward that saves the index alone (repeated indices
    add up)."""

    @staticmethod
    def forward(x, index):
        return _rows(x, index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, index = inputs
        ctx.save_for_backward(index)
        ctx.x_shape = x.shape

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        B, H, _, D = grad.shape
        full = grad.new_zeros(ctx.x_shape)
        return full.scatter_add(2, index[:, None, :, None].expand(B, H, index.shape[1], D),
                                grad), None


def _aligned(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, query_mask: Optional[Tensor],
             is_causal: bool, scale: float, enable_gqa: bool, config: PisaConfig,
             how: Plan) -> Tensor:
    """The sparse rows of a padded call (:func:`_rows_align`), each batch row computed as its
    sequence alone: query tiles and leaf blocks start at the row's first real token, and,
    causal, the dense tail takes the row's last real tokens. (Without a ``query_mask`` the
    padding queries vote, except, causal, a left-padding one, which sees no key: a
    left-padded row then still computes as alone; so does a right-padded one with a dense
    tail, whose rows its padding queries share a tile with, but not without one.) "As
    alone" holds where the row alone makes the call's per-call choices: the same side of
    ``min_seq_len``, and of ``flat_leaves`` (flat scan or pyramid walk).

    Query tiles and leaf blocks otherwise start at position 0 of the padded batch, so a
    left-padded row groups its tokens as the same sequence alone does only when its padding
    is a multiple of both: in the sparse regime its output differed at most positions (a
    new user's Qwen2.5-Coder trial: 144 of 200 positions, up to 8.9 in the logits). Here the
    row is rolled left by its leading padding (a per-row gather of q, k, v, on the device:
    no host sync), which makes it a right-padded row, whose real rows select as the sequence
    alone (padding queries do not vote), and the output is rolled back. The dense tail runs
    in a second frame where each row's last real token comes last (the tail's rows are then
    the last ones, at one causal offset): it takes ``t`` rows of a row of ``n`` real tokens,
    as :func:`_tail_rows` takes of a call of ``n`` queries. Causal, a left-padding query sees
    no key: zero, as SDPA's semantics under the mask say (in the rolled frame it would come
    after the real keys). Rows between real ones, a mask's hidden keys, are as any key mask.

    Costs per call: gathers of q, k, v and the output (and of k, v for the tail), O(N D)
    each, against the attention's O(N K D)."""
    N = q.shape[2]
    pos, first, last = _live_span(key_mask)
    empty = last < 0  # no real key: any frame (every row sees nothing)
    first, last = first.masked_fill(empty, 0), last.masked_fill(empty, N - 1)
    # The sparse frame: position j holds the row's token first + j.
    into = (pos + first) % N
    qf, kf, vf = (_gather_rows(x, into) for x in (q, k, v))
    kmf = key_mask.gather(1, into)
    qmf = None if query_mask is None else query_mask.gather(1, into)
    if is_causal:
        # A left-padding query sees no key (its output is zeroed below); in this frame it
        # comes after the real keys, so it must not vote.
        seen = pos < N - first
        qmf = seen if qmf is None else qmf & seen
    block_indices, block_counts = _select_blocks_op(
        _voting(qf.detach(), qmf), kf.detach(), None, kmf, is_causal, 0, scale,
        *config.selection_args(), how.select)
    out, _lse = _Attention.apply(qf, kf, vf, None, kmf, block_indices, block_counts,
                                 is_causal, 0, scale, config.block_size, config.query_tile,
                                 how.attention, 0)
    out = _gather_rows(out, (pos - first) % N)
    if not is_causal:
        return out
    out = out.masked_fill((pos < first)[:, None, :, None], 0.0)
    T, TQ = config.dense_tail, config.query_tile
    if T == 0:
        return out
    bound = T + TQ - 1  # the most rows a tail takes (_tail_rows)
    # No guard on a symbolic N; a plain int takes min (Dynamo refuses sym_min's int result
    # when it traces this function, as torch.compile of pisa_attention does).
    R = torch.sym_min(N, bound) if isinstance(N, torch.SymInt) else min(N, bound)
    n = last - first + 1
    t = torch.where(n <= T, n, n - torch.div(n - T, TQ, rounding_mode="floor") * TQ)
    # The tail frame: position j holds token j - (N - 1 - last), the last real one at N - 1.
    into = (pos - (N - 1 - last)) % N
    kt, vt = _gather_rows(k, into), _gather_rows(v, into)
    tail = _dense(_gather_rows(q, into[:, N - R:]), kt, vt, None, key_mask.gather(1, into),
                  True, N - R, None, scale, enable_gqa, max_rows=bound, kernel=config.kernel)
    r = pos - last + (R - 1)  # token i is the tail's row r
    use = (r >= R - t) & (r < R)
    return torch.where(use[:, None, :, None], _gather_rows(tail, r.clamp(0, R - 1)), out)


def _cached_decode_applies(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                           is_causal: bool, window, config: PisaConfig) -> bool:
    """Whether a decode call (within the dense tail) goes through ``pisa::cached_decode``,
    which looks its keys up among the live :class:`~pisa_compile.PisaKVCache` s at run time:
    causal without an explicit mask, or one query with no mask or under a bool mask
    ``[B or 1, 1, 1, Nk]`` (a key mask: transformers' decode calls), no window, no gradient,
    at most 16 queries, on the Triton path, and only once a cache exists (a graph traced before keeps its traced dense
    decode)."""
    nq = q.shape[2]
    # Only a query count known at trace time: a test on a symbolic one would guard it (and
    # recompile graphs that never decode).
    if not (persistent.any_registered() and isinstance(nq, int) and nq <= DECODE_MAX_QUERIES
            and window is None and not _needs_grad(q, k, v)
            and dispatch.triton_refusal(q, v, config.kernel) is None):
        return False
    if attn_mask is None:  # causal, or one query that sees every key (transformers' decode)
        return is_causal or nq == 1
    # One query under a bool mask that does not vary by head: the mask is a key mask.
    shape = attn_mask.shape
    return (nq == 1 and attn_mask.dtype == torch.bool and attn_mask.dim() == 4
            and statically_known_true(shape[1] == 1) and statically_known_true(shape[2] == 1)
            and (statically_known_true(shape[0] == 1)
                 or statically_known_true(shape[0] == q.shape[0])))


def _mask_checked_at_run_time(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor,
                              config: PisaConfig) -> bool:
    """Whether an unproved explicit mask goes through ``pisa::structured_from_mask`` (its
    structure read at run time by :func:`mask_structure`): a mask that does not vary by
    head, a float ``scale``, and the Triton kernels take the inputs (or the reference runs: off
    CUDA, or on CUDA with ``kernel`` other than ``"auto"``, whose refusal there runs dense SDPA
    under the mask instead; the reference's structured path keeps the dense tail and a left-padded row's
    alignment, where the reference selection under the raw mask has neither; a new user's
    ``PisaCache`` prefill on the CPU, whose update breaks the graph before the mask reaches
    attention, was 3.18 logits from eager against 0.22 with a ``DynamicCache``); a bool mask,
    or a float one where no gradient is wanted. With gradients the op's backward runs its forward
    again: worth it for transformers' bool masks (causal AND padding, then sparse), not for
    a float mask, most often a finite bias (ALiBi), where it would add a mask read, a host
    sync and a dense forward to dense SDPA's training step."""
    m = _mask4(attn_mask)
    return (not m.requires_grad
            and (m.dtype == torch.bool or (m.is_floating_point() and not _needs_grad(q, k, v)))
            and statically_known_true(m.shape[1] == 1)
            # Only CUDA's kernel="auto" has an exact fallback (dense SDPA under the mask) where
            # Triton refuses; the reference selection elsewhere is better on the structure.
            and (not unstructured_mask_runs_dense(q.device, config.kernel)
                 or dispatch.triton_refusal(q, v, config.kernel) is None))


def mask_structure(attn_mask: Tensor, n_queries: int, n_keys: int
                   ) -> Optional[tuple[Tensor, int]]:
    """The structure of an explicit mask, read at run time: ``(key_mask, causal_offset)`` when
    ``attn_mask`` is exactly causal with that offset AND a per-batch key mask, else None.

    This is what transformers hands attention when its mask was built in another graph (a
    graph break before the decoder layers, as a cache whose update runs eagerly makes):
    causal (top-left, offset 0; or bottom-right, offset ``Nk - Nq``: a prompt appended to a
    cache) AND padding. The key mask is the keys some query sees; the mask must then equal
    ``(j <= i + offset) & key_mask[b, j]`` on every entry, padding rows included (a row
    that sees no key must be all masked).

    Args:
        attn_mask: ``[B or 1, 1, Nq, Nk]`` bool (True = attend) or float (0 = attend,
            ``<= finfo.min / 2`` or ``-inf`` = masked; any other value is a bias: None).
        n_queries, n_keys: ``Nq``, ``Nk``.

    Returns:
        ``(key_mask [B or 1, Nk] bool, causal_offset)`` or None. One host sync. The mask is
        read about three times (a float mask once more): its key mask, then both candidate
        offsets in one pass of row chunks, whose temporaries stay a fraction of the mask's
        size.
    """
    m = attn_mask
    if m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != n_queries or m.shape[3] != n_keys:
        return None
    m = m[:, 0]
    offsets = [o for o in dict.fromkeys((0, n_keys - n_queries)) if o >= 0]
    # bad[0]: not a mask at all; bad[1 + c]: not causal at offsets[c] AND the key mask.
    bad = torch.zeros(1 + len(offsets), dtype=torch.bool, device=m.device)
    if m.is_floating_point():
        thr = max(torch.finfo(m.dtype).min / 2, torch.finfo(torch.float32).min)
        bad[0] = (~((m == 0) | (m <= thr))).any()  # a finite bias or NaN
        m = m == 0
    elif m.dtype != torch.bool:
        return None
    key_mask = m.any(dim=1)  # [B or 1, Nk]: keys some query sees
    j = torch.arange(n_keys, device=m.device)
    rows = max(1, (1 << 24) // max(1, n_keys * m.shape[0]))  # about 16M entries per chunk
    for r0 in range(0, n_queries, rows):
        i = torch.arange(r0, min(r0 + rows, n_queries), device=m.device)
        chunk = m[:, r0:r0 + rows]
        for c, offset in enumerate(offsets):
            want = (j[None, :] <= i[:, None] + offset)[None] & key_mask[:, None, :]
            bad[1 + c] |= (chunk != want).any()
    bad = bad.tolist()  # the one host sync
    if bad[0]:
        return None
    for c, offset in enumerate(offsets):
        if not bad[1 + c]:
            return key_mask, offset
    return None


def _dense(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
           key_mask: Optional[Tensor], is_causal: bool, causal_offset, window: Optional[int],
           scale, enable_gqa: bool, *, kernel: str, max_rows: Optional[int] = None) -> Tensor:
    """Dense attention over what the structured arguments stand for: the dense path of
    :func:`pisa_attention` and its dense tail (arguments as there, checked; ``max_rows``: a
    static bound on ``Nq`` where it is symbolic, given for the tail and decode calls;
    ``kernel``: the config's). SDPA, except the tail calls under a key mask without
    gradients on the Triton path (:func:`_dense_split_k`). Returns ``[B, Hq, Nq, Dv]``."""
    rows = _masked_rows(q, k, v, key_mask, attn_mask, window, few_rows=max_rows is not None,
                        scale=scale, kernel=kernel)
    if rows == "split-k":
        return _dense_split_k(q, k, v, key_mask, is_causal, causal_offset, scale, max_rows)
    if rows == "gqa-sdpa":
        mask = dense_mask(q.shape[0], q.shape[2], k.shape[2], is_causal, causal_offset,
                          key_mask, q.device)  # [B, 1, 1, Nk]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return _zero_unseen_rows(out, mask)  # a row of padding only
    if is_causal and key_mask is None and window is None:
        if statically_known_true(causal_offset >= k.shape[2] - 1):
            # Every query sees every key (a decode step over its cache): no mask, so SDPA
            # keeps its fused GQA kernels.
            is_causal = False
        elif causal_offset != 0 and statically_known_true(
                causal_offset == k.shape[2] - q.shape[2]):
            out = _flash_lower_right(q, k, v, scale)  # the dense tail: no mask to build
            if out is not None:
                return out
    if key_mask is not None or (is_causal and causal_offset != 0) or window is not None:
        # The dense mask the structure stands for: short sequences and the dense tail.
        attn_mask = dense_mask(q.shape[0], q.shape[2], k.shape[2], is_causal, causal_offset,
                               key_mask, q.device, window=window)
        is_causal = False
    # 4-D as on the sparse path (SDPA itself refuses a 1-D mask that broadcasts).
    return _dense_sdpa(q, k, v, _mask4(attn_mask), is_causal, scale, enable_gqa, max_rows)


def _masked_rows(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
                 attn_mask: Optional[Tensor], window: Optional[int], *, few_rows: bool,
                 scale, kernel: str) -> Optional[str]:
    """How :func:`_dense` runs rows under a key mask alone: ``"gqa-sdpa"`` for one row on
    CUDA (SDPA with the mask and ``enable_gqa``: 0.06 / 0.15 ms at 32K / 128K, B=1, against
    the split-K kernel's 0.25 / 0.46 on the H200, ``profiles/bench_dense_rows.json``);
    ``"split-k"`` for a few rows (``few_rows``: the dense tail, whose row count has a static
    bound) without gradients on the Triton path (64 rows at 32K: 0.26 ms against SDPA's
    0.74); else None (the masked SDPA of :func:`_dense_sdpa`). ``scale``: None where not
    known (:func:`plan`)."""
    if key_mask is None or attn_mask is not None or window is not None \
            or isinstance(scale, Tensor):
        return None
    if q.device.type == "cuda" and statically_known_true(q.shape[2] == 1):
        return "gqa-sdpa"  # also below min_seq_len (a hand-written site's decode steps)
    if few_rows and not _needs_grad(q, k, v) and dispatch.triton_refusal(q, v, kernel) is None:
        return "split-k"
    return None


def _needs_grad(*tensors: Tensor) -> bool:
    """Whether autograd will record a call on ``tensors`` (the split-K path has no backward
    of its own worth running: one program would walk every key block)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _dense_split_k(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, is_causal: bool,
                   causal_offset, scale: float, max_rows: int) -> Tensor:
    """Dense attention of a few queries (the dense tail, a decode step) under a key mask,
    through the split-K decode kernel over every key block (flash-decoding; Dao et al.,
    2023): the ``G`` heads of a KV head are rows of one tile, and the block list is cut into
    slices that fill the GPU. Masked SDPA runs such calls with one program per 64 rows (the
    tail at 32K on the H200: 0.81 ms against FlashAttention's 0.13 without a mask,
    ``profiles/bench_stages_key_mask.json``). Forward only: callers take it without gradients.

    Args: q ``[B, Hq, Nq, D]`` with ``Nq <= max_rows`` (an int); k, v ``[B, Hkv, Nk, D]``;
    key_mask ``[B, Nk]``; is_causal, causal_offset, scale as :func:`pisa_attention`.
    Returns ``[B, Hq, Nq, Dv]`` in ``q.dtype`` (zero rows where no key is visible)."""
    B, Hkv, Nk = k.shape[0], k.shape[1], k.shape[2]
    n_blocks = cdiv(Nk, _SPLIT_K_BLOCK)
    block_indices = torch.arange(n_blocks, device=q.device, dtype=torch.int32).expand(
        B, Hkv, 1, n_blocks)
    block_counts = torch.full((B, Hkv, 1), n_blocks, device=q.device, dtype=torch.int32)
    # Through the autograd Function, so that forward-mode AD raises as on the sparse path
    # instead of getting no tangent from the bare op.
    out, _lse = _Attention.apply(q, k, v, None, key_mask, block_indices, block_counts, is_causal,
                                 causal_offset, float(scale), _SPLIT_K_BLOCK, max_rows,
                                 dispatch.DECODE, 0)
    return out


# Keys per block of _dense_split_k's block list (the attention kernel's key tile).
_SPLIT_K_BLOCK = 64


def _flash_lower_right(q: Tensor, k: Tensor, v: Tensor, scale) -> Optional[Tensor]:
    """Causal attention aligned bottom-right (query ``i`` sees keys ``j <= i + Nk - Nq``)
    through FlashAttention, GQA without expanding K/V and no mask: ``[B, Hq, Nq, D]`` from
    q ``[B, Hq, Nq, D]``, k, v ``[B, Hkv, Nk, D]``. ``None`` where SDPA would not pick
    flash: not CUDA, a GPU before sm80, flash disabled (read once per trace), not
    fp16/bf16, a head dim over 128, a last dim that is not contiguous, a tensor scale.
    SDPA's ``is_causal`` is top-left; the flash op's is bottom-right (what
    ``torch.nn.attention.bias.causal_lower_right`` calls, which Dynamo cannot trace)."""
    from .kernels.runtime import flash_sdp_enabled, triton_targets_gpu
    D, Dv = q.shape[-1], v.shape[-1]
    # D <= 128: larger head dims need sm80/sm90 for flash's backward (not sm86/sm89).
    if (q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16)
            or isinstance(scale, Tensor) or D != Dv or D % 8 or D > 128
            or any(t.stride(-1) != 1 for t in (q, k, v))
            or not triton_targets_gpu(q.device.index or 0) or not flash_sdp_enabled()):
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=float(scale))[0]


def _dense_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                scale: float, enable_gqa: bool, max_rows: Optional[int] = None) -> Tensor:
    """Dense SDPA under the op's mask rules, for the calls :func:`plan` sends to it.

    A float mask entry at or below ``finfo.min / 2`` of its dtype is masked (``-inf``; SDPA
    would average a row of such entries), a row that sees no key is zero (as on the sparse
    path), and a float mask SDPA refuses (float64, or a half dtype other than q's) is
    computed in float32. With a mask, GQA is unrolled: SDPA's fused kernels take a mask or
    GQA, not both, and its math fallback would build the ``Nq x Nk`` scores for every head.
    A mask shared by the heads and smaller than the K/V copy (the dense tail, decode;
    ``max_rows`` bounds a symbolic ``Nq``) is repeated instead, with the ``G`` query heads
    of a KV head as rows; otherwise K and V are."""
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.masked_fill(
            attn_mask <= torch.finfo(attn_mask.dtype).min / 2, float("-inf"))
        if attn_mask.dtype not in (torch.float32, q.dtype):
            attn_mask = attn_mask.float()
    return _zero_unseen_rows(_masked_sdpa(q, k, v, attn_mask, scale, enable_gqa, max_rows),
                             attn_mask)


def _zero_unseen_rows(out: Tensor, attn_mask: Tensor) -> Tensor:
    """``out`` ``[B, Hq, Nq, Dv]`` with zeros in the rows whose ``attn_mask`` (bool, or float
    with ``-inf``; broadcastable to ``[B, Hq, Nq, Nk]``) lets no key through. SDPA's math
    path gives such rows zeros, its CUDA kernels need not (fp16 under a bool mask on the
    H200 gave them nonzero values). A NaN entry counts as seen: its row stays NaN."""
    seen = (attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")).any(
        -1, keepdim=True)
    return out.masked_fill(~seen, 0)


def _masked_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor, scale: float,
                 enable_gqa: bool, max_rows: Optional[int]) -> Tensor:
    """SDPA of ``q`` ``[B, Hq, Nq, D]`` over ``k``/``v`` ``[B, Hkv, Nk, D or Dv]`` under
    ``attn_mask`` (bool, or float with ``-inf``; broadcastable to ``[B, Hq, Nq, Nk]``), GQA
    as :func:`_dense_sdpa` says; ``[B, Hq, Nq, Dv]`` in q's dtype."""
    B, Hq, Nq, _ = q.shape
    Hkv, D = k.shape[1], k.shape[3]
    group = Hq // max(Hkv, 1)
    rows_bound = Nq if max_rows is None else max_rows
    if enable_gqa and group > 1 and attn_mask.shape[1] == 1 and (
            statically_known_true(group * rows_bound < 2 * (group - 1) * Hkv * D)):
        rows = q.reshape(B, Hkv, group * Nq, D)  # head kv*G + g: rows (g, i)
        mask = attn_mask  # one row for every query broadcasts as it is
        if attn_mask.shape[2] != 1:
            mask = attn_mask.expand(attn_mask.shape[0], 1, Nq, attn_mask.shape[3])
            mask = mask.unsqueeze(2).expand(-1, -1, group, -1, -1)
            mask = mask.reshape(mask.shape[0], 1, group * Nq, mask.shape[-1])
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)
        return out.reshape(B, Hq, Nq, v.shape[-1])
    if enable_gqa and group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        enable_gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                          enable_gqa=enable_gqa)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: the dense tail's output goes
    through it before the op's ``cat``, so its gradient is not a slice of the ``cat``'s.
    On the H200 (torch 2.11), compiled with Inductor, masked SDPA with repeated K/V gave
    0.93 relative error in dq, dk and dv from such a slice (eager and this identity: right;
    ``profiles/tail_grad_probe.json``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()
    # No jvp: Dynamo refuses Functions that define one. Forward AD stops at the sparse rows'
    # op before it (``_Attention`` has none either).


def check_causal_buffer(q: Tensor, buffer: Tensor) -> Tensor:
    """``q`` unchanged, after checking that ``buffer`` still holds a causal mask.

    The pass turns a mask read from a module buffer (nanoGPT's registered
    ``tril(ones(T, T))``, cut to ``[:T, :T]``) into ``is_causal`` when the buffer is causal
    at compile time; the buffer may be written later, so every call checks the region the
    mask reads: one fused pass with no host synchronisation (``torch._assert_async``, kept
    in the graph as a side effect; the pass keeps the mask where Inductor would compile the
    assert out: ROCm, or ``assert_indirect_indexing=False``).

    Args:
        q: any tensor, returned as is (the rewritten site routes its query through here).
        buffer: ``[1, .., 1, T, T]`` float or bool: must be 1 (True) exactly where ``j <= i``
            of its last two dims, 0 elsewhere.

    Returns:
        ``q``.

    Raises:
        RuntimeError: the buffer is no longer causal. On the CPU at once, with this message;
            on CUDA as a device-side assert, which poisons the CUDA context (the process
            must restart; the error reads "device-side assert triggered"). Recompile the
            model (``torch._dynamo.reset()``) after changing such a buffer on purpose.
        ValueError: ``buffer`` has fewer than 2 dims or non-square last dims.
    """
    if buffer.dim() < 2 or buffer.shape[-2] != buffer.shape[-1]:
        raise ValueError(f"buffer must be [..., T, T], got shape {tuple(buffer.shape)}")
    torch._assert_async(holds_causal_mask(buffer),
                        "pisa_compile: a causal mask buffer the compiled graph relies on "
                        "is no longer causal; recompile after changing it")
    return q


def eager_empty_rows(out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                     key_mask: Optional[Tensor] = None, *, attn_mask: Optional[Tensor] = None,
                     is_causal: bool = False, causal_offset=0, window: Optional[int] = None,
                     scale=None, score_grad: bool = True) -> Tensor:
    """``out`` with each row that sees no key replaced by what eager attention gives it under
    a finite fill (transformers' ``finfo.min``; ``masked_fill`` with such a value).

    An added fill: every score of such a row becomes the fill itself (``finfo.min + s``
    rounds to ``finfo.min`` in float32 and bfloat16), so the softmax is uniform over all
    ``Nk`` keys and the row is the mean of ``v``; its gradient still flows through ``s`` as
    autograd sees ``fill + s``. With ``C = K^T (V - mean V)`` the row is ``mean V + (t -
    t.detach()) / Nk`` for ``t = scale * q C``: that value, and to first order (all autograd
    takes) that softmax, at ``O(Nq * D * Dv)`` (``C`` is ``D x Dv`` per KV head). A
    ``masked_fill`` replaces the scores, so there (``score_grad=False``) ``q`` and ``k`` get
    no gradient from the row.

    The pass adds this after the op wherever a site's single mask has a finite fill: where it
    replaced the mask by structure (``key_mask``; a causal row always sees key 0, a window
    its diagonal), and where the mask stays explicit (``attn_mask``). Left-padded rows are
    the empty ones, and transformers' causal LM loss reads the last of them (it predicts the
    first real token).

    Args:
        out: ``[B, Hq, Nq, Dv]``, the op's output (zeros on empty rows).
        q, k, v: the op's inputs ``[B, Hq, Nq, D]``, ``[B, Hkv, Nk, D]``, ``[B, Hkv, Nk, Dv]``
            (``Hq`` a multiple of ``Hkv``).
        key_mask: bool or integer ``[B, Nk]`` (nonzero = may be attended), with the
            structure below; or None with ``attn_mask``.
        attn_mask: the site's explicit mask instead, broadcastable to ``[B, Hq, Nq, Nk]``:
            bool (True = attend; a ``masked_fill`` with a finite fill) or float (added, as
            written before any scale; an entry at or below ``finfo.min / 2`` is masked). A
            float row whose entries are all masked and equal is the mean of v. One whose
            entries differ (``-inf`` beside ``finfo.min``, or two fills) keeps the op's
            zeros: eager averages v over its largest entries, an ``Nq x Nk x Dv`` product
            this correction does not pay for every call (NaN there would spread to the
            whole batch through the next layer's padded keys). A row of ``-inf`` alone
            keeps the op's zeros too (SDPA's fused kernels give zeros).
        is_causal, causal_offset, window: the structure the op was given with ``key_mask``
            (query ``i`` sees keys ``i + causal_offset - window < j <= i + causal_offset``).
        scale: the softmax scale; None for ``1 / sqrt(D)``.
        score_grad: False for a replaced score (``masked_fill``): no gradient to ``q``, ``k``.

    Returns:
        A tensor like ``out``: eager's value in float32, and in bfloat16 up to eager's
        rounding of ``1 / Nk``. Not float16 with an added fill: there ``finfo.min + s`` keeps
        ``s / 32``, so eager's row follows its largest scores (or is NaN), and the pass leaves
        such rows to the op. The gradients are those of the explicit ops (transformers' eager
        attention, SDPA's math backend); SDPA's fused kernels give such rows ``Nk`` times
        larger ones (their saved logsumexp loses the ``log Nk``).

    Raises:
        ValueError: neither or both of ``key_mask`` and ``attn_mask``.
    """
    if (key_mask is None) == (attn_mask is None):
        raise ValueError("eager_empty_rows: pass exactly one of key_mask and attn_mask")
    B, Hq, Nq, _ = out.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if attn_mask is not None:
        m = attn_mask
        if m.dtype == torch.bool:
            empty = ~m.any(-1, keepdim=True)
        else:  # every entry the same finite fill: the max is that fill and at most min / 2
            top, low = m.amax(-1, keepdim=True), m.amin(-1, keepdim=True)
            empty = (top <= torch.finfo(m.dtype).min / 2) & (top == low) & (low > float("-inf"))
        empty = empty.expand(B, Hq, Nq, 1)
    else:
        seen = torch.nn.functional.pad((key_mask != 0).to(torch.int32).cumsum(-1), (1, 0))
        if is_causal:
            pos = torch.arange(Nq, device=out.device) + causal_offset  # each row's last key
            hi = (pos + 1).clamp(max=Nk)
            lo = ((pos + 1 - window).clamp(min=0, max=Nk) if window is not None
                  else torch.zeros_like(hi))
            count = seen[:, hi] - seen[:, lo]  # [B, Nq]
        else:
            count = seen[:, -1:].expand(B, Nq)
        empty = (count == 0)[:, None, :, None]
    acc = torch.promote_types(v.dtype, torch.float32)
    mean = v.mean(2, keepdim=True, dtype=acc)  # [B, Hkv, 1, Dv]
    group = Hq // Hkv
    row = mean.repeat_interleave(group, 1)
    if score_grad and (q.requires_grad or k.requires_grad):  # training only
        # v only through the mean (p does not depend on it): detached here
        c = k.to(acc).transpose(-1, -2) @ (v.to(acc) - mean).detach()  # [B, Hkv, D, Dv]
        t = (q.to(acc) @ c.repeat_interleave(group, 1)) * (
            q.shape[-1] ** -0.5 if scale is None else scale)
        row = row + (t - t.detach()) / Nk
    return torch.where(empty, row.to(out.dtype), out)


def holds_causal_mask(buffer: Tensor) -> Tensor:
    """Whether ``buffer [..., T, T]`` (float or bool) is 1 (True) exactly where ``j <= i`` of
    its last two dims and 0 elsewhere: a bool 0-d tensor, computed on the buffer's device
    without a host sync. The pass's compile-time test and :func:`check_causal_buffer`'s
    per-call check."""
    i = torch.arange(buffer.shape[-1], device=buffer.device)
    causal = i[None, :] <= i[:, None]
    return (((buffer != 0) == causal) & ((buffer == 0) | (buffer == 1))).all()


def select_blocks(
    q: Tensor, k: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
    scale: Optional[float] = None, enable_gqa: bool = False, *, config: Optional[PisaConfig] = None,
    key_mask: Optional[Tensor] = None, causal_offset: int = 0,
    query_mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The leaf blocks each query tile attends (forced blocks included); PISA selection.

    Args: as :func:`pisa_attention` (``q`` ``[B, Hq, Nq, D]``, ``k`` ``[B, Hkv, Nk, D]``,
        ``key_mask`` ``[B, Nk]``, ``causal_offset``, ``query_mask`` ``[B, Nq]``).
        ``min_seq_len`` is ignored here: the selection is always computed.

    Returns:
        ``block_indices``: int32 ``[B, Hkv, n_tiles, max_blocks]``, ascending leaf indices
        (leaf ``b`` holds keys ``[b*block_size, (b+1)*block_size)``), padded with -1.
        ``block_counts``: int32 ``[B, Hkv, n_tiles]``, the valid entries per tile.
        Tile ``t`` covers queries ``[t*query_tile, (t+1)*query_tile)``.

    Raises:
        TypeError, ValueError: a bad argument; the message names it and what was expected.
        ValueError: on the Triton selection, a ``top_k``, ``beam`` or ``shortlist`` that
            makes a tile rank more than 1024 leaves at once (only past 1024 leaves).
    """
    config = _config(config).replace(min_seq_len=0)
    _check_inputs(q, k, None, attn_mask, is_causal, enable_gqa, config, v_optional=True)
    key_mask = _check_structure(q, k, attn_mask, key_mask, is_causal, causal_offset)
    scale = _check_scale(scale, q)
    query_mask = _check_query_mask(q, attn_mask, query_mask)
    how = dispatch.plan(q, k, k, _mask4(attn_mask), is_causal, kernel=config.kernel,
                        local_blocks=config.local_blocks,
                        bound_block=config.effective_bound_block, selection_only=True)
    if how.select is None:  # empty: nothing to select
        B, Hkv, Nq, Nk = q.shape[0], k.shape[1], q.shape[2], k.shape[2]
        M = block_width(Nk, config.block_size, config.top_k, config.sink_blocks,
                        config.local_blocks, config.query_tile)
        T = cdiv(Nq, config.query_tile)
        return (q.new_full((B, Hkv, T, M), -1, dtype=torch.int32),
                q.new_zeros((B, Hkv, T), dtype=torch.int32))
    return _select_blocks_op(_voting(q.detach(), query_mask), k.detach(), _mask4(attn_mask),
                             key_mask, is_causal, causal_offset, float(scale),
                             *config.selection_args(), how.select)


def _voting(q: Tensor, query_mask: Optional[Tensor]) -> Tensor:
    """``q`` as the selection reads it: the rows ``query_mask`` marks as padding NaN (a
    non-finite query votes for nothing, in the reference and the Triton selections). ``q``
    may be the first rows of the call (the dense tail cut off)."""
    if query_mask is None:
        return q
    return q.masked_fill(~query_mask[:, None, :q.shape[2], None], float("nan"))
