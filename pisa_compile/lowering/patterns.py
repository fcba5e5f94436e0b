"""The attention pattern catalogue: small, named recognisers over Dynamo FX nodes.

Dynamo graphs are torch IR before autograd: ``call_function`` nodes on ``torch.*`` /
``operator.*`` / ``torch.nn.functional.*`` and ``call_method`` nodes on tensors. One idea is
written many ways there (``q @ k.mT``, ``torch.matmul``, ``torch.bmm``, ``torch.einsum``;
``F.softmax``, ``Tensor.softmax``, ``torch.softmax``; ...), so each recogniser below accepts
one *step* of an attention site in all its spellings and returns what the rewrite needs, or
``None``. Fixed-shape sub-graphs (Llama's ``repeat_kv``) are :mod:`torch._inductor.pattern_matcher`
patterns; the steps whose arity and spelling vary are small functions.

Nothing here edits a graph: :mod:`.rewrite` walks sites with these and decides.

The catalogue (what the pass rewrites; ``tests/test_lowering.py`` and
``tests/test_zoo_forms.py`` have one test per form, ``tests/test_zoo.py`` the HF models):

- **SDPA**: ``F.scaled_dot_product_attention`` / ``torch._C._nn...``, every argument; on
  ``repeat_kv``-ed or ``repeat_interleave``-ed k/v it becomes ``enable_gqa``.
- **Hand-written**: ``softmax(scores) @ v`` where ``scores`` is ``q @ kᵀ`` (``@``,
  ``matmul``, ``bmm`` on 3-D ``[B*H, N, D]``, or a two-operand ``einsum`` in any letter
  order), with any of, between the matmul and the softmax: numeric or symbolic scales
  (``*``, ``/``, ``.mul``/``.div``, on q, on k or on the scores; a one-element constant
  ``torch.full([], c)`` / ``torch.tensor(c)`` counts as ``c``); dtype casts
  (``.float()``, ``.to(float32)``, ``.type_as``); any number of additive float masks (HF's
  ``finfo.min`` masks, sliced ``mask[:, :, :, :k.shape[-2]]``, T5's position bias then its
  mask, BERT's extended mask); at most one bool mask (``masked_fill(m, -inf|finfo.min)``,
  ``where(m, s, fill)``, ``where(m, fill, s)``, fills given as numbers or constant
  tensors). After the softmax: casts, ``.contiguous()``, dropout that is off. k/v may pass
  through permutes, ``.contiguous()``, no-op casts and Llama's ``repeat_kv`` (GQA).
- **Inductor's ``fuse_attention`` forms** (torch 2.13, ``_sfdp_pattern_1`` .. ``_30``), in
  words: 1-4, 12, 28: ``matmul(q, kᵀ)`` divided or multiplied by a scale, softmax, optional
  dropout, matmul with v (12 with [B,N,H,D] permuted inputs; 28 non-contiguous); 5-6: the
  same plus an additive mask, dropout in 6; 7-10: permuted fp16 inputs, scores upcast to
  fp32 before softmax and cast back, ``v.to(weights.dtype)``, the scale on the scores (7-8)
  or on q (9-10), with/without dropout; 11: permuted inputs, chained ``.div().softmax()
  .matmul()``; 13: ``bmm`` on 3-D tensors, no scale, dropout; 14/16 (BERT): scale, add mask,
  softmax, dropout, ``.to(q.dtype)``; 15/17/20 (DistilBERT): ``(mask == 0).view(b,1,1,S)
  .expand_as(scores)`` then ``masked_fill`` with a ``-inf`` tensor, scale on scores or q
  (20), dropout (17, 20); 18/19 (old HF GPT-2): ``k.permute(0,1,3,2)``, divide by a
  ``torch.full([], sqrt(d))`` tensor, ``where(causal, scores, full((), finfo.min))``, plus a
  mask in 19, ``.type(v.dtype)``, dropout; 21-23, 25-27 (T5): unscaled scores plus a mask
  (23, 27: no mask), ``.float().softmax().type_as(q)``, dropout in 25-27, k/v also
  returned; 24 (MBart): ``bmm`` on 3-D with the scores viewed to 4-D to add the mask and
  back; 29-30: aten-level ``_safe_softmax`` decomposition of SDPA. All are caught except 24
  (a ``view`` of the scores between matmul and softmax: left dense, "score transform
  view"); 29-30 are aten-level forms that a Dynamo graph holds as the SDPA call, which is
  caught. Dropout that is active in training (3, 4, 6, 7, 9, 12, 13, 16-19, 25-27 in
  training) is left dense: the kernels have no dropout.
- **``nn.MultiheadAttention``**: Dynamo keeps ``F.multi_head_attention_forward`` as one
  call; it is replaced by :func:`.mha.pisa_multi_head_attention_forward` when batched, with
  no ``bias_k``/``bias_v``/``add_zero_attn``/``static_k``, dropout off, and the weights
  never read (``need_weights=False`` or output 1 unused); masks: bool/float ``attn_mask``,
  ``key_padding_mask``, ``is_causal``.

Left dense, with the reason in the report: weights used elsewhere; active dropout; a tensor
scale; a mask of unsupported dtype/shape; a mask that requires grad (T5's learned bias in
training); softcapping (``tanh``) or any other score transform; softmax over another dim.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch._inductor.pattern_matcher import (
    Arg,
    CallFunction,
    CallMethod,
    KeywordArg,
)

__all__ = [
    "SDPA_TARGETS", "val", "is_tensor_node", "arg", "is_softmax", "softmax_input",
    "matmul_kind", "as_scale", "as_cast", "as_dropout", "as_view_perm", "as_contiguous",
    "as_repeat_kv", "as_mask_add", "as_masked_fill", "as_where", "parse_einsum", "describe",
    "constant_of", "is_softcap", "as_noop_cast", "known_equal", "autocast_enter",
    "is_autocast_exit", "norm_dims", "known_le",
]

# -- node helpers ----------------------------------------------------------------------------

def val(x: Any) -> Any:
    """The example value Dynamo recorded for a node (a FakeTensor, SymInt, ...), or ``x``."""
    if isinstance(x, Node):
        return x.meta.get("example_value", x.meta.get("val"))
    return x


def is_tensor_node(x: Any) -> bool:
    return isinstance(x, Node) and isinstance(val(x), torch.Tensor)


def known_equal(a: Any, b: Any) -> bool:
    """``a == b`` provably (ints, or SymInts equal for every value the shape env allows)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return bool(statically_known_true(a == b))


