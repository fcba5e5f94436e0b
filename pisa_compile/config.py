"""PisaConfig: the validated options of PISA attention and of the ``pisa`` backend, and
:func:`split_options`, which separates them from Inductor's in ``torch.compile(options=...)``."""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from dataclasses import InitVar, dataclass
from typing import Any, Mapping, Optional

import torch

from .kernels.dispatch import KERNELS  # the implementations plan() chooses from
from .kernels.geometry import cdiv, flat_applies, level_sizes

__all__ = ["PisaConfig", "PRESETS", "MAX_FLAT_LEAVES", "split_options"]

LEAF_SCORINGS = ("pooled", "exact")
_OPTIONAL = ("beam", "shortlist", "bound_block")  # the int options that take None
# Most leaves of a flat scan: its scratch is 65 rows of pow2(L) fp32 per persistent program
# and its work grows as L^2; 4096 leaves are 256K keys at block_size 64.
MAX_FLAT_LEAVES = 4096
_FLAT_NEEDS = "the flat scan needs leaf_scoring='exact', a shortlist and a bound_block"


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _as_int(name: str, value: Any) -> int:
    """``value`` as a Python int: any integral number (``numpy.int64`` too), never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"PisaConfig.{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_int(name: str, value: int, lo: int, hi: Optional[int] = None,
               pow2: bool = False) -> None:
    rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
    if value < lo or (hi is not None and value > hi) or (pow2 and not _is_pow2(value)):
        what = "a power of two " + rng if pow2 else rng
        raise ValueError(f"PisaConfig.{name} must be {what}, got {value}")


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel, called from ``__post_init__``, of the first frame
    outside ``pisa_compile`` and ``dataclasses`` (``__init__``, ``preset``, ``replace``,
    ``split_options``): the user's line."""
    import sys
    level, frame = 2, sys._getframe(2)
    while frame is not None and (frame.f_globals.get("__name__", "").startswith("pisa_compile")
                                 or frame.f_globals.get("__name__") == "dataclasses"):
        level, frame = level + 1, frame.f_back
    return level


def _unknown_options(where: str, names, valid=None) -> TypeError:
    """The error for option names that are not in ``valid`` (default: PisaConfig's fields):
    each with its closest valid name."""
    import difflib
    valid = PisaConfig.field_names() if valid is None else list(valid)
    hints = [f"{n!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(
        n, valid, n=1)) else "") for n in sorted(names)]
    return TypeError(f"{where}: unknown option(s) {', '.join(hints)}; valid: {', '.join(valid)}")


