"""The rewrite pass: find every attention site in a Dynamo graph, decide, and swap the
rewritable ones for one ``pisa_compile.ops.pisa_attention`` call.

A site is either an SDPA call or a softmax whose weights feed a matmul with the values
(``softmax(q·kᵀ·scale + mask) @ v`` in any spelling the catalogue in :mod:`.patterns` knows).
A site is rewritten only when the replacement is provably the same function of its inputs,
up to the sparsity the config asks for; otherwise it is left dense and the report says why.

Entry point: :func:`rewrite_graph`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import operator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true
from torch.utils._sympy.numbers import int_oo

from ..config import PisaConfig
from ..ops import (check_causal_buffer, eager_empty_rows, is_decode_step, pisa_attention,
                   self_attention_query_mask, unstructured_mask_runs_dense)
from . import masks as M
from . import patterns as P
from .mha import (ENCODER_LAYER_TARGET, MHA_SIGNATURE, MHA_TARGET,
                  pisa_multi_head_attention_forward, pisa_transformer_encoder_layer_fwd)
from .report import LEFT_DENSE, REWRITTEN, Site, fmt_shape, source_of
from .tokens import same_tokens

__all__ = ["rewrite_graph", "find_sites", "LeaveDense"]

# The report's word for a site whose padding queries get a queries' mask (op or module).
_QUERY_PADDING_NOTE = "; self-attention: padding queries do not vote"
# With as many queries as keys (no cache before them) the op also starts each row's query
# tiles and leaf blocks at its first real token (ops._aligned).
_ALIGNED_NOTE = "rows start at their first token"

# The inserted node carries the PisaConfig as a kwarg constant. FX prints constants with
# repr() into the GraphModule's Python code, so the name must resolve there: register it
# as an FX "custom builtin" (the mechanism FX uses for ``inf``, ``device``, ...).
try:
    from torch.fx.graph import _register_custom_builtin

    _register_custom_builtin("PisaConfig", "from pisa_compile.config import PisaConfig",
                             PisaConfig)
except ImportError:  # pragma: no cover - private FX API moved; AOTAutograd still works
    pass


class LeaveDense(Exception):
    """Raised inside site analysis: leave this site dense, for the reason given."""


@dataclass
class _Plan:
    """How to build the replacement of one site."""

    anchor: Node                     # the node whose value the PISA call replaces
    q: Node
    k: Node
    v: Node
    q_perm: Optional[list] = None    # permute applied to q/k/v/out (None: as is)
    k_perm: Optional[list] = None
    v_perm: Optional[list] = None
    out_perm: Optional[list] = None
    mask: Optional[Node] = None      # an SDPA call's attn_mask, as is
    masks: list = field(default_factory=list)     # hand-written: (kind, m, extra, dtype):
    # ("add", m, factors after it, dtype of the sum) | ("bool", m, attend_if, scores dtype)
    is_causal: bool = False
    causal_offset: Any = None        # (const, terms) offset of the causal diagonal (masks.Struct)
    key_mask: Optional[Node] = None  # [B, Nk] bool key mask proved from the graph
    key_cut: bool = False            # pass key_mask[:, :Nk] (masks.Struct.key_cut)
    key_test: Optional[tuple] = None  # pass key_mask <op> c (masks.Struct.key_test)
    key_rows: bool = False           # pass key_mask[:B] (masks.Struct.key_rows)
    # A key mask proved in a checkpoint body's caller: made an input of the body by _apply
    # (not by the analysis, which must leave the graphs as they are if the site stays dense).
    key_outer: Optional["_Outer"] = None
    window: Optional[int] = None     # causal sliding window: keys per query
    # q and k proved one token sequence under a key mask: the op gets the queries' mask
    # (ops.self_attention_query_mask; lowering/tokens.py)
    query_padding: bool = False
    # Rows that see no key as eager gives them under a finite fill (ops.eager_empty_rows):
    # "add" (finfo.min added), "replace" (masked_fill), or None (the op's zeros).
    empty_rows: Optional[str] = None
    fills: list = field(default_factory=list)     # each masked_fill's constant, in order
    checked: tuple = ()              # buffers the structure was read from (checked per call)
    scale: Any = None                # None: SDPA's default 1/sqrt(D); else list of factors
    enable_gqa: bool = False
    rank3: bool = False              # [B*H, N, D] inputs: run as [1, B*H, N, D]
    dtype: Any = None                # q's dtype (float masks are cast to it)
    # torch.autocast's dtype where it casts the site's q, k, v (and SDPA's float mask) to it
    # (_autocast_cast), else None.
    autocast: Optional[torch.dtype] = None
    owned: list = field(default_factory=list)     # nodes the site consumes (erased if dead)


# -- small helpers ---------------------------------------------------------------------------------

def _identity(p: Optional[list]) -> bool:
    return p is None or list(p) == list(range(len(p)))


def _permuted_val(node: Node, perm: Optional[list]):
    v = P.val(node)
    if not isinstance(v, torch.Tensor):
        raise LeaveDense(f"no shape recorded for {node.name}")
    return v if _identity(perm) else v.permute(*perm)


def _may_eq(a, b) -> bool:
    return not statically_known_true(a != b)


def _same_shape(a: Node, b: Node) -> bool:
    va, vb = P.val(a), P.val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dim() == vb.dim()
            and all(P.known_equal(x, y) for x, y in zip(va.shape, vb.shape)))


class _Outer:
    """An activation-checkpoint body's view of its caller: each body placeholder's operand in
    the calling graph, so that a mask built outside the region is proved where it is built.
    ``thread`` makes an outer node (a proved key mask) an input of the body: a placeholder
    appended to the body and an operand appended to the call (``apply`` only)."""

    def __init__(self, call: Node, body: GraphModule, apply: bool):
        self.call, self.body, self.apply = call, body, apply
        # unmatched counts: no operand is known, so no mask is proved across the boundary
        self.operands = P.checkpoint_operands(call, body) or {}

    def thread(self, node: Node) -> Node:
        if not self.apply:
            return node  # explain: analysed, nothing is built
        for ph, operand in self.operands.items():
            if operand is node:
                return ph
        last = [n for n in self.body.graph.nodes if n.op == "placeholder"][-1]
        with self.body.graph.inserting_after(last):
            ph = self.body.graph.placeholder(f"{node.name}_pisa")
        ph.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val")})
        self.call.args = (*self.call.args, node)
        self.operands[ph] = node
        return ph


# The checkpoint body being rewritten (set by _rewrite_subgraphs around its rewrite_graph).
_OUTER: ContextVar[Optional[_Outer]] = ContextVar("pisa_outer", default=None)

# The autocast state a graph starts in: None for a graph Dynamo hands the backend (the
# caller's state then, read when the pass runs: the backend compiles inside the user's
# ``torch.autocast``, and Dynamo guards on it), or for a checkpoint body a function of the
# device type giving the state at its call in the enclosing graph.
_AUTOCAST_AT_START: ContextVar[Optional[Callable]] = ContextVar("pisa_autocast", default=None)
_FROM_CONTEXT = object()


def _autocast_dtype(node: Node, device_type: str, start: Any = _FROM_CONTEXT
                    ) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` runs ``node`` in on ``device_type``, None where it is
    off or not known: the innermost region entered in the graph before ``node`` and not yet
    left, else the state the graph starts in (``start``: as :data:`_AUTOCAST_AT_START`)."""
    regions: dict = {}
    for n in node.graph.nodes:
        if n is node:
            break
        if n.op == "call_function" and n.target is torch.amp.autocast_mode._enter_autocast:
            regions[n] = P.autocast_enter(n)  # None: arguments not read, state unknown
        elif P.is_autocast_exit(n) and n.args:
            regions.pop(n.args[0], None)
    for state in reversed(list(regions.values())):
        if state is None:
            return None
        dev, dtype, enabled = state
        if dev == device_type:
            return dtype if enabled else None
    start = _AUTOCAST_AT_START.get() if start is _FROM_CONTEXT else start
    if start is not None:
        return start(device_type)
    return (torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type) else None)


def _autocast_cast(products: list, q: Any, k: Any, v: Any, mask: Any = None
                   ) -> Optional[torch.dtype]:
    """The dtype autocast casts the site's ``q``, ``k`` and ``v`` (their example values) and
    SDPA's float ``mask`` to, where it does: each node of ``products`` (SDPA, or a hand-written
    site's two matmuls) runs inside an enabled region for their device, its traced output is
    in that region's dtype, q, k and v are floating and not float64 (autocast leaves those),
    and one of them or the mask is in another dtype. Else None.

    The region is found by walking the graph up to each product (``_autocast_dtype``), only
    for a site whose dtypes disagree: ``O(nodes)`` per such site."""
    ts = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point()
               and t.dtype != torch.float64 for t in ts):
        return None
    cast = list(ts)
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        cast.append(mask)
    if all(t.dtype == q.dtype for t in cast) and all(
            getattr(P.val(n), "dtype", None) == q.dtype for n in products):
        return None  # nothing was cast (the common case: no graph walk)
    dtypes = {_autocast_dtype(n, q.device.type) for n in products}
    if len(dtypes) != 1 or None in dtypes:
        return None
    (dtype,) = dtypes
    if not all(getattr(P.val(n), "dtype", None) == dtype for n in products):
        return None
    return None if all(t.dtype == dtype for t in cast) else dtype


