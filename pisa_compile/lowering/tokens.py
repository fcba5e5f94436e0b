"""Which rows of a site's q and k are the same tokens: a proof of self-attention from the FX
graph (DESIGN.md, "Rewrite rules": padding queries).

Under a key padding mask, a padding query still votes in its query tile's selection, so the
real rows of that tile could pick other blocks than the sequence alone would (a right-padded
batch changed a sentence's output). The op cannot tell a padding query from a real one: it
takes the key mask only. Where q and k are projections of one token sequence, query ``i`` of
batch row ``b`` is the token of key ``Nk - Nq + i`` of row ``b`` (a KV cache appends in front
of it), and the pass hands the op the queries' mask that follows from the key mask
(:func:`~pisa_compile.ops.self_attention_query_mask`).

The proof walks q and k back, tracking both their batch and their sequence dim, to a common
node, along steps that keep each (batch row, token) where it is: layout (views, reshapes,
transposes, permutes, unsqueeze, expand of other dims, basic slicing that keeps both dims
whole, contiguous, casts), pointwise ops (followed through their operands of the output's
full shape, which must agree; broadcast operands such as RoPE's cos/sin or a norm's weight are
side data), norms over trailing dims, ``split``/``chunk``/``unbind``/``cat``/``stack`` of other
dims, and for k one ``cat`` along the sequence that appends it last (a KV cache's update). A
projection ends the walk at its input, where q's and k's meet: ``linear``, ``x @ W`` with
``W`` a module's parameter, GPT-2's ``addmm`` between views. A part taken of another dim (an
index, a split piece) must be of a projection's output features. Anything else (a gather, a
flip, a roll, a slice of the sequence or the batch, any other matmul) ends the walk at that
node: q and k then agree only where they reach that very node at the same two dims.
Cross-attention (q from the decoder, k from the encoder) ends at two different nodes, so it
gets no queries' mask, even at equal lengths. A walked node that anything writes in place
(through any view, or through a graph input) proves nothing.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from . import masks as M
from . import patterns as P

__all__ = ["same_tokens"]

# Row i of the output from row i of each full-shape tensor operand.
_POINTWISE_FNS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pos,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.tanh, torch.sigmoid,
    torch.exp, torch.rsqrt, torch.sqrt, torch.abs, torch.where, torch.clamp,
    F.silu, F.gelu, F.relu, F.dropout, F.sigmoid, F.tanh,
}
_POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "tanh", "sigmoid", "exp", "rsqrt", "sqrt", "abs",
    "clamp", "to", "type", "type_as", "float", "half", "bfloat16", "double", "contiguous",
    "clone", "detach",
}
_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze",
             "squeeze", "view_as", "reshape_as"}
_RESHAPE_FNS = {torch.reshape, torch.flatten, torch.unflatten, torch.unsqueeze, torch.squeeze}
_LINEAR_FNS = {F.linear, torch._C._nn.linear}
# Normalise over trailing dims only (QK-norm): row i from row i.
_NORM_FNS = {F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm}
_MATMUL_FNS = {torch.matmul, operator.matmul}
_CAT_FNS = {torch.cat, torch.concat, torch.concatenate}
_SPLIT_FNS = {torch.split, torch.chunk, torch.tensor_split}
_SPLIT_METHODS = {"split", "chunk", "tensor_split"}
_UNBIND = {torch.unbind, "unbind"}

# The walk's state: a node, its (batch dim, sequence dim), and whether a cat along the
# sequence put other keys in front.
_Found = tuple[Node, tuple[int, int], bool]


def same_tokens(q: Node, q_dims: tuple[int, int], k: Node, k_dims: tuple[int, int]) -> bool:
    """Whether query ``i`` of batch row ``b`` and key ``Nk - Nq + i`` of row ``b`` are one
    token's, proved from the graph: q and k reach one node, at the same (batch, sequence)
    dims, along steps that keep rows in place (module docstring), with a cache's ``cat`` at
    most on k's side, and nothing writes in place into a node on the way.

    Args:
        q, k: FX nodes of a site's query and key tensors (Dynamo's graph, with example
            values); ``q_dims``, ``k_dims``: their (batch, sequence) dims.

    Returns:
        False where the walk cannot tell (never an error): the op then gets no queries' mask.
    """
    memo: dict = {}
    fq = _walk(q, q_dims, frozenset(), False, memo)
    fk = _walk(k, k_dims, frozenset(), True, memo)
    if fq is None or fk is None or fq[:2] != fk[:2]:
        return False
    walked = {key[0] for key in memo} | {fq[0]}
    return not _written(q.graph, walked)


def _written(graph, nodes: set) -> bool:
    """Whether any node of ``graph`` may write in place into memory of ``nodes`` (through
    any view or in-place result): the walk read their values where they were made. Graph
    inputs may share memory the graph cannot see: a write into any input counts against a
    walk that reached one."""
    find = M.alias_find(graph)
    roots = {find(n) for n in nodes}
    reads_input = any(find(n).op == "placeholder" for n in nodes)
    for n in graph.nodes:
        for t in M.written_by(n):
            if find(t) in roots or reads_input and find(t).op == "placeholder":
                return True
    return False


def _shape(node: Any) -> Optional[tuple]:
    v = P.val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _reshaped_dim(src: tuple, out: tuple, d: int) -> Optional[int]:
    """The dim of ``src`` that a row-major reshape to ``out`` keeps as ``out``'s dim ``d``:
    the same size, with equal products of the dims before it and of those after it (row
    ``i`` then maps to row ``i``). None if there is none, or more than one (size-1 ties)."""
    eq, prod = P.known_equal, math.prod
    hits = [e for e in range(len(src))
            if eq(src[e], out[d]) and eq(prod(src[:e]), prod(out[:d]))
            and eq(prod(src[e + 1:]), prod(out[d + 1:]))]
    return hits[0] if len(hits) == 1 else None


def _within(src: tuple, out: tuple, c: int) -> Optional[int]:
    """The dim of ``src`` whose row-major span holds ``out``'s dim ``c`` after a reshape (``c``
    one factor of a split dim, or the dim itself); None if ``c`` spans several."""
    le = P.known_le
    for e in range(len(src)):
        if le(math.prod(src[e + 1:]), math.prod(out[c + 1:])) and \
                le(math.prod(out[c:]), math.prod(src[e:])):
            return e
    return None


def _index_map(index: Any, src: tuple) -> Optional[tuple[list, set]]:
    """Basic indexing ``x[index]``: for each output dim the ``src`` dim it comes from (None
    for a new ``None`` axis), and the ``src`` dims it cuts (an int, or a slice that may not be
    whole). None for advanced indexing (tensors, lists: they can reorder rows)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool)
           for i in items) or items.count(Ellipsis) > 1:
        return None
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(src) - consumed)
    else:
        items += [slice(None)] * (len(src) - consumed)
    where, cut, e = [], set(), 0
    for i in items:
        if i is None:
            where.append(None)
            continue
        if isinstance(i, int) or i != slice(None):
            cut.add(e)
        if not isinstance(i, int):
            where.append(e)
        e += 1
    return where, cut