def known_le(a: Any, b: Any) -> bool:
    """``a <= b`` provably (ints, or SymInts for every value the shape env allows)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return bool(statically_known_true(a <= b))


def is_number(x: Any) -> bool:
    """A Python number, or a node carrying a SymInt/SymFloat (shape-derived scalar)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    return isinstance(x, Node) and isinstance(val(x), (torch.SymInt, torch.SymFloat, int, float))


def arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional) or ``name`` (keyword) of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _fn(node: Node, *targets) -> bool:
    return node.op == "call_function" and node.target in targets


def _meth(node: Node, *names: str) -> bool:
    return node.op == "call_method" and node.target in names


def is_checkpoint(node: Any) -> bool:
    """An activation-checkpoint region (``torch.utils.checkpoint`` under Dynamo):
    ``tag_activation_checkpoint(get_attr body, *operands)``."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return (isinstance(node, Node) and node.op == "call_function" and hop is not None
            and node.target is hop and bool(node.args)
            and getattr(node.args[0], "op", None) == "get_attr")


def autocast_enter(node: Any) -> Optional[tuple]:
    """``(device_type, dtype, enabled)`` of a ``torch.autocast`` region entered inside the
    graph (Dynamo: ``torch.amp.autocast_mode._enter_autocast(device, dtype, enabled,
    cache)``), else None. A dtype of None is the device's autocast dtype now (as
    ``torch.autocast`` reads it on entry)."""
    if not (isinstance(node, Node) and node.op == "call_function"
            and node.target is torch.amp.autocast_mode._enter_autocast):
        return None
    try:
        bound = inspect.signature(torch.autocast.__init__).bind(None, *node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    device, dtype, enabled = (bound.arguments[k] for k in ("device_type", "dtype", "enabled"))
    if not isinstance(device, str) or not isinstance(enabled, bool):
        return None
    if dtype is None:
        dtype = torch.get_autocast_dtype(device)
    return (device, dtype, enabled) if isinstance(dtype, torch.dtype) else None


def is_autocast_exit(node: Any) -> bool:
    """The end of a region :func:`autocast_enter` recognises: ``_exit_autocast(enter)``."""
    return (isinstance(node, Node) and node.op == "call_function"
            and node.target is torch.amp.autocast_mode._exit_autocast)


def checkpoint_operands(call: Node, body: Any) -> Optional[dict]:
    """Each placeholder of a checkpoint ``body`` (a GraphModule) and the operand ``call``
    (:func:`is_checkpoint`) passes it, in order; None when their counts differ."""
    holders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(holders) != len(call.args) - 1:
        return None
    return dict(zip(holders, call.args[1:]))


def describe(node: Any) -> str:
    """A short human name for a node's operation: ``tanh``, ``Tensor.clamp``, ``add``."""
    if not isinstance(node, Node):
        return repr(node)
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {node.target}"