def _autocast_form(plan: "_Plan") -> str:
    """The report's suffix for a site whose inputs the rewrite casts as autocast does."""
    return "" if plan.autocast is None else \
        f"+autocast({str(plan.autocast).replace('torch.', '')})"


def _through_boundary(mask: Any) -> Any:
    """The operand a checkpoint body's mask placeholder stands for, else ``mask``."""
    outer = _OUTER.get()
    return outer.operands.get(mask, mask) if outer is not None and isinstance(mask, Node) \
        else mask


def _structure(masks: list, n_queries, n_keys) -> Optional[M.Struct]:
    """The structure every mask together stands for (their attended entries intersected),
    or None when one is not proved (:mod:`.masks` has the proof rules). ``masks``:
    ``(kind, mask, extra, dtype)`` as in ``_Plan.masks``. An additive fill is judged where it
    is added, before the positive scales that follow it, as the op judges it (see
    ``_apply``). The fill of a float mask (:attr:`masks.Struct.fill`) is kept only for a
    site with one mask (what eager gives rows that see no key)."""
    out: Any = M.ONES
    for kind, mask, extra, dtype in masks:
        mask = _through_boundary(mask)  # a mask built outside a checkpointed region
        if kind == "bool":
            s = M.bool_structure(mask, extra)
        else:
            for f, _div in extra:
                if not (isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0):
                    return None
            s = M.additive_structure(mask, 1.0, dtype) if isinstance(dtype, torch.dtype) else None
        if s is None or not M.fits(mask, s, n_queries, n_keys):
            return None
        out = M.both(out, s)
        if out is None:
            return None
    if out == M.ONES:  # every entry attends (transformers' bidirectional q_idx >= 0)
        out = M.Struct(True, None, n_keys)
    if len(masks) > 1 and isinstance(out, M.Struct):
        out = dataclasses.replace(out, fill=None)  # empty rows: left as the op gives them
    return out if masks else None


def _empty_rows_kind(kind: str, fill: Any, dtype: Any) -> Optional[str]:
    """``kind`` ("add" or "replace", see ``_Plan.empty_rows``) where eager gives rows that
    see no key the mean of v: a finite fill (a fill of None: not known until run time), and
    for an added one not float16 (there ``finfo.min + s`` keeps ``s / 32``)."""
    if fill is not None and not (isinstance(fill, (int, float)) and math.isfinite(fill)):
        return None
    return None if kind == "add" and dtype == torch.float16 else kind


def _explicit_empty_rows(plan: "_Plan") -> Optional[str]:
    """``_Plan.empty_rows`` for a mask the op gets as is: SDPA's float ``attn_mask`` (added)
    or a hand-written site's one added mask, or its ``masked_fill`` masks of one fill. Other
    mixes keep the op's zeros (eager's row then depends on how they combine)."""
    added = _added_dtype(plan, plan.dtype)
    if added is not None:
        return _empty_rows_kind("add", None, added)
    return _empty_rows_kind("replace", plan.fills[0], None) if _one_fill(plan) else None


def _added_dtype(plan: "_Plan", q_dtype: Any) -> Optional[torch.dtype]:
    """The dtype of scores plus the site's one float mask (SDPA's ``attn_mask``, or a
    hand-written site's one added mask), where eager judges its fill; None for any other
    masks. ``q_dtype``: q's dtype (None if unknown)."""
    if plan.mask is not None and not plan.masks:
        mv = P.val(plan.mask)
        if isinstance(mv, torch.Tensor) and mv.dtype.is_floating_point:
            if plan.autocast is not None:  # SDPA's mask is cast with q, k and v
                return plan.autocast
            return mv.dtype if q_dtype is None else torch.promote_types(mv.dtype, q_dtype)
        return None
    if plan.mask is None and len(plan.masks) == 1 and plan.masks[0][0] == "add":
        return plan.masks[0][3]
    return None


def _one_fill(plan: "_Plan") -> bool:
    """Only ``masked_fill`` masks, all with one fill: a row they hide whole holds that fill
    alone (eager's weights are uniform there)."""
    return (plan.mask is None and bool(plan.masks) and all(m[0] == "bool" for m in plan.masks)
            and len(set(plan.fills)) == 1)


def _fmt_offset(off: tuple) -> str:
    c, terms = off
    parts = [f"{'-' if k < 0 else '+'}{'' if abs(k) == 1 else abs(k)}{n}" for n, k in terms]
    text = "".join(parts).lstrip("+")
    return (text + (f"{c:+d}" if c else "")) if text else str(c)


def _asserts_enforced() -> bool:
    """Whether Inductor keeps ``torch._assert_async`` (what :func:`check_causal_buffer` relies
    on): Triton compiles device asserts only in debug mode, which Inductor turns on with
    ``assert_indirect_indexing``, and never on ROCm."""
    import torch._inductor.config as inductor_config
    return torch.version.hip is None and bool(inductor_config.assert_indirect_indexing)


def _take_structure(graph, plan: _Plan, s: M.Struct, qv: Any, kv: Any, site: Site) -> bool:
    """Hand ``s`` to the op as ``is_causal``/``causal_offset``/``key_mask``/``window`` when
    the op takes it; records what was found in ``site.mask`` either way. False: keep the
    mask."""
    if s.lower is not None and s.n_queries is not None:
        # A window wider than every row's reach is no window: j - i >= -(Nq - 1) >= lower.
        low = M.offset_value(s.lower, graph)
        if low is not None and statically_known_true(low + s.n_queries - 1 <= 0):
            s = dataclasses.replace(s, lower=None)
    window = None
    if s.lower is not None:  # a sliding window: the op takes a causal one of fixed width
        width = (s.upper[0] - s.lower[0] + 1
                 if s.upper is not None and s.upper[1] == s.lower[1] else None)
        if s.upper is None:
            site.mask += "(keys j >= i + c only, no causal bound: kept as a mask)"
            return False
        if width is None:
            site.mask += "(a window whose width is not a constant: kept as a mask)"
            return False
        if width < 1:
            site.mask += "(an empty band: kept as a mask)"
            return False
        window = width
    if s.checked and not _asserts_enforced():
        site.mask += "(a buffer: kept as a mask, device-side checks are off)"
        return False
    outer = _OUTER.get()
    crossed = outer is not None and any(
        m in outer.operands for m in [plan.mask, *(m for _, m, *_ in plan.masks)])
    if crossed and (s.checked or (s.upper is not None and s.upper[1])
                    or (s.lower is not None and s.lower[1])):
        # Their nodes (a buffer, symbolic sizes) live outside the region.
        site.mask += "(built outside the checkpointed region with a symbolic offset or a " \
                     "checked buffer: kept as a mask)"
        return False
    if s.key is not None:
        km = P.val(s.key)
        if not (isinstance(km, torch.Tensor) and isinstance(qv, torch.Tensor) and qv.dim() == 4
                and P.known_equal(km.shape[0] if s.key_rows is None else s.key_rows,
                                  qv.shape[0])
                and (s.key_cut or P.known_equal(km.shape[1], kv.shape[-2]))):
            return False
    off = None
    if s.upper is not None:
        off = M.offset_value(s.upper, graph)
        if off is None or not statically_known_true(off >= 0):
            site.mask += f"(causal offset {_fmt_offset(s.upper)} not provably >= 0)"
            return False
    one_fill, added = _one_fill(plan), _added_dtype(plan, getattr(qv, "dtype", None))
    # Autocast casts SDPA's mask (not a hand-written site's: its sum is traced as is).
    cast_fill = plan.autocast if plan.mask is not None and not plan.masks else None
    plan.mask, plan.masks = None, []
    plan.is_causal = s.upper is not None
    plan.causal_offset = s.upper if s.upper is not None and s.upper != (0, ()) else None
    key = s.key
    if crossed and key is not None and key.graph is not graph:
        plan.key_outer = outer  # _apply makes the key mask an input of the body
    plan.key_mask, plan.key_cut, plan.key_test = key, s.key_cut, s.key_test
    plan.key_rows = s.key_rows is not None
    # Structure leaves a row empty only through the key mask: a causal row sees key 0 and a
    # window the diagonal.
    if s.key is None:
        plan.empty_rows = None
    elif s.fill is not None:  # a float mask: its fill was added
        fill = s.fill
        if cast_fill is not None and isinstance(fill, (int, float)):
            # As autocast hands it to SDPA: finfo(float32).min is -inf in bfloat16.
            fill = float(torch.tensor(fill, dtype=torch.float64).to(cast_fill))
        plan.empty_rows = _empty_rows_kind("add", fill, added)
    elif one_fill:
        plan.empty_rows = _empty_rows_kind("replace", plan.fills[0], None)
    plan.window = window
    plan.checked = s.checked
    found = []
    if s.upper is not None:
        found.append("is_causal" if plan.causal_offset is None
                     else f"causal(offset={_fmt_offset(s.upper)})")
    if window is not None:
        found.append(f"window({window})")
    if s.key is not None:
        found.append("padding")
    site.mask += "->" + ("+".join(found) or "none")
    if s.checked:
        site.mask += "(buffer checked per call)"
    return True


def _matmul_distance(node: Any, depth: int = 8) -> int:
    """Steps from ``node`` back through its inputs to the nearest matmul-like node
    (``depth + 1`` if there is none within ``depth`` steps)."""
    frontier = [node]
    for d in range(depth):
        nxt = []
        for n in frontier:
            if isinstance(n, Node):
                if P.matmul_kind(n):
                    return d
                nxt.extend(n.all_input_nodes)
        frontier = nxt
    return depth + 1


