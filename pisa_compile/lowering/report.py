"""The rewrite report: one :class:`Site` per attention site, the :class:`Report` table, counters
and logging (DESIGN.md, "Rewrite rules": every site is reported)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator, Optional

from ..tables import format_table

__all__ = ["Site", "Report", "record", "REWRITTEN", "LEFT_DENSE", "log"]

log = logging.getLogger("pisa_compile")

REWRITTEN = "rewritten"
LEFT_DENSE = "left dense"


@dataclass
class Site:
    """One attention site of one captured graph.

    Attributes:
        form: what it matched: ``"sdpa"``, ``"matmul-softmax-matmul"``, ``"bmm-softmax-bmm"``,
            ``"einsum-softmax-einsum"``, with suffixes such as ``"+gqa(repeat_kv)"``.
        q_shape, k_shape, v_shape: shapes as strings, symbolic (``s0``) where dynamic; ``k`` and
            ``v`` as PISA sees them (un-repeated under GQA).
        mask: ``"none"``, ``"causal"`` (``is_causal``), ``"bool"`` or ``"float"``; ``"bool(tril/triu)"``
            when the mask is built in the graph from ``tril``/``triu`` (which says nothing of
            its direction: what the pass proved follows it, e.g. ``"->is_causal"``).
        decision: ``"rewritten"`` or ``"left dense"``.
        reason: why it was left dense (empty when rewritten).
        note: for a rewritten site, what will run where it is not the fused sparse path:
            plain SDPA below ``min_seq_len`` (hand-written and module sites; an SDPA site
            there is left dense); for an explicit mask, dense SDPA under it on
            CUDA, the PyTorch reference selection elsewhere (empty when nothing needs saying).
        selection: for a rewritten site that selects blocks, how at its key length
            (``PisaConfig.selection_kind``): ``"flat scan (...)"``, ``"single-level pool
            (...)"`` or ``"pyramid walk (...)"``; empty where the whole call runs dense.
        node: the FX node name of the site (the SDPA call or the softmax).
        source: ``file:line`` of the user code, where Dynamo recorded it.
        graph: index of the captured graph (graph breaks give several).
    """

    form: str
    q_shape: str = "?"
    k_shape: str = "?"
    v_shape: str = "?"
    mask: str = "none"
    decision: str = LEFT_DENSE
    reason: str = ""
    note: str = ""
    selection: str = ""
    node: str = ""
    source: str = ""
    graph: int = 0

    @property
    def rewritten(self) -> bool:
        return self.decision == REWRITTEN

    @property
    def explanation(self) -> str:
        """The reason a site was left dense, or the note and the selection of a rewritten one."""
        if self.reason:
            return self.reason
        return "; ".join(filter(None, (self.note, self.selection and
                                       f"selection: {self.selection}")))

    def line(self) -> str:
        why = f" ({self.explanation})" if self.explanation else ""
        return (f"pisa site {self.node} [{self.form}] q={self.q_shape} k={self.k_shape} "
                f"v={self.v_shape} mask={self.mask}: {self.decision}{why}"
                + (f" at {self.source}" if self.source else ""))


_COLUMNS = (("graph", "graph"), ("node", "node"), ("form", "form"), ("q", "q_shape"),
            ("k", "k_shape"), ("v", "v_shape"), ("mask", "mask"), ("decision", "decision"),
            ("reason or note", "explanation"), ("source", "source"))


@dataclass
class Report:
    """Every attention site found in a model, from :func:`pisa_compile.explain`.

    ``str(report)`` is an aligned table; ``report.sites`` is the list of :class:`Site`;
    ``len(report)`` counts sites; ``report.rewritten`` / ``report.left_dense`` filter them.
    ``report.graph_breaks``: Dynamo's graph-break reasons met while capturing, and the
    frames it skipped, with their counts (code past a break runs in another graph, or
    eagerly where Dynamo skipped the frame: attention there is in no graph, so it is neither
    rewritten nor reported).
    """

    sites: list[Site] = field(default_factory=list)
    graphs: int = 0
    graph_breaks: list[tuple[str, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sites)

    def __iter__(self) -> Iterator[Site]:
        return iter(self.sites)

    def __getitem__(self, i: int) -> Site:
        return self.sites[i]

    @property
    def rewritten(self) -> list[Site]:
        return [s for s in self.sites if s.rewritten]

    @property
    def left_dense(self) -> list[Site]:
        return [s for s in self.sites if not s.rewritten]

    def __str__(self) -> str:
        head = (f"pisa_compile report: {len(self.sites)} attention site(s) in {self.graphs} "
                f"graph(s): {len(self.rewritten)} rewritten, {len(self.left_dense)} left dense")
        if self.graph_breaks:
            head += (f"\n{sum(n for _, n in self.graph_breaks)} graph break(s) or skipped "
                     f"frame(s): code after a break runs in another graph; attention in a frame "
                     f"Dynamo skipped runs eagerly and is not listed (TORCH_LOGS=graph_breaks "
                     f"shows where)")
            head += "".join(f"\n  {n}x {_brief(reason)}" for reason, n in self.graph_breaks)
        if not self.sites:
            return head
        rows = [[str(getattr(s, attr)) or "-" for _, attr in _COLUMNS] for s in self.sites]
        return format_table([name for name, _ in _COLUMNS], rows, head).rstrip("\n")

    __repr__ = __str__


def _brief(reason: str, width: int = 300) -> str:
    """A graph-break reason in one line: its first line, the frame Dynamo skipped if it says
    so, and Dynamo's hint (cut to ``width``, keeping a setting or call it names in backticks
    whole)."""
    lines = [ln.strip() for ln in str(reason).splitlines() if ln.strip()]
    text = lines[0] if lines else str(reason)
    skipped = next((ln.split("frame skipped:", 1)[1].strip() for ln in lines
                    if "frame skipped:" in ln), "")
    if skipped:
        text += f"; frame skipped: {skipped}"
    hint = next((ln for ln in lines if ln.startswith("Hint:")), "")
    if hint:
        text += f". {hint}"
    if len(text) <= width:
        return text
    code = hint.split("`")[1] if hint.count("`") >= 2 else ""
    tail = f" ... `{code}`" if code else " ..."
    return text[:max(0, width - len(tail))] + tail


def record(sites: list[Site], count: bool = True) -> None:
    """Log each site on the ``pisa_compile`` logger and, with ``count``, bump
    ``torch._dynamo.utils.counters["pisa"]["rewritten" | "left_dense"]``."""
    from torch._dynamo.utils import counters

    for s in sites:
        if count:
            counters["pisa"]["rewritten" if s.rewritten else "left_dense"] += 1
        log.info("%s", s.line())


def register_torch_log() -> None:
    """Let ``torch._logging`` (``TORCH_LOGS``-style settings) know the ``pisa_compile`` logger.

    Best effort: the registry is private API, so a failure here is ignored.
    """
    try:
        from torch._logging._internal import register_log
        register_log("pisa_compile", "pisa_compile")
    except Exception:  # pragma: no cover - private API moved
        pass


def fmt_shape(v) -> str:
    shape = getattr(v, "shape", None)
    if shape is None:
        return "?"
    return "[" + ", ".join(str(d) for d in shape) + "]"


def source_of(meta: dict) -> str:
    """``file:line`` of the innermost user frame in an FX node's ``stack_trace``."""
    st: Optional[str] = meta.get("stack_trace")
    if not st:
        return ""
    frames = [ln.strip() for ln in st.splitlines() if ln.strip().startswith("File ")]
    if not frames:
        return ""
    last = frames[-1]  # File "/path/x.py", line 12, in fn
    try:
        path = last.split('"')[1].rsplit("/", 1)[-1]
        lineno = last.split("line ")[1].split(",")[0]
        return f"{path}:{lineno}"
    except IndexError:
        return ""
