"""For test modules that run Triton kernels on the CPU: Triton's interpreter must be chosen
before the first ``@triton.jit`` function is made, so each such module calls
:func:`use_interpreter` ahead of its torch and triton imports (``conftest.py`` sets the
variable too, but a module run on its own, or after another that imported triton, must not
silently compile for a GPU it does not have)."""

from __future__ import annotations

import os
import sys

import pytest


def use_interpreter(*, unless_cuda: bool = False) -> None:
    """Set ``TRITON_INTERPRET=1``, or skip the calling module when triton was already
    imported without it. ``unless_cuda``: on a CUDA machine, leave the kernels compiled."""
    if unless_cuda:
        import torch
        if torch.cuda.is_available():
            return
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without TRITON_INTERPRET=1; run this module on its "
                    "own", allow_module_level=True)
    os.environ.setdefault("TRITON_INTERPRET", "1")
