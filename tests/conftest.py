"""Shared test set-up.

Without CUDA, Triton kernels can only run in Triton's interpreter; the variable must be set
before any ``@triton.jit`` function is created, so it is set here, ahead of every import.
"""

import os

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True, print_blob=True)
settings.load_profile("ci")


@pytest.fixture
def fresh_dynamo():
    """A clean Dynamo cache and clean counters around a compile test."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
