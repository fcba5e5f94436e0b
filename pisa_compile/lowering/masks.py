"""Which mask tensors are structure (causal with an offset, key padding), proved from how the
graph builds them.

Libraries hand attention an explicit mask tensor instead of structure: transformers builds
``(kv_idx <= q_idx) & attention_mask[batch_idx, kv_idx]`` from ``arange`` tensors under
``torch.compile`` (before torch 2.14 it never takes its ``is_causal`` shortcut while tracing),
with ``q_idx`` offset by the KV cache in decode; hand-written models use
``torch.tril(torch.ones(n, n))``. A mask *tensor* keeps the site off the fused selection
(dense SDPA under the mask on CUDA, the reference selection elsewhere), while structure takes
the fast analytic path. So the pass proves, symbolically and without running anything, what a mask
is, and hands the op the structure instead: ``is_causal`` with a ``causal_offset`` and a
``key_mask [B, Nk]``. The dense mask is then dead code.

The proof is an abstract evaluation of the mask's producers. Each node gets one of:

* :class:`Index`: ``arange(n) + offset`` (int32/int64), 1-D or laid along one dim (``-1``
  keys, ``-2`` queries, ``-4`` batch) of a broadcast tensor;
* :data:`ONES`: a tensor of ones / ``True``;
* :class:`Const`: a tensor every entry of which is one value (transformers' packed-sequence
  ids over ``arange`` position ids: one sequence);
* :class:`Struct`: 0/1 values with ``attend(b, i, j) = lower <= j - i <= upper and
  key[b, j]`` (query ``i``, key ``j``; each part optional), or the negation;
* :class:`FMask`: a float mask, 0 on a :class:`Struct` and a finite ``fill`` elsewhere
  (transformers 4.48-4.52 build ``full(finfo.min)``, ``triu``, ``*= bool``, then fill the
  padding through ``(mask + attention_mask) == 0``), with :class:`KeyVal`,
  :class:`PadSum` and :class:`PadTest` for the steps of that padding fill.

Masks built in place (``m *= hide``, ``hide |= window``, ``m[:, :, :, :n] = ...``) are read
by versions: a tensor the graph creates, written only through itself or its in-place results
(never through a view), has at each reader the value of its creation followed by the writes
before that reader in graph order (:func:`_versioned`); a site's mask must see every write
before its first use.

Offsets are compared exactly: constant parts as ints, symbolic parts (a cache position, a
sequence length) as signed sums of node names. Anything the evaluator does not know makes the
answer "not structure", and so does any node of the proof that may be written in place
through a view, or whose writes are not one of the forms above, the key mask's included. A
mask is left as it is unless the proof goes through.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops import holds_causal_mask
from . import patterns as P

__all__ = ["Index", "Struct", "ONES", "mask_value", "bool_structure", "additive_structure",
           "both", "fits", "spans", "written_by", "is_view", "alias_find", "offset_value",
           "canonical_bool"]


@dataclass(frozen=True)
class Index:
    """``arange(length) + offset``; ``axis`` None while 1-D, else the (negative) dim it runs
    along. ``offset`` = ``const`` + the signed sum of the symbolic ``terms`` ((name, count))."""

    axis: Optional[int]
    const: int
    terms: tuple = ()
    length: Any = None  # int or SymInt


# The comparison that holds exactly where another fails (on non-NaN values).
_FLIP_TEST = {"eq": "ne", "ne": "eq", "lt": "ge", "ge": "lt", "le": "gt", "gt": "le"}


@dataclass(frozen=True)
class Struct:
    """0/1 (or bool) values over ``[..., n_queries, n_keys]``: with ``attend`` True, 1 exactly
    where ``j - i <= upper`` (if set), ``j - i >= lower`` (if set) and ``key[b, j]`` (if set),
    for query ``i``, key ``j``, batch ``b``; with False, the negation.

    ``upper``/``lower`` are offsets ``(const, terms)`` as in :class:`Index`; ``upper = 0`` is
    SDPA's top-left causal mask, ``upper = past`` a KV cache's, ``lower`` a sliding window's
    edge. ``key`` is the node of a ``[B, Nk]`` bool tensor, read at ``[b, j]`` (padding), or
    with ``key_test = (op, c)`` of any dtype, read as ``key[b, j] <op> c`` (``op`` a
    comparison method: ``"ne"``, ``"eq"``, ``"gt"``, ``"ge"``, ``"lt"``, ``"le"``; a
    tokenizer's int ``attention_mask`` tested as written, ``.bool()`` as ``("ne", 0)``).
    ``n_queries`` is None while the values do not depend on the query (a key mask alone);
    callers compare the shapes with the mask's own.
    """

    attend: bool
    n_queries: Any
    n_keys: Any
    upper: Optional[tuple] = None
    lower: Optional[tuple] = None
    key: Optional[Node] = None
    key_cut: bool = False  # read key[:, :n_keys] (its length is not provably n_keys)
    # Module buffers whose values this structure was read from (a registered causal mask):
    # true when the graph was compiled, so the op must check them on every call.
    checked: tuple = ()
    key_test: Optional[tuple] = None  # (op, c): a key attends where ``key <op> c``
    # Rows of ``key`` read (``key[:key_rows]``) when its batch is not provably the rows read:
    # a graph where attention_mask got its own batch symbol (no duck sizing).
    key_rows: Any = None
    # A float mask's value off the structure (additive_structure): a finite one (finfo.min)
    # makes eager's rows that see no key uniform, where -inf and bool masks give zeros.
    fill: Optional[float] = None

    def negated(self) -> "Struct":
        """The negation; one bound alone flips to the other bound (``j - i > u`` is
        ``j - i >= u + 1``), so ``~triu(ones, 1)`` is the causal mask again, and a key test
        alone flips its comparison (``~(am < 1)`` is ``am >= 1``: ``masked_fill(am <= 0,
        -inf)`` attends where ``am > 0``). An ordering test flips only on a non-float key:
        ``not (x < c)`` is not ``x >= c`` for a NaN."""
        if (self.attend and self.key_test is not None and self.upper is None
                and self.lower is None):
            op, c = self.key_test
            flip = _FLIP_TEST[op]
            dtype = _dtype(self.key)
            # (a NaN constant fails both x < c and x >= c, whatever the key's dtype)
            if op in ("eq", "ne") or (dtype is not None and not dtype.is_floating_point
                                      and not dtype.is_complex and c == c):
                return dataclasses.replace(self, key_test=(flip, c), fill=None)
        if self.key is None and (self.upper is None) != (self.lower is None):
            if self.upper is not None:
                c, t = self.upper
                return Struct(self.attend, self.n_queries, self.n_keys, lower=(c + 1, t),
                              checked=self.checked)
            c, t = self.lower
            return Struct(self.attend, self.n_queries, self.n_keys, upper=(c - 1, t),
                          checked=self.checked)
        return dataclasses.replace(self, attend=not self.attend, fill=None)


@dataclass(frozen=True)
class FMask:
    """A float mask of transformers <= 4.52's kind (``full(min) -> triu -> *= bool``): 0 exactly
    where ``region`` attends, ``fill`` everywhere else (``region`` None: ``fill`` everywhere).
    ``fill`` is finite, so multiplying by a 0/1 mask keeps the two values (``-inf * 0`` would
    be NaN)."""

    region: Optional[Struct]
    fill: float


@dataclass(frozen=True)
class KeyVal:
    """``key[:, None, None, :]`` of a ``[B, Nk]`` tensor that is not bool (a tokenizer's int
    ``attention_mask``): its values, laid along the batch and key dims. ``exact`` False: cast
    after the layout (an int to a float rounds large values), so only its zero test holds."""

    key: Node
    exact: bool = True


@dataclass(frozen=True)
class PadSum:
    """``FMask(region, fill) + KeyVal(key)`` (a float tensor; only its test against 0 is
    read)."""

    region: Struct
    fill: float
    key: Node


@dataclass(frozen=True)
class PadTest:
    """``(FMask(region, fill) + KeyVal(key)) == 0``: on ``region`` (where the mask is 0) it
    is exactly ``key[b, j] == 0``; elsewhere it is unknown, which the ``masked_fill`` rule of
    :func:`_float_mask_rules` never needs (``fill`` is written there anyway)."""

    region: Struct
    fill: float
    key: Node


@dataclass(frozen=True)
class Const:
    """A tensor every entry of which is ``value`` (transformers' packed-sequence ids of
    positions that run ``arange``: one sequence, every id 0)."""

    value: Any


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
          "reshape_as", "alias", "__getitem__",
          # may return the input itself: a device or dtype it already has, a no-op
          "cpu", "cuda", "double", "byte", "char", "short", "cfloat", "cdouble", "positive",
          "ravel", "conj", "resolve_conj", "resolve_neg", "atleast_1d", "atleast_2d",
          "atleast_3d"}
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
    ``x //= 2``-style ops and ``inplace=True`` functions (``F.relu``), every tensor of the
    list of ``torch._foreach_xxx_``, an ``out=`` argument, every argument of an unknown
    module, and the operands a subgraph call may write (:func:`_subgraph_writes`)."""
    if u.op == "call_module":
        return [a for a in (*u.args, *u.kwargs.values()) if isinstance(a, Node)]
    hop = _subgraph_writes(u)
    if hop is not None:
        return hop
    schema = _schema_writes(u)
    if schema is not None:
        return schema
    out = [u.kwargs["out"]] if isinstance(u.kwargs.get("out"), Node) else []
    first = u.args[0] if u.args else None
    if isinstance(first, Node):
        targets = [first]
    elif isinstance(first, (list, tuple)):  # torch._foreach_xxx_([a, b]) writes each
        targets = [a for a in first if isinstance(a, Node)]
    else:
        targets = []
    if not targets:
        return out
    name = _name(u)
    if u.op == "call_function" and getattr(u.target, "__module__", None) in ("_operator",
                                                                              "operator"):
        inplace = u.target in _INPLACE_OPS  # operator.and_ / or_ are not in place
    else:
        inplace = _inplace_flag(u) or isinstance(name, str) and (
            (name.endswith("_") and not name.startswith("__")) or name == "__setitem__"
            or (name.startswith("__i") and name.endswith("__")))
    return [*targets, *out] if inplace else out


def _schema_writes(u: Node) -> Optional[list]:
    """For a call of a torch operator (``torch.ops.aten.copy_.default``, a
    ``torch.library.custom_op`` that mutates an argument), the arguments its schema marks
    written (of any overload, for a packet); None for other calls, whose names tell (an
    overload's name is ``copy_.default``, which the trailing ``_`` test misses)."""
    if u.op != "call_function":
        return None
    target = u.target
    if isinstance(target, torch._ops.OpOverload):
        schemas = [target._schema]
    elif isinstance(target, torch._ops.OpOverloadPacket):
        schemas = [getattr(target, o)._schema for o in target.overloads()]
    else:
        return None
    written = []
    for schema in schemas:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            x = u.args[i] if i < len(u.args) else u.kwargs.get(a.name)
            written += [x] if isinstance(x, Node) else [
                t for t in (x if isinstance(x, (list, tuple)) else ()) if isinstance(t, Node)]
    return written


def _subgraph_writes(u: Node) -> Optional[list]:
    """For a call that takes a subgraph (a higher-order op: ``tag_activation_checkpoint``,
    ``cond``, ...), the operands it may write: for a checkpoint, those whose placeholder in
    the body is written there (through any view, nested subgraphs included); for any other,
    every tensor operand. None for other nodes."""
    if u.op != "call_function" or not any(
            isinstance(a, Node) and a.op == "get_attr" for a in u.args):
        return None
    from torch.utils._pytree import tree_leaves
    operands = [a for a in tree_leaves((u.args, u.kwargs))
                if isinstance(a, Node) and a.op != "get_attr"]
    gm = u.graph.owning_module
    body = getattr(gm, u.args[0].target, None) if P.is_checkpoint(u) and gm is not None \
        else None
    pairs = P.checkpoint_operands(u, body) if isinstance(body, torch.fx.GraphModule) else None
    if pairs is not None:
        return [a for ph, a in pairs.items() if isinstance(a, Node) and _mutated(ph)]
    return operands


_VIEW_ATTRS = ("mT", "T", "H", "mH", "real", "imag", "data")


def alias_find(graph) -> Callable[[Node], Node]:
    """``find(node)``: one representative per set of nodes that may share memory (views and
    in-place results of one tensor), for asking whether a write reaches a node."""
    parent: dict = {}

    def find(n):
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    for n in graph.nodes:
        for src in ([n.args[0]] if is_view(n) else []) + (
                [] if n.op == "call_module" else written_by(n)):
            parent[find(n)] = find(src)
    return find


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


def _same_size(a: Any, b: Any) -> bool:
    return a is None or b is None or P.known_equal(a, b)


def _both(a: Optional[tuple], b: Optional[tuple], pick) -> tuple:
    """``(ok, bound)`` of two bounds of one kind: equal ones, or constants (``pick``: min for
    upper bounds, max for lower ones)."""
    if a is None or b is None or a == b:
        return True, a if b is None else b
    if not a[1] and not b[1]:
        return True, (pick(a[0], b[0]), ())
    return False, None


def both(x: Any, y: Any) -> Any:
    """``x & y`` of two abstract bool values (None: unknown)."""
    if x == ONES:
        return y if (y == ONES or isinstance(y, Struct)) else None
    if y == ONES:
        return x if isinstance(x, Struct) else None
    if not (isinstance(x, Struct) and isinstance(y, Struct) and x.attend and y.attend):
        return None
    if not (_same_size(x.n_queries, y.n_queries) and P.known_equal(x.n_keys, y.n_keys)):
        return None
    ok_u, upper = _both(x.upper, y.upper, min)
    ok_l, lower = _both(x.lower, y.lower, max)
    if not (ok_u and ok_l) or (x.key is not None and y.key is not None and (
            x.key is not y.key or x.key_test != y.key_test)):
        return None
    kx = x if x.key is not None else y
    return Struct(True, x.n_queries if x.n_queries is not None else y.n_queries, x.n_keys,
                  upper, lower, kx.key, kx.key_cut,
                  checked=x.checked + tuple(n for n in y.checked if n not in x.checked),
                  key_test=kx.key_test, key_rows=kx.key_rows)


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


def _number(c: Any) -> bool:
    """A Python int or float constant (not a bool, not a node)."""
    return isinstance(c, (int, float)) and not isinstance(c, bool)


def _key_test(x: "KeyVal", op: str, c: Any) -> Optional["Struct"]:
    """The key mask ``key <op> c`` of a laid-out ``[B, Nk]`` key tensor ``x``; after a cast
    that may round (``x.exact`` False) only ``!= 0`` and ``== 0`` (None otherwise)."""
    if not x.exact and (op, c) not in (("ne", 0), ("eq", 0)):
        return None
    return Struct(True, None, P.val(x.key).shape[1], key=x.key, key_test=(op, c))


_RESHAPE_METHODS = ("view", "reshape", "unsqueeze")


def _reshape_source(node: Node) -> Optional[Node]:
    """The input of ``node`` when ``node`` only reshapes it (row-major order kept: ``view``
    and ``reshape`` to sizes, ``unsqueeze``, indexing by full slices, ``None`` and ``...``),
    else None. ``view(dtype)`` reinterprets bytes: not a reshape."""
    if not (node.args and isinstance(node.args[0], Node)):
        return None
    if P._meth(node, *_RESHAPE_METHODS) or P._fn(node, torch.unsqueeze, torch.reshape):
        if any(isinstance(a, torch.dtype) for a in node.args[1:]) or node.kwargs.get(
                "dtype") is not None:
            return None
        return node.args[0]
    if P._fn(node, operator.getitem) or P._meth(node, "__getitem__"):
        idx = node.args[1] if len(node.args) > 1 else None
        items = idx if isinstance(idx, tuple) else (idx,)
        full = slice(None, None, None)
        if all(e is None or e is Ellipsis or e == full for e in items):
            return node.args[0]
    return None


def _written(node: Node) -> bool:
    """Whether ``node``'s memory may be written in place anywhere in the graph: through its
    views, or through the tensor an in-place result aliases (``b = a.mul_(2)`` reads ``a``,
    which a later ``a.zero_()`` writes)."""
    prev = None
    while node is not prev:
        prev, node = node, _alias_root(_root(node))
    return _mutated(node)


def _key_layout(node: Node) -> Any:
    """A ``[B, 1, 1, Nk]`` reshape of a ``[B, Nk]`` tensor (``am[:, None, None, :]``,
    ``am.unsqueeze(1).unsqueeze(2)``, ``am.view(B, 1, 1, Nk)``, ...): a reshape keeps
    row-major order, so entry ``[b, 0, 0, j]`` is ``am[b, j]``. A bool tensor is the key
    mask itself (:class:`Struct`), another dtype its values (:class:`KeyVal`); None
    otherwise, or when the tensor is written in place (the op reads it when it runs)."""
    v = P.val(node)
    if not (isinstance(v, torch.Tensor) and v.dim() == 4 and P.known_equal(v.shape[1], 1)
            and P.known_equal(v.shape[2], 1)):
        return None
    src, sv = node, None
    while (up := _reshape_source(src)) is not None:  # back to the first [B, Nk] tensor
        src, sv = up, P.val(up)
        if isinstance(sv, torch.Tensor) and sv.dim() == 2:
            break
    if (src is node or not isinstance(sv, torch.Tensor) or sv.dim() != 2 or sv.is_complex()
            or not P.known_equal(sv.shape[0], v.shape[0])
            or not P.known_equal(sv.shape[1], v.shape[3]) or _written(src)):
        return None
    return Struct(True, None, sv.shape[1], key=src) if sv.dtype == torch.bool else KeyVal(src)


def _compare(op: str, a: Any, b: Any) -> Any:
    """``a <op> b`` for two laid-out indices (a band :class:`Struct`), an index against a
    constant it always passes (:data:`ONES`: transformers' bidirectional ``q_idx >= 0``), or
    a laid-out key tensor against a number (a key mask: ``am[:, None, None, :] > 0``)."""
    if isinstance(a, KeyVal) and _number(b):  # (Dynamo writes 0 < t as t > 0)
        return _key_test(a, op, b)
    if isinstance(a, Index) and isinstance(b, (int, float)) and not isinstance(b, bool):
        low = a.const  # arange(n) + c >= c: holds for every entry when no symbol is added
        if not a.terms and (op == "ge" and low >= b or op == "gt" and low > b):
            return ONES
        return None
    if not (isinstance(a, Index) and isinstance(b, Index)):
        return None
    # A 1-D index broadcast against a [n, 1] one lies along the last dim (keys).
    if a.axis is None and b.axis == -2:
        a = Index(-1, a.const, a.terms, a.length)
    elif b.axis is None and a.axis == -2:
        b = Index(-1, b.const, b.terms, b.length)
    if {a.axis, b.axis} != {-1, -2}:
        return None
    if a.axis == -2:  # normalise to key <op> query
        a, b = b, a
        op = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt"}[op]
    # key j + ka <op> query i + qa  <=>  j - i <op> qa - ka
    d = _shifted(Index(None, b.const, b.terms), (a.const, a.terms), -1)
    c, t = d.const, d.terms
    bound = {"le": ("upper", c), "lt": ("upper", c - 1), "ge": ("lower", c),
             "gt": ("lower", c + 1)}[op]
    return Struct(True, b.length, a.length, **{bound[0]: (bound[1], t)})


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
    return _fits(Index(None, *off, v.shape[0]), v.dtype)


def _fits(ix: Optional[Index], dtype: Optional[torch.dtype]) -> Optional[Index]:
    """``ix`` where its values provably fit ``dtype`` (int32 wraps past ``2**31 - 1``, and
    the Index arithmetic does not), else None. int64 is taken to fit (positions)."""
    if ix is None or dtype != torch.int32:
        return ix
    if ix.terms or not isinstance(ix.length, int):
        return None
    lo, hi = ix.const, ix.const + max(ix.length - 1, 0)
    return ix if -2**31 <= lo and hi < 2**31 else None


def _is_ones_call(node: Node) -> bool:
    if P._fn(node, torch.ones, torch.ones_like) or P._meth(node, "new_ones"):
        return True
    if P._fn(node, torch.full) or P._meth(node, "new_full"):
        fill = P.arg(node, 1 if node.op == "call_function" else 2, "fill_value")
        return fill is True or (not isinstance(fill, bool) and fill == 1)
    return False


def _root(node: Node) -> Node:
    """The tensor whose memory ``node`` may share, through views and ``.to``-style casts."""
    while is_view(node):
        node = node.args[0]
    return node


def _key_gather(node: Node, ev) -> Optional[Struct]:
    """``mask2d[batch_idx, kv_idx]`` (transformers' padding mask function): with
    ``batch_idx = arange(B)`` laid along dim -4 and ``kv_idx = arange(Nk)`` along dim -1, over
    a ``[B, Nk']`` bool tensor no node writes to, it is ``key[b, j]``
    (``mask2d[:, None, None, :]`` is a reshape, read by :func:`_key_layout`). When ``Nk' = Nk`` is not
    provable (decode under dynamic shapes: two symbols), the key mask is ``key[:, :Nk]``,
    which raises where the gather would (``Nk' < Nk``) and equals it otherwise."""
    idx = node.args[1] if len(node.args) > 1 else None
    src = node.args[0]
    sv = P.val(src)
    if not (isinstance(idx, tuple) and len(idx) == 2 and all(isinstance(i, Node) for i in idx)):
        return None
    bi, ki = ev(idx[0]), ev(idx[1])
    if not (isinstance(src, Node) and isinstance(sv, torch.Tensor) and sv.dim() == 2
            and sv.dtype == torch.bool and isinstance(bi, Index) and isinstance(ki, Index)):
        return None
    if (bi.axis, bi.const, bi.terms, ki.axis, ki.const, ki.terms) != (-4, 0, (), -1, 0, ()):
        return None
    if _written(src):
        return None
    # key[:B] where its rows are not provably B: the op reads the same rows, and the cut
    # raises where the gather would (fewer rows).
    return Struct(True, None, ki.length, key=src,
                  key_cut=not P.known_equal(sv.shape[1], ki.length),
                  key_rows=None if P.known_equal(sv.shape[0], bi.length) else bi.length)


def _position_gather(node: Node, ev) -> Optional[Index]:
    """``pos[batch_idx, idx]`` of position ids ``pos`` ``[B, N]`` whose every row is
    ``arange(N) + c`` (an :class:`Index` along the last dim, e.g. ``arange`` expanded over the
    batch), with ``batch_idx = arange(B)`` laid along dim -4 and ``idx = arange(n) + d`` along
    the query or key dim: ``idx + c`` along that dim. Only where every index is provably in
    range (constant ``d >= 0``, ``d + n <= N``, ``B`` rows): a negative index would wrap
    around, and one past the end raises in eager, where the proved mask is never gathered."""
    idx = node.args[1] if len(node.args) > 1 else None
    if not (isinstance(idx, tuple) and len(idx) == 2 and all(isinstance(i, Node) for i in idx)):
        return None
    src, bi, ki = ev(node.args[0]), ev(idx[0]), ev(idx[1])
    sv = P.val(node.args[0])
    if not (isinstance(src, Index) and src.axis == -1 and isinstance(sv, torch.Tensor)
            and sv.dim() == 2 and isinstance(bi, Index) and bi.axis == -4
            and (bi.const, bi.terms) == (0, ()) and P.known_equal(sv.shape[0], bi.length)
            and isinstance(ki, Index) and ki.axis in (-2, -1) and not ki.terms
            and ki.const >= 0):
        return None
    end = ki.const + ki.length
    if not (P.known_equal(end, sv.shape[1])
            or (isinstance(end, int) and isinstance(sv.shape[1], int) and end <= sv.shape[1])):
        return None
    return _shifted(ki, (src.const, src.terms))


def _arange_diff(node: Node, ev) -> Any:
    """``torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)`` of position ids whose rows run
    ``arange``: every entry is 1 (transformers' packed-sequence test)."""
    x = P.arg(node, 0, "input")
    n = P.arg(node, 1, "n", 1)
    dim = P.arg(node, 2, "dim", -1)
    prepend = node.kwargs.get("prepend", node.args[3] if len(node.args) > 3 else None)
    append = node.kwargs.get("append", node.args[4] if len(node.args) > 4 else None)
    v = P.val(node)
    ix = ev(x) if isinstance(x, Node) else None
    if (n != 1 or append is not None or not isinstance(v, torch.Tensor)
            or dim not in (-1, v.dim() - 1) or not isinstance(ix, Index) or ix.axis != -1
            or not isinstance(prepend, Node)):
        return None
    # prepend = sub(getitem(pos', (:, :1)), 1), with pos' the same ids; one integer dtype
    # throughout (a float prepend promotes the diff, which then rounds large positions).
    if not ((P._fn(prepend, operator.sub, torch.sub) or P._meth(prepend, "sub", "__sub__"))
            and prepend.kwargs.get("alpha", 1) == 1 and len(prepend.args) == 2
            and type(prepend.args[1]) is int and prepend.args[1] == 1
            and isinstance(prepend.args[0], Node)
            and _dtype(node) in _INDEX_DTYPES
            and _dtype(node) == _dtype(x) == _dtype(prepend) == _dtype(prepend.args[0])):
        return None
    first = prepend.args[0]
    full = slice(None, None, None)
    if not ((P._fn(first, operator.getitem) or P._meth(first, "__getitem__"))
            and len(first.args) == 2 and first.args[1] == (full, slice(None, 1, None))
            and isinstance(first.args[0], Node) and ev(first.args[0]) == ix
            and _same_rows(first.args[0], x)):
        return None
    # The prepend was read when it was sliced, the ids when diff runs: neither may be
    # written in between (or at all: the simple sound rule).
    if _mutated(_root(x)) or _mutated(_root(first.args[0])):
        return None
    return Const(1)


def _same_rows(a: Node, b: Node) -> bool:
    """Both ``[rows, n]`` with provably the same rows."""
    va, vb = P.val(a), P.val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.dim() == vb.dim() == 2 and P.known_equal(va.shape[0], vb.shape[0]))


