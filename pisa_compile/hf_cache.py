"""``PisaCache``: a transformers ``Cache`` whose layers keep PISA's persistent pyramid, so that
``generate(past_key_values=PisaCache(max_cache_len))`` on a model compiled with
``backend="pisa"`` decodes sparsely (DESIGN.md "Persistent pyramid").

Each layer is a :class:`~pisa_compile.PisaKVCache` (preallocated keys and values for
``max_cache_len`` tokens and the pyramid's boxes). ``update`` runs eagerly (a graph break
under ``torch.compile``: the append launches the pyramid kernels) and returns views
``keys[:, :, :length]``; the compiled attention's decode op recognises those views at run time
(``pisa_compile.kernels.persistent``) and selects from the pyramid where the cost model says
sparse is faster. Without ``backend="pisa"`` the cache behaves as a ``DynamicCache`` (dense
attention reads the views).

:class:`PisaStaticCache` is the static counterpart (transformers' ``StaticCache``): its
length stays on the device and its update is one custom op, so a decode step is one graph
with no host length (DESIGN.md "A static cache: the length on the device").

Needs transformers >= 5 (``transformers.cache_utils.Cache`` with layer classes).
"""

from __future__ import annotations

import functools
import numbers
import warnings
from typing import Optional

import torch
from transformers.cache_utils import (Cache, DynamicCache, DynamicLayer, StaticCache,
                                      StaticLayer)

from .config import PisaConfig, _unknown_options
from .kv_cache import PisaKVCache, PisaStaticKVCache, check_options

__all__ = ["PisaCache", "PisaLayer", "PisaStaticCache", "PisaStaticLayer"]


