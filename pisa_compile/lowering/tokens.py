"""Which rows of a site's q and k are the same tokens: a proof of self-attention from the FX
graph (DESIGN.md, "Rewrite rules": padding queries).

Under a key padding mask, a padding query still votes in its query tile's selection, so the
real rows of that tile could pick other blocks than the sequence alone would (a right-padded
batch changed a sentence's output). The op cannot tell a padding query from a real one: it
takes the key mask only. Where q and k are projections of one token sequence, query ``i`` is
the token of key ``Nk - Nq + i`` (a KV cache appends in front of it), and the pass hands the op
the queries' mask that follows from the key mask (:func:`~pisa_compile.ops.self_attention_query_mask`).

The proof walks q and k back to a common node along token-preserving steps only: row ``i``
of each step's output comes from row ``i`` of the input it is followed through. Steps:
layout (views, reshapes, transposes, permutes, unsqueeze, basic slicing of other dims,
contiguous, casts), pointwise ops (followed through their operands of the output's full
shape, which must agree; broadcast operands such as RoPE's cos/sin or a norm's weight are side
data), ``linear`` and ``x @ W`` with a 2-D ``W``, ``split``/``chunk`` of other dims, ``cat``
of other dims (its operands must agree), and for k one ``cat`` along the sequence that appends
it last (a KV cache's update). Anything else (a gather, a flip, a roll, a slice of the
sequence, a matmul over tokens) ends the walk at that node: q and k then agree only where
they reach that very node. Cross-attention (q from the decoder, k from the encoder) ends at
two different nodes, so no queries' mask is handed on, even at equal lengths.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

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
_NORM_FNS = {F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm} - {None}
_MATMUL_FNS = {torch.matmul, operator.matmul}
_CAT_FNS = {torch.cat, torch.concat, torch.concatenate}
_SPLIT_FNS = {torch.split, torch.chunk, torch.tensor_split}
_SPLIT_METHODS = {"split", "chunk", "tensor_split"}

# (root node, its sequence dim, whether a cat along the sequence put other keys in front)
_Found = tuple[Node, int, bool]


def same_tokens(q: Node, q_dim: int, k: Node, k_dim: int) -> bool:
    """Whether query ``i`` of ``q`` and key ``Nk - Nq + i`` of ``k`` are one token's, proved
    from the graph: both reach one node, at one sequence dim, along token-preserving steps
    (module docstring), with a cache's ``cat`` at most on k's side.

    Args:
        q, k: FX nodes of a site's query and key tensors (Dynamo's graph, with example
            values); ``q_dim``, ``k_dim``: their sequence dims.

    Returns:
        False where the walk cannot tell (never an error): the op then gets no queries' mask.
    """
    memo: dict = {}
    fq = _walk(q, q_dim, False, memo)
    fk = _walk(k, k_dim, True, memo)
    return fq is not None and fk is not None and fq[:2] == fk[:2]


def _shape(node: Any) -> Optional[tuple]:
    v = P.val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _eq(a: Any, b: Any) -> bool:
    return P.known_equal(a, b)


def _prod(xs) -> Any:
    return math.prod(xs) if xs else 1


def _reshaped_dim(src: tuple, out: tuple, d: int) -> Optional[int]:
    """The dim of ``src`` that a row-major reshape to ``out`` keeps as ``out``'s dim ``d``:
    the same size, with equal products of the dims before it and of those after it (row
    ``i`` then maps to row ``i``). None if there is none, or more than one (size-1 ties)."""
    hits = [e for e in range(len(src))
            if _eq(src[e], out[d]) and _eq(_prod(src[:e]), _prod(out[:d]))
            and _eq(_prod(src[e + 1:]), _prod(out[d + 1:]))]
    return hits[0] if len(hits) == 1 else None


def _index_dim(index: Any, src: tuple, out: tuple, d: int) -> Optional[int]:
    """The dim of ``src`` that basic indexing ``x[index]`` keeps as dim ``d`` of ``out``,
    taken whole (a slice of its full length); None for advanced indexing or a cut."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool)
           for i in items):
        return None  # tensors, lists: advanced indexing can reorder rows
    if items.count(Ellipsis) > 1:
        return None
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(src) - consumed)
    else:
        items += [slice(None)] * (len(src) - consumed)
    e = o = 0
    for i in items:
        if i is None:
            o += 1
            continue
        if isinstance(i, int):
            e += 1
            continue
        if o == d:
            return e if e < len(src) and _eq(src[e], out[d]) else None
        e += 1
        o += 1
    return None


def _agree(found: list) -> Optional[_Found]:
    if found and all(f is not None and f == found[0] for f in found):
        return found[0]
    return None