class _Top:
    """The reader of a mask handed to a site: its first user (see :func:`_versioned`)."""

    def __init__(self, node: Node):
        self.node = node


def mask_value(node: Any, depth: int = 32, _memo: Optional[dict] = None,
               _at: Any = None) -> Any:
    """The abstract value of ``node`` (an :class:`Index`, :data:`ONES`, :class:`Struct`,
    :class:`FMask`, ...), or None when unknown.

    ``_at`` is the node that reads ``node`` (its place in the graph decides which in-place
    writes it sees); None for the mask a site reads.
    """
    memo = {} if _memo is None else _memo
    if not isinstance(node, Node) or depth <= 0:
        return None
    at = _Top(node) if _at is None else _at
    key = (node, at.node if isinstance(at, _Top) else at, isinstance(at, _Top))
    if key in memo:
        return memo[key]
    memo[key] = None

    def ev(x: Any) -> Any:  # every op reads its inputs when it runs
        return mask_value(x, depth - 1, memo, node)

    root = _alias_root(_root(node))
    writes = _family_writes(root, memo)
    if writes is None:  # written through a view: not followed
        out = None
    elif not writes:
        out = _evaluate(node, ev)
    elif node is root or _is_inplace_alias(node):
        out = _versioned(root, writes, at, memo, depth)
    else:
        # A view (or a cast that may copy) keeps the value it had when it ran only if
        # nothing writes its memory before its reader runs.
        order = _order(node.graph, memo)
        stop = len(order) if isinstance(at, _Top) else order[at]
        out = None if any(order[node] < order[w] < stop for w in writes) else _evaluate(node, ev)
    memo[key] = out
    return out