def _leads_to_matmul(node: Any, depth: int = 8) -> bool:
    """Whether ``node`` is computed from a matmul-like node within ``depth`` steps."""
    return _matmul_distance(node, depth) <= depth


# Inductor's attention fusion (the sfdp patterns of fuse_attention) ignores the softmax dim:
# it rewrites softmax(q k^T, dim=-2) v into SDPA, silently wrong (pytorch/pytorch#196468).
_SOFTMAX_DIM_GUARD = ("Inductor's pattern matcher is off for this graph: its attention "
                      "fusion ignores the softmax dim (pytorch/pytorch#196468)")


def _softmax_off_last_dim(node: Any) -> bool:
    """Whether ``node`` is a softmax over another dim than its input's last one."""
    if not P.is_softmax(node):
        return False
    x, dim, _ = P.softmax_input(node)
    v = P.val(x)
    return not (isinstance(dim, int) and isinstance(v, torch.Tensor) and v.dim() > 0
                and dim % v.dim() == v.dim() - 1)


def guard_inductor(gm: Any, sites: list, patches: dict) -> None:
    """Turn Inductor's pattern matcher off (in ``patches``, the graph's Inductor options)
    where ``gm`` (or a subgraph of it: checkpoint bodies) holds a softmax over another dim
    than its input's last, which Inductor's attention fusion would turn into attention over
    the last dim, whatever became of the site (left dense for any reason, or the pass
    failed); say so in the reason of a site left dense at that softmax. A
    ``pattern_matcher`` the user set is left as set.

    Args:
        gm: the Dynamo graph module after the pass (rewritten sites hold no softmax).
        sites: the pass's :class:`Site` list for ``gm`` (reasons are extended in place).
        patches: the Inductor config patches ``gm`` will compile with (updated in place).
    """
    hazards = {n.name for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if _softmax_off_last_dim(n)}
    if not hazards or "pattern_matcher" in patches:
        return
    patches["pattern_matcher"] = False
    for s in sites:
        if not s.rewritten and s.node in hazards:
            s.reason += f"; {_SOFTMAX_DIM_GUARD}"


def _mask_kind(mask: Any, is_causal: bool) -> str:
    if is_causal:
        return "causal"
    if mask is None:
        return "none"
    v = P.val(mask)
    kind = "bool" if getattr(v, "dtype", None) == torch.bool else "float"
    # Says how the mask is built, not that it is causal: triu, or tril(...).T, build
    # others (what the structure proves is appended where the site is rewritten).
    return kind + ("(tril/triu)" if P.builds_from_tril(mask) else "")


def _check_mask_tensor(mask: Any, bool_only: bool = False, float_only: bool = False) -> None:
    v = P.val(mask)
    if not isinstance(v, torch.Tensor):
        raise LeaveDense(f"unsupported mask: {P.describe(mask)} is not a tensor")
    if v.dtype == torch.bool:
        if float_only:
            raise LeaveDense("unsupported mask dtype torch.bool for an additive mask")
    elif not v.is_floating_point() or bool_only:
        raise LeaveDense(f"unsupported mask dtype {v.dtype}")
    if v.dim() > 4:
        raise LeaveDense(f"unsupported mask shape {fmt_shape(v)} (more than 4 dims)")


def _check_mask_grad(mask: Any) -> None:
    v = P.val(mask)
    if isinstance(v, torch.Tensor) and v.requires_grad:
        raise LeaveDense("the mask requires grad (a learned bias, e.g. T5's relative position "
                    "bias, with grad mode on: under torch.no_grad() or inference_mode() it "
                    "is rewritten): PISA gives no gradient for the mask")


def _peel_one(node: Node, factors: Optional[list], owned: list) -> Optional[Node]:
    """The input under one numeric scale (if ``factors`` is a list), ``.contiguous()`` or
    no-op cast; ``None`` if ``node`` is none of those."""
    if factors is not None:
        sc = P.as_scale(node)
        if sc is not None and not sc.is_tensor:
            factors.append((sc.factor, sc.divide))
            owned.append(node)
            return sc.input
    c = P.as_contiguous(node)
    if c is None:
        c = P.as_noop_cast(node)
    if c is not None:
        owned.append(node)
    return c


def _strip_numeric_scales(node: Node, factors: list, owned: list) -> Node:
    """Peel ``x * s`` / ``x / s`` (number or symbolic scalar) and ``.contiguous()`` off ``node``."""
    while isinstance(node, Node):
        nxt = _peel_one(node, factors, owned)
        if nxt is None:
            break
        node = nxt
    return node


def _strip_views(node: Node, perm: list, factors: Optional[list], owned: list):
    """Peel permutes (composing ``perm``), and numeric scales if ``factors`` is a list.

    Returns ``(x, p)`` with the original value equal to ``x.permute(p)`` times the factors.
    """
    while isinstance(node, Node):
        vp = P.as_view_perm(node)
        if vp is not None:
            src, p0 = vp
            perm = [p0[i] for i in perm]
            owned.append(node)
            node = src
            continue
        nxt = _peel_one(node, factors, owned)
        if nxt is None:
            break
        node = nxt
    return node, perm


def _strip_repeat(k: Node, v: Node, owned: list):
    """Undo matching ``repeat_kv`` / ``repeat_interleave`` on both ``k`` and ``v``."""
    rk, rv = P.as_repeat_kv(k), P.as_repeat_kv(v)
    if rk is None or rv is None or rk.n_rep != rv.n_rep:
        return k, v, None
    for r, n in ((rk, k), (rv, v)):
        owned.append(n)
        owned.extend(x for x in n.all_input_nodes if x is not r.input)
    return rk.input, rv.input, rk.form


def _check_shapes(plan: _Plan) -> tuple:
    """Shapes/dtypes as PISA will see them; ``LeaveDense`` if they are not ``[B,H,N,D]``-compatible."""
    q = _permuted_val(plan.q, plan.q_perm)
    k = _permuted_val(plan.k, plan.k_perm)
    v = _permuted_val(plan.v, plan.v_perm)
    if not (q.dim() == k.dim() == v.dim()) or q.dim() not in (3, 4):
        raise LeaveDense(f"unsupported rank: q {fmt_shape(q)}, k {fmt_shape(k)}, v {fmt_shape(v)} "
                    "(need 4-D [B, H, N, D] or 3-D [B*H, N, D])")
    plan.rank3 = q.dim() == 3
    plan.dtype = q.dtype if plan.autocast is None else plan.autocast
    if plan.autocast is None and (not (q.dtype == k.dtype == v.dtype)
                                  or not q.is_floating_point()):
        raise LeaveDense(f"dtypes differ or are not floating: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (P.known_equal(q.shape[0], k.shape[0]) and P.known_equal(k.shape[0], v.shape[0])):
        raise LeaveDense("batch dims of q, k, v differ (broadcast matmul)")
    if not plan.rank3:
        hq, hk = q.shape[1], k.shape[1]
        if not P.known_equal(hk, v.shape[1]):
            raise LeaveDense("k and v head counts differ")
        if plan.enable_gqa:
            if not statically_known_true(hq % hk == 0):
                raise LeaveDense(f"q heads {hq} not a multiple of k heads {hk}")
        elif not P.known_equal(hq, hk):
            raise LeaveDense(f"q heads {hq} != k heads {hk}")
    # The site's own matmuls (or SDPA) already require q/k head dims and k/v lengths to
    # agree at run time, so "not provably different" is enough: a KV cache gives k and v
    # lengths distinct symbols (s84 + 1, s94 + 1) that Dynamo cannot prove equal.
    if not (_may_eq(q.shape[-1], k.shape[-1]) and _may_eq(k.shape[-2], v.shape[-2])):
        raise LeaveDense("q/k head dims or k/v lengths differ")
    out = P.val(plan.anchor)
    if isinstance(out, torch.Tensor) and out.dtype != plan.dtype:
        raise LeaveDense(f"output dtype {out.dtype} differs from q dtype {plan.dtype}")
    return q, k, v


# -- site analysis ---------------------------------------------------------------------------------

def _dropout_reason(dp: Any) -> str:
    """Why a ``dropout_p`` that is not a literal 0 keeps the site dense."""
    if isinstance(dp, (int, float)):
        return f"dropout active (dropout_p={dp}; a module passes 0.0 in eval())"
    # e.g. Tensor.item: with dynamic=True Dynamo may pass a module's float as an input
    return (f"dropout_p is a value known only at run time ({P.describe(dp)}), so dropout "
            "cannot be ruled out; dynamic=False, or a literal 0.0, keeps it a constant")


def _analyze_sdpa(node: Node, site: Site) -> _Plan:
    b = P.sdpa_args(node)
    q, k, v, mask = b["query"], b["key"], b["value"], b["attn_mask"]
    site.mask = _mask_kind(mask, b["is_causal"] is True)
    dp = b["dropout_p"]
    if not (isinstance(dp, (int, float)) and dp == 0):
        raise LeaveDense(_dropout_reason(dp))
    scale = b["scale"]
    if scale is not None and not P.is_number(scale):
        raise LeaveDense("the scale is a tensor" if P.is_tensor_node(scale)
                    else f"unsupported scale {P.describe(scale)}")
    if not isinstance(b["is_causal"], bool) or not isinstance(b["enable_gqa"], bool):
        raise LeaveDense("is_causal / enable_gqa are not constants")
    if mask is not None and b["is_causal"]:
        # PyTorch documents the pair as an error, but some of its kernels (the CPU's) run it
        # as causal AND mask: what runs there stays SDPA's to decide.
        raise LeaveDense("attn_mask together with is_causal=True")
    if mask is not None:
        _check_mask_tensor(mask)
        _check_mask_grad(mask)
    plan = _Plan(anchor=node, q=q, k=k, v=v, mask=mask, is_causal=b["is_causal"],
                 enable_gqa=b["enable_gqa"], owned=[node])
    plan.autocast = _autocast_cast([node], P.val(q), P.val(k), P.val(v),
                                   None if mask is None else P.val(mask))
    if mask is not None and P.is_tensor_node(q) and P.is_tensor_node(k):
        kind = "bool" if P.val(mask).dtype == torch.bool else "add"
        s = _structure([(kind, mask, True if kind == "bool" else [],
                         plan.autocast or P.val(q).dtype)],
                       P.val(q).shape[-2], P.val(k).shape[-2])
        if s is not None:
            _take_structure(node.graph, plan, s, P.val(q), P.val(k), site)
    plan.scale = None if scale is None else [(scale, False)]
    kk, vv, form = _strip_repeat(k, v, plan.owned)
    if form is not None:
        plan.k, plan.v, plan.enable_gqa = kk, vv, True
        site.form += f"+gqa({form})"
    return plan


def _is_reshape_of(u: Node, cur: Node) -> bool:
    """``u`` merges the batch and head dims of the weights ``cur``: ``[B, H, Nq, Nk]`` as
    ``[B*H, Nq, Nk]`` for a ``bmm`` (BLOOM), by ``view`` or ``reshape``. Other reshapes (a
    MoE gate's ``[T, E]`` as ``[T, 1, E]``) are not followed: no attention site there."""
    if not (bool(u.args) and u.args[0] is cur
            and (P._meth(u, "view", "reshape") or P._fn(u, torch.reshape))):
        return False
    a, b = P.val(cur), P.val(u)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dim() == 4 and b.dim() == 3):
        return False
    return (P.known_equal(b.shape[0], a.shape[0] * a.shape[1])
            and P.known_equal(b.shape[1], a.shape[2]) and P.known_equal(b.shape[2], a.shape[3]))


