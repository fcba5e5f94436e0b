"""Which mask tensors are SDPA's top-left causal mask, proved from how the graph builds them.

Libraries often hand attention an explicit causal mask instead of ``is_causal=True``:
transformers builds ``kv_idx <= q_idx`` from two ``arange`` tensors under ``torch.compile``
(before torch 2.14 it never takes its ``is_causal`` shortcut while tracing); hand-written
models use ``torch.tril(torch.ones(n, n))``. A mask *tensor* forces the kernels onto the
masked path (a mask read per block, and the reference selection), while ``is_causal=True``
takes the fast analytic one. So the pass proves, symbolically and without running anything,
that a mask equals the causal mask, and then drops it for ``is_causal=True``.

The proof is an abstract evaluation of the mask's producers. Each node gets one of:

* :class:`Index`: ``arange(n) + offset`` (int32/int64), 1-D or laid along one dim (``-1``
  keys, ``-2`` queries) of a broadcast tensor;
* :data:`ONES`: a tensor of ones / ``True``;
* :class:`Causal`: 0/1 values with ``attend(i, j) = (j <= i)`` (query ``i``, key ``j``), or
  the negation, proved over an ``n_queries x n_keys`` grid.

Offsets are compared exactly: constant parts as ints, symbolic parts (a cache position, a
sequence length) as signed sums of node names. Anything the evaluator does not know makes the
answer "not causal", and so does any node of the proof that may be written in place (through
any view). A mask is left as it is unless the proof goes through.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Node

from . import patterns as P

__all__ = ["Index", "Causal", "ONES", "mask_value", "is_causal_bool", "is_causal_additive",
           "spans", "written_by", "is_view"]


@dataclass(frozen=True)
class Index:
    """``arange(length) + offset``; ``axis`` None while 1-D, else the (negative) dim it runs
    along. ``offset`` = ``const`` + the signed sum of the symbolic ``terms`` ((name, count))."""

    axis: Optional[int]
    const: int
    terms: tuple = ()
    length: Any = None  # int or SymInt


@dataclass(frozen=True)
class Causal:
    """0/1 (or bool) values over the last two dims: with ``attend`` True, 1 exactly where
    ``key <= query`` (SDPA's top-left causal mask); with False, the negation. Proved over
    ``n_queries x n_keys`` (a broadcast row is not causal: callers compare these with the
    mask's shape)."""

    attend: bool
    n_queries: Any
    n_keys: Any

    def negated(self) -> "Causal":
        return Causal(not self.attend, self.n_queries, self.n_keys)


ONES = "ones"
_INDEX_DTYPES = (torch.int32, torch.int64)
_CMP = {operator.le: "le", operator.ge: "ge", operator.lt: "lt", operator.gt: "gt",
        torch.le: "le", torch.ge: "ge", torch.lt: "lt", torch.gt: "gt"}
_CMP_METHODS = ("le", "ge", "lt", "gt", "__le__", "__ge__", "__lt__", "__gt__")
# Value-preserving for 0/1 masks (and, for Index, between int32/int64: checked separately).
_PASS_METHODS = ("to", "bool", "int", "long", "float", "half", "bfloat16", "type_as",
                 "contiguous", "expand", "expand_as", "clone", "detach")
# Ops whose result may share memory with their input: a write into the result is a write
# into the input.
_VIEWS = {"getitem", "view", "reshape", "expand", "expand_as", "unsqueeze", "squeeze",
          "transpose", "permute", "t", "T", "mT", "narrow", "select", "as_strided", "flatten",
          "unflatten", "view_as", "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims",
          "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "hsplit", "vsplit",
          "unfold", "detach", "to", "broadcast_to", "broadcast_tensors", "contiguous", "type_as",
          "type", "bool", "int", "long", "float", "half", "bfloat16", "real", "imag", "view_as_real", "view_as_complex",
          "reshape_as", "alias", "__getitem__"}
_INPLACE_OPS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                operator.ilshift, operator.irshift, operator.iand, operator.ior, operator.ixor,
                operator.imatmul, operator.iconcat}


def _name(n: Node) -> str:
    return n.target if n.op == "call_method" else getattr(n.target, "__name__", "")


@functools.lru_cache(maxsize=None)
def _inplace_position(fn) -> Optional[int]:
    """The position of ``fn``'s ``inplace`` parameter (``F.relu``, ``F.dropout``, ...)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def _inplace_flag(u: Node) -> bool:
    """``inplace=True`` given by keyword or by position."""
    if u.kwargs.get("inplace") is True:
        return True
    pos = _inplace_position(u.target) if u.op == "call_function" and callable(u.target) else None
    return pos is not None and len(u.args) > pos and u.args[pos] is True


def written_by(u: Node) -> list:
    """The tensors ``u`` may write in place: ``args[0]`` of ``setitem``, ``Tensor.xxx_``,
    ``x //= 2``-style ops and ``inplace=True`` functions (``F.relu``), an ``out=`` argument,
    and every argument of an unknown module."""
    if u.op == "call_module":
        return [a for a in (*u.args, *u.kwargs.values()) if isinstance(a, Node)]
    out = [u.kwargs["out"]] if isinstance(u.kwargs.get("out"), Node) else []
    if not (u.args and isinstance(u.args[0], Node)):
        return out
    name = _name(u)
    if u.op == "call_function" and getattr(u.target, "__module__", None) in ("_operator",
                                                                              "operator"):
        inplace = u.target in _INPLACE_OPS  # operator.and_ / or_ are not in place
    else:
        inplace = _inplace_flag(u) or isinstance(name, str) and (
            (name.endswith("_") and not name.startswith("__")) or name == "__setitem__"
            or (name.startswith("__i") and name.endswith("__")))
    return [u.args[0], *out] if inplace else out


_VIEW_ATTRS = ("mT", "T", "H", "mH", "real", "imag")


def is_view(u: Node) -> bool:
    """Whether ``u``'s result may share memory with its first argument (a view, a
    ``.mT``-style attribute, ``broadcast_to``)."""
    if not (u.args and isinstance(u.args[0], Node)):
        return False
    if u.op == "call_function" and u.target is getattr:
        return u.args[1] in _VIEW_ATTRS
    return _name(u) in _VIEWS


def _mutated(node: Node, seen: Optional[set] = None) -> bool:
    """Whether ``node``'s tensor, or any view of it, is written in place in the graph
    (``setitem``, ``Tensor.xxx_``, ``x //= 2``, ``out=``, an unknown module)."""
    seen = set() if seen is None else seen
    if node in seen:
        return False
    seen.add(node)
    for u in node.users:
        if any(t is node for t in written_by(u)):
            return True
        if is_view(u) and u.args[0] is node and _mutated(u, seen):
            return True
    return False


def _dtype(node: Any) -> Optional[torch.dtype]:
    v = P.val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _offset(x: Any) -> Optional[tuple[int, tuple]]:
    """A scalar offset as ``(const, terms)``: an int, or a symbolic node."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x, ()
    if isinstance(x, Node) and isinstance(P.val(x), (int, torch.SymInt)):
        return 0, ((x.name, 1),)
    return None


def _shifted(ix: Index, off: tuple[int, tuple], sign: int = 1) -> Index:
    c, terms = off
    t = Counter(dict(ix.terms))
    for name, k in terms:
        t[name] += sign * k
    kept = tuple(sorted((n, k) for n, k in t.items() if k != 0))  # signed: x - s keeps -s
    return Index(ix.axis, ix.const + sign * c, kept, ix.length)


def _equal(x: Any, y: Any) -> bool:
    if isinstance(x, Causal) and isinstance(y, Causal):
        return (x.attend == y.attend and P.known_equal(x.n_queries, y.n_queries)
                and P.known_equal(x.n_keys, y.n_keys))
    return x == ONES and y == ONES


def _index_axis(index: Any) -> Optional[int]:
    """The axis a 1-D tensor lands on under ``x[None, :, None]``-style indexing."""
    if not isinstance(index, tuple):
        return None
    full = [i for i, e in enumerate(index) if isinstance(e, slice)]
    if len(full) != 1 or any(e is not None for i, e in enumerate(index) if i != full[0]):
        return None
    s = index[full[0]]
    if (s.start, s.stop, s.step) != (None, None, None):
        return None
    return full[0] - len(index)


def _keeps_last_two(index: Any) -> bool:
    """``m[None, ..., :a, :b]``-style indexing: ``None`` only in front, then slices from 0
    with step 1 or ``...``. The last two dims stay the original last two, cut top-left."""
    items = index if isinstance(index, tuple) else (index,)
    leading = True
    for e in items:
        if e is None and leading:
            continue
        leading = False
        if e is Ellipsis:
            continue
        if not isinstance(e, slice) or e.start not in (None, 0) or e.step not in (None, 1):
            return False
    return True


def _compare(op: str, a: Any, b: Any) -> Optional[Causal]:
    """``a <op> b`` for two laid-out indices: causal when it is ``key <= query``."""
    if not (isinstance(a, Index) and isinstance(b, Index)):
        return None
    if {a.axis, b.axis} != {-1, -2} or (a.const, a.terms) != (b.const, b.terms):
        return None  # a shifted diagonal is not SDPA's causal mask
    if a.axis == -2:  # normalise to key <op> query
        a, b = b, a
        op = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt"}[op]
    if op in ("le", "gt"):
        return Causal(op == "le", b.length, a.length)
    return None  # key < query (strict) or key >= query: other masks


def _arange(node: Node) -> Optional[Index]:
    a, kw = node.args, node.kwargs
    if len(a) >= 2:
        start, end = a[0], a[1]
    elif len(a) == 1:
        start, end = (a[0], kw["end"]) if "end" in kw else (kw.get("start", 0), a[0])
    else:
        start, end = kw.get("start", 0), kw.get("end")
    step = a[2] if len(a) > 2 else kw.get("step", 1)
    v = P.val(node)
    off = _offset(start)
    if (end is None or isinstance(step, (bool, Node)) or step != 1 or off is None
            or not isinstance(v, torch.Tensor) or v.dim() != 1 or v.dtype not in _INDEX_DTYPES):
        return None
    return Index(None, *off, v.shape[0])


def _is_ones_call(node: Node) -> bool:
    if P._fn(node, torch.ones, torch.ones_like) or P._meth(node, "new_ones"):
        return True
    if P._fn(node, torch.full) or P._meth(node, "new_full"):
        fill = P.arg(node, 1 if node.op == "call_function" else 2, "fill_value")
        return fill is True or (not isinstance(fill, bool) and fill == 1)
    return False


def _causal_over(node: Node, attend: bool) -> Optional[Causal]:
    """A causal value over ``node``'s own last two dims (tril/triu of ones, a top-left cut)."""
    v = P.val(node)
    if not isinstance(v, torch.Tensor) or v.dim() < 2:
        return None
    return Causal(attend, v.shape[-2], v.shape[-1])


def mask_value(node: Any, depth: int = 32, _memo: Optional[dict] = None) -> Any:
    """The abstract value of ``node`` (an :class:`Index`, :data:`ONES`, :class:`Causal`),
    or None when unknown."""
    memo = {} if _memo is None else _memo
    if not isinstance(node, Node) or depth <= 0:
        return None
    if node in memo:
        return memo[node]
    memo[node] = None
    if _mutated(node):  # `pad = ones(..); pad[0, -3:] = False`: the value is not the call's
        return None
    out = _evaluate(node, lambda x: mask_value(x, depth - 1, memo))
    memo[node] = out
    return out


def _evaluate(node: Node, ev) -> Any:
    x0 = P.arg(node, 0, "input")
    x1 = P.arg(node, 1, "other")
    if P._fn(node, torch.arange):
        return _arange(node)
    if P._fn(node, operator.add, torch.add) or P._meth(node, "add", "__add__", "__radd__"):
        if node.kwargs.get("alpha", 1) != 1 or _dtype(node) not in _INDEX_DTYPES:
            return None
        a, b = (x0, x1) if isinstance(ev(x0), Index) else (x1, x0)
        ix, off = ev(a), _offset(b)
        return _shifted(ix, off) if isinstance(ix, Index) and off is not None else None
    if P._fn(node, operator.sub, torch.sub) or P._meth(node, "sub", "__sub__"):
        if node.kwargs.get("alpha", 1) != 1 or _dtype(node) not in _INDEX_DTYPES:
            return None
        ix, off = ev(x0), _offset(x1)
        return _shifted(ix, off, -1) if isinstance(ix, Index) and off is not None else None
    if P._fn(node, operator.getitem) or P._meth(node, "__getitem__"):
        x = ev(node.args[0])
        if isinstance(x, Index) and x.axis is None:
            axis = _index_axis(node.args[1])
            return None if axis is None else Index(axis, x.const, x.terms, x.length)
        if x == ONES:
            return ONES
        if isinstance(x, Causal) and _keeps_last_two(node.args[1]):
            return _causal_over(node, x.attend)
        return None
    if P._fn(node, torch.unsqueeze) or P._meth(node, "unsqueeze"):
        x, dim = ev(x0), P.arg(node, 1, "dim")
        if isinstance(x, Index) and x.axis is None and dim in (0, 1, -1, -2):
            return Index(-2 if dim in (1, -1) else -1, x.const, x.terms, x.length)
        return None
    if node.op == "call_function" and node.target in _CMP or P._meth(node, *_CMP_METHODS):
        op = _CMP.get(node.target) if node.op == "call_function" else node.target.strip("_")
        return _compare(op, ev(x0), ev(x1))
    if P._fn(node, operator.and_, torch.logical_and, torch.bitwise_and) or \
            P._meth(node, "logical_and", "bitwise_and", "__and__", "__rand__"):
        x, y = ev(x0), ev(x1)
        if _dtype(node) != torch.bool:
            return None
        if x == ONES and (y == ONES or isinstance(y, Causal)):
            return y
        if y == ONES and isinstance(x, Causal) or _equal(x, y):
            return x
        return None
    if P._fn(node, operator.invert, torch.bitwise_not) or \
            P._meth(node, "bitwise_not", "__invert__"):
        x = ev(x0)
        if _dtype(x0) != torch.bool or not isinstance(x, Causal):  # ~1 == -2 on ints
            return None
        return x.negated()
    if P._fn(node, torch.logical_not) or P._meth(node, "logical_not"):
        x = ev(x0)
        return x.negated() if isinstance(x, Causal) else None
    if P._fn(node, operator.eq, operator.ne, torch.eq, torch.ne) or \
            P._meth(node, "eq", "ne", "__eq__", "__ne__"):
        x, c = ev(x0), x1
        if isinstance(x, Causal) and not isinstance(c, Node) and c in (0, 1, True, False):
            keep = (c in (1, True)) == (_name(node) in ("eq", "__eq__"))
            return x if keep else x.negated()
        return None
    if P._fn(node, torch.tril, torch.triu) or P._meth(node, "tril", "triu"):
        diag = P.arg(node, 1, "diagonal", 0)
        lower = _name(node) == "tril"
        if ev(x0) == ONES and (lower and diag == 0 or not lower and diag == 1):
            return _causal_over(node, lower)
        return None
    if _is_ones_call(node):
        return ONES
    if node.op == "call_method" and node.target in _PASS_METHODS:
        x = ev(node.args[0])
        if isinstance(x, Index):
            return x if _dtype(node) in _INDEX_DTYPES and node.target in (
                "to", "int", "long", "contiguous", "clone", "detach") else None
        return x
    return None


def is_causal_bool(mask: Any, attend_if: bool = True) -> bool:
    """Whether a bool mask is SDPA's causal mask, where ``mask == attend_if`` means attend."""
    v = mask_value(mask)
    return (isinstance(v, Causal) and v.attend == attend_if and _dtype(mask) == torch.bool
            and spans(mask, v.n_queries, v.n_keys))


def spans(mask: Any, n_queries, n_keys) -> bool:
    """The mask's last two dims are exactly ``[n_queries, n_keys]`` (no size-1 dim that would
    broadcast)."""
    t = P.val(mask)
    return (isinstance(t, torch.Tensor) and t.dim() >= 2
            and P.known_equal(t.shape[-2], n_queries) and P.known_equal(t.shape[-1], n_keys))


def _same_last_two(a: Any, b: Any) -> bool:
    tb = P.val(b)
    return isinstance(tb, torch.Tensor) and tb.dim() >= 2 and spans(a, *tb.shape[-2:])


def _const(x: Any) -> Any:
    if isinstance(x, Node) and _mutated(x):
        return None
    return P.constant_of(x)


def _is_zero(x: Any) -> bool:
    """The number 0, a one-element constant 0, or a ``zeros`` tensor, never written to."""
    c = _const(x)
    if not isinstance(c, bool) and isinstance(c, (int, float)) and c == 0:
        return True
    return isinstance(x, Node) and not _mutated(x) and (
        P._fn(x, torch.zeros, torch.zeros_like) or P._meth(x, "new_zeros"))


def _masks(fill: Any, scale: float, scores_dtype: torch.dtype) -> bool:
    """``fill`` added to scores of ``scores_dtype`` and then scaled by ``scale > 0`` gives
    softmax weight exactly 0: ``-inf``, or at most ``finfo(scores_dtype).min / 2``."""
    c = _const(fill)
    if isinstance(c, bool) or not isinstance(c, (int, float)):
        return False
    if c == -math.inf:
        return True
    return scores_dtype.is_floating_point and c * scale <= torch.finfo(scores_dtype).min / 2


def is_causal_additive(mask: Any, scale: float = 1.0,
                       scores_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether a float mask, added to scores of ``scores_dtype`` (default: the mask's) that
    are then scaled by ``scale``, is 0 where causal and masks everything else:
    ``where(causal, 0, fill)``, ``where(~causal, fill, 0)``,
    ``zeros.masked_fill(~causal, fill)``, and float-to-float casts of those."""
    if not isinstance(mask, Node) or not (isinstance(scale, (int, float)) and scale > 0):
        return False
    dtype = _dtype(mask)
    if dtype is None or not dtype.is_floating_point:
        return False
    scores_dtype = scores_dtype or dtype
    node = mask
    while node.op == "call_method" and node.target in ("to", "float", "half", "bfloat16",
                                                       "type_as", "contiguous", "expand"):
        src = node.args[0]
        if not (isinstance(src, Node) and (_dtype(src) or torch.bool).is_floating_point):
            return False  # a bool -> float cast turns the mask into 0/1, not 0/-inf
        node = src
    if _mutated(node):
        return False
    if P._fn(node, torch.where) and len(node.args) == 3:
        cond, a, b = node.args
        if not _same_last_two(cond, node):
            return False
        if _is_zero(a) and _masks(b, scale, scores_dtype):
            return is_causal_bool(cond, True)
        if _is_zero(b) and _masks(a, scale, scores_dtype):
            return is_causal_bool(cond, False)
        return False
    if P._fn(node, torch.masked_fill) or P._meth(node, "masked_fill"):
        base, m, fill = node.args[0], P.arg(node, 1, "mask"), P.arg(node, 2, "value")
        return (_is_zero(base) and _same_last_two(base, node) and _same_last_two(m, node)
                and _masks(fill, scale, scores_dtype) and is_causal_bool(m, False))
    return False