def _is_inplace_alias(u: Node) -> bool:
    """``x *= y``-style ops: they write ``args[0]`` and return it."""
    return bool(u.args) and isinstance(u.args[0], Node) and u.args[0] in written_by(u) \
        and _name(u) not in ("setitem", "__setitem__")


def _alias_root(node: Node) -> Node:
    while _is_inplace_alias(node):
        node = node.args[0]
    return node


def _family_writes(root: Node, memo: dict) -> Optional[list]:
    """The in-place writes to ``root`` and to the in-place results that alias it
    (``root *= m`` returns ``root``), in graph order; None when a write goes through a view
    of them (not followed). ``[]``: never written."""
    aliases, stack = {root}, [root]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in aliases and _is_inplace_alias(u) and u.args[0] is n:
                aliases.add(u)
                stack.append(u)
    writes = set()
    for n in aliases:
        for u in n.users:
            if any(t is n for t in written_by(u)):
                writes.add(u)
            elif is_view(u) and u.args[0] is n and _mutated(u):
                return None
    order = _order(root.graph, memo) if writes else {}
    return sorted(writes, key=order.__getitem__)


def _order(graph, memo: dict) -> dict:
    """Each node's place in ``graph`` (computed once per proof)."""
    if "order" not in memo:
        memo["order"] = {n: i for i, n in enumerate(graph.nodes)}
    return memo["order"]


