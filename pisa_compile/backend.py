"""The ``pisa`` torch.compile backend: rewrite dense attention into PISA, then Inductor.

``torch.compile(model, backend="pisa")`` finds :func:`pisa_backend` through the
``torch_dynamo_backends`` entry point in ``pyproject.toml``. It is a plain function on
purpose: decorating it with ``register_backend`` as well makes torch >= 2.5 fail with
"duplicate name" on first lookup (DESIGN.md, "Rewrite rules").
"""

from __future__ import annotations

import functools
import hashlib
import logging
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from .config import split_options

__all__ = ["pisa_backend"]

log = logging.getLogger("pisa_compile")

# The inserted call_function target, as AOTAutograd's cache names it.
_OP_QUALNAME = "pisa_compile.ops.pisa_attention"
_CHECK_QUALNAME = "pisa_compile.ops.check_causal_buffer"
_warned_pass_failure = False


@functools.lru_cache(maxsize=None)
def _source_fingerprint() -> str:
    """Hash of the package sources behind the inserted op: a code change misses the caches."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted([root / "ops.py", root / "config.py", *sorted((root / "kernels").glob("*.py"))]):
        try:
            h.update(p.read_bytes())
        except OSError:
            pass
    from ._version import __version__
    return f"{__version__}+{h.hexdigest()[:16]}"


def _warn_pass_failure(err: BaseException) -> None:
    global _warned_pass_failure
    log.warning("pisa rewrite pass failed; compiling the graph unchanged", exc_info=err)
    if _warned_pass_failure:
        return
    _warned_pass_failure = True
    warnings.warn(
        f"pisa_compile: the attention rewrite pass failed ({type(err).__name__}: {err}); "
        "the graph is compiled unchanged by Inductor (dense attention). Please report this "
        "as a bug with the model that triggers it.", RuntimeWarning, stacklevel=2)


def pisa_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 options: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None,
                 **kwargs: Any):
    """The ``pisa`` backend: rewrite attention sites of a Dynamo graph, compile with Inductor.

    Args:
        gm: the FX graph Dynamo captured (torch IR, before autograd).
        example_inputs: its example inputs (fake tensors / SymInts), as Dynamo passes them.
        options: ``torch.compile(options=...)``: PisaConfig keys and Inductor config keys.
        mode: ``torch.compile(mode=...)``, mapped as Inductor maps it.

    Returns:
        The compiled callable from ``torch._inductor.compile_fx.compile_fx``.

    Raises:
        ValueError: bad ``options``/``mode`` (see :func:`pisa_compile.config.split_options`).
        TypeError: an unexpected keyword argument.

    A failure inside the rewrite pass never fails the model: it warns once and compiles the
    original graph. Each attention site is counted in
    ``torch._dynamo.utils.counters["pisa"]`` and logged on the ``pisa_compile`` logger.
    """
    if kwargs:
        raise TypeError(f"pisa_backend got unexpected keyword arguments {sorted(kwargs)}; "
                        "it takes options= and mode=")
    from torch._inductor.compile_fx import compile_fx
    from .lowering import rewrite_graph, record
    from .lowering.rewrite import copy_graph, guard_inductor

    config, patches = split_options(options, mode)
    original, children = gm.graph, dict(gm.named_children())
    try:
        # Rewrite a copy (nodes and per-node meta copied), so a failure midway leaves the
        # original graph intact to fall back on (checkpoint bodies are replaced by rewritten
        # copies, restored below too).
        gm.graph = copy_graph(original)
        # Under the Inductor options the graph will compile with: whether device-side
        # asserts survive decides if a buffer mask may be checked per call (lowering).
        with torch._inductor.config.patch(patches):
            sites = rewrite_graph(gm, config)
    except Exception as err:  # never fail a user's model because of the pass
        gm.graph = original
        for name, child in children.items():
            setattr(gm, name, child)
        gm.recompile()
        _warn_pass_failure(err)
        sites = []
    guard_inductor(gm, sites, patches)
    if any(s.rewritten for s in sites):
        # AOTAutograd's cache allows only known call_function targets; mark ours cacheable,
        # keyed by a fingerprint of the sources behind it, so the caches are not bypassed.
        marked = dict(torch._inductor.config.unsafe_marked_cacheable_functions)
        marked.update(patches.get("unsafe_marked_cacheable_functions") or {})
        marked[_OP_QUALNAME] = marked[_CHECK_QUALNAME] = _source_fingerprint()
        patches["unsafe_marked_cacheable_functions"] = marked
    compiled = compile_fx(gm, example_inputs, config_patches=patches or None)
    # Counted once the graph compiled: Dynamo drops a graph whose compile raised (it may
    # retrace, e.g. with a symbolic float made constant) and compiles another.
    record(sites)
    return compiled