def _forward_chain(sm: Node):
    """From the softmax to the matmul with ``v``: ``(pv, chain, used_elsewhere, dropout)``.
    A reshape on the way (BLOOM's ``[B, H, Nq, Nk]`` weights viewed as ``[B*H, Nq, Nk]`` for
    a ``bmm``) is followed so that the site is found, then left dense by name: the layouts
    are not taken apart."""
    cur, chain, elsewhere, dropout = sm, [], False, None
    while True:
        nxt = pv = None
        for u in cur.users:
            kind = P.matmul_kind(u)
            if kind:
                a, b = P.matmul_operands(u)
                if a is cur or (kind == "einsum" and b is cur):
                    pv = pv or u
                    continue
            d = P.as_dropout(u)
            if (P.as_cast(u) is cur or P.as_contiguous(u) is cur
                    or (d is not None and d.input is cur) or _is_reshape_of(u, cur)):
                nxt = nxt or u
        if pv is None and nxt is None:
            return None
        if len(cur.users) > 1:
            elsewhere = True
        if pv is not None:
            reshaped = next((n for n in chain if _is_reshape_of(n, n.args[0])), None)
            if reshaped is not None:
                raise LeaveDense(f"the attention weights are reshaped ({P.describe(reshaped)}) "
                                 "before the matmul with v: not rewritten")
            return pv, chain, elsewhere, dropout
        d = P.as_dropout(nxt)
        if d is not None and d.active:
            dropout = d
        chain.append(nxt)
        cur = nxt


@dataclass
class _Scores:
    """The steps between ``q·kᵀ`` and the softmax, walked back from the softmax input."""

    qk: Node                                   # the score matmul
    factors: list = field(default_factory=list)  # (factor, divide) scales met on the way
    masks: list = field(default_factory=list)    # (MaskOp, factors after it, scores dtype)
    elsewhere: bool = False                    # an intermediate is used outside the site
    reasons: list = field(default_factory=list)  # refusals found on the way


def _score_chain(x: Any, site: Site, owned: list) -> _Scores:
    """Walk back from the softmax input ``x`` to ``q·kᵀ`` through casts, scales and masks.

    Any number of additive float masks (T5: position bias, then the padding/causal mask) and
    at most one bool mask (``masked_fill`` / ``where``); each mask is recorded with the scale
    factors applied after it (seen so far on the way back), which scale the mask too.
    """
    found = _Scores(qk=None)
    s = x
    while True:
        if not isinstance(s, Node):
            raise LeaveDense("the softmax input is not computed from a matmul")
        if P.matmul_kind(s):
            found.qk = s
            return found
        if len(s.users) > 1:
            found.elsewhere = True
        owned.append(s)
        c = P.as_cast(s)
        if c is None:
            c = P.as_contiguous(s)
        if c is not None:
            s = c
            continue
        sc = P.as_scale(s, allow_inplace=True)
        if sc is not None and _leads_to_matmul(sc.input):
            if sc.is_tensor:
                found.reasons.append("the scale is a tensor")
            found.factors.append((sc.factor, sc.divide))
            s = sc.input
            continue
        m = P.as_masked_fill(s)
        if m is None:
            for cand in sorted(s.all_input_nodes, key=_matmul_distance):
                if _leads_to_matmul(cand):
                    m = P.as_where(s, cand) or P.as_mask_add(s, cand)
                    if m is not None:
                        break
        if m is not None:
            if not _same_shape(s, m.scores):
                raise LeaveDense("the mask broadcasts the scores to a larger shape")
            found.masks.append((m, list(found.factors), getattr(P.val(s), "dtype", None)))
            site.mask = _mask_kind(m.mask, False)  # shown even if a later step refuses
            s = m.scores
            continue
        if P.is_softcap(s):
            raise LeaveDense(f"score transform {P.describe(s)} between matmul and softmax "
                             "(logit softcapping, c*tanh(s/c): PISA has no softcap)")
        if P._fn(s, torch.baddbmm, torch.addbmm) or P._meth(s, "baddbmm", "addbmm"):
            raise LeaveDense(f"the scores come from {P.describe(s)}, a product with a bias "
                             "added in (BLOOM's ALiBi), which the pass does not take apart")
        raise LeaveDense(f"score transform {P.describe(s)} between matmul and softmax")


def _qk_layout(qk: Node) -> tuple[Optional[list], list, Optional[str]]:
    """``(q_perm, k_perm, score_letters)``: how q and k of the score matmul map to
    ``[.., Nq, D]`` and ``[.., Nk, D]`` (einsum: the letters of the scores)."""
    a, b = P.matmul_operands(qk)
    if P.matmul_kind(qk) == "einsum":
        eq = P.parse_einsum(qk)
        if eq is None or len(eq.out) < 3:
            raise LeaveDense(f"unsupported einsum {qk.args[0]!r}")
        batch, i, j = eq.out[:-2], eq.out[-2], eq.out[-1]
        contr = [c for c in eq.a if c in eq.b and c not in eq.out]
        if len(contr) != 1 or sorted(eq.a) != sorted(batch + i + contr[0]) or \
                sorted(eq.b) != sorted(batch + j + contr[0]):
            raise LeaveDense(f"unsupported einsum {qk.args[0]!r}")
        c = contr[0]
        return ([eq.a.index(ch) for ch in batch + i + c], [eq.b.index(ch) for ch in batch + j + c],
                eq.out)
    rank = P.val(b).dim() if P.is_tensor_node(b) else 0
    if rank < 2:
        raise LeaveDense("unsupported matmul operand ranks")
    k_perm = list(range(rank))
    k_perm[-2], k_perm[-1] = k_perm[-1], k_perm[-2]
    return None, k_perm, None


def _v_layout(pv: Node, w_in: Node, score_letters: Optional[str]):
    """``(v_node, v_perm, out_perm)`` of the weights·v matmul ``pv`` (weights ``w_in``)."""
    a2, b2 = P.matmul_operands(pv)
    if P.matmul_kind(pv) != "einsum":
        if a2 is not w_in:
            raise LeaveDense("the weights are not the left operand of the matmul with v")
        rank = P.val(b2).dim() if P.is_tensor_node(b2) else 0
        return b2, list(range(rank)), None
    eq2 = P.parse_einsum(pv)
    if eq2 is None:
        raise LeaveDense(f"unsupported einsum {pv.args[0]!r}")
    wl, vl = (eq2.a, eq2.b) if a2 is w_in else (eq2.b, eq2.a)
    v_node = b2 if a2 is w_in else a2
    if len(wl) < 3:
        raise LeaveDense(f"unsupported einsum {pv.args[0]!r}")
    batch2, i2, j2 = wl[:-2], wl[-2], wl[-1]
    e = [ch for ch in vl if ch not in wl]
    if len(e) != 1 or sorted(vl) != sorted(batch2 + j2 + e[0]) or \
            sorted(eq2.out) != sorted(batch2 + i2 + e[0]):
        raise LeaveDense(f"unsupported einsum {pv.args[0]!r}")
    if score_letters is not None and len(score_letters) != len(wl):
        raise LeaveDense("einsum ranks differ")
    layout = batch2 + i2 + e[0]
    return v_node, [vl.index(ch) for ch in batch2 + j2 + e[0]], \
        [layout.index(ch) for ch in eq2.out]