@dataclass(frozen=True)
class PisaConfig:
    """Options of PISA (Pyramid Top-K Sparse Attention); see ``DESIGN.md``, "The algorithm".

    The defaults are the ``"quality"`` preset, chosen on Qwen2.5-Coder-0.5B (H200, 45 needle
    cases per length, ``profiles/eval_llm_flat.json``): retrieval within 2 points of dense
    SDPA and loss within 1% at 4K, 8K, 16K and 30K (``min_seq_len`` lowered to measure them;
    below it the op is dense). ``PisaConfig.preset("fast")`` is an earlier, cheaper selection
    (pooled leaves, 64-query tiles): with the dense tail it retrieves 0.87 at 30K on that
    model (dense 0.91), at +7% loss; without the tail it loses most needles past 4K.
    ``README.md`` ("Speed and quality") gives both presets' measured quality and cost.

    Args:
        block_size: keys per leaf block ``C`` (power of two, 4..1024). Default 64.
        top_k: scored leaf blocks each query tile attends, on top of the forced blocks (>= 1).
        branching: children per pyramid node ``g`` (2..16).
        beam: nodes kept per pyramid level (>= 1), raised to ``top_k`` if smaller; ``None``
            means ``top_k``. Default 60: the widest beam whose candidate pool stays 128 wide
            with the default forced leaves (``pow2(g * (beam + forced))``).
        sink_blocks: leading leaf blocks every tile attends (>= 0), counted from the leaf of
            the row's first key that ``key_mask`` lets through (left padding is skipped).
        local_blocks: leaf blocks holding the tile's own positions, plus ``local_blocks - 1``
            before them, always attended in self-attention (>= 0; causal needs >= 1).
        query_tile: consecutive queries ``Tq`` that share one selection (power of two, 1..1024).
            A tile has ``Tq * G`` rows (``G`` query heads per KV head). Default 16.
        leaf_scoring: ``"pooled"`` (``scale*q.mu + log n``) or ``"exact"`` (LSE over the
            leaf's visible keys, the default).
        shortlist: with ``leaf_scoring="exact"``: an int ``M >= 1`` scores the pool's leaves
            roughly first (pooled, or box bounds with ``bound_block``) and only the
            ``max(M, top_k)`` best exactly; ``None`` scores every candidate leaf exactly.
            Unused with pooled scoring. With an explicit mask, partly visible leaves are
            scored exactly on top of the ``M``. Default 128 (with the flat scan: within 1% of
            dense's loss at 30K on Qwen2.5-Coder-0.5B, where 64 lost 1.7%; past
            ``flat_leaves`` the walk's pool is 128 wide, so every pool leaf is scored exactly).
        bound_block: ``None`` ranks pyramid nodes (and the shortlist, and pooled leaf picks)
            by pooled mean keys. An int ``S`` (power of two, capped at ``block_size``) ranks
            them by upper bounds of their logits instead: per-channel key boxes (Quest's page
            bounds) of every node, and for leaves the LSE over their ``S``-key sub-blocks'
            bounds. A mean dilutes a one-line needle 64-fold; a bound keeps it (DESIGN.md
            "Bound scores"). Default 16.
        flat_leaves: a call with at most this many leaf blocks has a one-level pyramid: every
            visible leaf is in the pool (a flat scan of the sub-block bounds, then the
            shortlist's exact scores), instead of the walk's beam. Quadratic in the length, so
            bounded: past it the walk keeps the cost at ``O(N log N)`` (0..4096; 0 always
            walks). Used with ``leaf_scoring="exact"``, a ``shortlist`` and a ``bound_block``
            (ignored otherwise). Default 512 (32K keys of 64); the scan's scratch takes
            ``65 * pow2(L)`` floats per persistent program (two per SM), whatever the batch.
            At most 4096 (:data:`MAX_FLAT_LEAVES`, 256K keys at ``block_size`` 64): the
            scan's work grows as ``L^2``. DESIGN.md "Flat leaves".
        min_seq_len: below this many keys the op is plain SDPA, and the backend leaves an
            SDPA call as it is (>= 0; DESIGN.md "Rewrite rules"). Default 32768: from
            there the default selection pays in training (forward+backward 2.2x faster than
            dense at 32K on the standard shape, H200); its forward matches dense at 32K (0.97x
            dense's speed, the flat scan's last length) and pays past it (2.2x at 64K, 4.5x
            at 128K; ``profiles/bench_options_r128.json``).
        dense_tail: the last ``dense_tail`` queries of an ``is_causal`` call without a
            window attend every visible key (dense SDPA; rounded up so that the sparse rows
            end on a query tile, fewer than ``dense_tail + query_tile``), and a call of at
            most ``dense_tail`` queries (a decode step; any mask) is dense SDPA, except a
            window on CUDA (FlexAttention) (>= 0; 0 turns both off). A prompt's closing
            question and every generated token then attend every key of their layer (keys
            that earlier rows computed sparsely), at
            ``O(dense_tail * Nk)`` per call. Assumes the queries a user reads come last
            (left padding for batched prompts). Default 64. A decode step (at most 16
            queries, fewer than the keys) is dense whatever ``dense_tail``, unless a persistent
            pyramid (``PisaCache``) holds its keys (``ops.is_decode_step``).
        kernel: ``"auto"`` (Triton on CUDA, reference elsewhere), ``"triton"`` (also the
            Triton interpreter on CPU, for tests) or ``"reference"`` (PyTorch only).

    Raises:
        ValueError: a field is out of range; the message names the field and the range.
        TypeError: an unknown option name; the message lists the valid ones and the closest.

    Warns:
        UserWarning: an option set to a value other than its default (the preset's, under
            :meth:`preset`; the copied config's, under :meth:`replace`) that the other options
            leave unused (``shortlist`` with pooled leaves; ``flat_leaves`` where the flat scan
            does not apply); the message names it, its value and why. Off values (0, None)
            never warn. One warning per config.
    """

    block_size: int = 64
    top_k: int = 16
    branching: int = 2
    beam: Optional[int] = 60
    sink_blocks: int = 1
    local_blocks: int = 2
    query_tile: int = 16
    leaf_scoring: str = "exact"
    shortlist: Optional[int] = 128
    bound_block: Optional[int] = 16
    flat_leaves: int = 512
    min_seq_len: int = 32768
    dense_tail: int = 64
    kernel: str = "auto"
    # Private: the values an option must differ from to count as set (None: the defaults);
    # preset() and replace() pass theirs. Read only by the unused-option warning.
    _base: InitVar[Optional[Mapping[str, Any]]] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "PisaConfig":
        # The dataclass's own TypeError names neither the valid fields nor the likely one.
        # A frozenset, not dataclasses.fields: Dynamo traces this where a compiled function
        # builds a config (pisa_attention's default).
        if kwargs and not _INIT_NAMES.issuperset(kwargs):
            raise _unknown_options(cls.__name__, set(kwargs) - _INIT_NAMES)
        return super().__new__(cls)

    def __post_init__(self, _base: Optional[Mapping[str, Any]]) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (f.name in ("leaf_scoring", "kernel") or type(value) is int
                    or (value is None and f.name in _OPTIONAL)):
                continue
            # numpy integers become ints, so configs hash and print as plain ints.
            object.__setattr__(self, f.name, _as_int(f.name, value))
        _check_int("block_size", self.block_size, 4, 1024, pow2=True)
        _check_int("top_k", self.top_k, 1)
        _check_int("branching", self.branching, 2, 16)
        if self.beam is not None:
            _check_int("beam", self.beam, 1)
        _check_int("sink_blocks", self.sink_blocks, 0)
        _check_int("local_blocks", self.local_blocks, 0)
        _check_int("query_tile", self.query_tile, 1, 1024, pow2=True)
        _check_int("flat_leaves", self.flat_leaves, 0, MAX_FLAT_LEAVES)
        _check_int("min_seq_len", self.min_seq_len, 0)
        _check_int("dense_tail", self.dense_tail, 0)
        if self.leaf_scoring not in LEAF_SCORINGS:
            raise ValueError(
                f"PisaConfig.leaf_scoring must be one of {LEAF_SCORINGS}, got {self.leaf_scoring!r}"
            )
        if self.shortlist is not None:
            _check_int("shortlist", self.shortlist, 1)
        if self.bound_block is not None:
            _check_int("bound_block", self.bound_block, 1, 1024, pow2=True)
        if self.kernel not in KERNELS:
            raise ValueError(f"PisaConfig.kernel must be one of {KERNELS}, got {self.kernel!r}")
        # Not while Dynamo traces (a compiled function building a config): frame inspection
        # would break the graph, and the same config warns when built eagerly.
        unused = {} if torch.compiler.is_compiling() else self._unused_options()
        if unused:
            base = _base or {}
            unused = {n: why for n, why in unused.items()
                      if getattr(self, n) != base.get(n, getattr(type(self), n))}
        if unused:
            warnings.warn("PisaConfig: " + "; ".join(
                f"{n}={getattr(self, n)!r} is ignored: {why}" for n, why in unused.items()),
                UserWarning, stacklevel=_caller_level())

    def _unused_options(self) -> dict[str, str]:
        """Options set to something other than off (0, None) that the other options leave
        unused: name -> why."""
        unused = {}
        if self.shortlist is not None and self.leaf_scoring != "exact":
            unused["shortlist"] = (f"leaf_scoring={self.leaf_scoring!r} scores no leaf exactly "
                                   "(a shortlist needs leaf_scoring='exact')")
        if self.flat_leaves and not self.effective_flat_leaves:
            unused["flat_leaves"] = (f"{_FLAT_NEEDS} (here leaf_scoring={self.leaf_scoring!r}, "
                                     f"shortlist={self.shortlist}, bound_block={self.bound_block})")
        return unused

    @property
    def effective_beam(self) -> int:
        """``beam`` as the selection uses it: ``None`` is ``top_k``, and never below ``top_k``
        (the leaf level picks ``top_k`` among the children of the kept nodes)."""
        return self.top_k if self.beam is None else max(self.beam, self.top_k)

    @property
    def effective_shortlist(self) -> int:
        """Leaves scored exactly per tile: 0 for all candidates (``shortlist=None``) and for
        pooled scoring (no exact scores), else ``max(shortlist, top_k)``."""
        if self.leaf_scoring != "exact" or self.shortlist is None:
            return 0
        return max(self.shortlist, self.top_k)

    @property
    def effective_flat_leaves(self) -> int:
        """``flat_leaves`` where it applies (exact leaves, a shortlist and box bounds:
        ``geometry.flat_applies``), else 0."""
        if flat_applies(self.leaf_scoring, self.effective_shortlist, self.effective_bound_block):
            return self.flat_leaves
        return 0

    @property
    def effective_bound_block(self) -> int:
        """``bound_block`` capped at ``block_size`` (a whole leaf's box), 0 for ``None``."""
        return 0 if self.bound_block is None else min(self.bound_block, self.block_size)

    def selection_kind(self, n_keys: Optional[int]) -> str:
        """How the sparse path selects the blocks of a call with ``n_keys`` keys (``L =
        ceil(n_keys / block_size)`` leaves): a flat scan (a one-level pool of every leaf) when
        ``L`` is at most :attr:`effective_flat_leaves`; a single-level pool (every leaf, no
        walk) when the pyramid has one level anyway (``L <= branching * beam``,
        ``geometry.level_sizes``); else the pyramid walk.

        Args:
            n_keys: the call's key count ``Nk`` (an int), or None where it is symbolic.

        Returns:
            e.g. ``"flat scan (512 leaves <= flat_leaves 512)"``, ``"single-level pool (all
            110 leaves <= branching * beam = 120)"``, ``"pyramid walk (2048 leaves, 5
            levels; flat_leaves 512)"``, or for None ``"flat scan up to 512 leaves (32768
            keys), pyramid walk past"``.
        """
        flat = self.effective_flat_leaves
        why = (f"flat_leaves {flat}" if flat else "flat_leaves=0" if not self.flat_leaves
               else f"flat_leaves unused: {_FLAT_NEEDS}")
        if n_keys is None:
            if flat:
                return (f"flat scan up to {flat} leaves ({flat * self.block_size} keys), "
                        "pyramid walk past")
            return f"pyramid walk ({why})"
        L = cdiv(n_keys, self.block_size)
        leaves = f"{L} leaf" if L == 1 else f"{L} leaves"
        if L <= flat:
            return f"flat scan ({leaves} <= flat_leaves {flat})"
        width = self.branching * self.effective_beam
        if L <= width:
            return f"single-level pool (all {leaves} <= branching * beam = {width})"
        n_lev = len(level_sizes(n_keys, self.block_size, self.branching, self.effective_beam))
        return f"pyramid walk ({leaves}, {n_lev} levels; {why})"

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "PisaConfig":
        """A named option set (:data:`PRESETS`) with ``overrides`` applied.

        ``"quality"`` is the defaults. ``"fast"`` is pooled leaves with 64-query tiles and
        ``beam = top_k`` from ``2048`` keys, no flat scan: several times cheaper than
        ``"quality"`` at 32K-128K (standard shape, H200) but it loses needles on a pretrained
        LLM (README "Speed and quality").

        Raises:
            ValueError: ``name`` is not a preset (the message lists them), or an override's
                value is out of range. TypeError: an override is not a field (the message
                lists them).

        Warns:
            UserWarning: an override that differs from the preset's value and that the other
                options leave unused (see the class); the preset's own values never warn.
        """
        unknown = set(overrides) - set(cls.field_names())
        if unknown:
            raise _unknown_options("PisaConfig.preset", unknown)
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"PisaConfig.preset: unknown preset {name!r}; expected one of "
                             f"{sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides}, _base=PRESETS[name])

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]]) -> "PisaConfig":
        """Build a config from the PISA keys of ``options`` (``"preset"`` first, then the
        fields over it); other keys are ignored here."""
        options = options or {}
        fields = {k: v for k, v in options.items() if k in cls.field_names()}
        if options.get("preset") is not None:  # None: the defaults, as for the other keys
            return cls.preset(options["preset"], **fields)
        return cls(**fields)

    def replace(self, **changes: Any) -> "PisaConfig":
        """A copy with ``changes`` applied (validated again; only ``changes`` can warn)."""
        return dataclasses.replace(
            self, **changes, _base={n: getattr(self, n) for n in _FIELDS})

    def selection_args(self) -> tuple:
        """The selection options in the order of the ``pisa::select_blocks`` schema:
        ``block_size, top_k, branching, beam (resolved), sink_blocks, local_blocks,
        query_tile, leaf_scoring, shortlist, bound_block, flat_leaves`` (resolved:
        ``effective_*``, 0 for none)."""
        return (self.block_size, self.top_k, self.branching, self.effective_beam,
                self.sink_blocks, self.local_blocks, self.query_tile, self.leaf_scoring,
                self.effective_shortlist, self.effective_bound_block, self.effective_flat_leaves)

    def attention_options(self) -> dict:
        """``block_size`` and ``query_tile``: what the attention kernels need to read a
        selection."""
        return dict(block_size=self.block_size, query_tile=self.query_tile)

    def selection_options(self) -> dict:
        """:meth:`selection_args` by name (the keyword arguments of the selection kernels)."""
        names = ("block_size", "top_k", "branching", "beam", "sink_blocks", "local_blocks",
                 "query_tile", "leaf_scoring", "shortlist", "bound_block", "flat_leaves")
        return dict(zip(names, self.selection_args()))


