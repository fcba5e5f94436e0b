"""The one decision point: which implementation runs each PISA stage, and the routing to it.

:func:`plan` looks at a call (device, dtype, head dims, mask, lengths, the ``kernel`` option)
and returns a :class:`Plan`: plain SDPA, or which implementation selects the blocks and which
attends, with the reason whenever the fused Triton path is not taken (a fallback on CUDA warns
once). The stage functions below run what a plan names, each inside a ``torch.profiler``
range of :data:`~pisa_compile.kernels.runtime.STAGES` (in eager execution; a compiled graph
shows the Triton kernels by name instead).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import reference
from .runtime import (DECODE_MAX_QUERIES, MAX_HEAD_DIM, stage_range, tracing,
                      triton_available, triton_interpreting, triton_targets_gpu)

__all__ = ["Plan", "plan", "select_blocks", "attention_forward", "attention_backward",
           "triton_refusal"]

KERNELS = ("auto", "triton", "reference")
SDPA, TRITON, DECODE, REFERENCE = "sdpa", "triton", "triton-decode", "reference"
WINDOW = "flex-window"
TRITON_WINDOW = "triton-window"
RUNTIME_MASK = "runtime-mask"


class Plan(NamedTuple):
    """Which implementation runs each stage of one call (a NamedTuple: Dynamo traces it).

    Attributes:
        select: ``"triton"`` or ``"reference"`` (``None`` when ``attention`` is ``"sdpa"``).
        attention: ``"sdpa"`` (plain dense SDPA: the exact regime by shape, a call within the
            dense tail (under a ``key_mask``, ``pisa_attention`` runs one query on CUDA through
            SDPA with ``enable_gqa``, and more rows with no gradient wanted, on the Triton path,
            through the split-K kernel over every key block), or on
            CUDA an explicit mask the fused selection cannot read), ``"triton"``,
            ``"triton-decode"`` (split-K over the blocks, for a few queries),
            ``"flex-window"`` (a sliding window: exact windowed attention through
            FlexAttention, no selection, :mod:`.window`), ``"triton-window"`` (the same
            through the Triton attention kernels over the window's leaf blocks: a window
            with a key mask, or ``kernel="triton"``), ``"runtime-mask"`` (an explicit mask
            whose structure is read at run time: causal AND padding runs the structured
            path, any other mask dense SDPA; ``ops.mask_structure``) or ``"reference"``.
        reason: why a stage does not run the fused Triton path; empty when everything does.
    """

    select: Optional[str]
    attention: str
    reason: str = ""


_warned: set[str] = set()
# FlexAttention traced into a graph with a per-batch key mask gave wrong rows on the H200
# (left padding inside the windows); such calls run PISA's Triton window path (dense SDPA
# where Triton refuses them) until that is fixed upstream. True hands them to FlexAttention
# again (experiments/window_probe.py shows the bug).
TRACED_FLEX_WITH_KEY_MASK = False
# The reason of a call with an explicit mask the pass could not prove (ops reads its
# structure at run time where it can: ``ops.mask_structure``).
EXPLICIT_MASK = "explicit attn_mask (the fused selection reads no mask yet)"
# The reason of a call the dense tail takes whole (too few queries for a query tile of sparse
# rows before the tail).
IN_DENSE_TAIL = "every query in the dense tail"
# The reason of a decode step (at most DECODE_MAX_QUERIES queries, fewer than the keys) that
# no persistent pyramid serves: a selection rebuilt per call reads every key, as dense does,
# and measured slower than dense (issue #16: never slower than dense without the pyramid).
DECODE_STEP = "a decode step (few queries, fewer than the keys; no persistent pyramid)"


def _count(name: str, n: int = 1) -> None:
    """``torch._dynamo.utils.counters["pisa"][name] += n``, except while Dynamo traces a
    direct call of the op (it would guard on the counter and recompile at every call). The
    backend's rewrite plans under ``compile_fx``, where it counts once per trace."""
    if not torch.compiler.is_dynamo_compiling():
        from torch._dynamo.utils import counters
        counters["pisa"][name] += n


def _count_reference(q: Tensor, how: Plan) -> Plan:
    """Count a plan that runs a reference stage on CUDA in
    ``torch._dynamo.utils.counters["pisa"]["reference_select" | "reference_attention"]`` (at
    trace time under torch.compile): tests assert that the calls users make never do."""
    if q.device.type == "cuda":
        for stage in ("select", "attention"):
            if getattr(how, stage) == REFERENCE:
                _count(f"reference_{stage}")
    return how