def _positive(f: Any) -> bool:
    """A number > 0, or a symbolic scalar provably > 0 for every value it can take."""
    if isinstance(f, bool):
        return False
    if isinstance(f, (int, float)):
        return f > 0
    v = P.val(f)
    return isinstance(v, (torch.SymInt, torch.SymFloat)) and bool(statically_known_true(v > 0))


def _plan_masks(plan: _Plan, masks: list) -> None:
    """Check each mask of the chain and record it in ``plan.masks``."""
    for mask_op, post, dtype in masks:
        # -inf * c stays -inf, and a masked entry stays masked, only for c > 0.
        if not all(_positive(f) for f, _div in post):
            raise LeaveDense("a scale after the mask is not provably positive")
        if mask_op.kind == "add":
            _check_mask_tensor(mask_op.mask, float_only=True)
            # (s + m) * c == s*c + m*c
            plan.masks.append(("add", mask_op.mask, post, dtype))
        else:
            _check_mask_tensor(mask_op.mask, bool_only=True)
            sv = P.val(mask_op.scores)
            if not P.is_masking_fill(mask_op.fill, sv.dtype):
                raise LeaveDense(f"mask fill value {P.describe(mask_op.fill)} is not -inf or "
                                 f"<= finfo({sv.dtype}).min/2")
            plan.masks.append(("bool", mask_op.mask, mask_op.attend_if, dtype))
            plan.fills.append(P.constant_of(mask_op.fill))
        _check_mask_grad(mask_op.mask)


def _analyze_softmax(sm: Node, site: Site) -> Optional[_Plan]:
    """Plan for a hand-written site, or ``None`` when ``sm`` is not attention at all."""
    fwd = _forward_chain(sm)
    if fwd is None:
        return None
    pv, fchain, elsewhere, dropout = fwd
    site.node = sm.name
    site.form = f"?-softmax-{P.matmul_kind(pv)}"
    x, dim, _dtype = P.softmax_input(sm)
    owned = [pv, *fchain, sm]
    chain = _score_chain(x, site, owned)
    if chain.masks:
        kinds = {"bool" if o.kind == "bool" else _mask_kind(o.mask, False)
                 for o, *_ in chain.masks}
        site.mask = "+".join(sorted(kinds))
    qk = chain.qk
    owned.append(qk)
    kind1, kind2 = P.matmul_kind(qk), P.matmul_kind(pv)
    site.form = (f"{kind1}-softmax-{kind2}" if kind1 != kind2 or kind1 != "matmul"
                 else "matmul-softmax-matmul")
    if kind1 == kind2 and kind1 != "matmul":
        site.form = f"{kind1}-softmax-{kind1}"

    # Layouts: q as [.., Nq, D], k as [.., Nk, D] after a permute; the scores as [.., Nq, Nk].
    q_perm, k_perm, letters = _qk_layout(qk)
    a, b = P.matmul_operands(qk)
    q = _strip_numeric_scales(a, chain.factors, owned)
    k, k_perm = _strip_views(b, k_perm, chain.factors, owned)
    v_node, v_perm, out_perm = _v_layout(pv, fchain[-1] if fchain else sm, letters)
    v, v_perm = _strip_views(v_node, v_perm, None, owned)

    plan = _Plan(anchor=pv, q=q, k=k, v=v, q_perm=q_perm, k_perm=k_perm, v_perm=v_perm,
                 out_perm=None if _identity(out_perm) else out_perm, owned=owned)
    # The masks' dtypes are the traced sums', which already say what autocast did.
    plan.autocast = _autocast_cast([qk, pv], P.val(q), P.val(k), P.val(v))
    if _identity(plan.k_perm) and _identity(plan.v_perm):
        kk, vv, form = _strip_repeat(k, v, owned)
        if form is not None:
            plan.k, plan.v, plan.enable_gqa = kk, vv, True
            site.form += f"+gqa({form})"
    _plan_masks(plan, chain.masks)
    plan.scale = chain.factors
    sv = P.val(x)
    s = _structure(plan.masks, sv.shape[-2], sv.shape[-1]) if (
        isinstance(sv, torch.Tensor) and sv.dim() >= 2) else None
    if s is not None:
        _take_structure(sm.graph, plan, s, _permuted_val(plan.q, plan.q_perm),
                        _permuted_val(plan.k, plan.k_perm), site)

    # Refusals that need the whole site seen first.
    sdim = P.val(x).dim() if P.is_tensor_node(x) else None
    if not (isinstance(dim, int) and sdim is not None and dim % sdim == sdim - 1):
        raise LeaveDense(f"softmax over dim {dim}, not the key dim")
    if elsewhere or chain.elsewhere:
        raise LeaveDense("the attention weights are used elsewhere (returned, stored or reused)")
    if dropout is not None:
        raise LeaveDense(f"dropout active in training (p={P.describe(dropout.p)})")
    if chain.reasons:
        raise LeaveDense(chain.reasons[0])
    return plan


def _check_no_writes(graph, plan: _Plan) -> None:
    """``LeaveDense`` if a node between the site's first node and its anchor may write in place
    into memory the site reads (q, k, v, the masks, or the site's own intermediates, through
    any view). The op runs at the anchor, so it would read the written values: ``k.mul_(-3)``
    after ``q @ k.mT``, ``s.div_(4)`` on raw scores the softmax then reads, a ``masked_fill_``
    off the chain."""
    find = M.alias_find(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    site = [n for n in plan.owned if isinstance(n, Node) and n in order] + [plan.anchor]
    reads = [plan.q, plan.k, plan.v, plan.mask, plan.key_mask, *(m for _, m, *_ in plan.masks),
             *site]
    roots = {find(n) for n in reads if P.is_tensor_node(n)}
    first, last = min(order[n] for n in site), order[plan.anchor]
    owned = set(site)
    for n in graph.nodes:
        if not first < order[n] < last or n in owned:
            continue
        for t in M.written_by(n):
            if find(t) in roots:
                raise LeaveDense(f"{P.describe(n)} ({n.name}) may write in place into {t.name}, "
                                 "which the site reads, between its first node and its last; "
                                 "the op there would read the written value")


# -- graph editing ---------------------------------------------------------------------------------

def _fake_mode(nodes):
    from torch._guards import detect_fake_mode
    vals = [P.val(n) for n in nodes if isinstance(n, Node)]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


class _Emitter:
    """Inserts nodes before ``anchor``, recording example values (fake) for later passes."""

    def __init__(self, graph, anchor: Node):
        self.graph, self.anchor = graph, anchor
        self.fake = _fake_mode(anchor.all_input_nodes)
        self.meta = {k: anchor.meta[k] for k in ("stack_trace", "nn_module_stack")
                     if k in anchor.meta}

    def __call__(self, op: str, target, args, kwargs=None) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, tuple(args), dict(kwargs or {}))
        node.meta.update(self.meta)
        self._set_val(node)
        return node

    def _set_val(self, node: Node) -> None:
        if self.fake is None:
            return
        a = torch.fx.node.map_arg(node.args, P.val)
        kw = torch.fx.node.map_arg(node.kwargs, P.val)
        try:
            with self.fake:
                if node.op == "call_method":
                    out = getattr(a[0], node.target)(*a[1:], **kw)
                else:
                    out = node.target(*a, **kw)
            node.meta["example_value"] = out
        except Exception:  # meta is a courtesy; AOTAutograd retraces anyway
            pass


