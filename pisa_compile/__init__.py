"""pisa_compile: ``torch.compile(model, backend="pisa")`` rewrites dense attention into PISA.

Public API: :class:`PisaConfig`, :func:`pisa_attention`, :func:`select_blocks`, :func:`explain`,
:func:`profile`.
"""

from .config import PisaConfig
from .ops import pisa_attention, select_blocks
from .lowering import explain
from .profiling import profile
from . import metrics

__all__ = ["PisaConfig", "pisa_attention", "select_blocks", "explain", "profile", "metrics"]
__version__ = "0.1.0"