class PisaLayer(DynamicLayer):
    """One decoder layer's cache: a :class:`PisaKVCache` created at the first ``update``
    (its batch, heads, head dims, dtype and device), ``keys``/``values`` its filled views."""

    is_compileable = False  # its update breaks the graph (eager kernel launches)
    is_croppable = False  # transformers checks this before assisted decoding; crop() raises

    def __init__(self, max_cache_len: int, config: Optional[PisaConfig] = None,
                 sparse_from: Optional[int] = None, on_init=None, full_attention: bool = False):
        super().__init__()
        self.max_cache_len, self.pisa_config, self.sparse_from = (max_cache_len, config,
                                                                  sparse_from)
        self.full_attention = full_attention  # known from the model's config: no window check
        self.cache: Optional[PisaKVCache] = None
        self._on_init = on_init  # called once, at the first update

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.cache = PisaKVCache(B, H, self.max_cache_len, D, value_dim=value_states.shape[3],
                                 dtype=key_states.dtype, device=key_states.device,
                                 config=self.pisa_config, sparse_from=self.sparse_from)
        self.cache.full_attention = self.full_attention
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        self._views()
        if self._on_init is not None:
            self._on_init()

    def _views(self) -> None:
        n = self.cache.length
        self.keys, self.values = self.cache.keys[:, :, :n], self.cache.values[:, :, :n]

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, Hkv, n, D]`` keys and values; returns every cached key and value
        (views of the preallocated buffers).

        Raises:
            ValueError: more tokens than ``max_cache_len``, or shapes that do not match the
                first call's (from :meth:`PisaKVCache.append`).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        if self.cache.length + n > self.max_cache_len:
            raise ValueError(
                f"PisaCache: max_cache_len={self.max_cache_len} is too small: a layer holds "
                f"{self.cache.length} tokens and gets {n} more (build PisaCache with at least "
                f"the prompt length plus max_new_tokens; a cache is reused by a later "
                f"generate() call, so reset() it first for a new prompt)")
        self.cache.append(key_states, value_states)
        self._views()
        # Batch, heads and head dim are fixed: the compiled graph after this break must not
        # take them as symbols (a symbolic head count cannot be proved a GQA multiple).
        for t in (self.keys, self.values):
            for dim in (0, 1, 3):
                torch._dynamo.mark_static(t, dim)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if self.cache is None else self.cache.length

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()
            self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search): keys and values are gathered and the pyramid is
        rebuilt over them."""
        if self.cache is None:
            return
        self.cache.reorder_batch(beam_idx)
        self._views()

    def crop(self, *args, **kwargs) -> None:
        raise NotImplementedError("PisaCache does not crop (assisted decoding); use a "
                                  "DynamicCache for it")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PisaCache has a fixed batch; build it for the expanded batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("PisaCache has a fixed batch; build it for the selected batch")


def _cache_len(max_cache_len, owner: str) -> int:
    """``max_cache_len`` as a Python int (numpy ints too, as transformers' ``StaticCache``
    takes them). Raises ValueError naming ``owner`` for a bool or a value below 1."""
    if not isinstance(max_cache_len, numbers.Integral) or isinstance(max_cache_len, bool) \
            or max_cache_len < 1:
        # A model config passed here (arguments swapped) would print as pages of JSON.
        got = (repr(max_cache_len) if isinstance(max_cache_len, (numbers.Number, str))
               else f"a {type(max_cache_len).__name__}")
        raise ValueError(f"{owner}: max_cache_len must be an int >= 1, got {got}")
    return int(max_cache_len)


class PisaCache(Cache):
    """A transformers cache with a persistent PISA pyramid per layer, for ``generate()``.

    Args:
        max_cache_len: the most tokens (prompt plus new tokens) a layer holds (int >= 1).
        config: the selection options of decode (:class:`PisaKVCache`); default
            ``PisaConfig()``.
        sparse_from: keys from which a decode step is sparse; None: the cost model of
            :class:`PisaKVCache`.
        model_config: the model's config (``model.config``), keyword only. With it, layers
            that are not full attention (sliding windows, chunks) keep transformers' own
            cache, as in ``DynamicCache(config=...)``: PISA does not select inside a window,
            and a window's cache stays window-sized; the other layers skip the run-time
            window check (one host sync per sparse step with a mask). Without it every layer
            keeps a pyramid, and a window is found at run time: from the prefill's mask when
            it is read at run time (a compiled prefill after this cache's graph break), else
            at the first step whose window start has moved past a key the cache holds as
            real. The layer's steps then run dense, with a warning. A prompt longer than the
            window whose prefill mask was not read gets one sparse step inside the window.

    The batch size, key heads and head dims are fixed at the first update (preallocated
    buffers), also after ``reset()``. No crop (``is_croppable`` is False): assisted
    decoding needs a ``DynamicCache``.

    Example::

        model.forward = torch.compile(model.forward, backend="pisa")
        out = model.generate(**inputs, max_new_tokens=64,
                             past_key_values=PisaCache(inputs["input_ids"].shape[1] + 64))
        # (transformers >= 5.24 names the argument ``cache=``)

    Decoder-only models. An encoder-decoder model (T5, Whisper) takes it as the
    self-attention half of transformers' ``EncoderDecoderCache(PisaCache(n),
    DynamicCache(config=model.config))``: passed alone, the cross-attention's keys land in
    the same layers (as they would in a ``DynamicCache`` passed alone) and the tokens are
    wrong, which this cache cannot tell from inside.

    Raises:
        ValueError: ``max_cache_len`` < 1 or ``sparse_from`` < 0; at an update, more tokens
            than ``max_cache_len``, or another batch size or head shape than the first's.
        TypeError: ``config`` is not a PisaConfig, or ``model_config`` not a model config.

    Warns:
        UserWarning: when it raises ``torch._dynamo.config.recompile_limit`` (to at least 64,
            and 4 per decoder layer): compiled, each layer's code after the cache's graph
            break is a graph of its own, and past the limit Dynamo would run the layers
            eagerly without an error. A process-wide setting; set it higher yourself to
            silence this.
    """

    def __init__(self, max_cache_len: int, config: Optional[PisaConfig] = None,
                 sparse_from: Optional[int] = None, *, model_config=None):
        max_cache_len = _cache_len(max_cache_len, "PisaCache")
        check_options(config, sparse_from, "PisaCache")  # now, not at the first update
        if model_config is not None and not hasattr(model_config, "get_text_config"):
            raise TypeError(f"PisaCache: model_config must be the model's config (a "
                            f"transformers PretrainedConfig, model.config), got "
                            f"{type(model_config).__name__}")
        _raise_recompile_limit(_MIN_RECOMPILES)
        # A counter, not a bound method of the cache: the layers must not keep the cache
        # (and its preallocated buffers) alive in a reference cycle.
        make = functools.partial(PisaLayer, max_cache_len, config, sparse_from, _LayerCount())
        if model_config is None:
            super().__init__(layer_class_to_replicate=make)
        else:
            # transformers' own layers where DynamicCache(config=...) makes other than full
            # attention (sliding windows, chunks): PISA does not select inside a window.
            layers = [make(full_attention=True) if type(layer) is DynamicLayer else layer
                      for layer in DynamicCache(config=model_config).layers]
            super().__init__(layers=layers)


# Each decoder layer's code after the cache's graph break is compiled per layer (Dynamo
# guards on the layer index, and on transformers' shared decorator frames): a tiny 2-layer
# Llama passed Dynamo's default limit of 8 in one generate() and ran eagerly, without an
# error (a new user's trial). PisaCache raises the limit so that compiled models stay
# compiled: at least 64, and 4 per layer.
_MIN_RECOMPILES = 64
_RECOMPILES_PER_LAYER = 4


_warned_limit = False


class _LayerCount:
    """Counts one cache's layers as they are made, and raises the limit to match."""

    def __init__(self):
        self.n = 0

    def __call__(self) -> None:
        self.n += 1
        _raise_recompile_limit(_RECOMPILES_PER_LAYER * self.n)