def _apply(gm: GraphModule, plan: _Plan, config: PisaConfig) -> Node:
    emit = _Emitter(gm.graph, plan.anchor)

    def perm(n, p):
        return n if _identity(p) else emit("call_method", "permute", (n, *p))

    q, k, v = perm(plan.q, plan.q_perm), perm(plan.k, plan.k_perm), perm(plan.v, plan.v_perm)
    if plan.autocast is not None:
        # What autocast does to SDPA's (or the matmuls') inputs, written out: the op is not
        # on autocast's lists. SDPA's float mask is cast with them.
        q, k, v = (t if getattr(P.val(t), "dtype", None) == plan.autocast
                   else emit("call_method", "to", (t, plan.autocast)) for t in (q, k, v))
        mv = P.val(plan.mask) if plan.mask is not None else None
        if isinstance(mv, torch.Tensor) and mv.dtype.is_floating_point \
                and mv.dtype != plan.autocast:
            plan.mask = emit("call_method", "to", (plan.mask, plan.autocast))
    if plan.key_outer is not None:
        plan.key_mask = plan.key_outer.thread(plan.key_mask)
    if plan.key_mask is None and plan.empty_rows is None:
        plan.empty_rows = _explicit_empty_rows(plan)
    mask = plan.mask
    float_terms, bool_term = [], None
    written = plan.mask  # the explicit mask as the site adds it (eager_empty_rows reads it)
    for kind, m, extra, dtype in plan.masks:
        if kind == "add":
            written = m  # before folding: that turns the fill into -inf
            m = _folded_additive(emit, m, extra, dtype, plan.dtype)
            float_terms.append(m)
        else:
            if not extra:                                # masked_fill: True = masked
                inner = P.invert_target(m)
                m = inner if inner is not None else emit("call_function", operator.invert, (m,))
            # Several masked_fills: a key is hidden if any hides it (-inf stays -inf).
            bool_term = m if bool_term is None else emit("call_function", operator.and_,
                                                         (bool_term, m))
    for m in float_terms:
        mask = m if mask is None else emit("call_function", operator.add, (mask, m))
    if bool_term is not None:
        mask = bool_term if mask is None else emit(
            "call_function", torch.where, (bool_term, mask, float("-inf")))
    scale = plan.scale
    if scale is not None:
        num, sym = 1.0, []
        for f, div in scale:
            if isinstance(f, (int, float)):
                num = num / f if div else num * f
            else:
                sym.append((f, div))
        scale = num
        for f, div in sym:
            scale = emit("call_function", operator.truediv if div else operator.mul, (scale, f))
    for buf in plan.checked:  # q passes through the check, so the check stays in the graph
        q = emit("call_function", check_causal_buffer, (q, buf))
    if plan.rank3:
        q, k, v = (emit("call_method", "unsqueeze", (t, 0)) for t in (q, k, v))
    structure = {}
    if plan.key_mask is not None:
        km = plan.key_mask
        if plan.key_cut:  # key[:, :Nk]: raises where the dense gather would
            km = emit("call_method", "narrow", (km, 1, 0, emit("call_method", "size", (k, 2))))
        if plan.key_rows:  # key[:B]: raises where the dense gather would
            km = emit("call_method", "narrow", (km, 0, 0, emit("call_method", "size", (q, 0))))
        if plan.key_test is not None:  # e.g. an int attention_mask read as (mask != 0)
            km = emit("call_method", plan.key_test[0], (km, plan.key_test[1]))
        structure["key_mask"] = km
    if plan.causal_offset is not None:
        structure["causal_offset"] = _emit_offset(emit, gm.graph, plan.causal_offset)
    if plan.window is not None:
        structure["window"] = plan.window
    if plan.query_padding:
        structure["query_mask"] = emit("call_function", self_attention_query_mask,
                                       (structure["key_mask"],
                                        emit("call_method", "size", (q, 2))))
    out = emit("call_function", pisa_attention, (q, k, v),
               dict(attn_mask=mask, dropout_p=0.0, is_causal=plan.is_causal, scale=scale,
                    enable_gqa=plan.enable_gqa, config=config, **structure))
    if plan.empty_rows is not None:
        where = (dict(is_causal=plan.is_causal, causal_offset=structure.get("causal_offset", 0),
                      window=structure.get("window")) if mask is None
                 else dict(attn_mask=written if plan.empty_rows == "add" else mask))
        out = emit("call_function", eager_empty_rows,
                   (out, q, k, v, structure.get("key_mask")),
                   dict(scale=scale, score_grad=plan.empty_rows == "add", **where))
    if plan.rank3:
        out = emit("call_method", "squeeze", (out, 0))
    out = perm(out, plan.out_perm)
    plan.anchor.replace_all_uses_with(out)
    _erase_dead(gm.graph, plan.owned)
    return out


def _self_attention(plan: _Plan) -> bool:
    """Whether the site's q and k are proved one token sequence (:mod:`.tokens`), read at
    their batch and sequence dims before the plan's permutes (and the rank-3 unsqueeze)."""
    dims = (0, 1 if plan.rank3 else 2)  # (batch, sequence) as the op sees q and k

    def before(perm):
        return dims if perm is None else (perm[dims[0]], perm[dims[1]])
    return same_tokens(plan.q, before(plan.q_perm), plan.k, before(plan.k_perm))


def _emit_offset(emit, graph, off: tuple):
    """An offset ``(const, terms)`` as an int, or as SymInt arithmetic on the symbol nodes."""
    c, terms = off
    nodes = {n.name: n for n in graph.nodes}
    total: Any = c
    for name, count in terms:
        term = nodes[name] if count == 1 else emit("call_function", operator.mul,
                                                   (nodes[name], count))
        total = term if total == 0 else emit("call_function", operator.add, (total, term))
    return total


def _folded_additive(emit, m: Node, factors: list, sum_dtype, q_dtype) -> Node:
    """An additive mask ``m`` with the scales that follow it folded in, in ``q_dtype``, or in
    ``sum_dtype`` where that is wider: eager adds a float32 bias to bfloat16 scores in float32
    (a mixed-precision model, autocast), and a bias of large common offset (absolute-position
    ALiBi) loses its differences in bfloat16 (the op takes a mask of any float dtype).

    Where the mask is added, an entry at or below ``finfo(sum_dtype).min / 2`` (or ``-inf``)
    masks its key (DESIGN.md, "The algorithm"). Scaling or casting can move such an entry
    above the op's own threshold (``finfo.min / 8`` after ``/ 8``; fp16's ``-65504`` cast to
    fp32), where the op would read it as a finite bias and let the key steer the selection.
    So masked entries become ``-inf`` first, which every positive scale and cast keeps.
    """
    mv = P.val(m)
    if not factors and isinstance(mv, torch.Tensor) and mv.dtype == q_dtype == sum_dtype:
        return m  # the op applies the same threshold to the same dtype
    if isinstance(sum_dtype, torch.dtype) and sum_dtype.is_floating_point:
        masked = emit("call_function", operator.le, (m, torch.finfo(sum_dtype).min / 2))
        for f, div in factors:
            m = emit("call_function", operator.truediv if div else operator.mul, (m, f))
        m = emit("call_function", torch.where, (masked, float("-inf"), m))
    else:  # pragma: no cover - the sum of a float mask and float scores is float
        for f, div in factors:
            m = emit("call_function", operator.truediv if div else operator.mul, (m, f))
    target = q_dtype
    if isinstance(sum_dtype, torch.dtype) and sum_dtype.is_floating_point and \
            isinstance(q_dtype, torch.dtype) and torch.promote_types(sum_dtype, q_dtype) == sum_dtype:
        target = sum_dtype
    mv = P.val(m)
    if not (isinstance(mv, torch.Tensor) and mv.dtype == target):  # unknown: cast
        m = emit("call_method", "to", (m, target))
    return m


def _erase_dead(graph, owned: list) -> None:
    """Erase the site's own nodes that no longer have users (never placeholders)."""
    owned_set = {n for n in owned if n.op in ("call_function", "call_method")}
    changed = True
    while changed:
        changed = False
        for n in list(owned_set):
            if not n.users:
                graph.erase_node(n)
                owned_set.discard(n)
                changed = True


# -- the pass --------------------------------------------------------------------------------------

def _is_mha(node: Node) -> bool:
    return node.op == "call_function" and node.target is MHA_TARGET


def _is_encoder_layer(node: Node) -> bool:
    return node.op == "call_function" and node.target is ENCODER_LAYER_TARGET


