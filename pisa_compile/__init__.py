"""pisa_compile: ``torch.compile(model, backend="pisa")`` rewrites dense attention into PISA.

Public API: :class:`PisaConfig`, :func:`pisa_attention`, :func:`select_blocks`, :func:`plan`,
:func:`explain`, :func:`profile`, :mod:`metrics`.
"""

from .config import PRESETS, PisaConfig
from .ops import pisa_attention, plan, select_blocks
from .lowering import explain
from .profiling import profile
from . import metrics
from ._version import __version__

__all__ = ["PisaConfig", "PRESETS", "pisa_attention", "select_blocks", "plan", "explain", "profile",
           "metrics"]