_PISA_CACHE_WHY = ("after the cache's graph break each layer compiles graphs of its own (the "
                   f"limit rises to {_RECOMPILES_PER_LAYER} per decoder layer as layers are "
                   "made)")


def _raise_recompile_limit(want: int, who: str = "PisaCache", why: str = _PISA_CACHE_WHY
                           ) -> None:
    """Raise Dynamo's per-frame recompile limit (and its accumulated limit, by as much) to
    at least ``want``; warn once per process, naming ``who`` and ``why`` it needs them."""
    global _warned_limit
    cfg = torch._dynamo.config
    limit = cfg.recompile_limit
    if limit >= want:
        return
    cfg.recompile_limit = want
    if hasattr(cfg, "accumulated_recompile_limit"):  # a cap over all frames (torch >= 2.6)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit,
                                              4 * want)
    if not _warned_limit:
        _warned_limit = True
        warnings.warn(f"{who} raised torch._dynamo.config.recompile_limit from {limit}: {why}, "
                      f"and past the limit torch.compile would run them eagerly, silently. Set "
                      f"it higher yourself to silence this.", stacklevel=3)


# StaticCache's own options, and the ones it takes and ignores (older transformers' names).
_STATIC_CACHE_KWARGS = ("offloading", "offload_only_non_sliding", "max_batch_size", "device",
                        "dtype", "layer_device_map")