def find_sites(gm: GraphModule) -> list[Node]:
    """Candidate anchors in graph order: SDPA calls, softmax nodes,
    ``F.multi_head_attention_forward`` calls (``nn.MultiheadAttention``),
    ``torch._transformer_encoder_layer_fwd`` calls (``nn.TransformerEncoderLayer``) and
    activation-checkpoint regions (``torch.utils.checkpoint``), whose bodies hold their own."""
    return [n for n in gm.graph.nodes
            if P.sdpa_args(n) is not None or P.is_softmax(n) or _is_mha(n)
            or _is_encoder_layer(n) or _subgraphs(n)]


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph``: new nodes, shallow-copied meta, and the extra attributes Dynamo
    hangs on nodes (``_dynamo_source`` on placeholders, which AOTAutograd reads)."""
    new = copy.deepcopy(graph)
    for old_node, new_node in zip(graph.nodes, new.nodes):
        extra = getattr(old_node, "__dict__", {})
        for name, value in extra.items():
            if name not in new_node.__dict__:
                setattr(new_node, name, value)
    return new


def _subgraphs(node: Node) -> list[str]:
    """Names of the subgraph modules a call takes (a higher-order op's bodies)."""
    if node.op != "call_function":
        return []
    gm = node.graph.owning_module
    return [a.target for a in node.args if isinstance(a, Node) and a.op == "get_attr"
            and isinstance(getattr(gm, a.target, None), GraphModule)]


def _rewrite_subgraphs(gm: GraphModule, node: Node, config: PisaConfig, apply: bool,
                       done: dict) -> list[Site]:
    """The sites inside the bodies ``node`` calls. An activation-checkpoint region's body
    (``torch.utils.checkpoint``) is rewritten in a copy that replaces it, so a module shared
    with another caller (``explain``'s copy of the graph) is never changed; a mask it takes
    as an input is proved in the calling graph, where it is built (constant causal offsets
    and key padding; the key mask is then passed into the body as one more operand). Other bodies (``autograd.Function``, ``cond``,
    ...) are analysed and reported, not rewritten. ``done``: sites per body already seen."""
    checkpoint = P.is_checkpoint(node)
    sites = []
    for name in _subgraphs(node):
        if name not in done:
            body = getattr(gm, name)
            rewrite = apply and checkpoint
            if rewrite:
                body = GraphModule(body, copy_graph(body.graph))
            # Masks built outside the region are proved where they are built, when this call
            # is the body's only caller (its operands are then the body's inputs).
            callers = [u for a in gm.graph.nodes if a.op == "get_attr" and a.target == name
                       for u in a.users]
            token = _OUTER.set(_Outer(node, body, rewrite)
                               if checkpoint and callers == [node] else None)
            # The body runs in the autocast state of its call.
            outer_start = _AUTOCAST_AT_START.get()
            started = _AUTOCAST_AT_START.set(
                lambda dev, n=node, s=outer_start: _autocast_dtype(n, dev, s))
            try:
                inner = rewrite_graph(body, config, rewrite)
            finally:
                _AUTOCAST_AT_START.reset(started)
                _OUTER.reset(token)
            if rewrite and any(s.rewritten for s in inner):
                setattr(gm, name, body)
            for s in inner:
                s.node = f"{name}.{s.node}"
                if not checkpoint:
                    s.decision = LEFT_DENSE
                    s.reason = (f"inside {P.describe(node)}: the pass rewrites attention only "
                                "in activation-checkpoint bodies among subgraphs")
            done[name] = inner
        sites.extend(done[name])
    return sites


def _analyze_mha(node: Node, site: Site) -> dict:
    """Checks an ``F.multi_head_attention_forward`` call; returns its bound arguments."""
    try:
        b = MHA_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError as err:
        raise LeaveDense(f"unexpected multi_head_attention_forward call ({err})") from None
    b.apply_defaults()
    a = b.arguments
    q, k = P.val(a["query"]), P.val(a["key"])
    site.q_shape, site.k_shape, site.v_shape = (fmt_shape(P.val(a[n]))
                                                for n in ("query", "key", "value"))
    kinds = [m for m in ("attn_mask", "key_padding_mask") if a[m] is not None]
    site.mask = "+".join(kinds) if kinds else ("causal" if a["is_causal"] is True else "none")
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not isinstance(k, torch.Tensor):
        raise LeaveDense("unbatched nn.MultiheadAttention input")
    if not q.is_floating_point():
        raise LeaveDense(f"dtype {q.dtype}")
    for name in ("bias_k", "bias_v", "static_k", "static_v"):
        if a[name] is not None:
            raise LeaveDense(f"nn.MultiheadAttention with {name}")
    if a["add_zero_attn"] is not False:
        raise LeaveDense("nn.MultiheadAttention with add_zero_attn")
    dp, training = a["dropout_p"], a["training"]
    if not (training is False or (isinstance(dp, (int, float)) and dp == 0)):
        raise LeaveDense(_dropout_reason(dp))
    if not all(isinstance(a[n], bool) for n in ("is_causal", "use_separate_proj_weight")):
        raise LeaveDense("is_causal / use_separate_proj_weight are not constants")
    if not isinstance(a["num_heads"], int):
        raise LeaveDense("num_heads is not a constant")
    for u in node.users:
        if not (u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0):
            raise LeaveDense("the attention weights are used elsewhere (returned, stored or reused)")
    for name in ("attn_mask", "key_padding_mask"):
        if a[name] is not None:
            _check_mask_tensor(a[name])
            _check_mask_grad(a[name])
    # The module hands over its bool key padding mask as 0/-inf floats; the bool one is
    # structure the kernels read per key (lowering.mha).
    kpm = M.canonical_bool(a["key_padding_mask"])
    if kpm is not None:
        a["key_padding_mask"] = kpm
    return a


def _analyze_encoder_layer(node: Node, site: Site) -> dict:
    """Checks a ``torch._transformer_encoder_layer_fwd`` call; returns its arguments."""
    names = list(inspect.signature(pisa_transformer_encoder_layer_fwd).parameters)[:-1]
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        raise LeaveDense("unexpected _transformer_encoder_layer_fwd call")
    a = dict(zip(names, node.args), **node.kwargs)
    for name, default in (("mask", None), ("mask_type", None)):
        a.setdefault(name, default)
    src = P.val(a.get("src"))
    site.q_shape = site.k_shape = site.v_shape = fmt_shape(src)
    site.mask = "none" if a["mask"] is None else (
        f"{'bool' if P.val(a['mask']).dtype == torch.bool else 'float'}"
        f"({'key padding' if a['mask_type'] == 1 else 'attn_mask'})")
    if not isinstance(src, torch.Tensor) or src.dim() != 3 or not src.is_floating_point():
        raise LeaveDense("unbatched or non-float input to the fused encoder layer")
    for name in ("embed_dim", "num_heads", "use_gelu", "norm_first", "mask_type"):
        if isinstance(a[name], Node):
            raise LeaveDense(f"{name} is not a constant")
    if a["mask"] is not None:
        _check_mask_tensor(a["mask"])
    return a


def _apply_mha(gm: GraphModule, node: Node, bound: dict, config: PisaConfig,
               target=pisa_multi_head_attention_forward) -> None:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, (), dict(bound, config=config))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def rewrite_graph(gm: GraphModule, config: PisaConfig, apply: bool = True) -> list[Site]:
    """Rewrite every provable attention site of ``gm`` in place; return one :class:`Site` each.

    Args:
        gm: a Dynamo-captured ``GraphModule`` (torch IR, before autograd), with
            ``example_value`` metadata on its nodes.
        config: the :class:`PisaConfig` the inserted ``pisa_attention`` calls carry.
        apply: False only analyses (for :func:`explain`); the graph is untouched.

    Returns:
        The sites in graph order, each ``"rewritten"`` or ``"left dense"`` with a reason.
    """
    sites: list[Site] = []
    bodies: dict = {}  # subgraph name -> its sites (a body two calls share is seen once)
    for node in find_sites(gm):
        if node.graph is not gm.graph or node not in node.graph.nodes:
            continue  # erased by an earlier site
        if _subgraphs(node):
            sites.extend(_rewrite_subgraphs(gm, node, config, apply, bodies))
            continue
        is_sdpa = P.sdpa_args(node) is not None
        is_mha, is_layer = _is_mha(node), _is_encoder_layer(node)
        site = Site(form="sdpa" if is_sdpa else "nn.MultiheadAttention" if is_mha
                    else "nn.TransformerEncoderLayer" if is_layer else "softmax",
                    node=node.name, source=source_of(node.meta))
        try:
            if is_mha or is_layer:
                bound = (_analyze_mha if is_mha else _analyze_encoder_layer)(node, site)
                if apply:
                    _apply_mha(gm, node, bound, config, pisa_multi_head_attention_forward
                               if is_mha else pisa_transformer_encoder_layer_fwd)
                site.decision, site.reason = REWRITTEN, ""
                key = bound["key"] if is_mha else bound["src"]
                has_mask = _mha_has_mask(bound, is_layer, site)
                _describe(site, P.val(key).shape[-3 if is_mha else -2], has_mask, config,
                          P.val(key).device)
                # As mha.py decides it: an encoder layer, or MHA called with `query is key`.
                if (site.mask.endswith("->padding") and site.selection
                        and (is_layer or bound["query"] is bound["key"])):
                    site.selection += f"{_QUERY_PADDING_NOTE}, {_ALIGNED_NOTE}"
                sites.append(site)
                continue
            if is_sdpa:
                plan = _analyze_sdpa(node, site)
            else:
                plan = _analyze_softmax(node, site)
                if plan is None:
                    continue  # a softmax that does not feed a matmul: not attention
            q, k, v = _check_shapes(plan)
            site.q_shape, site.k_shape, site.v_shape = fmt_shape(q), fmt_shape(k), fmt_shape(v)
            _check_no_writes(gm.graph, plan)
            if is_sdpa and (short := _bounded_sdpa_reason(q.shape[-2], k.shape[-2])
                            or _short_sdpa_reason(k.shape[-2], config)):
                raise LeaveDense(short)
            plan.query_padding = plan.key_mask is not None and _self_attention(plan)
            if apply:
                _apply(gm, plan, config)
            site.decision, site.reason = REWRITTEN, ""
            site.form += _autocast_form(plan)
            _describe(site, k.shape[-2], plan.mask is not None or bool(plan.masks), config,
                      k.device, window=plan.window, padded=plan.key_mask is not None,
                      n_queries=q.shape[-2], causal=plan.is_causal)
            if site.selection and plan.key_mask is not None:
                if plan.query_padding:
                    site.selection += _QUERY_PADDING_NOTE
                # As ops._rows_align decides it (causal, or the proof; no cache before).
                if ((plan.query_padding or plan.is_causal) and plan.window is None
                        and statically_known_true(q.shape[-2] == k.shape[-2])):
                    site.selection += (", " if plan.query_padding else "; ") + _ALIGNED_NOTE
        except LeaveDense as why:
            site.decision, site.reason = LEFT_DENSE, str(why)
            if site.q_shape == "?" and not (is_mha or is_layer):
                _fill_shapes_best_effort(node, site)
        sites.append(site)
    if apply and any(s.rewritten for s in sites):
        gm.graph.lint()
        gm.recompile()
    return sites


def _mha_has_mask(bound: dict, is_layer: bool, site: Site) -> bool:
    """Whether a rewritten module site hands the op an explicit mask. A bool key padding mask
    alone goes to the kernels as structure (``key_mask``, see :mod:`.mha`); MHA drops
    ``attn_mask`` as a hint when ``is_causal`` holds without padding."""
    def is_bool(m):
        return m is not None and getattr(P.val(m), "dtype", None) == torch.bool

    if is_layer:
        m = bound["mask"]
        padding = m is not None and bound["mask_type"] == 1 and is_bool(m)
        has = m is not None and not padding
    else:
        kpm, am = bound["key_padding_mask"], bound["attn_mask"]
        padding = is_bool(kpm) and am is None
        has = not padding and (kpm is not None
                               or am is not None and bound["is_causal"] is not True)
    if padding:
        site.mask += "->padding"
    return has