def _versioned(root: Node, writes: list, at: Any, memo: dict, depth: int) -> Any:
    """The value of ``root`` (a tensor the graph creates, written in place by ``writes``,
    :func:`_family_writes`) as ``at`` reads it: its value when created, then each write
    before ``at`` in graph order. The reader of a site's mask is its first user, and every
    write must come before it (a later write would give the site's other users another
    value)."""
    if root.op not in ("call_function", "call_method") or is_view(root) or _name(root) in (
            "setitem", "__setitem__"):
        return None  # inputs and views: memory the graph does not own
    order = _order(root.graph, memo)
    if isinstance(at, _Top):
        first = min((order[u] for u in at.node.users), default=len(order))
        if any(order[w] >= first for w in writes):
            return None
        before = writes
    else:
        before = [w for w in writes if order[w] < order[at]]
    value = _evaluate(root, lambda x: mask_value(x, depth - 1, memo, root))
    for w in before:
        if value is None:
            return None
        wev = lambda x, w=w: mask_value(x, depth - 1, memo, w)  # noqa: E731
        name = _name(w)
        if name in ("setitem", "__setitem__"):
            target, index, new = w.args[0], w.args[1], w.args[2]
            tv, nv = P.val(target), P.val(new)
            # The whole tensor, same shape and dtype (an assignment casts: an Index written
            # into a bool tensor, or -inf after a float32 fill lands in float16).
            if not (_covers(target, index) and isinstance(nv, torch.Tensor)
                    and nv.dim() == tv.dim() and nv.dtype == tv.dtype
                    and all(P.known_equal(a, b) for a, b in zip(nv.shape, tv.shape))):
                return None
            value = wev(new)
        elif w.target is operator.imul or name in ("mul_", "__imul__"):
            value = _times(value, wev(w.args[1]), w.args[1], w)
        elif w.target is operator.ior or name in ("bitwise_or_", "logical_or_", "__ior__"):
            value = _either(value, wev(w.args[1])) if _dtype(w.args[1]) == torch.bool else None
        else:
            return None
    return value