class PisaStaticLayer(StaticLayer):
    """transformers' ``StaticLayer`` with PISA's persistent pyramid: its buffers, its
    device-side ``cumulative_length``, and a :class:`~pisa_compile.kv_cache.PisaStaticKVCache`
    over them that updates the pyramid in the same op as the write. Compileable: a decode
    step is one graph, replayable from a CUDA graph."""

    def __init__(self, max_cache_len: int, pisa_config: Optional[PisaConfig] = None,
                 sparse_from: Optional[int] = None):
        super().__init__(max_cache_len=max_cache_len)
        self.pisa_config, self.sparse_from = pisa_config, sparse_from
        self.pisa: Optional[PisaStaticKVCache] = None

    @torch.compiler.disable  # allocates and registers buffers: eager, once (a graph break)
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.pisa = PisaStaticKVCache(self.keys, self.values, self.cumulative_length,
                                      config=self.pisa_config, sparse_from=self.sparse_from)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, Hkv, n, D]`` keys and values at the layer's length and update its
        pyramid; returns the whole buffers (as ``StaticLayer``). Writing past
        ``max_cache_len`` is a ``ValueError`` when run eagerly; in a compiled step it fails
        in ``index_copy_`` (a device-side assert on CUDA), as ``StaticCache``'s does."""
        if key_states.shape[2] > self.max_cache_len:  # a shape: checked without a sync
            raise ValueError(f"PisaStaticCache: max_cache_len={self.max_cache_len} is too small "
                             f"for {key_states.shape[2]} tokens at once (build it with at "
                             f"least the prompt length plus max_new_tokens)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pisa.append(key_states, value_states)
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        if self.pisa is not None:
            self.pisa.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PisaStaticCache does not reorder its batch (beam search); "
                                  "use PisaCache or a StaticCache for it")

    def crop(self, *args, **kwargs) -> None:
        """``StaticLayer.crop`` (assisted decoding), then the pyramid rebuilt over the kept
        keys (eager, ``O(length)``): boxes of cut keys would otherwise stay."""
        super().crop(*args, **kwargs)
        if self.pisa is not None:
            self.pisa.rebuild()