# -- SDPA --------------------------------------------------------------------------------------

# F.scaled_dot_product_attention *is* torch._C._nn.scaled_dot_product_attention (a builtin).
SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                 "enable_gqa": False}


def sdpa_args(node: Node) -> Optional[dict]:
    """The bound SDPA arguments of a ``scaled_dot_product_attention`` call, else ``None``."""
    if node.op != "call_function" or node.target not in SDPA_TARGETS:
        return None
    bound = dict(SDPA_DEFAULTS)
    bound.update(zip(SDPA_ARGS, node.args))
    bound.update(node.kwargs)
    return bound


# -- softmax -------------------------------------------------------------------------------------

_SOFTMAX_FNS = (F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax)


def is_softmax(node: Node) -> bool:
    """``F.softmax(x, dim)``, ``torch.softmax(x, dim)``, ``x.softmax(dim)``."""
    return _fn(node, *_SOFTMAX_FNS) or _meth(node, "softmax")


def softmax_input(node: Node) -> tuple[Node, Any, Any]:
    """``(input, dim, dtype)`` of a softmax node."""
    # F.softmax(input, dim, _stacklevel, dtype); torch.softmax(input, dim, dtype); x.softmax(dim, dtype)
    return arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 3 if node.target is F.softmax
                                                                else 2, "dtype")


# -- matmul --------------------------------------------------------------------------------------

def matmul_kind(node: Node) -> Optional[str]:
    """``"matmul"`` (``@``, ``torch.matmul``, ``Tensor.matmul``), ``"bmm"`` or ``"einsum"``."""
    if _fn(node, operator.matmul, torch.matmul) or _meth(node, "matmul", "__matmul__"):
        return "matmul"
    if _fn(node, torch.bmm) or _meth(node, "bmm"):
        return "bmm"
    if _fn(node, torch.einsum):
        return "einsum"
    return None


def matmul_operands(node: Node) -> tuple[Any, Any]:
    """The two operands of a matmul-like node (einsum: the two tensors after the equation)."""
    if matmul_kind(node) == "einsum":
        ops = node.args[1:]
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = tuple(ops[0])
        return (ops[0], ops[1]) if len(ops) == 2 else (None, None)
    if node.op == "call_method":
        return node.args[0], arg(node, 1, "other", node.kwargs.get("mat2"))
    return arg(node, 0, "input"), arg(node, 1, "other", node.kwargs.get("mat2"))


@dataclass(frozen=True)
class Einsum:
    """A two-operand einsum ``a,b->out`` with single-letter axes (no ellipsis)."""

    a: str
    b: str
    out: str


def parse_einsum(node: Node) -> Optional[Einsum]:
    eq = node.args[0]
    if not isinstance(eq, str) or "..." in eq or "->" not in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    parts = lhs.split(",")
    if len(parts) != 2 or any(len(set(p)) != len(p) for p in (*parts, out)):
        return None
    return Einsum(parts[0], parts[1], out)


# -- scale ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scale:
    """``out = input * factor`` (``divide`` means ``out = input / factor``)."""

    input: Node
    factor: Any  # a number, a SymFloat/SymInt node, or a tensor node (then not rewritable)
    divide: bool

    @property
    def is_tensor(self) -> bool:
        return is_tensor_node(self.factor)


