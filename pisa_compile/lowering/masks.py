"""Which mask tensors are SDPA's top-left causal mask, proved from how the graph builds them.

Libraries often hand attention an explicit causal mask instead of ``is_causal=True``:
transformers builds ``kv_idx <= q_idx`` from two ``arange`` tensors under ``torch.compile``
(before torch 2.14 it never takes its ``is_causal`` shortcut while tracing); hand-written
models use ``torch.tril(torch.ones(n, n))``. A mask *tensor* forces the kernels onto the
masked path (a mask read per block, and the reference selection), while ``is_causal=True``
takes the fast analytic one. So the pass proves, symbolically and without running anything,
that a mask equals the causal mask, and then drops it for ``is_causal=True``.

The proof is an abstract evaluation of the mask's producers. Each node gets one of:

* :class:`Index`: ``arange(n) + offset``, 1-D or laid along one dim (``-1`` keys, ``-2``
  queries) of a broadcast tensor;
* :data:`ONES`: a tensor of ones / ``True``;
* :class:`Causal`: ``attend(i, j) = (j <= i)`` (query ``i``, key ``j``), or its negation.

Offsets are compared exactly: constant parts as ints, symbolic parts (a cache position) by
node identity. Anything the evaluator does not know makes the answer "not causal": a mask
is left as it is unless the proof goes through. The caller checks that the mask's last two
dims are exactly ``[Nq, Nk]`` (a broadcast row would not be causal).
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Node

from . import patterns as P

__all__ = ["Index", "Causal", "ONES", "mask_value", "is_causal_bool", "is_causal_additive"]


@dataclass(frozen=True)
class Index:
    """``arange(length) + offset``; ``axis`` None while 1-D, else the (negative) dim it runs
    along. ``offset`` is a constant plus a multiset of symbolic terms (node names)."""

    axis: Optional[int]
    const: int
    terms: tuple = ()
    length: Any = None  # int or SymInt: the arange's length


@dataclass(frozen=True)
class Causal:
    """A bool (or 0/1) tensor over the last two dims: ``attend`` True means the value is
    True exactly where ``key <= query`` (SDPA's top-left causal mask), False its negation;
    proved over ``n_queries x n_keys`` (a broadcast row is not causal: callers compare these
    with the mask's shape)."""

    attend: bool
    n_queries: Any
    n_keys: Any


ONES = "ones"
_CMP = {operator.le: "le", operator.ge: "ge", operator.lt: "lt", operator.gt: "gt",
        torch.le: "le", torch.ge: "ge", torch.lt: "lt", torch.gt: "gt"}
_PASS_METHODS = ("to", "bool", "contiguous", "expand", "expand_as", "clone", "detach",
                 "float", "half", "bfloat16", "type_as")


def _offset(x: Any) -> Optional[tuple[int, tuple]]:
    """A scalar offset as ``(const, terms)``: an int, or a symbolic node."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x, ()
    if isinstance(x, Node) and isinstance(P.val(x), (int, torch.SymInt)):
        return 0, (x.name,)
    return None


def _shifted(ix: Index, off: tuple[int, tuple], sign: int = 1) -> Optional[Index]:
    c, terms = off
    t = Counter(ix.terms)
    for name in terms:
        t[name] += sign
    return Index(ix.axis, ix.const + sign * c, tuple(sorted((+t).elements())), ix.length)


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


def _is_ones_call(node: Node) -> bool:
    if P._fn(node, torch.ones, torch.ones_like) or P._meth(node, "new_ones"):
        return True
    if P._fn(node, torch.full) or P._meth(node, "new_full"):
        fill = P.arg(node, 1 if node.op == "call_function" else 2, "fill_value")
        return fill is True or (not isinstance(fill, bool) and fill == 1)
    return False


def mask_value(node: Any, depth: int = 24, _memo: Optional[dict] = None) -> Any:
    """The abstract value of ``node`` (an :class:`Index`, :data:`ONES`, :class:`Causal`),
    or None when unknown."""
    memo = {} if _memo is None else _memo
    if not isinstance(node, Node) or depth <= 0:
        return None
    if node in memo:
        return memo[node]
    memo[node] = None  # cycles cannot happen in an FX graph; this also bounds re-entry
    if _mutated(node):  # `pad = ones(..); pad[0, -3:] = False`: the value is not the call's
        return None
    ev = lambda x: mask_value(x, depth - 1, memo)  # noqa: E731
    out = None
    a0 = node.args[0] if node.args else None
    if P._fn(node, torch.arange):
        start, end = (0, a0) if len(node.args) == 1 else node.args[:2]
        step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
        off = _offset(start)
        v = P.val(node)
        if step == 1 and off is not None and isinstance(v, torch.Tensor) and v.dim() == 1:
            out = Index(None, *off, v.shape[0])
    elif P._fn(node, operator.add, torch.add) or P._meth(node, "add", "__add__"):
        x, y = (node.args + (None,))[:2]
        if isinstance(ev(y), Index) and not isinstance(ev(x), Index):
            x, y = y, x
        ix, off = ev(x), _offset(y)
        if isinstance(ix, Index) and off is not None and node.kwargs.get("alpha", 1) == 1:
            out = _shifted(ix, off)
    elif P._fn(node, operator.sub, torch.sub) or P._meth(node, "sub", "__sub__"):
        ix, off = ev(a0), _offset(node.args[1] if len(node.args) > 1 else None)
        if isinstance(ix, Index) and off is not None:
            out = _shifted(ix, off, -1)
    elif P._fn(node, operator.getitem):
        x = ev(a0)
        if isinstance(x, Index) and x.axis is None:
            axis = _index_axis(node.args[1])
            out = None if axis is None else Index(axis, x.const, x.terms, x.length)
        elif x == ONES:
            out = x
        elif isinstance(x, Causal) and _keeps_top_left(node.args[1]):
            out = _causal_over(node, x.attend)
    elif P._fn(node, torch.unsqueeze) or P._meth(node, "unsqueeze"):
        x, dim = ev(a0), P.arg(node, 1, "dim")
        if isinstance(x, Index) and x.axis is None and dim in (0, 1, -1, -2):
            out = Index(-2 if dim in (1, -1) else -1, x.const, x.terms, x.length)
    elif node.op == "call_function" and node.target in _CMP or \
            P._meth(node, "le", "ge", "lt", "gt", "__le__", "__ge__", "__lt__", "__gt__"):
        op = _CMP.get(node.target) if node.op == "call_function" else node.target.strip("_")
        out = _compare(op, ev(a0), ev(node.args[1]))
    elif P._fn(node, operator.and_, operator.iand, torch.logical_and, torch.bitwise_and) or \
            P._meth(node, "logical_and", "bitwise_and", "__and__"):
        x, y = ev(a0), ev(node.args[1])
        if x == ONES:
            out = y
        elif y == ONES or x == y:
            out = x
    elif P._fn(node, operator.invert, torch.logical_not, torch.bitwise_not) or \
            P._meth(node, "logical_not", "bitwise_not", "__invert__"):
        x = ev(a0)
        out = Causal(not x.attend, x.n_queries, x.n_keys) if isinstance(x, Causal) else None
    elif P._fn(node, operator.eq, operator.ne, torch.eq, torch.ne) or \
            P._meth(node, "eq", "ne", "__eq__", "__ne__"):
        x, c = ev(a0), node.args[1]
        if isinstance(x, Causal) and not isinstance(c, Node) and c in (0, 1, True, False):
            keep = (c in (1, True)) == (node.target in (operator.eq, torch.eq, "eq", "__eq__"))
            out = x if keep else Causal(not x.attend, x.n_queries, x.n_keys)
    elif P._fn(node, torch.tril, torch.triu) or P._meth(node, "tril", "triu"):
        x = ev(a0)
        diag = P.arg(node, 1, "diagonal", 0)
        lower = node.target in (torch.tril, "tril")
        if x == ONES and (lower and diag == 0 or not lower and diag == 1):
            out = _causal_over(node, lower)
    elif _is_ones_call(node):
        out = ONES
    elif node.op == "call_method" and node.target in _PASS_METHODS:
        out = ev(a0)
        if isinstance(out, Index):
            out = out if node.target in ("to", "contiguous", "clone", "detach") else None
    memo[node] = out
    return out


_VIEWS = ("getitem", "view", "reshape", "expand", "expand_as", "unsqueeze", "squeeze",
          "transpose", "permute", "t", "narrow", "select", "as_strided", "flatten", "unflatten",
          "view_as", "diagonal", "movedim", "detach", "to", "contiguous", "type_as", "bool",
          "float", "T", "mT")


_INPLACE = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
            operator.iand, operator.ior, operator.ixor)


def _mutated(node: Node, depth: int = 6) -> bool:
    """Whether ``node``'s tensor, or a view of it, is written in place anywhere in the graph
    (``setitem``, ``Tensor.xxx_``, ``out=``). Views are followed a few steps; other ops make
    new tensors."""
    for u in node.users:
        name = u.target if u.op == "call_method" else getattr(u.target, "__name__", "")
        if u.op == "call_function" and u.target in _INPLACE and u.args and u.args[0] is node \
                or "out" in u.kwargs:
            return True
        if isinstance(name, str) and name.endswith("_") and not name.startswith("__") \
                and u.args and u.args[0] is node:
            return True
        if name in _VIEWS and depth > 0 and _mutated(u, depth - 1):
            return True
    return False


def _causal_over(node: Node, attend: bool) -> Optional[Causal]:
    """A causal value over ``node``'s own last two dims (tril/triu of ones, a top-left slice)."""
    v = P.val(node)
    if not isinstance(v, torch.Tensor) or v.dim() < 2:
        return None
    return Causal(attend, v.shape[-2], v.shape[-1])


def _same(a: Any, b: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    try:
        return a is b or bool(statically_known_true(a == b))
    except Exception:  # unrelated symbols
        return False


def _covers(mask: Any, v: Causal) -> bool:
    """The causal proof spans the mask's own last two dims (no broadcast row or column)."""
    t = P.val(mask)
    return (isinstance(t, torch.Tensor) and t.dim() >= 2 and _same(t.shape[-2], v.n_queries)
            and _same(t.shape[-1], v.n_keys))


def _keeps_top_left(index: Any) -> bool:
    """``mask[..., :a, :b]``-style slicing from 0 (keeps a causal mask causal)."""
    items = index if isinstance(index, tuple) else (index,)
    for e in items:
        if e is Ellipsis or e is None:
            continue
        if not isinstance(e, slice) or e.start not in (None, 0) or e.step not in (None, 1):
            return False
    return True


def is_causal_bool(mask: Any, attend_if: bool = True) -> bool:
    """Whether a bool mask is SDPA's causal mask, where ``mask == attend_if`` means attend."""
    v = mask_value(mask)
    return (isinstance(v, Causal) and v.attend == attend_if and _is_bool(mask)
            and _covers(mask, v))


def is_causal_additive(mask: Any) -> bool:
    """Whether a float mask is ``0`` where causal and a masking fill (``-inf`` or at most
    ``finfo.min / 2``) elsewhere: ``where(causal, 0, fill)``, ``where(~causal, fill, 0)``,
    ``zeros.masked_fill(~causal, fill)``, and casts of those."""
    if not isinstance(mask, Node):
        return False
    v = P.val(mask)
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        return False
    node = mask
    while P.as_noop_cast(node) is not None or P._meth(node, "to", "contiguous", "expand"):
        node = node.args[0]
    dtype = v.dtype
    if P._fn(node, torch.where) and len(node.args) == 3:
        cond, a, b = node.args
        if _is_zero(a) and P.is_masking_fill(b, dtype):
            return is_causal_bool(cond, True)
        if _is_zero(b) and P.is_masking_fill(a, dtype):
            return is_causal_bool(cond, False)
        return False
    if P._fn(node, torch.masked_fill) or P._meth(node, "masked_fill"):
        base, m, fill = node.args[0], P.arg(node, 1, "mask"), P.arg(node, 2, "value")
        return _is_zero(base) and P.is_masking_fill(fill, dtype) and is_causal_bool(m, False)
    return False


def _is_zero(x: Any) -> bool:
    """The number 0, a one-element constant 0, or a ``zeros`` tensor."""
    c = P.constant_of(x)
    if not isinstance(c, bool) and isinstance(c, (int, float)) and c == 0:
        return True
    return isinstance(x, Node) and (P._fn(x, torch.zeros, torch.zeros_like)
                                    or P._meth(x, "new_zeros", "zero_"))


def _is_bool(mask: Any) -> bool:
    v = P.val(mask)
    return isinstance(v, torch.Tensor) and v.dtype == torch.bool