def _walk(node: Any, d: int, allow_append: bool, memo: dict) -> Optional[_Found]:
    """Follow ``node``'s sequence dim ``d`` back to the node where token-preserving steps end
    (``memo``: each (node, dim) once, as pointwise ops fan out)."""
    out = _shape(node)
    if out is None or not -len(out) <= d < len(out):
        return None
    d %= len(out)
    key = (node, d, allow_append)
    if key not in memo:
        memo[key] = None  # a cycle cannot occur in a graph; this only bounds re-entry
        step = None
        if node.op in ("call_function", "call_method"):
            step = _step(node, out, d, allow_append, memo)
        memo[key] = (node, d, False) if step is None else step
    return memo[key]


def _step(node: Node, out: tuple, d: int, allow_append: bool, memo: dict) -> Optional[_Found]:
    """One step back from ``node`` (output shape ``out``, sequence dim ``d``); None: the walk
    ends at ``node``."""
    a0 = node.args[0] if node.args else None
    src = _shape(a0)

    def follow(x, e):
        return _walk(x, e, allow_append, memo)

    view = P.as_view_perm(node)
    if view is not None:
        return follow(view[0], view[1][d])
    if node.op == "call_method" and node.target in _RESHAPES or \
            node.op == "call_function" and node.target in _RESHAPE_FNS:
        e = _reshaped_dim(src, out, d) if src is not None else None
        return None if e is None else follow(a0, e)
    if node.op == "call_method" and node.target == "expand":
        e = d - (len(out) - len(src)) if src is not None else -1
        return follow(a0, e) if e >= 0 and _eq(src[e], out[d]) else None
    if node.op == "call_function" and node.target is operator.getitem:
        if isinstance(a0, Node) and a0.op in ("call_function", "call_method") and \
                (a0.target in _SPLIT_FNS or a0.target in _SPLIT_METHODS):
            return _split(a0, d, allow_append, memo)
        if src is None:
            return None
        e = _index_dim(node.args[1], src, out, d)
        return None if e is None else follow(a0, e)
    if node.op == "call_function" and node.target in _LINEAR_FNS or \
            node.op == "call_function" and node.target in _MATMUL_FNS and _weight(node):
        # A projection's input is where the walk ends: q's and k's meet there (walking on
        # would only retrace the residual stream).
        return (a0, d, False) if d != len(out) - 1 and isinstance(a0, Node) else None
    if node.op == "call_function" and node.target in _NORM_FNS:
        shape = P.arg(node, 1, "normalized_shape")
        n = len(shape) if isinstance(shape, (list, tuple)) else 1
        return follow(a0, d) if d < len(out) - n else None
    if node.op == "call_function" and node.target in _CAT_FNS:
        return _cat(node, out, d, allow_append, memo)
    if node.op == "call_function" and node.target in _POINTWISE_FNS or \
            node.op == "call_method" and node.target in _POINTWISE_METHODS:
        full = [x for x in (*node.args, *node.kwargs.values())
                if isinstance(x, Node) and _shape(x) is not None
                and len(_shape(x)) == len(out) and all(map(_eq, _shape(x), out))]
        if not full or node.op == "call_method" and full[0] is not a0:
            return None  # all broadcast, or x.to(other): follow only the tensor itself
        return _agree([follow(x, d) for x in full])
    return None


def _weight(node: Node) -> bool:
    """``x @ W`` with a 2-D right operand: token-wise, like ``linear``."""
    w = _shape(node.args[1]) if len(node.args) > 1 else None
    return w is not None and len(w) == 2


def _split(split: Node, d: int, allow_append: bool, memo: dict) -> Optional[_Found]:
    """A piece of ``split``/``chunk`` along another dim than the sequence's."""
    src = _shape(split.args[0] if split.args else None)
    if src is None:
        return None
    dim = P.arg(split, 2, "dim", 0)
    if not isinstance(dim, int) or not -len(src) <= dim < len(src) or dim % len(src) == d:
        return None
    return _walk(split.args[0], d, allow_append, memo)


def _cat(node: Node, out: tuple, d: int, allow_append: bool, memo: dict) -> Optional[_Found]:
    """``torch.cat`` along another dim (operands agree), or for k along the sequence with the
    followed tensor last: a KV cache's ``cat([past, new])``."""
    parts = P.arg(node, 0, "tensors")
    dim = P.arg(node, 1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or not parts or not isinstance(dim, int) \
            or not -len(out) <= dim < len(out):
        return None
    if dim % len(out) != d:
        return _agree([_walk(x, d, allow_append, memo) for x in parts])
    last = parts[-1]
    if not allow_append or _shape(last) is None or len(_shape(last)) != len(out):
        return None
    found = _walk(last, d, False, memo)  # one cache append, no more
    return None if found is None else (found[0], found[1], True)