def _warn_once(reason: str,
               instead: str = "the PyTorch reference runs instead (exact, slower)") -> None:
    # Dynamo cannot trace warnings.warn; a plan made while it traces user code is reported by
    # the rewrite's notes (explain) instead.
    if torch.compiler.is_dynamo_compiling():
        return
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"pisa_compile: {reason}; {instead}", stacklevel=4)


def triton_refusal(q: Tensor, v: Tensor, kernel: str) -> Optional[str]:
    """Why the Triton kernels cannot take these inputs (``None``: they can)."""
    if kernel == "reference":
        return "kernel='reference'"
    if q.device.type != "cuda" and kernel == "auto":
        return f"{q.device.type} tensors (the Triton kernels run on CUDA)"
    if not triton_available():
        return "Triton is not installed"
    if q.device.type != "cuda":
        if not triton_interpreting():
            return ("kernel='triton' on a CPU tensor needs TRITON_INTERPRET=1 set before Triton "
                    "is imported")
        if q.dtype not in (torch.float16, torch.float32):
            return f"Triton's interpreter is unreliable for {q.dtype}"
        return None
    if q.dtype not in (torch.float16, torch.bfloat16) and not (
            kernel == "triton" and q.dtype == torch.float32):
        return f"{q.dtype} inputs (the Triton kernels take float16/bfloat16)"
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v.shape[-1])} > {MAX_HEAD_DIM}"
    if not triton_targets_gpu(q.device.index or 0):
        return "a GPU older than compute capability 8.0"
    return None


def _flex_refusal(q: Tensor, k: Tensor, v: Tensor, kernel: str) -> Optional[str]:
    """Why FlexAttention (the sliding-window path) cannot take these inputs, or None."""
    if kernel == "reference":
        return "kernel='reference'"
    # Its CPU path has no backward and does not lower these block masks under Inductor.
    if q.device.type != "cuda":
        return f"{q.device.type} tensors"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{q.dtype} inputs"
    if not triton_available():
        return "Triton is not installed"
    D = max(q.shape[-1], v.shape[-1])
    if D < 16 or D > 256:
        return f"head dim {D} (FlexAttention compiles 16..256)"
    G = q.shape[1] // max(k.shape[1], 1)
    if G & (G - 1):  # its decoding kernel packs a GQA group into a power-of-two tile
        return f"{G} query heads per KV head (not a power of two)"
    return None


def unstructured_mask_runs_dense(device: torch.device, kernel: str) -> bool:
    """Whether an explicit mask that is not causal AND padding runs dense SDPA under it
    (exact, at dense speed) rather than the reference selection: on CUDA with
    ``kernel="auto"``, where the fused selection reads no such mask and the reference
    selection would be many times slower than dense. The plan, the run-time mask read
    (``ops._mask_checked_at_run_time``) and the report's note all follow this rule."""
    return device.type == "cuda" and kernel == "auto"