def _agree(found: list) -> Optional[_Found]:
    if found and all(f is not None and f == found[0] for f in found):
        return found[0]
    return None


def _dim_arg(node: Node, index: int, rank: int) -> Optional[int]:
    """The ``dim`` (or numpy's ``axis``) argument of ``node``, normalised to ``rank``."""
    dim = P.arg(node, index, "dim", node.kwargs.get("axis", 0))
    dims = P.norm_dims([dim], rank)
    return None if dims is None else dims[0]


def _walk(node: Any, dims: tuple, cuts: frozenset, allow_append: bool, memo: dict
          ) -> Optional[_Found]:
    """Follow ``node``'s (batch, sequence) ``dims`` back to the node where row-keeping steps
    end. ``cuts``: dims of ``node`` that a step toward the site took a part of (an index, a
    split piece); they must be of a projection's output features (q's and k's pieces of a
    fused projection), not a dim of whole sequences (two streams stacked), nor the last dim
    of any other node (``cat([q_x, k_y], -1)`` packs two sequences there).
    ``memo``: each state once, as pointwise ops fan out."""
    out = _shape(node)
    if out is None:
        return None
    dims = P.norm_dims(list(dims), len(out))
    if dims is None or dims[0] == dims[1]:
        return None
    dims = tuple(dims)
    cuts = frozenset(c for c in cuts if not P.known_equal(out[c], 1))  # no part of size 1
    if cuts & set(dims):
        return None  # a part of the batch or of the sequence
    key = (node, dims, cuts, allow_append)
    if key not in memo:
        memo[key] = None  # re-entry cannot happen in a DAG; this only bounds it
        found = None
        if node.op in ("call_function", "call_method"):
            found = _step(node, out, dims, cuts, allow_append, memo)
        if found is None and not cuts:
            # The walk ends here. With a part taken it ends only at a projection (_step):
            # elsewhere the last dim may hold two sequences side by side (q | k of x and y).
            found = (node, dims, False)
        memo[key] = found
    return memo[key]