_FIELDS = PisaConfig.field_names()  # a tuple: Dynamo traces replace(), not dataclasses.fields
_FIELD_NAMES = frozenset(_FIELDS)
_INIT_NAMES = _FIELD_NAMES | {"_base"}

# Named option sets (PisaConfig.preset, or options={"preset": name} in torch.compile).
PRESETS: dict[str, dict] = {
    "quality": {},
    "fast": dict(beam=None, query_tile=64, leaf_scoring="pooled", shortlist=None,
                 bound_block=None, flat_leaves=0, min_seq_len=2048),
}


def split_options(options: Optional[Mapping[str, Any]] = None,
                  mode: Optional[str] = None) -> tuple[PisaConfig, dict]:
    """Split ``torch.compile``'s ``options=``/``mode=`` into a config and Inductor patches.

    Args:
        options: ``"preset"`` (a :data:`PRESETS` name), PisaConfig keys (validated by
            :class:`PisaConfig`, applied over the preset) and/or any
            ``torch._inductor.config`` key (``-`` may stand for ``_``), as ``torch.compile``
            passes them unvalidated.
        mode: a ``torch.compile`` mode, mapped with ``torch._inductor.list_mode_options``.

    Returns:
        ``(PisaConfig, inductor_config_patches)``; explicit ``options`` override ``mode``.

    Raises:
        TypeError: ``options`` is not a mapping.
        ValueError: an unknown key (the message lists the valid keys), an unknown mode, a bad
            PisaConfig value (the message names the field) or an Inductor value of the
            wrong type.
    """
    from torch._inductor import config as inductor_config, list_mode_options

    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict, got {type(options).__name__}")
    patches: dict = {}
    if mode is not None and mode != "default":
        modes = list_mode_options()
        if mode not in modes:
            raise ValueError(f"unknown mode {mode!r} for backend 'pisa': valid modes are "
                             f"{sorted(modes)}")
        patches.update(list_mode_options(mode))
    pisa_keys = ("preset",) + PisaConfig.field_names()
    known = inductor_config.get_config_copy()
    pisa: dict = {}
    for key, value in (options or {}).items():
        if key in pisa_keys:
            pisa[key] = value
            continue
        name = str(key).replace("-", "_")
        if name not in known:
            import difflib
            # An Inductor typo ("max_autotun", "triton.cudagraph") gets its hint too.
            close = (difflib.get_close_matches(str(key), pisa_keys, n=1)
                     or difflib.get_close_matches(name, list(known), n=1))
            raise ValueError(
                f"unknown option {key!r} for backend 'pisa'"
                + (f" (did you mean {close[0]!r}?)" if close else "") + ". Valid keys: the PISA keys "
                f"{', '.join(pisa_keys)}; or any torch._inductor.config key (e.g. "
                f"'max_autotune', 'triton.cudagraphs')")
        expected = inductor_config.get_type(name)
        if isinstance(expected, type) and not isinstance(value, expected):
            raise ValueError(f"option {key!r} (torch._inductor.config) must be "
                             f"{expected.__name__}, got {type(value).__name__} {value!r}")
        patches[name] = value
    return PisaConfig.from_options(pisa), patches