def plan(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, *,
         kernel: str = "auto", min_seq_len: int = 0, local_blocks: int = 1,
         bound_block: int = 0, window: Optional[int] = None,
         dense_rows: "int | torch.SymInt" = 0,
         key_padding: bool = False, selection_only: bool = False,
         mask_at_run_time: bool = False, decode: bool = False) -> Plan:
    """Decide which implementation runs selection and attention for one call.

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]``.
        attn_mask: the (4-D) mask or None; is_causal: SDPA's flag.
        kernel: ``"auto"`` (Triton on CUDA, the reference elsewhere), ``"triton"`` (also the
            interpreter on CPU, for tests) or ``"reference"``.
        min_seq_len: below this many keys the call is plain SDPA (DESIGN.md "Exact regime").
        local_blocks: the PISA option; a causal selection with none needs the reference.
        bound_block: the PISA option (0 for None); both selections take it (kept so the
            call sites need not change).
        window: a causal sliding window's width (keys per query), or None. From
            ``min_seq_len`` keys on, such a call is exact windowed attention: ``O(N * window)``
            already, and a query sees fewer keys than the sparse path starts at.
        key_padding: the call has a ``key_mask``. With a window, traced (under
            ``torch.compile``), it plans the Triton window path: FlexAttention traced into the
            graph with a per-batch key mask gave wrong rows on the H200 (left padding reaching
            into the windows), where its eager calls were right (and they run FlexAttention).
            Where Triton cannot run either, dense SDPA under the window's mask.
        dense_rows: how many of the last query rows attend densely (the ``dense_tail``
            option, as ``ops._tail_rows`` counts it): when that is every row (a decode
            step) the call is plain SDPA, which reads every key once, as a selection over
            the cache would (no pyramid is kept between calls yet); the stages are chosen
            for the other rows.
        decode: a decode step (at most ``DECODE_MAX_QUERIES`` queries, fewer than the
            keys): plain SDPA whatever ``dense_rows``, as :data:`DECODE_STEP` says why
            (``ops`` hands it to a persistent pyramid where one holds the keys).
        mask_at_run_time: the op can read an explicit mask's structure at run time (see
            ``ops._mask_checked_at_run_time``): such a call plans ``"runtime-mask"``.
        selection_only: the plan of ``select_blocks`` (a selection is wanted whatever the
            attention would run). Otherwise an explicit ``attn_mask`` on CUDA with
            ``kernel="auto"`` plans dense SDPA under the mask: exact, at dense speed, where
            the reference selection (the only one that reads an arbitrary mask) would be
            many times slower than dense.

    Returns:
        A :class:`Plan`. Falling back to the reference or to dense SDPA on CUDA warns once
        per reason.

    Raises:
        ValueError: an unknown ``kernel``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    n_keys = k.shape[2]
    if n_keys < min_seq_len:
        return Plan(None, SDPA, f"Nk={n_keys} < min_seq_len={min_seq_len}")
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return Plan(None, SDPA, "empty input")
    if window is not None:
        why = _flex_refusal(q, k, v, kernel)
        # tracing(): Dynamo's trace, and the backend's (fake tensors under compile_fx,
        # where torch <= 2.11's is_compiling() is False).
        if why is None and key_padding and tracing(q) and not TRACED_FLEX_WITH_KEY_MASK:
            why = "a key mask under torch.compile (traced FlexAttention gave wrong rows with " \
                  "padding; DESIGN.md)"
        # PISA's kernels where FlexAttention cannot run it (eager FlexAttention is right with
        # a key mask, and faster: profiles/bench_window.json), or where asked for.
        refusal = triton_refusal(q, v, kernel)
        if (why is not None or kernel == "triton") and refusal is None:
            _count("triton_window")  # tests: the window path really ran
            return Plan(None, TRITON_WINDOW, f"sliding window({window}): exact windowed "
                        "attention (Triton), no selection" + (f"; not FlexAttention: {why}"
                                                              if why else ""))
        instead = "dense SDPA under the window's mask" if why else "FlexAttention"
        if kernel == "triton":  # asked for and refused: say so (a new user's report read
            _warn_once(refusal, f"the window runs {instead} instead")  # "Triton" here)
        not_triton = f"; not Triton: {refusal}" if refusal and (why or kernel == "triton") else ""
        if why is not None:
            if q.device.type == "cuda":  # per plan (one per trace); GPU tests assert 0
                _count("window_sdpa")
            return Plan(None, SDPA, f"sliding window({window}): dense SDPA with the window's "
                                    f"mask (not FlexAttention: {why}{not_triton})")
        _count("flex_window")  # tests: the window path really ran
        return Plan(None, WINDOW, f"sliding window({window}): exact windowed attention "
                                  f"(FlexAttention), no selection{not_triton}")
    if decode and not selection_only:
        return Plan(None, SDPA, DECODE_STEP)
    n_sparse = q.shape[2] - dense_rows
    if n_sparse <= 0 and not selection_only:
        # No number in the text: formatting a symbolic Nq would guard on its value.
        return Plan(None, SDPA, IN_DENSE_TAIL)
    if attn_mask is not None and mask_at_run_time and not selection_only:
        return Plan(None, RUNTIME_MASK, f"{EXPLICIT_MASK}: its structure is read at run time "
                                        "(causal AND padding: PISA; else dense SDPA on CUDA "
                                        "with kernel='auto', the reference selection "
                                        "elsewhere)")
    if attn_mask is not None and unstructured_mask_runs_dense(q.device, kernel) and (
            not selection_only):
        # Before the Triton checks: SDPA takes every dtype and head dim the reference would.
        why = EXPLICIT_MASK
        _warn_once(why, "dense SDPA runs under the mask instead (exact, dense speed)")
        return Plan(None, SDPA, f"{why}: dense SDPA under the mask")
    why = triton_refusal(q, v, kernel)
    if why is not None:
        if kernel == "triton" or (kernel == "auto" and q.device.type == "cuda"):
            _warn_once(why)  # not what was asked for: say so
        return _count_reference(q, Plan(REFERENCE, REFERENCE, why))
    attention = attention_impl(n_sparse)
    if attn_mask is not None:
        why = EXPLICIT_MASK
    elif q.dtype == torch.float64:
        why = "float64 inputs"
    elif is_causal and local_blocks == 0:
        why = "causal with local_blocks=0 (PARTIAL candidates need masked exact scores)"
    else:
        return Plan(TRITON, attention)
    if q.device.type == "cuda":
        _warn_once(f"selection: {why}")
    return _count_reference(q, Plan(REFERENCE, attention, f"selection: {why}"))


def attention_impl(n_rows) -> str:
    """The Triton attention kernel for ``n_rows`` query rows: the split-K decode kernel for
    at most ``DECODE_MAX_QUERIES``, else the forward kernel."""
    return DECODE if n_rows <= DECODE_MAX_QUERIES else TRITON


def _window_needs_triton(impl: str, window: int) -> None:
    if window and impl not in (TRITON, DECODE):
        raise ValueError(f"a window ({window}) runs on the Triton attention kernels only, got "
                         f"impl={impl!r}")


def select_blocks(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                  scale: float, impl: str, **options) -> tuple[Tensor, Tensor]:
    """``(block_indices, block_counts)`` by ``impl`` (a :class:`Plan`'s ``select``); the
    pyramid is built inside the selection, so one range covers both. ``options``: the
    selection options (``block_size`` ... ``leaf_scoring``) as plain values, and the
    structured mask (``key_mask``, ``causal_offset``)."""
    with stage_range("pisa.select", q):
        if impl == TRITON:
            from . import triton_select
            return triton_select.select_blocks(q, k, is_causal, scale, **options)
        return reference.select_blocks(q, k, attn_mask, is_causal, scale, **options)


def attention_forward(q, k, v, attn_mask, is_causal, scale, block_indices, block_counts,
                      impl: str, *, block_size: int, query_tile: int,
                      key_mask: Optional[Tensor] = None,
                      causal_offset: int = 0, window: int = 0) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of block-sparse attention by ``impl`` (a :class:`Plan`'s ``attention``);
    ``window`` > 0: a causal sliding window on top of the block lists (Triton only)."""
    args = (q, k, v, attn_mask, is_causal, scale, block_indices, block_counts)
    shape = dict(block_size=block_size, query_tile=query_tile, key_mask=key_mask,
                 causal_offset=causal_offset)
    _window_needs_triton(impl, window)
    if window:
        shape["window"] = window
    if impl == DECODE:
        from .triton_decode import decode_attention
        with stage_range("pisa.decode", q):
            return decode_attention(*args, **shape)
    with stage_range("pisa.attention_fwd", q):
        if impl == TRITON:
            from .triton_attention import sparse_attention
            return sparse_attention(*args, **shape)
        return reference.sparse_attention(*args, **shape)


def attention_backward(grad_out, q, k, v, attn_mask, out, lse, block_indices, block_counts,
                       is_causal, scale, impl: str, *, block_size: int, query_tile: int,
                       key_mask: Optional[Tensor] = None, causal_offset: int = 0,
                       window: int = 0):
    """``(dq, dk, dv)`` of :func:`attention_forward` with the selection held fixed; both
    Triton forward kernels share one backward."""
    args = (grad_out, q, k, v, attn_mask, out, lse, block_indices, block_counts, is_causal,
            scale)
    shape = dict(block_size=block_size, query_tile=query_tile, key_mask=key_mask,
                 causal_offset=causal_offset)
    _window_needs_triton(impl, window)
    if window:
        shape["window"] = window
    with stage_range("pisa.attention_bwd", q):
        if impl in (TRITON, DECODE):
            from .triton_attention import sparse_attention_backward
            return sparse_attention_backward(*args, **shape)
        return reference.sparse_attention_backward(*args, **shape)