def _covers(target: Node, index: Any) -> bool:
    """``target[index]`` is all of ``target``: full slices (``:n`` with ``n`` at least the
    dim) and ``...``, one per dim."""
    t = P.val(target)
    items = index if isinstance(index, tuple) else (index,)
    n_ell = sum(1 for e in items if e is Ellipsis)
    if not isinstance(t, torch.Tensor) or n_ell > 1 or len(items) - n_ell > t.dim():
        return False
    if any(e is not Ellipsis and not (isinstance(e, slice) and e.start in (None, 0)
                                      and e.step in (None, 1)) for e in items):
        return False
    spec = [e for e in items if e is not Ellipsis]
    dims = list(range(t.dim()))
    if n_ell:  # slices before ... take the first dims, after it the last ones
        k = next(i for i, e in enumerate(items) if e is Ellipsis)
        pos = dims[:k] + dims[t.dim() - (len(items) - k - 1):]
    else:
        pos = dims[:len(spec)]
    for d, e in zip(pos, spec):
        stop = P.val(e.stop) if isinstance(e.stop, Node) else e.stop
        if stop is not None and not statically_known_true(stop >= t.shape[d]):
            return False
    return True


def _either(x: Any, y: Any) -> Any:
    """``x | y`` of two abstract bool values, by De Morgan over :func:`both`."""
    if x == ONES or y == ONES:
        return ONES
    if not (isinstance(x, Struct) and isinstance(y, Struct)):
        return None
    b = both(x.negated(), y.negated())
    return b.negated() if isinstance(b, Struct) else None


def _times(x: Any, y: Any, y_node: Any, reader: Node) -> Any:
    """``x * y`` (run at ``reader``) of a float mask ``x`` (:class:`FMask`) and a bool
    ``y``: ``fill`` stays where ``y`` is 1, so the attended region grows by where ``y`` is
    0."""
    if not isinstance(x, FMask) or _dtype(y_node) != torch.bool:
        return None
    # transformers' `_unmask_unattended` (SDPA on CUDA, `m * ~all(m == min, -1)`) falls here
    # and is not proved: its rows that see no key attend every key with their scores, which
    # the op's structure does not give (ops.eager_empty_rows gives eager's uniform rows).
    off = _attend_set(y, False)  # where y is 0: now 0 too
    if off is None or off.n_queries is None or not spans(reader, off.n_queries, off.n_keys):
        return None  # y broadcast (a row or a column) over the result: not proved
    if x.region is None:
        return FMask(off, x.fill)
    region = _either(x.region, off)
    return FMask(region, x.fill) if isinstance(region, Struct) and region.attend else None


