"""``pisa_compile.explain``: the rewrite report of a model, without compiling it."""

from __future__ import annotations

import torch

from ..config import split_options
from .report import Report, record
from .rewrite import guard_inductor, rewrite_graph

__all__ = ["explain"]


def explain(model_or_fn, *args, options=None, **kwargs) -> Report:
    """Report every attention site of ``model_or_fn(*args, **kwargs)`` without compiling it.

    Dynamo captures the graphs as ``torch.compile(model, backend="pisa")`` would; the rewrite
    pass analyses each one (nothing is rewritten) and the graphs run eagerly.

    Args:
        model_or_fn: an ``nn.Module`` or a function.
        *args, **kwargs: example inputs; the model is called once on them.
        options: the ``torch.compile(options=...)`` the backend would get (validated the same
            way; PisaConfig keys shape the decisions and notes: an SDPA site below
            ``min_seq_len`` keys is left dense, a hand-written one rewritten with a note
            that it runs plain SDPA there).

    Returns:
        A :class:`Report`: ``str(report)`` is a table of sites (form, shapes, mask kind,
        decision, reason or note); ``report.sites``; ``len(report)``. A rewritten site that
        selects blocks also says how at its key length (``Site.selection``, from
        ``PisaConfig.selection_kind``): e.g. ``"selection: flat scan (512 leaves <= flat_leaves
        512)"`` or ``"selection: pyramid walk (2048 leaves, 6 levels; flat_leaves 512)"`` (for
        a symbolic length, up to which length it scans). ``report.graph_breaks`` lists
        Dynamo's graph-break reasons met on the way, which ``str(report)`` prints under its
        head line: attention in a frame Dynamo skipped (e.g. transformers' gradient
        checkpointing, docs/limits.md) is in no graph and so not in the table.

    Raises:
        ValueError: bad ``options`` (see :func:`pisa_compile.config.split_options`).

    Note: Dynamo's caches are reset before and after (``torch._dynamo.reset()``), so the
    report is fresh and nothing stays compiled; the model itself is not modified.
    """
    config, patches = split_options(options)
    report = Report()

    def analyse(gm, example_inputs):
        index = report.graphs
        report.graphs += 1
        with torch._inductor.config.patch(patches):  # as the backend runs the pass
            sites = rewrite_graph(gm, config, apply=False)
        guard_inductor(gm, sites, dict(patches))  # the reasons, as the backend's
        for s in sites:
            s.graph = index
        record(sites, count=False)
        report.sites.extend(sites)
        return gm.forward

    from torch._dynamo.utils import counters
    before = {key: dict(counters[key]) for key in ("graph_break", "unimplemented")}
    torch._dynamo.reset()
    try:
        torch.compile(model_or_fn, backend=analyse)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    # Sites in a frame Dynamo skipped never reach the pass: the breaks say why there are none.
    new = {key: {r: n - before[key].get(r, 0) for r, n in counters[key].items()
                 if n > before[key].get(r, 0)} for key in before}
    report.graph_breaks = list(new["graph_break"].items()) + [
        (r, n) for r, n in new["unimplemented"].items()
        if r not in new["graph_break"] and "frame skipped" in str(r)]
    return report

