"""pisa_compile: ``torch.compile(model, backend="pisa")`` rewrites dense attention into PISA.

Public API: :class:`PisaConfig`, :func:`pisa_attention`, :func:`select_blocks`, :func:`plan`,
:func:`explain`, :func:`profile`, :class:`PisaKVCache` (decode over a persistent pyramid),
:mod:`metrics`.
"""

from .config import PRESETS, PisaConfig
from .ops import pisa_attention, plan, select_blocks
from .lowering import explain
from .kv_cache import PisaKVCache
from .profiling import profile
from . import metrics
from ._version import __version__

__all__ = ["PisaConfig", "PRESETS", "pisa_attention", "select_blocks", "plan", "explain", "profile",
           "PisaKVCache", "metrics"]