def _evaluate(node: Node, ev) -> Any:
    x0 = P.arg(node, 0, "input")
    x1 = P.arg(node, 1, "other")
    out = _float_mask_rules(node, ev, x0, x1)
    if out is not _NOT_MINE:
        return out
    out = _key_layout(node)
    if out is not None:
        return out
    if P._fn(node, torch.arange):
        return _arange(node)
    if P._fn(node, operator.add, torch.add) or P._meth(node, "add", "__add__", "__radd__"):
        if node.kwargs.get("alpha", 1) != 1 or _dtype(node) not in _INDEX_DTYPES:
            return None
        a, b = (x0, x1) if isinstance(ev(x0), Index) else (x1, x0)
        ix, off = ev(a), _offset(b)
        return (_fits(_shifted(ix, off), _dtype(node))
                if isinstance(ix, Index) and off is not None else None)
    if P._fn(node, operator.sub, torch.sub) or P._meth(node, "sub", "__sub__"):
        if node.kwargs.get("alpha", 1) != 1 or _dtype(node) not in _INDEX_DTYPES:
            return None
        ix, off = ev(x0), _offset(x1)
        return (_fits(_shifted(ix, off, -1), _dtype(node))
                if isinstance(ix, Index) and off is not None else None)
    if P._fn(node, operator.getitem) or P._meth(node, "__getitem__"):
        x = ev(node.args[0])
        if isinstance(x, Index) and x.axis is None:
            axis = _index_axis(node.args[1])
            return None if axis is None else Index(axis, x.const, x.terms, x.length)
        if x == ONES:
            return ONES
        if isinstance(x, Const):
            return x
        if isinstance(x, Index) and x.axis == -1:
            return _position_gather(node, ev)
        if isinstance(x, Struct) and x.key is None and _keeps_last_two(node.args[1]):
            v = P.val(node)  # a top-left cut keeps j - i: same bounds, the cut's shape
            # ... of values proved over the source's own last two dims (not a broadcast row)
            if (isinstance(v, torch.Tensor) and v.dim() >= 2 and x.n_queries is not None
                    and spans(node.args[0], x.n_queries, x.n_keys)):
                # The cut of a causal buffer itself: the op checks the region the mask reads
                # (the check wants 1 exactly on j <= i), not the whole buffer.
                cut = x.checked and x.attend and x.upper == (0, ()) and x.lower is None
                return Struct(x.attend, v.shape[-2], v.shape[-1], x.upper, x.lower,
                              checked=(node,) if cut else x.checked)
            return None
        return _key_gather(node, ev)
    if P._fn(node, torch.unsqueeze) or P._meth(node, "unsqueeze"):
        x, dim = ev(x0), P.arg(node, 1, "dim")
        if isinstance(x, Index) and x.axis is None and dim in (0, 1, -1, -2):
            return Index(-2 if dim in (1, -1) else -1, x.const, x.terms, x.length)
        return None
    if node.op == "call_function" and node.target in _CMP or P._meth(node, *_CMP_METHODS):
        op = _CMP.get(node.target) if node.op == "call_function" else node.target.strip("_")
        return _compare(op, ev(x0), ev(x1) if isinstance(x1, Node) else x1)
    if P._fn(node, operator.and_, torch.logical_and, torch.bitwise_and) or \
            P._meth(node, "logical_and", "bitwise_and", "__and__", "__rand__"):
        if _dtype(node) != torch.bool:
            return None
        return both(ev(x0), ev(x1))
    if P._fn(node, operator.invert, torch.bitwise_not) or \
            P._meth(node, "bitwise_not", "__invert__"):
        x = ev(x0)
        if _dtype(x0) != torch.bool or not isinstance(x, Struct):  # ~1 == -2 on ints
            return None
        return x.negated()
    if P._fn(node, torch.logical_not) or P._meth(node, "logical_not"):
        x = ev(x0)
        return x.negated() if isinstance(x, Struct) else None
    if P._fn(node, operator.eq, operator.ne, torch.eq, torch.ne) or \
            P._meth(node, "eq", "ne", "__eq__", "__ne__"):
        x, c = ev(x0), x1
        is_eq = _name(node) in ("eq", "__eq__")
        if isinstance(x, Const):  # against a constant, or another Const
            other = ev(c) if isinstance(c, Node) else c
            if isinstance(other, Const):
                other = other.value
            if isinstance(other, (bool, int)):
                out = (x.value == other) == is_eq
                return ONES if out else Const(False)
            return None
        if isinstance(x, Struct) and not isinstance(c, Node) and c in (0, 1, True, False):
            keep = (c in (1, True)) == is_eq
            return x if keep else x.negated()
        if isinstance(x, KeyVal) and _number(c):  # am[:, None, None, :] == 0 (or == 1)
            return _key_test(x, "eq" if is_eq else "ne", c)
        return None
    if P._fn(node, torch.tril, torch.triu) or P._meth(node, "tril", "triu"):
        diag = P.arg(node, 1, "diagonal", 0)
        v = P.val(node)
        if (ev(x0) != ONES or isinstance(diag, bool) or not isinstance(diag, int)
                or not isinstance(v, torch.Tensor) or v.dim() < 2):
            return None
        bound = "upper" if _name(node) == "tril" else "lower"  # tril: j - i <= diag
        return Struct(True, v.shape[-2], v.shape[-1], **{bound: (diag, ())})
    if P._fn(node, torch.diff):
        return _arange_diff(node, ev)
    if P._fn(node, torch.cumsum) or P._meth(node, "cumsum"):
        x = ev(x0)  # a running sum of zeros (False) is zeros
        return Const(0) if isinstance(x, Const) and x.value in (0, False) else None
    if _is_ones_call(node):
        return ONES
    if node.op == "placeholder":
        return _causal_buffer(node)
    if node.op == "call_method" and node.target in _PASS_METHODS:
        x = ev(node.args[0])
        if isinstance(x, Index):
            if node.target in ("expand", "expand_as") and x.axis in (None, -1):
                # arange laid along the last dim, broadcast over rows: position ids [B, N]
                v = P.val(node)
                ok = isinstance(v, torch.Tensor) and P.known_equal(v.shape[-1], x.length)
                return Index(-1, x.const, x.terms, x.length) if ok else None
            return x if _dtype(node) in _INDEX_DTYPES and node.target in (
                "to", "int", "long", "contiguous", "clone", "detach") else None
        return x
    return None


_NOT_MINE = object()  # _float_mask_rules: the node is not one of its forms


def _float_of(x: Any) -> Optional[float]:
    c = _const(x)
    return None if isinstance(c, bool) or not isinstance(c, (int, float)) else float(c)


def _same_struct(a: Struct, b: Struct) -> bool:
    """Equal structures (sizes compared without adding shape guards)."""
    return (a.attend, a.upper, a.lower, a.key, a.key_cut, a.key_test, a.checked) == (
        b.attend, b.upper, b.lower, b.key, b.key_cut, b.key_test, b.checked) and (
        (a.key_rows is None) == (b.key_rows is None)) and (
        a.key_rows is None or P.known_equal(a.key_rows, b.key_rows)) and all(
        (x is None and y is None) or (x is not None and y is not None and P.known_equal(x, y))
        for x, y in ((a.n_queries, b.n_queries), (a.n_keys, b.n_keys)))


def _plain_index(index: Any, ndim: int) -> bool:
    """Full slices and ``...``, and a ``:n`` only on the last of ``ndim`` dims: the batch
    and head dims are not cut."""
    items = index if isinstance(index, tuple) else (index,)
    if any(e is None for e in items):
        return False
    full = slice(None, None, None)
    if not all(e is Ellipsis or e == full for e in items[:-1]):
        return False
    last = items[-1]
    if last is Ellipsis or last == full:
        return True
    on_last_dim = Ellipsis in items or len(items) == ndim
    return (on_last_dim and isinstance(last, slice) and last.start in (None, 0)
            and last.step in (None, 1))


