"""Constants and small helpers shared by the Triton kernels (``@triton.jit`` code may read
module globals only when they are ``tl.constexpr``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["LOG2E", "LN2", "pow2"]

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): natural-log scores to base 2, for exp2
LN2 = tl.constexpr(0.6931471805599453)    # ln(2): a base-2 lse back to natural log


def pow2(x: int, lo: int = 16) -> int:
    """The next power of two >= ``x``, at least ``lo`` (``tl.dot`` needs 16)."""
    return max(lo, triton.next_power_of_2(int(x)))