def _user_bounded_symbols() -> Optional[set]:
    """The size symbols of this compile whose range the user bounded
    (``mark_dynamic(t, dim, min=, max=)``: a ``StrictMinMaxConstraint``, which Dynamo checks
    every guard against), or None when that cannot be read (then any bounded range counts).
    Read from Dynamo's tracing context: each input's per-dim constraints beside the symbols
    it made for them (private API, hence the fallback)."""
    try:
        from torch._guards import TracingContext
        from torch.fx.experimental.symbolic_shapes import StrictMinMaxConstraint
        ctx = TracingContext.try_get()
        if ctx is None:
            return None
        out = set()
        for sc in ctx.tensor_to_context.values():
            dims = [i for i, c in enumerate(getattr(sc, "constraint_sizes", None) or ())
                    if isinstance(c, StrictMinMaxConstraint)]
            for cache in (sc.shape_env_to_source_to_symbol_cache or {}).values() if dims else ():
                out.update(sym for name, sym in cache.items()
                           if any(name.endswith(f".size()[{i}]") for i in dims))
        return out
    except Exception:  # pragma: no cover - private API moved
        return None


def _bounded_sdpa_reason(n_queries, n_keys) -> Optional[str]:
    """Why an SDPA site whose lengths the user bounded (``mark_dynamic(min=, max=)``) stays
    as it is, or None. The op branches on the lengths (``min_seq_len``, the dense tail's
    bounds, one block or more), and Dynamo fails a compile whose guards narrow a range the
    user set, where Inductor's SDPA compiles it."""
    sizes = [n for n in (n_queries, n_keys) if isinstance(n, torch.SymInt)]
    if not sizes:
        return None
    env = sizes[0].node.shape_env
    # 2..int_oo: a size symbol nothing narrowed; only a narrowed one needs the look at the
    # tracing context (every input's constraints) for who narrowed it.
    bounded = {sym for n in sizes for sym in n.node.expr.free_symbols
               if (vr := env.var_to_range.get(sym)) is not None
               and (vr.lower > 2 or vr.upper is not int_oo)}
    if not bounded:
        return None
    user = _user_bounded_symbols()
    if user is not None and not bounded & user:
        return None
    return (f"Nq={n_queries}, Nk={n_keys}: a length range set by mark_dynamic(min=, max=) "
            f"(the op's branches on the lengths would narrow it and fail the compile): the "
            f"graph keeps its SDPA")


def _short_sdpa_reason(n_keys, config: PisaConfig) -> Optional[str]:
    """Why an SDPA site stays as it is, below ``min_seq_len`` keys, or None (rewrite it).

    The op would run plain SDPA there (``kernels.dispatch.plan``); left in the graph, it is
    Inductor's SDPA without the op's wrapper. A symbolic length is decided by a shape guard,
    as the traced op's own branch on it was, so a longer call recompiles once with the op.
    A length known only at run time (unbacked) gets no guard and stays dense: the op's
    branch on it failed the compile. One whose range the user bounded is left to
    :func:`_bounded_sdpa_reason`.
    """
    limit = config.min_seq_len
    if limit <= 0 or statically_known_true(n_keys >= limit):
        return None
    why = f"Nk={n_keys} < min_seq_len={limit}: the graph keeps its SDPA (Inductor)"
    if statically_known_true(n_keys < limit):
        return why
    if free_unbacked_symbols(n_keys):
        return (f"Nk={n_keys} is known only at run time (no guard can pick PISA or SDPA): "
                f"the graph keeps its SDPA")
    # (a range the user bounded never gets here: _bounded_sdpa_reason keeps it dense)
    if n_keys < limit:  # a guard: Dynamo recompiles for a longer call
        return why + "; a call with more keys recompiles with PISA"
    return None


def _describe(site: Site, n_keys, has_mask: bool, config: PisaConfig, device: torch.device,
              **kw) -> None:
    """Fill ``site.note`` (:func:`_note`) and ``site.selection`` of a rewritten site: how it
    selects blocks at its key length, where it selects at all."""
    site.note, selects = _note_and_selects(n_keys, has_mask, config, device, **kw)
    if selects:
        site.selection = config.selection_kind(n_keys if isinstance(n_keys, int) else None)
        n_leaves = -(-n_keys // config.block_size)
        if statically_known_true(n_leaves <= config.top_k):
            # DESIGN.md's exact regime: a user reading the report sees the call is not lossy.
            site.selection += (f"; exact: top_k {config.top_k} covers all {n_leaves} "
                               f"leaves")


def _note(n_keys, has_mask: bool, config: PisaConfig, device: torch.device, **kw) -> str:
    """What a rewritten site will run where it is not the fused sparse path (as
    ``kernels.dispatch.plan`` decides it at run time)."""
    return _note_and_selects(n_keys, has_mask, config, device, **kw)[0]


def _note_and_selects(n_keys, has_mask: bool, config: PisaConfig, device: torch.device,
                      window=None, padded: bool = False, n_queries=None,
                      causal: bool = False) -> tuple[str, bool]:
    """:func:`_note`, and whether the call selects blocks at all (not when all of it runs
    dense: below ``min_seq_len``, in the dense tail, under a window or, on CUDA, under an
    explicit mask)."""
    if statically_known_true(n_keys < config.min_seq_len):
        return f"runs plain SDPA: Nk={n_keys} < min_seq_len={config.min_seq_len}", False
    T = config.dense_tail
    # The dense tail takes such a call whole (ops._tail_rows), as a decode step is; known
    # statically, no guard.
    decode = n_queries is not None and window is None and is_decode_step(n_queries, n_keys)
    if decode or n_queries is not None and window is None and T and (
            statically_known_true(n_queries <= T)
            or causal and statically_known_true(n_queries < T + config.query_tile)):
        if not padded:
            # An explicit mask stays an argument of that SDPA call (a new user read "plain"
            # as the mask dropped).
            how = "runs SDPA under its explicit mask" if has_mask else "runs plain SDPA"
        elif device.type == "cuda" and statically_known_true(n_queries == 1):
            how = "runs SDPA under its key mask with enable_gqa"  # ops._masked_rows
        elif device.type == "cuda" and config.kernel != "reference":
            how = ("runs dense (the split-K kernel over every key block under its key mask "
                   "when no gradient is wanted, else SDPA)")
        else:
            how = "runs SDPA under its key mask"
        if decode:
            return (f"{how}: a decode step (Nq={n_queries} < Nk={n_keys}; a PisaCache's "
                    f"pyramid can serve it sparse)"), False
        bound = (f"Nq={n_queries} <= dense_tail={T}" if statically_known_true(n_queries <= T)
                 else f"Nq={n_queries} < dense_tail + query_tile = {T + config.query_tile}: "
                      f"too few rows before the tail for one query tile")
        return f"{how}: every query in the dense tail ({bound})", False
    notes = []
    if not statically_known_true(n_keys >= config.min_seq_len):
        notes.append(f"plain SDPA while Nk={n_keys} < min_seq_len={config.min_seq_len}")
    if window is not None and config.kernel == "triton":
        notes.append("window: PISA's Triton kernels over the window's blocks (kernel='triton'; "
                     "inputs they refuse run FlexAttention or dense SDPA under the window's "
                     "mask, with a warning)")
    elif window is not None and config.kernel == "reference":
        notes.append("window: dense SDPA under the window's mask (kernel='reference')")
    elif window is not None and device.type != "cuda":
        notes.append("window: dense SDPA under the window's mask (on CUDA: FlexAttention, or "
                     "PISA's Triton kernels over the window's blocks with a key mask)")
    elif window is not None and padded:
        notes.append("window with a key mask: the Triton attention kernels over the window's "
                     "blocks (traced FlexAttention was wrong with padding)")
    # Every kernel reads an unproved mask at run time; only CUDA's kernel="auto" runs dense
    # SDPA under a mask that is not causal AND padding (and where Triton refuses the inputs).
    dense_mask = has_mask and unstructured_mask_runs_dense(device, config.kernel)
    if has_mask:
        where = ("dense SDPA under the mask, as are inputs the Triton kernels refuse"
                 if dense_mask else "the PyTorch reference selection")
        if dense_mask:
            how = "the Triton kernels"
        elif config.kernel != "triton":
            how = "the PyTorch reference"
        elif device.type == "cuda":
            how = "the Triton kernels where they take the inputs, else the PyTorch reference"
        else:
            how = "Triton's interpreter (float16/float32), else the PyTorch reference"
        notes.append("explicit mask: read at run time (one pass over it per call, a host sync "
                     "on CUDA; with gradients the backward runs the forward again): causal AND "
                     f"padding runs PISA on its structure ({how}), any other mask {where}")
    return "; ".join(notes), window is None and not dense_mask


def _fill_shapes_best_effort(node: Node, site: Site) -> None:
    b = P.sdpa_args(node)
    if b is not None:
        site.q_shape, site.k_shape, site.v_shape = (fmt_shape(P.val(b[n]))
                                                    for n in ("query", "key", "value"))
    else:
        site.q_shape = "scores " + fmt_shape(P.val(P.softmax_input(node)[0]))
        site.k_shape = site.v_shape = "-"