def _float_mask_rules(node: Node, ev, x0: Any, x1: Any) -> Any:
    """The rules of transformers <= 4.52's float masks (``_prepare_4d_causal_attention_mask
    _with_cache_position``): ``full(min)``, ``triu``, ``* bool``, ``| bool``, ``(mask +
    key) == 0`` (the int ``attention_mask`` laid out by :func:`_key_layout`), ``masked_fill``,
    cuts and casts, and a reshaped ``cache_position``. :data:`_NOT_MINE` for other nodes. (In-place
    forms, ``*=`` and ``|=``, are read by :func:`_versioned`.)"""
    dtype = _dtype(node)
    if P._fn(node, torch.full) or P._meth(node, "new_full"):
        fill = _float_of(P.arg(node, 1 if node.op == "call_function" else 2, "fill_value"))
        if dtype is None or not dtype.is_floating_point or fill is None or fill == 1:
            return _NOT_MINE  # ones (and int fills) as before
        return FMask(None, fill) if math.isfinite(fill) else None
    if P._fn(node, torch.tril, torch.triu) or P._meth(node, "tril", "triu"):
        x = ev(x0)
        if not isinstance(x, FMask):
            return _NOT_MINE
        diag = P.arg(node, 1, "diagonal", 0)
        v = P.val(node)
        if (x.region is not None or isinstance(diag, bool) or not isinstance(diag, int)
                or not isinstance(v, torch.Tensor) or v.dim() < 2):
            return None
        # triu keeps fill on j - i >= diag (0 below); tril on j - i <= diag.
        bound = ("upper", diag - 1) if _name(node) == "triu" else ("lower", diag + 1)
        return FMask(Struct(True, v.shape[-2], v.shape[-1], **{bound[0]: (bound[1], ())}),
                     x.fill)
    if P._fn(node, operator.mul, torch.mul) or P._meth(node, "mul", "__mul__", "__rmul__"):
        if not isinstance(x1, Node):
            return _NOT_MINE
        a, b = ev(x0), ev(x1)
        if isinstance(a, FMask):
            return _times(a, b, x1, node)
        if isinstance(b, FMask):
            return _times(b, a, x0, node)
        return _NOT_MINE
    if P._fn(node, operator.or_, torch.bitwise_or, torch.logical_or) or \
            P._meth(node, "bitwise_or", "logical_or", "__or__", "__ror__"):
        if dtype != torch.bool or not isinstance(x1, Node):
            return None
        return _either(ev(x0), ev(x1))
    if P._fn(node, operator.add, torch.add) or P._meth(node, "add", "__add__", "__radd__"):
        if dtype is None or not dtype.is_floating_point or not isinstance(x1, Node):
            return _NOT_MINE
        a, b = ev(x0), ev(x1)
        if isinstance(b, FMask):
            a, b = b, a
        if (node.kwargs.get("alpha", 1) == 1 and isinstance(a, FMask)
                and a.region is not None and a.region.key is None and isinstance(b, KeyVal)
                and P.known_equal(P.val(b.key).shape[1], a.region.n_keys)):
            return PadSum(a.region, a.fill, b.key)
        return None
    if P._fn(node, operator.eq, torch.eq) or P._meth(node, "eq", "__eq__"):
        x = ev(x0) if isinstance(x0, Node) else None
        if isinstance(x, PadSum):
            return PadTest(x.region, x.fill, x.key) if _float_of(x1) == 0 else None
        return _NOT_MINE
    if P._fn(node, torch.masked_fill) or P._meth(node, "masked_fill"):
        x, m = ev(node.args[0]), P.arg(node, 1, "mask")
        if not isinstance(x, FMask):
            return _NOT_MINE
        t = ev(m) if isinstance(m, Node) else None
        if not (isinstance(t, PadTest) and x.region is not None
                and _same_struct(t.region, x.region)
                and _float_of(P.arg(node, 2, "value")) == x.fill):
            return None
        # fill where the region is 0 and the key is 0: the region narrowed to nonzero keys
        return FMask(dataclasses.replace(
            x.region, key=t.key,
            key_test=None if _dtype(t.key) == torch.bool else ("ne", 0)), x.fill)
    if P._meth(node, "reshape", "view"):
        x = ev(x0)
        if not isinstance(x, Index) or x.axis is not None:
            return _NOT_MINE
        shape = tuple(node.args[1]) if len(node.args) == 2 and isinstance(
            node.args[1], (list, tuple)) else tuple(node.args[1:])
        if shape == (-1, 1):  # a column: along the queries
            return Index(-2, x.const, x.terms, x.length)
        if shape == (1, -1):
            return Index(-1, x.const, x.terms, x.length)
        return None
    if node.op == "call_method" and node.target in _PASS_METHODS:
        x = ev(node.args[0])
        src = _dtype(node.args[0])
        if isinstance(x, FMask):
            if dtype == src:
                return x
            if not (dtype is not None and dtype.is_floating_point):
                return None
            fill = torch.tensor(x.fill, dtype=src).to(dtype).item()
            return dataclasses.replace(x, fill=fill) if math.isfinite(fill) else None
        if isinstance(x, KeyVal):
            if dtype == torch.bool:  # .bool(), .to(torch.bool): nonzero
                return _key_test(x, "ne", 0)
            # nonzero stays nonzero: same dtype, or integers/bools to floats (which may round
            # large values: only the zero test stays exact)
            if dtype == src:
                return x
            ok = (dtype is not None and dtype.is_floating_point and src is not None
                  and not src.is_floating_point)
            return dataclasses.replace(x, exact=False) if ok else None
        if isinstance(x, (PadSum, PadTest)):
            return None
        return _NOT_MINE
    if P._fn(node, operator.getitem) or P._meth(node, "__getitem__"):
        src = node.args[0]
        idx = node.args[1] if len(node.args) > 1 else None
        x = ev(src)
        if isinstance(x, FMask):
            return _cut_fmask(x, src, node, idx)
        return _NOT_MINE  # am[:, None, None, :] is a reshape: _key_layout reads it
    return _NOT_MINE


def _cut_fmask(x: FMask, src: Node, node: Node, idx: Any) -> Optional[FMask]:
    """``x[idx]``: leading ``None``s and top-left cuts keep ``j - i``. The region must have
    been proved over the source's own last two dims (a broadcast row relabelled as a square
    would claim rows it does not hold); with a key mask, no batch or key cut."""
    v = P.val(node)
    if not (_keeps_last_two(idx) and isinstance(v, torch.Tensor) and v.dim() >= 2):
        return None
    if x.region is None:
        return x
    r = x.region
    if r.n_queries is None or not spans(src, r.n_queries, r.n_keys):
        return None
    if r.key is not None and not (
            _plain_index(idx, P.val(src).dim()) and P.known_equal(v.shape[-1], r.n_keys)):
        return None
    return dataclasses.replace(
        x, region=dataclasses.replace(r, n_queries=v.shape[-2], n_keys=v.shape[-1]))