def _step(node: Node, out: tuple, dims: tuple, cuts: frozenset, allow_append: bool,
          memo: dict) -> Optional[_Found]:
    """One step back from ``node`` (output shape ``out``); None: the walk ends at ``node``."""
    a0 = node.args[0] if node.args else None
    src = _shape(a0)

    def follow(x, one, cut=None, more=()):
        """Walk on to ``x``: ``one`` maps a tracked dim (exactly), ``cut`` a cut dim (by
        default as ``one``); ``more``: dims of ``x`` this step cuts."""
        mapped = tuple(one(d) for d in dims)
        moved = [(cut or one)(c) for c in cuts]
        if any(e is None for e in (*mapped, *moved)):
            return None
        return _walk(x, mapped, frozenset(moved) | frozenset(more), allow_append, memo)

    fn = node.target if node.op == "call_function" else None
    meth = node.target if node.op == "call_method" else None
    view = P.as_view_perm(node)
    if view is not None:
        return follow(view[0], lambda d: view[1][d])
    if fn is operator.getitem and isinstance(a0, Node) and a0.op in ("call_function",
                                                                      "call_method"):
        if a0.target in _SPLIT_FNS or a0.target in _SPLIT_METHODS or a0.target in _UNBIND:
            return _piece(a0, dims, cuts, allow_append, memo)
    if src is None:
        return _step_on_values(node, out, dims, cuts, allow_append, memo, follow)
    if meth in _RESHAPES or fn in _RESHAPE_FNS:
        return (follow(a0, lambda d: _reshaped_dim(src, out, d), lambda c: _within(src, out, c))
                or _flat_projection(a0, out, dims, cuts))
    if meth == "expand":  # a broadcast dim is no row of the input
        lead = len(out) - len(src)
        return follow(a0, lambda d: d - lead if d >= lead and P.known_equal(
            src[d - lead], out[d]) else None)
    if fn is operator.getitem:
        index = _index_map(node.args[1], src)
        if index is None:
            return None
        where, cut = index
        if any(where[d] is None or where[d] in cut for d in dims):
            return None  # a tracked dim not taken whole
        return follow(a0, lambda d: where[d], more=cut)
    if fn in _LINEAR_FNS or fn in _MATMUL_FNS and len(node.args) > 1 and \
            _parameter(node.args[1]):
        # A projection's input ends the walk: q's and k's meet there (walking on would
        # only retrace the residual stream). Their pieces must be of its output features.
        # `x @ W` only with W a module's parameter: in `A @ x` the tokens are on the right.
        last = len(out) - 1
        return (a0, dims, False) if last not in dims and cuts <= {last} else None
    if fn in _NORM_FNS:
        shape = P.arg(node, 1, "normalized_shape")
        n = len(shape) if isinstance(shape, (list, tuple)) else 1
        return follow(a0, lambda d: d) if max(dims) < len(out) - n else None
    return _step_on_values(node, out, dims, cuts, allow_append, memo, follow)


def _parameter(node: Any, depth: int = 4) -> bool:
    """A 2-D ``nn.Parameter`` of a module, as is or transposed (``W.T``, ``W.t()``, ...)."""
    if not isinstance(node, Node) or depth == 0:
        return False
    if node.op in ("placeholder", "get_attr"):
        v = P.val(node)
        return isinstance(v, torch.nn.Parameter) and v.dim() == 2
    view = P.as_view_perm(node)
    if view is None and node.op == "call_function" and node.target is getattr and \
            node.args[1] == "T" or node.op == "call_method" and node.target == "t":
        view = (node.args[0], None)
    return view is not None and _parameter(view[0], depth - 1)