def as_scale(node: Node, allow_inplace: bool = False) -> Optional[Scale]:
    """``x * s``, ``s * x``, ``x / s``, ``torch.mul/div``, ``Tensor.mul/div`` (and in-place).

    ``s`` is a number, a symbolic scalar, or a one-element tensor (a tensor scale, which the
    rewrite refuses). In-place forms only with ``allow_inplace``: stripping ``q.mul_(s)`` off
    ``q`` would read the mutated ``q``, so only chain-internal tensors may be scaled in place.
    """
    inplace = ((operator.imul, operator.itruediv) if allow_inplace else ())
    inplace_m = (("mul_", "div_") if allow_inplace else ())
    if _fn(node, operator.mul, torch.mul, *inplace[:1]) or _meth(node, "mul", "__mul__",
                                                                   *inplace_m[:1]):
        divide = False
    elif (_fn(node, operator.truediv, torch.div, torch.true_divide, *inplace[1:])
          or _meth(node, "div", "true_divide", "__truediv__", *inplace_m[1:])):
        if node.kwargs.get("rounding_mode") is not None:
            return None
        divide = True
    else:
        return None
    if len(node.args) != 2:
        return None
    a, b = node.args
    ta, tb = is_tensor_node(a), is_tensor_node(b)
    if ta and tb:
        # Both tensors: a scale only if one side is a one-element tensor. A constant built in
        # the graph (GPT-2's ``torch.full([], value.size(-1) ** 0.5)``) is its number;
        # anything else is a tensor scale (which the rewrite refuses).
        if _is_scalar_tensor(b) and not _is_scalar_tensor(a):
            c = constant_of(b)
            return Scale(a, b if c is None else c, divide)
        if not divide and _is_scalar_tensor(a) and not _is_scalar_tensor(b):
            c = constant_of(a)
            return Scale(b, a if c is None else c, False)
        return None
    if ta and is_number(b):
        return Scale(a, b, divide)
    if tb and is_number(a) and not divide:
        return Scale(b, a, False)
    return None


def constant_of(x: Any) -> Any:
    """The number held by ``x``: a Python number or symbolic scalar as is, or a one-element
    tensor built from one in the graph (``torch.full([], c)``, ``torch.full((1,), c)``,
    ``torch.tensor(c)``, ``torch.scalar_tensor(c)``); else ``None``."""
    if is_number(x):
        return x
    if not isinstance(x, Node):
        return None
    if _fn(x, torch.full):
        size, value = arg(x, 0, "size"), arg(x, 1, "fill_value")
        if isinstance(size, int):
            size = (size,)
        if (isinstance(size, (list, tuple)) and all(d == 1 for d in size)
                and is_number(value)):
            return value
        return None
    if _fn(x, torch.tensor, torch.scalar_tensor, torch.as_tensor) and x.args:
        return x.args[0] if is_number(x.args[0]) else None
    return None


def is_softcap(node: Node) -> bool:
    """``tanh`` on the scores: Gemma-2 / Grok logit softcapping, ``c * tanh(s / c)``."""
    return _fn(node, torch.tanh, F.tanh) or _meth(node, "tanh")


