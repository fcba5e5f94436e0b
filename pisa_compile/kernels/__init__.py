"""PISA kernels: ``reference`` (PyTorch, any device, the oracle), the Triton kernels, and the
rules and helpers they share (``geometry``, ``runtime``, ``triton_util``); ``window`` runs
exact sliding-window attention through FlexAttention (a library, not a PISA kernel).

The op layer (``pisa_compile.ops``) runs them through :mod:`.dispatch`; ``metrics`` and
``profiling`` read ``reference``, ``geometry`` and ``runtime`` directly. Nothing here imports
from the layers above.
"""