class PisaStaticCache(StaticCache):
    """transformers' ``StaticCache`` whose full-attention layers keep PISA's persistent
    pyramid: ``generate()`` decodes sparsely with a static cache, each step one compiled
    graph with no host length, so that CUDA graphs can capture it (DESIGN.md "A static
    cache: the length on the device"). Measured inside ``generate()`` on the H200 (the
    Llama-1B-shaped 4-layer stack, 64 new tokens, per token against ``StaticCache`` with
    Inductor's CUDA graphs): 2.3x faster at 128K, B=1 and 3.2x at 32K, B=8 (docs/results.md).

    Args:
        config: the model's config (as ``StaticCache``: it gives the layers and their kinds;
            sliding-window layers stay transformers' own).
        max_cache_len: the most tokens (prompt plus new tokens) a layer holds (int >= 1).
        pisa_config: :class:`~pisa_compile.PisaConfig` of the decode selection; default
            ``PisaConfig()``.
        sparse_from: a ``max_cache_len`` from which decode steps are sparse; None: the cost
            model's ``"static"`` row (:func:`~pisa_compile.kv_cache.sparse_worthy`: dense SDPA
            over a static cache reads every slot each step) at ``max_cache_len``, and dense
            below ``pisa_config.min_seq_len`` (32768 by default, as the backend's).
        **kwargs: passed to ``StaticCache`` (not ``offloading``).

    Example::

        from transformers import CompileConfig
        cache = PisaStaticCache(model.config, max_cache_len=prompt_len + 64)
        # CompileConfig's default mode excludes options: CUDA graphs as Inductor's option.
        # Set once on the model (or pass compile_config= to each generate call).
        model.generation_config.compile_config = CompileConfig(
            backend="pisa", mode=None, options={"triton.cudagraphs": True})
        out = model.generate(**inputs, max_new_tokens=64, past_key_values=cache)
        # (transformers >= 5.24 names the argument ``cache=``)

    transformers compiles the decode steps itself when the cache is static (on CUDA), with
    ``compile_config`` (``mode="reduce-overhead"`` by default: CUDA graphs; with its default
    backend, Inductor, the steps run dense attention). Leave ``model.forward`` uncompiled:
    a forward compiled without CUDA graphs takes the steps over and runs them without
    graphs (``experiments/static_graph_probe.py``); the prefill is then eager and dense.
    The steps' sites are rewritten from the compile options' ``min_seq_len`` keys of
    capacity (32768 by default); ``pisa_config`` sets the decode selection, and (with
    ``sparse_from=None``) its ``min_seq_len`` the capacity below which no pyramid is kept:
    lower both together to decode shorter caches sparsely.
    ``sparse_from`` counts capacity (``PisaCache``'s counts keys held). transformers compiles
    the steps on CUDA only; elsewhere they run through whatever forward you compiled. As
    with ``StaticCache``, the batch is fixed at first use and a new prompt needs
    ``reset()``. A ``copy.deepcopy`` registers its own buffers. transformers'
    ``prefill_chunk_size`` runs the prompt's chunks through the compiled steps: on the H200
    (torch 2.11) Inductor's CUDA graphs crashed there (SIGSEGV), for ``StaticCache`` alone
    as for this cache; on the CPU it runs. Beam search is not
    supported (``reorder_cache`` raises NotImplementedError).

    Raises:
        ValueError: ``max_cache_len`` < 1, ``sparse_from`` < 0, or ``offloading`` (its
            prefetch swaps the layers' buffers for copies the pyramid does not see); at an
            update, more tokens at once than ``max_cache_len``, or, run eagerly, more than
            it has left (the message says to ``reset()`` before a new prompt). In a compiled
            step the length is on the device and an overflow fails ``index_copy_``'s bounds
            check: a device-side assert on CUDA (as for transformers' ``StaticCache``), an
            ``IndexError`` on the CPU.
        TypeError: ``config`` is not a model config, ``pisa_config`` is not a PisaConfig, a
            PisaConfig option is passed as a keyword, or a keyword is neither this class's nor
            ``StaticCache``'s (which would drop it silently).

    Warns:
        UserWarning: when it raises ``torch._dynamo.config.recompile_limit`` (as
            :class:`PisaCache`).
    """

    def __init__(self, config, max_cache_len: int, pisa_config: Optional[PisaConfig] = None,
                 sparse_from: Optional[int] = None, **kwargs):
        max_cache_len = _cache_len(max_cache_len, "PisaStaticCache")
        check_options(pisa_config, sparse_from, "PisaStaticCache", "pisa_config")
        if not hasattr(config, "get_text_config"):
            raise TypeError(f"PisaStaticCache: config must be the model's config (a "
                            f"transformers PretrainedConfig, model.config), got "
                            f"{type(config).__name__}")
        misplaced = sorted(set(kwargs) & set(PisaConfig.field_names()))
        if misplaced:
            raise TypeError(f"PisaStaticCache: {misplaced} are PisaConfig options: pass "
                            f"pisa_config=PisaConfig({misplaced[0]}=...)")
        # StaticCache takes any keyword and drops what it does not know: a misspelt
        # sparse_from or pisa_config would be lost silently.
        unknown = set(kwargs) - set(_STATIC_CACHE_KWARGS)
        if unknown:
            raise _unknown_options("PisaStaticCache", unknown, (
                "config", "max_cache_len", "pisa_config", "sparse_from") + _STATIC_CACHE_KWARGS)
        if kwargs.get("offloading"):
            raise ValueError("PisaStaticCache: offloading is not supported (its prefetch "
                             "replaces the layers' key buffers, which the pyramid and the "
                             "decode lookup are tied to); use StaticCache(offloading=True)")
        super().__init__(config, max_cache_len, **kwargs)
        # Each new batch, capacity or mask form compiles graphs of its own; past Dynamo's
        # default limit of 8 the steps would run eagerly and densely, silently.
        _raise_recompile_limit(_MIN_RECOMPILES, "PisaStaticCache",
                               "each new batch, capacity or mask form compiles graphs of its own")
        # Full-attention layers only: a sliding window's cache is small, dense is cheap.
        self.layers = [PisaStaticLayer(max_cache_len, pisa_config, sparse_from)
                       if type(layer) is StaticLayer else layer for layer in self.layers]