def _is_scalar_tensor(node: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    v = val(node)
    return (isinstance(v, torch.Tensor) and v.dim() <= 1
            and statically_known_true(v.numel() == 1))


# -- casts, dropout, views -------------------------------------------------------------------------

def as_noop_cast(node: Node) -> Optional[Node]:
    """A cast (:func:`as_cast`) whose output dtype equals its input's: ``v.to(w.dtype)``
    where they already agree (Inductor's fp16 patterns 7-10 write it on ``v``)."""
    src = as_cast(node)
    if src is None:
        return None
    a, b = val(src), val(node)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype:
        return src
    return None


def as_cast(node: Node) -> Optional[Node]:
    """A dtype cast that keeps values: ``.float()``, ``.half()``, ``.to(dtype)``, ``.type_as(t)``."""
    if _meth(node, "float", "half", "bfloat16", "double", "type_as"):
        return node.args[0]
    if _meth(node, "to", "type") and is_tensor_node(node.args[0]):
        rest = [a for a in node.args[1:]] + [v for k, v in node.kwargs.items() if k == "dtype"]
        if all(isinstance(a, torch.dtype) or is_tensor_node(a) for a in rest) and (
                set(node.kwargs) <= {"dtype", "copy", "non_blocking"}):
            return node.args[0]
    if _fn(node, torch.Tensor.to, torch.Tensor.float, torch.Tensor.type_as):
        return node.args[0]
    return None


@dataclass(frozen=True)
class Dropout:
    input: Node
    active: bool  # True: dropout really drops (training with p != 0) or cannot be proven off
    p: Any


def as_dropout(node: Node) -> Optional[Dropout]:
    """``F.dropout(x, p, training)``; ``torch.dropout(x, p, train)``; ``nn.Dropout`` as traced."""
    if _fn(node, F.dropout, torch.dropout, torch.nn.functional.dropout1d,
           torch.nn.functional.dropout2d):
        default_training = node.target is not torch.dropout
        p = arg(node, 1, "p", 0.5)
        training = arg(node, 2, "train" if node.target is torch.dropout else "training",
                       default_training)
    elif _meth(node, "dropout"):
        p, training = arg(node, 1, "p", 0.5), arg(node, 2, "train", True)
    else:
        return None
    off = training is False or (isinstance(p, (int, float)) and p == 0)
    return Dropout(node.args[0], not off, p)


def as_contiguous(node: Node) -> Optional[Node]:
    """``x.contiguous()`` / ``x.clone()``: value-preserving, layout only."""
    if _meth(node, "contiguous", "clone") and len(node.args) == 1:
        return node.args[0]
    return None


def norm_dims(dims: Sequence[Any], rank: int) -> Optional[list[int]]:
    """Dims as non-negative ints below ``rank``, or None where one is not an int in range."""
    out = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or not -rank <= d < rank:
            return None
        out.append(d % rank)
    return out


def as_view_perm(node: Node) -> Optional[tuple[Node, list[int]]]:
    """A pure axis permutation ``y = x.permute(p)``: returns ``(x, p)`` (``y.dim i = x.dim p[i]``).

    Covers ``transpose/swapaxes/swapdims`` (method or ``torch.*``), ``permute``, ``.mT``.
    """
    src = node.args[0] if node.args else None
    v = val(src)
    if not isinstance(v, torch.Tensor):
        return None
    rank = v.dim()
    if node.op == "call_function" and node.target is getattr and node.args[1] == "mT":
        if rank < 2:
            return None
        p = list(range(rank))
        p[-2], p[-1] = p[-1], p[-2]
        return src, p
    if _fn(node, torch.transpose, torch.swapaxes, torch.swapdims) or _meth(
            node, "transpose", "swapaxes", "swapdims"):
        dims = norm_dims(node.args[1:3], rank)
        if dims is None or len(dims) != 2:
            return None
        p = list(range(rank))
        p[dims[0]], p[dims[1]] = p[dims[1]], p[dims[0]]
        return src, p
    if _fn(node, torch.permute) or _meth(node, "permute"):
        dims = node.args[1:] if len(node.args) > 2 else node.args[1] if len(node.args) == 2 else \
            node.kwargs.get("dims")
        if isinstance(dims, int):
            dims = [dims]
        dims = norm_dims(list(dims or ()), rank)
        if dims is None or sorted(dims) != list(range(rank)):
            return None
        return src, dims
    return None


# -- GQA: Llama's repeat_kv, repeat_interleave ------------------------------------------------------

# x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)
REPEAT_KV = CallMethod(
    "reshape",
    CallMethod("expand",
               CallFunction(operator.getitem, KeywordArg("kv"), KeywordArg("index")),
               Arg(), Arg(), KeywordArg("n_rep"), Arg(), Arg()),
    Arg(), Arg(), Arg(), Arg(),
)
_FULL = slice(None, None, None)


@dataclass(frozen=True)
class Repeat:
    """``out = input`` with each head repeated ``n_rep`` times in place (SDPA's GQA layout)."""

    input: Node
    n_rep: int
    form: str  # "repeat_kv" or "repeat_interleave"


def as_repeat_kv(node: Node) -> Optional[Repeat]:
    """Llama's ``repeat_kv`` or ``x.repeat_interleave(n, dim=1)`` on a 4-D ``[B, H, N, D]``."""
    m = REPEAT_KV.match(node)
    if m:
        kv, index, n_rep = m.kwargs["kv"], m.kwargs["index"], m.kwargs["n_rep"]
        if (isinstance(index, tuple) and index == (_FULL, _FULL, None, _FULL, _FULL)
                and isinstance(n_rep, int) and _heads_are(node, kv, n_rep)):
            return Repeat(kv, n_rep, "repeat_kv")
    if _fn(node, torch.repeat_interleave) or _meth(node, "repeat_interleave"):
        src = node.args[0]
        n_rep = arg(node, 1, "repeats")
        dim = arg(node, 2, "dim")
        v = val(src)
        if (isinstance(v, torch.Tensor) and v.dim() == 4 and isinstance(n_rep, int)
                and isinstance(dim, int) and dim % 4 == 1 and not node.kwargs.get("output_size")
                and _heads_are(node, src, n_rep)):
            return Repeat(src, n_rep, "repeat_interleave")
    return None


def _heads_are(out: Node, src: Node, n_rep: int) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    vo, vs = val(out), val(src)
    if not (isinstance(vo, torch.Tensor) and isinstance(vs, torch.Tensor)):
        return False
    if vo.dim() != 4 or vs.dim() != 4:
        return False
    return (statically_known_true(vo.shape[1] == vs.shape[1] * n_rep)
            and all(statically_known_true(vo.shape[i] == vs.shape[i]) for i in (0, 2, 3)))


# -- masks -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MaskOp:
    """A mask applied to the scores.

    ``kind`` is ``"add"`` (``scores + mask``, float mask) or ``"bool"``; for ``"bool"``,
    ``attend_if`` is True when ``mask`` True means *attend* (``where(m, s, -inf)``) and False
    when it means *masked* (``masked_fill(m, -inf)``). ``fill`` is the fill value, if any.
    """

    scores: Node
    mask: Any
    kind: str
    attend_if: bool = True
    fill: Any = None


def as_mask_add(node: Node, scores: Node) -> Optional[MaskOp]:
    """``scores + mask`` / ``mask + scores`` / ``torch.add`` / ``Tensor.add`` (no ``alpha``)."""
    if not (_fn(node, operator.add, operator.iadd, torch.add) or _meth(node, "add", "add_",
                                                                        "__add__")):
        return None
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    if a is scores:
        return MaskOp(scores, b, "add")
    if b is scores:
        return MaskOp(scores, a, "add")
    return None


def as_masked_fill(node: Node) -> Optional[MaskOp]:
    """``scores.masked_fill(m, value)`` / ``torch.masked_fill``: ``m`` True means masked."""
    if _fn(node, torch.masked_fill) or _meth(node, "masked_fill", "masked_fill_"):
        return MaskOp(node.args[0], arg(node, 1, "mask"), "bool", False, arg(node, 2, "value"))
    return None


def as_where(node: Node, scores: Node) -> Optional[MaskOp]:
    """``torch.where(m, scores, fill)`` (m True = attend) or ``where(m, fill, scores)``."""
    if not (_fn(node, torch.where) or _meth(node, "where")):
        return None
    if node.op == "call_method":  # scores.where(m, fill)
        if node.args[0] is scores and len(node.args) == 3:
            return MaskOp(scores, node.args[1], "bool", True, node.args[2])
        return None
    if len(node.args) != 3:
        return None
    cond, a, b = node.args
    if a is scores:
        return MaskOp(scores, cond, "bool", True, b)
    if b is scores:
        return MaskOp(scores, cond, "bool", False, a)
    return None


def is_masking_fill(value: Any, dtype: torch.dtype) -> bool:
    """``-inf``, or at or below half of ``finfo(dtype).min``: softmax weight exactly 0.

    That is the threshold PISA itself uses for float masks (DESIGN.md, "The algorithm").
    """
    value = constant_of(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if value == -math.inf:
        return True
    if not dtype.is_floating_point:
        return False
    return value <= torch.finfo(dtype).min / 2


def invert_target(node: Any) -> Optional[Node]:
    """``x`` when ``node`` is ``~x`` / ``logical_not(x)`` on a bool tensor, else ``None``."""
    if isinstance(node, Node) and (
            _fn(node, operator.invert, torch.logical_not, torch.bitwise_not)
            or _meth(node, "logical_not", "bitwise_not", "__invert__")):
        src = node.args[0]
        v = val(src)
        if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
            return src
    return None


def builds_from_tril(node: Any, depth: int = 6) -> bool:
    """Whether a mask node is built from ``tril``/``triu`` within a few steps (the report's
    ``(tril/triu)``; not a proof of causality)."""
    seen, frontier = set(), [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if not isinstance(n, Node) or n in seen:
                continue
            seen.add(n)
            if _fn(n, torch.tril, torch.triu) or _meth(n, "tril", "triu", "tril_", "triu_"):
                return True
            nxt.extend(a for a in n.all_input_nodes)
        frontier = nxt
    return False