def _causal_buffer(node: Node) -> Optional[Struct]:
    """A module buffer that holds a causal mask now (nanoGPT's ``register_buffer("bias",
    torch.tril(torch.ones(T, T)).view(1, 1, T, T))``): 1 (or True) exactly on ``j <= i`` of
    its last two dims, size-1 leading dims. Dynamo passes the buffer's current value with
    the graph; the value may change later (an in-place write, ``load_state_dict``), so the
    structure names the buffer in ``checked`` and the op checks it on every call. Inputs
    other than module buffers are never assumed (a mask argument may differ per call)."""
    ga = node.meta.get("grapharg")
    source = getattr(ga, "source", None)
    # Dynamo lifts a buffer as `<module>._buffers[name]`: an item of an attribute source
    # whose member is `_buffers` (a name that merely contains "_buffers" is not one).
    if getattr(getattr(source, "base", None), "member", None) != "_buffers":
        return None
    example = getattr(ga, "example", None)
    if not isinstance(example, torch.Tensor):
        return None
    from torch._subclasses.fake_tensor import is_fake
    if is_fake(example) or example.dim() < 2 or any(d != 1 for d in example.shape[:-2]):
        return None
    S, S2 = example.shape[-2:]
    if S != S2 or not (example.dtype == torch.bool or example.is_floating_point()):
        return None
    if not bool(holds_causal_mask(example.detach())):  # the test the op repeats per call
        return None
    return Struct(True, S, S, upper=(0, ()), checked=(node,))


def _attend_set(v: Any, attend_if: bool) -> Optional[Struct]:
    """The structure of the attended entries of a mask of value ``v``, where
    ``mask == attend_if`` means attend (a :class:`Struct` with ``attend`` True), or None."""
    if isinstance(v, Struct) and not attend_if:
        v = v.negated()
    if isinstance(v, Struct) and v.attend:
        return v
    return None


def bool_structure(mask: Any, attend_if: bool = True) -> Optional[Struct]:
    """The structure of a bool mask's attended entries, where ``mask == attend_if`` means
    attend: proved over exactly the mask's last two dims (no broadcast row, unless the
    values do not depend on the query: a key mask), or None."""
    if _dtype(mask) != torch.bool:
        return None
    s = _attend_set(mask_value(mask), attend_if)
    if s is None or not fits(mask, s):
        return None
    return s


def fits(mask: Any, s: Struct, n_queries: Any = None, n_keys: Any = None) -> bool:
    """``mask``'s last two dims hold ``s`` as proved (and, if given, apply to an
    ``n_queries x n_keys`` score grid): the key dim is ``s.n_keys``; the query dim is
    ``s.n_queries``, or anything broadcastable when ``s`` does not depend on the query."""
    t = P.val(mask)
    if not (isinstance(t, torch.Tensor) and t.dim() >= 2 and P.known_equal(t.shape[-1], s.n_keys)):
        return False
    if n_keys is not None and not P.known_equal(s.n_keys, n_keys):
        return False
    if s.n_queries is None:
        return n_queries is None or P.known_equal(t.shape[-2], 1) or P.known_equal(
            t.shape[-2], n_queries)
    return P.known_equal(t.shape[-2], s.n_queries) and (
        n_queries is None or P.known_equal(s.n_queries, n_queries))


def offset_value(off: tuple, graph) -> Any:
    """The value (int or SymInt) of an offset ``(const, terms)``, its terms read from the
    nodes of ``graph`` by name (None when a term's node is gone)."""
    c, terms = off
    nodes = {n.name: n for n in graph.nodes} if terms else {}
    total = c
    for name, count in terms:
        n = nodes.get(name)
        if n is None:
            return None
        total = total + count * P.val(n)
    return total


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
    c = _float_of(fill)
    if c is None:
        return False
    if c == -math.inf:
        return True
    return scores_dtype.is_floating_point and c * scale <= torch.finfo(scores_dtype).min / 2


def additive_structure(mask: Any, scale: float = 1.0,
                       scores_dtype: Optional[torch.dtype] = None) -> Optional[Struct]:
    """The structure of a float mask that, added to scores of ``scores_dtype`` (default: the
    mask's) then scaled by ``scale``, is 0 on a structure and masks everything else:
    ``where(s, 0, fill)``, ``where(~s, fill, 0)``, ``zeros.masked_fill(~s, fill)``, and
    float-to-float casts of those (transformers' eager masks). None when not proved."""
    if not isinstance(mask, Node) or not (isinstance(scale, (int, float)) and scale > 0):
        return None
    dtype = _dtype(mask)
    if dtype is None or not dtype.is_floating_point:
        return None
    scores_dtype = scores_dtype or dtype
    v = mask_value(mask)  # transformers <= 4.52: full(min), triu, *= bool, padding fill
    if isinstance(v, FMask):
        if v.region is None or not _masks(v.fill, scale, scores_dtype):
            return None
        return dataclasses.replace(v.region, fill=v.fill)
    node, dtypes = mask, [dtype]
    while node.op == "call_method" and node.target in ("to", "float", "half", "bfloat16",
                                                       "type_as", "contiguous", "expand"):
        src = node.args[0]
        if not (isinstance(src, Node) and (_dtype(src) or torch.bool).is_floating_point):
            return None  # a bool -> float cast turns the mask into 0/1, not 0/-inf
        node = src
        dtypes.append(_dtype(node))
    if _mutated(node):
        return None
    casts = dtypes[::-1]  # the fill's dtypes from where it is written to the mask's
    if P._fn(node, torch.where) and len(node.args) == 3:
        cond, a, b = node.args
        if not _same_last_two(cond, node):
            return None
        if _is_zero(a) and _masks(b, scale, scores_dtype):
            return _with_fill(bool_structure(cond, True), b, casts)
        if _is_zero(b) and _masks(a, scale, scores_dtype):
            return _with_fill(bool_structure(cond, False), a, casts)
        return None
    if P._fn(node, torch.masked_fill) or P._meth(node, "masked_fill"):
        base, m, fill = node.args[0], P.arg(node, 1, "mask"), P.arg(node, 2, "value")
        if (_is_zero(base) and _same_last_two(base, node) and _same_last_two(m, node)
                and _masks(fill, scale, scores_dtype)):
            return _with_fill(bool_structure(m, False), fill, casts)
    return None


def _with_fill(s: Optional[Struct], fill: Any, casts: list) -> Optional[Struct]:
    """``s`` with the fill as the mask holds it: rounded through ``casts`` (dtypes, from the
    node that writes it to the mask itself); ``finfo(float32).min`` cast to bfloat16 is
    ``-inf``."""
    if s is None:
        return None
    value = _float_of(fill)
    if value is None:
        return dataclasses.replace(s, fill=None)
    t = torch.tensor(value, dtype=torch.float64)
    for d in casts:
        if d is None or not d.is_floating_point:
            return dataclasses.replace(s, fill=None)
        t = t.to(d)
    return dataclasses.replace(s, fill=float(t))


def canonical_bool(node: Any) -> Optional[Node]:
    """The bool mask ``m`` (True = masked) behind ``zeros_like(m, dtype=f).masked_fill_(m,
    -inf)``, PyTorch's ``F._canonical_mask`` of a bool mask (``nn.MultiheadAttention`` turns
    its ``key_padding_mask`` into it); None for anything else or anything written to."""
    if not (isinstance(node, Node) and P._meth(node, "masked_fill_", "masked_fill")):
        return None
    base, m, fill = node.args[0], P.arg(node, 1, "mask"), P.arg(node, 2, "value")
    if not (isinstance(base, Node) and P._fn(base, torch.zeros_like) and base.args[0] is m
            and len(base.users) == 1 and fill == -math.inf and _dtype(m) == torch.bool):
        return None
    if _mutated(_root(m)) or _mutated(node):
        return None
    return m
