"""Runtime helpers shared by every kernel: environment checks, launches, profiler ranges.

A leaf module: it imports nothing else from ``pisa_compile`` (and not Triton, which may be
absent), so the reference and the Triton kernels can both depend on it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch
from torch import Tensor

__all__ = ["STAGES", "NESTED_IN", "MAX_HEAD_DIM", "DECODE_MAX_QUERIES", "triton_available",
           "triton_interpreting", "triton_targets_gpu", "launcher", "stage_range",
           "multiprocessors"]

# Profiler ranges, one per PISA stage (pisa_compile.profile tabulates them by these names).
STAGES = ("pisa.pyramid", "pisa.select", "pisa.attention_fwd", "pisa.attention_bwd", "pisa.decode")
# Stages whose range always sits inside another's: the pyramid is built by the selection.
NESTED_IN = {"pisa.pyramid": "pisa.select"}
# Largest head dim (D and Dv) the Triton kernels take.
MAX_HEAD_DIM = 256
# Up to this many queries attend through the split-K decode kernel (flash-decoding style).
DECODE_MAX_QUERIES = 16


# Environment facts, constant for a process: Dynamo evaluates them once while tracing instead
# of tracing into importlib or the CUDA runtime (torch 2.11 breaks the graph on `find_spec`).
@torch.compiler.assume_constant_result
def triton_available() -> bool:
    """Whether Triton can be imported."""
    return importlib.util.find_spec("triton") is not None


@torch.compiler.assume_constant_result
def triton_interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@torch.compiler.assume_constant_result
def triton_targets_gpu(index: int) -> bool:
    """Whether the kernels support CUDA device ``index`` (compute capability >= 8.0)."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


@torch.compiler.assume_constant_result
def flash_sdp_enabled() -> bool:
    """``torch.backends.cuda.flash_sdp_enabled()``, read once per trace (Dynamo cannot trace
    the call): a graph compiled before ``enable_flash_sdp(False)`` or inside another
    ``sdpa_kernel`` keeps calling FlashAttention for the dense tail."""
    return torch.backends.cuda.flash_sdp_enabled()


def tracing(t: Tensor) -> bool:
    """Whether ``t`` belongs to a graph being traced (Dynamo, or AOTAutograd's fake and
    functional tensors under a backend's ``compile_fx``)."""
    # Profiler ranges cannot be traced into a graph, and traced launches need wrap_triton.
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return isinstance(t, (FakeTensor, FunctionalTensor)) or torch.compiler.is_compiling()


def launcher(kernel, t: Tensor):
    """``kernel`` itself for a call on real tensors, ``wrap_triton(kernel)`` while a graph is
    traced or a dispatch mode is active. Eager ``wrap_triton`` goes through a higher-order op
    and pytree flattening: hundreds of microseconds of host time per launch on the H200
    (``benchmarks/overhead_probe.py --cprofile``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    if tracing(t) or _get_current_dispatch_mode() is not None:
        return torch.library.wrap_triton(kernel)
    return kernel


def stage_range(name: str, t: Tensor):
    """A profiler range for one PISA stage (a no-op while a graph is being traced)."""
    return contextlib.nullcontext() if tracing(t) else torch.profiler.record_function(name)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (the size of a persistent grid); 1
    elsewhere (Triton's interpreter: a persistent kernel's loop is then exercised in full).
    Keyed by the device index (``cuda`` alone: the current device)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _multiprocessors(device)