def _flat_projection(proj: Any, out: tuple, dims: tuple, cuts: frozenset
                     ) -> Optional[_Found]:
    """GPT-2's ``Conv1D``: ``addmm(b, x.view(-1, C), W).view(*x.shape[:-1], F)`` (or ``mm``,
    ``linear``) is a projection of ``x``, whose leading dims the reshape restores; the walk
    ends at ``x``, as at a ``linear``'s input."""
    if not isinstance(proj, Node) or proj.op != "call_function":
        return None
    flat = {torch.addmm: 1, torch.mm: 0, F.linear: 0, torch._C._nn.linear: 0}.get(proj.target)
    if flat is None or len(proj.args) <= flat or not isinstance(proj.args[flat], Node):
        return None
    view = proj.args[flat]
    x = view.args[0] if view.op == "call_method" and view.target in _RESHAPES or \
        view.op == "call_function" and view.target in _RESHAPE_FNS else None
    xs = _shape(x)
    last = len(out) - 1
    vs, ps = _shape(view), _shape(proj)
    if xs is None or vs is None or ps is None or len(xs) != len(out) or last in dims or \
            not cuts <= {last} or not all(map(P.known_equal, xs[:-1], out[:-1])) or \
            not P.known_equal(vs[-1], xs[-1]) or not P.known_equal(ps[-1], out[-1]):
        return None  # one row of the projection per token of x (not a group of them)
    return x, dims, False


def _step_on_values(node, out, dims, cuts, allow_append, memo, follow) -> Optional[_Found]:
    """``cat``, ``stack`` and pointwise steps (their first argument need not be a tensor)."""
    fn = node.target if node.op == "call_function" else None
    meth = node.target if node.op == "call_method" else None
    if fn in _CAT_FNS:
        return _cat(node, out, dims, cuts, allow_append, memo)
    if fn is torch.stack:
        return _stack(node, out, dims, cuts, allow_append, memo)
    if fn in _POINTWISE_FNS or meth in _POINTWISE_METHODS:
        full = [x for x in (*node.args, *node.kwargs.values())
                if isinstance(x, Node) and _shape(x) is not None
                and len(_shape(x)) == len(out) and all(map(P.known_equal, _shape(x), out))]
        if not full or meth is not None and full[0] is not node.args[0]:
            return None  # all broadcast, or a method on a broadcast tensor
        return _agree([follow(x, lambda d: d) for x in full])  # e.g. x.to(y): y must agree
    return None


def _piece(split: Node, dims: tuple, cuts: frozenset, allow_append: bool, memo: dict
           ) -> Optional[_Found]:
    """A piece of ``split``/``chunk``/``unbind`` along neither tracked dim: that dim is cut."""
    src = _shape(split.args[0] if split.args else None)
    if src is None:
        return None
    unbind = split.target in _UNBIND
    dim = _dim_arg(split, 1 if unbind else 2, len(src))
    if dim is None:
        return None

    def one(d):  # unbind drops its dim
        return d + 1 if unbind and d >= dim else d
    mapped = tuple(one(d) for d in dims)
    if dim in mapped:
        return None
    return _walk(split.args[0], mapped, frozenset(map(one, cuts)) | {dim}, allow_append, memo)


def _cat(node: Node, out: tuple, dims: tuple, cuts: frozenset, allow_append: bool,
         memo: dict) -> Optional[_Found]:
    """``torch.cat`` along another dim (operands agree), or for k along the sequence with the
    followed tensor last: a KV cache's ``cat([past, new])``. Never along the batch."""
    parts = P.arg(node, 0, "tensors")
    dim = _dim_arg(node, 1, len(out))
    if not isinstance(parts, (list, tuple)) or not parts or dim is None or dim == dims[0]:
        return None
    if dim != dims[1]:
        return _agree([_walk(x, dims, cuts, allow_append, memo) for x in parts])
    last = parts[-1]
    if not allow_append or _shape(last) is None or len(_shape(last)) != len(out):
        return None
    found = _walk(last, dims, cuts, False, memo)  # one cache append, no more
    return None if found is None else (found[0], found[1], True)


def _stack(node: Node, out: tuple, dims: tuple, cuts: frozenset, allow_append: bool,
           memo: dict) -> Optional[_Found]:
    """``torch.stack`` along a new dim that neither tracked dim is (GPT-J's
    ``stack((-x2, x1), -1)``): its parts must agree, a part taken of the new dim included."""
    parts = P.arg(node, 0, "tensors")
    new = _dim_arg(node, 1, len(out))
    if not isinstance(parts, (list, tuple)) or not parts or new is None or new in dims:
        return None

    def one(d):
        return d - 1 if d > new else d
    moved = frozenset(one(c) for c in cuts if c != new)
    return _agree([_walk(x, tuple(map(one, dims)), moved, allow_append, memo) for x in parts])
