"""PISA kernels: ``reference`` (PyTorch, any device, the oracle) and the Triton kernels.

Only ``pisa_compile.ops`` calls into this package, through :mod:`.dispatch`.
"""
