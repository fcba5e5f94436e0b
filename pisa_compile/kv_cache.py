"""A static KV cache that keeps PISA's key pyramid beside the keys (DESIGN.md "Persistent
pyramid"): decode selects from the pyramid and reads only the keys it picks.

Dense decode reads all of ``K`` and ``V`` per step. Rebuilding the pyramid per step (what
:func:`pisa_compile.pisa_attention` does) reads all of ``K`` too, so it cannot beat dense
decode. Here the pyramid's boxes (per leaf and per node above it: channel max/min of the
keys, Quest's page bounds arranged as PISA's pyramid) are updated as keys are appended: a
step touches one leaf and its ``O(log L)`` ancestors. A decode step then reads the boxes of
the walk's pool per level, the keys of the leaves it scores exactly, and the ``K``/``V``
blocks it attends.
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import PisaConfig
from .kernels import dispatch, persistent
from .kernels.geometry import dense_mask
from .kernels.runtime import DECODE_MAX_QUERIES, stage_range
from .kernels.persistent import BoxPyramid, box_pyramid

_log = logging.getLogger("pisa_compile")
_TOLD_MIN_SEQ_LEN = False  # the min_seq_len gate of PisaStaticKVCache, logged once
# Single-token appends in a row that nothing read the pyramid after: a model whose attention
# never reaches the cache (generate() on the module torch.compile returns runs the
# original, uncompiled forward; a new user's trial). Warned once per process.
_UNREAD_STEPS = 8
_TOLD_UNREAD = False

__all__ = ["PisaKVCache", "PisaStaticKVCache", "SPARSE_DECODE_BYTES", "SPARSE_DECODE_BYTES_FLAT",
           "decode_config"]

# The cost model: a sparse step takes about the same time at any length (0.05-0.14 ms on the
# H200 replayed from a CUDA graph, 0.4 ms launched eagerly, mostly host time), dense decode
# reads every key and value once. So a step is sparse from this many bytes of K/V per step
# (the crossovers of profiles/bench_decode.json: B=8 between 8K and 16K keys, B=1 near 80K
# in a graph; eagerly B=8 near 56K, B=1 past 128K).
# "static": steps over a static cache in CUDA graphs (PisaStaticKVCache), where the dense
# step reads every slot under a mask that has SDPA expand the GQA heads: in generate() with
# transformers' static cache (Llama-1B-shaped 4-layer stack, D=64, B=1) sparse steps tied
# at 64 MiB of K/V (32K: 1.511 against 1.504 ms per token) and won at 256 MiB (128K: 1.43
# against 2.07; profiles/generate_static_graphs.json). 128 MiB sits between the two.
SPARSE_DECODE_BYTES = {"graph": 384 << 20, "eager": 2 << 30, "static": 128 << 20}
# Up to flat_leaves leaves a step ranks every leaf box (the flat kernel) instead of walking:
# 0.157 ms at B=8, 32K in a CUDA graph against the walk's 0.110 and dense's 0.257, 0.114
# at B=1 (walk 0.069, dense 0.051); eagerly 0.47 ms at B=8 (walk 0.38). A straight line
# through those two batch sizes puts the graph break-even near 475 MiB of K/V at 32K
# (profiles/bench_decode_flat.json): these thresholds keep a margin; they are estimates,
# not a measured sweep. Which steps are flat: triton_select.runs_flat.
# Its "static" row is the walk's scaled as the "graph" rows are (640 / 384): not measured
# (every sparse static step measured walked).
SPARSE_DECODE_BYTES_FLAT = {"graph": 640 << 20, "eager": 3 << 30, "static": 213 << 20}


def decode_config(config: PisaConfig) -> PisaConfig:
    """The options a :class:`PisaKVCache` decode step selects with: per query, from per-leaf
    boxes. Up to ``flat_leaves`` leaves every leaf box is ranked (on Qwen2.5-Coder at 30K the
    walk's pool of 128 lost needles, 0.822 against 0.933 with dense steps; the flat ranking
    kept them, 0.933), past it the walk."""
    return config.replace(query_tile=1, bound_block=config.block_size, dense_tail=0,
                          min_seq_len=0)


def sparse_worthy(keys: Tensor, values: Tensor, n_keys: int, step_config: PisaConfig,
                  sparse_from: Optional[int], cuda_graph: bool, static: bool = False) -> bool:
    """The cost model: whether a decode step over ``n_keys`` cached keys (of the buffers
    ``keys`` ``[B, Hkv, cap, D]`` and ``values``, selecting with ``step_config``, a
    :func:`decode_config`) is sparse: from ``sparse_from`` keys if given, else once a dense
    step would read :data:`SPARSE_DECODE_BYTES` of K/V (:data:`SPARSE_DECODE_BYTES_FLAT`
    while the step ranks every leaf box), the ``"eager"`` row without CUDA graphs, else
    the ``"static"`` row for a static cache's steps and the ``"graph"`` row otherwise."""
    if sparse_from is not None:
        return n_keys >= sparse_from
    B, Hkv, _, D = keys.shape
    dense_bytes = B * Hkv * n_keys * (D + values.shape[3]) * keys.element_size()
    from .kernels.triton_select import runs_flat
    flat = runs_flat(n_keys, **step_config.selection_options())
    table = SPARSE_DECODE_BYTES_FLAT if flat else SPARSE_DECODE_BYTES
    return dense_bytes >= table[("static" if static else "graph") if cuda_graph else "eager"]


def check_options(config: Optional[PisaConfig], sparse_from: Optional[int],
                  where: str, config_name: str = "config") -> PisaConfig:
    """``config`` (default ``PisaConfig()``) once ``config`` and ``sparse_from`` are checked;
    ``where`` names the caller and ``config_name`` the config's argument in the errors.

    Raises:
        TypeError: ``config`` is not a PisaConfig.
        ValueError: ``sparse_from`` is not None or an int >= 0 (numpy ints too).
    """
    if sparse_from is not None and (not isinstance(sparse_from, numbers.Integral) or isinstance(
            sparse_from, bool) or sparse_from < 0):
        raise ValueError(f"{where}: sparse_from must be an int >= 0 or None, got "
                         f"{sparse_from!r}")
    config = PisaConfig() if config is None else config
    if not isinstance(config, PisaConfig):
        hint = (f" (PisaConfig(**{config!r}))" if isinstance(config, dict) else "")
        raise TypeError(f"{where}: {config_name} must be a PisaConfig{hint}, got "
                        f"{type(config).__name__}")
    return config


def _deepcopy_registered(self, memo):
    """``copy.deepcopy`` of a cache: a copy (transformers' prompt reuse deep-copies a
    prefilled cache) holds buffers of its own, registered, or its steps would miss the
    registry and run dense."""
    import copy
    new = object.__new__(type(self))
    memo[id(self)] = new
    for name, val in self.__dict__.items():
        setattr(new, name, copy.deepcopy(val, memo))
    persistent.register(new.keys, new)
    return new


def _decode_refusal(cache, t: Tensor) -> Optional[str]:
    """Why a cache's sparse decode (Triton only) cannot take ``t`` (None: it can); warns once
    per reason where the cache was asked for sparse steps by name (``sparse_from``): dense
    steps, equal to dense attention, would pass for PISA's quality in a user's evaluation."""
    why = dispatch.triton_refusal(t, cache.values, cache.config.kernel)
    if why is not None and cache.sparse_from is not None:
        dispatch._warn_once(f"{type(cache).__name__}(sparse_from=...): the sparse decode runs "
                            f"the Triton kernels, which cannot run here ({why})",
                            "decode steps run dense SDPA (exact), not PISA")
    return why


class PisaKVCache:
    """One attention layer's KV cache, preallocated, with a persistent PISA key pyramid.

    Prefill and decode both go through it: :meth:`append` writes the new keys and values and
    updates the pyramid (from the length where decode turns sparse; below it the cache costs
    what a dense one does), :meth:`attend` runs causal attention for the newest queries.
    A decode call (at most 16 queries) on the Triton path is sparse where the cost model says
    it is faster than dense (``sparse_from``): per query (query tile 1; the ``G`` query
    heads of a KV head share it) it ranks every leaf by its box (up to ``flat_leaves``
    leaves; past it, walks the pyramid's boxes: ``branching``, ``beam``), scores the
    ``shortlist`` best leaves exactly, and attends the ``top_k`` best plus the forced leaves
    with the split-K decode kernel. Other calls run :func:`pisa_compile.pisa_attention` with
    ``config`` (a long prefill: PISA; a short call: dense), or dense SDPA where dense is
    faster.

    Args:
        batch_size, num_kv_heads, max_len, head_dim: ``B``, ``Hkv``, the most tokens, ``D``
            (ints >= 1).
        value_dim: ``Dv`` (default ``head_dim``).
        dtype: the keys' and values' dtype (the pyramid's boxes are stored in it).
        device: where the cache lives; default CUDA where available, else the CPU.
        config: :class:`~pisa_compile.PisaConfig` for the selection (``block_size``,
            ``top_k``, ``branching``, ``beam``, ``sink_blocks``, ``local_blocks``,
            ``shortlist``) and for prefill. Default ``PisaConfig()``.
        sparse_from: keys from which a decode step is sparse; None (default): the cost model,
            sparse once a dense step would read :data:`SPARSE_DECODE_BYTES` of K/V
            (:data:`SPARSE_DECODE_BYTES_FLAT` while the step ranks every leaf box; measured
            on the H200 for one shape: Hkv=8, D=128, G=4).
        cuda_graph: tells the cost model that you replay the steps from CUDA graphs you
            capture (no host time per step): its ``"graph"`` threshold, else ``"eager"``.
            A captured step is valid for one cache length only (the length, the ``[:n]``
            views and the offsets are Python values baked in at capture).

    Quality: on Qwen2.5-Coder-0.5B with every decode step sparse (45 needle cases per
    length) the walk (``beam`` 60) lost needles that dense steps keep: 0.822 against 0.933
    at 30K (``profiles/eval_llm_pyramid.json``). Ranking every leaf box (the flat kernel,
    up to ``flat_leaves``) keeps them: 1.000 / 0.956 / 0.933 / 0.933 at 4K / 8K / 16K / 30K
    against dense steps' 1.000 / 0.978 / 0.933 / 0.933 and dense SDPA's 1.000 / 0.978 /
    0.911 / 0.911 (``profiles/eval_llm_flat_decode.json``). Past ``flat_leaves`` (over 32K
    keys) decode walks, unmeasured on a real model (the model's context is 32K).
    The ``"fast"`` preset's pooled leaves keep the walk and lose far more (0.400 against
    0.867 at 30K).

    Memory: the pyramid takes ``(2 * D * itemsize + 8)`` bytes per node and head, about
    ``2 * ceil(max_len / block_size)`` nodes (``branching`` 2): 3.1% of the K/V cache at
    ``D = 128``, ``block_size`` 64 (:meth:`nbytes`).

    Raises:
        ValueError: a size < 1, or ``sparse_from`` < 0.
        TypeError: ``config`` is not a PisaConfig.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *,
                 value_dim: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
                 device=None, config: Optional[PisaConfig] = None,
                 sparse_from: Optional[int] = None, cuda_graph: bool = False):
        value_dim = head_dim if value_dim is None else value_dim
        sizes = {"batch_size": batch_size, "num_kv_heads": num_kv_heads, "max_len": max_len,
                 "head_dim": head_dim, "value_dim": value_dim}
        for name, val in sizes.items():
            if not isinstance(val, numbers.Integral) or isinstance(val, bool) or val < 1:
                raise ValueError(f"PisaKVCache: {name} must be an int >= 1, got {val!r}")
        # numpy ints too, as transformers' caches take them
        batch_size, num_kv_heads, max_len, head_dim, value_dim = map(int, sizes.values())
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"PisaKVCache: dtype must be a floating dtype, got {dtype!r}")
        config = check_options(config, sparse_from, "PisaKVCache")
        self.sparse_from = None if sparse_from is None else int(sparse_from)
        self.config, self.cuda_graph = config, bool(cuda_graph)
        self.decode_config = decode_config(config)
        self.keys = torch.zeros(batch_size, num_kv_heads, max_len, head_dim, dtype=dtype,
                                device=device)
        self.values = torch.zeros(batch_size, num_kv_heads, max_len, value_dim, dtype=dtype,
                                  device=device)
        self.key_mask: Optional[Tensor] = None  # bool [B, max_len], once padding is given
        self.pyramid: BoxPyramid = box_pyramid(
            batch_size, num_kv_heads, max_len, head_dim, dtype, device,
            block_size=config.block_size, branching=config.branching,
            beam=config.effective_beam)
        self.length = 0
        self.pyramid_length = 0  # keys the pyramid is up to date for
        # Set (a reason) once a step's mask hid a key the cache holds as real: not padding
        # but a window or another structure, which PISA's selection does not run inside.
        self.not_padding: Optional[str] = None
        self._hid_real: Optional[Tensor] = None  # device bool: a step's mask hid a real key
        self._mask_known = 0  # keys whose padding the cache was told (the rest: assumed real)
        # Set by a caller that knows the layer is full attention (PisaCache's model_config):
        # no window to look for, so no per-step check and its sync.
        self.full_attention = False
        self._unread_steps = 0  # single-token appends since the pyramid was last read
        # Compiled models' decode steps find the pyramid through the keys they are handed.
        persistent.register(self.keys, self)

    __deepcopy__ = _deepcopy_registered

    @property
    def view_length(self) -> int:
        """The keys a compiled step is handed: ``keys[:, :, :length]``."""
        return self.length

    def reset(self) -> None:
        """Empty the cache (the buffers are kept)."""
        self.length = self.pyramid_length = self._unread_steps = 0
        self.key_mask = None
        self.not_padding, self._hid_real, self._mask_known = None, None, 0
        self.pyramid.clear()

    def reorder_batch(self, index: Tensor) -> None:
        """Gather the batch rows ``index`` (int ``[B]``, beam search) of the keys, values and
        key mask, and rebuild the pyramid over them (``O(length)``). What the masks showed
        (:meth:`mark_not_padding`, the window check) is kept: transformers reorders after
        every forward."""
        n, index = self.length, index.to(self.keys.device)
        k = self.keys[:, :, :n].index_select(0, index)
        v = self.values[:, :, :n].index_select(0, index)
        km = None if self.key_mask is None else self.key_mask[:, :n].index_select(0, index)
        found = self.not_padding, self._hid_real, self._mask_known
        self.reset()
        self.append(k, v, km)
        self.not_padding, self._hid_real, self._mask_known = found

    def nbytes(self) -> dict:
        """``{"kv": bytes of K and V, "pyramid": bytes of the pyramid}`` (allocated)."""
        return {"kv": self.keys.numel() * self.keys.element_size()
                + self.values.numel() * self.values.element_size(),
                "pyramid": self.pyramid.nbytes()}

    def append(self, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None
               ) -> None:
        """Write ``n`` new tokens at positions ``[length, length + n)`` and update the pyramid.

        Args:
            key: ``[B, Hkv, n, D]``; value: ``[B, Hkv, n, Dv]`` (the cache's dtype and device).
            key_padding_mask: None (all real) or ``[B, n]`` bool/int, nonzero = a real token
                (a tokenizer's ``attention_mask`` for these tokens; left padding).

        Raises:
            ValueError: shapes that do not match the cache, or more tokens than fit.
        """
        B, Hkv, cap, D = self.keys.shape
        if key.dim() != 4 or (key.shape[0], key.shape[1], key.shape[3]) != (B, Hkv, D):
            raise ValueError(f"PisaKVCache.append: key must be [B={B}, Hkv={Hkv}, n, D={D}], "
                             f"got {tuple(key.shape)}: the cache holds batch {B}, {Hkv} key "
                             f"heads of dim {D}, fixed by its preallocated buffers (also "
                             f"after reset()); build a new cache for another batch size")
        n = key.shape[2]
        for name, t in (("key", key), ("value", value)):
            if t.dtype != self.keys.dtype or t.device != self.keys.device:
                raise ValueError(f"PisaKVCache.append: {name} must be {self.keys.dtype} on "
                                 f"{self.keys.device} (the cache's), got {t.dtype} on {t.device}")
        if tuple(value.shape) != (B, Hkv, n, self.values.shape[3]):
            raise ValueError(f"PisaKVCache.append: value must be "
                             f"{[B, Hkv, n, self.values.shape[3]]}, got {tuple(value.shape)}")
        if n == 0:
            return
        start, end = self.length, self.length + n
        if end > cap:
            raise ValueError(f"PisaKVCache.append: {start} + {n} tokens exceed max_len={cap}")
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (B, n):
                raise ValueError(f"PisaKVCache.append: key_padding_mask must be [B={B}, n={n}],"
                                 f" got {tuple(key_padding_mask.shape)}")
            self._key_mask_buffer()[:, start:end] = key_padding_mask != 0
            if start <= self._mask_known:
                self._mask_known = end
        elif self.key_mask is not None:
            self.key_mask[:, start:end] = True
        self.keys[:, :, start:end] = key
        self.values[:, :, start:end] = value
        self.length = end
        # Kept only where decode would read it: below the cost model's threshold (and off
        # the Triton path) a step costs what a dense cache's does; the first sparse-worthy
        # length catches the pyramid up in one pass.
        if self.decode_is_sparse(1):
            self._sync_pyramid()
            if n == 1:
                self._count_unread_step()

    def _count_unread_step(self) -> None:
        """Count a decode step's append; warn once per process when ``_UNREAD_STEPS`` came
        in a row with no read of the pyramid (:meth:`_select` resets the count)."""
        global _TOLD_UNREAD
        self._unread_steps += 1
        if self._unread_steps >= _UNREAD_STEPS and not _TOLD_UNREAD:
            _TOLD_UNREAD = True
            warnings.warn(
                f"PisaKVCache: {self._unread_steps} decode steps were appended and no "
                "attention read the pyramid, so the model's decode is not PISA's. With "
                "transformers, compile model.forward with backend='pisa' (generate() on the "
                "module torch.compile returns runs the original forward), with a "
                "min_seq_len option at most the cache's length (the default, 32768, leaves "
                "shorter attention dense); with PisaKVCache itself, call attend(). Said "
                "once.", stacklevel=4)

    def _key_mask_buffer(self) -> Tensor:
        """``key_mask`` (bool ``[B, max_len]``), allocated all real on first use."""
        if self.key_mask is None:
            self.key_mask = torch.ones(self.keys.shape[0], self.keys.shape[2],
                                       dtype=torch.bool, device=self.keys.device)
        return self.key_mask

    def _sync_pyramid(self) -> None:
        """Bring the pyramid up to ``length`` keys (the leaves from ``pyramid_length`` on,
        and their ancestors)."""
        if self.pyramid_length < self.length:
            from .kernels.triton_pyramid import append_boxes  # Triton: only where it runs
            with stage_range("pisa.pyramid", self.keys):
                append_boxes(self.pyramid, self.keys, self.pyramid_length, self.length,
                             self.key_mask)
            self.pyramid_length = self.length

    def _triton_refusal(self, t: Tensor) -> Optional[str]:
        return _decode_refusal(self, t)

    def decode_is_sparse(self, n_queries: int, t: Optional[Tensor] = None) -> bool:
        """Whether :meth:`attend` of ``n_queries`` queries now selects from the pyramid."""
        t = self.keys if t is None else t
        if n_queries > DECODE_MAX_QUERIES or self._triton_refusal(t) is not None:
            return False
        return sparse_worthy(self.keys, self.values, self.length, self.decode_config,
                             self.sparse_from, self.cuda_graph)

    def attend(self, query: Tensor, *, scale: Optional[float] = None) -> Tensor:
        """Causal attention of the newest ``Nq`` queries over the cache's ``length`` tokens.

        Query ``i`` sits at position ``length - Nq + i`` and sees keys ``j <= length - Nq +
        i`` that are not padding.

        Args:
            query: ``[B, Hq, Nq, D]`` in the cache's dtype, ``Hq`` a multiple of ``Hkv``,
                ``1 <= Nq <= length``.
            scale: softmax scale (default ``1 / sqrt(D)``).

        Returns:
            ``[B, Hq, Nq, Dv]`` in the cache's dtype (rows that see no key are 0).

        Raises:
            ValueError: a query that does not match the cache, or more queries than tokens.
        """
        self._check_query(query)
        n, Nq, D = self.length, query.shape[2], self.keys.shape[3]
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        k, v = self.keys[:, :, :n], self.values[:, :, :n]
        km = None if self.key_mask is None else self.key_mask[:, :n]
        if self.decode_is_sparse(Nq, query):
            return self._sparse_decode(query, k, v, km, scale)
        if Nq <= DECODE_MAX_QUERIES:
            mask = None if (km is None and Nq == 1) else dense_mask(
                query.shape[0], Nq, n, True, n - Nq, km, device=query.device)
            return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)
        from .ops import pisa_attention
        return pisa_attention(query, k, v, is_causal=True, causal_offset=n - Nq, key_mask=km,
                              scale=scale, enable_gqa=True, config=self.config)

    def _check_query(self, query: Tensor) -> None:
        B, Hkv, _, D = self.keys.shape
        n = self.length
        if (query.dim() != 4 or query.shape[0] != B or query.shape[3] != D
                or query.shape[1] % Hkv != 0 or query.dtype != self.keys.dtype):
            raise ValueError(f"PisaKVCache.attend: query must be [B={B}, Hq (a multiple of "
                             f"{Hkv}), Nq, D={D}] {self.keys.dtype}, got {tuple(query.shape)} "
                             f"{query.dtype}")
        Nq = query.shape[2]
        if not 1 <= Nq <= n:
            raise ValueError(f"PisaKVCache.attend: need 1 <= Nq <= length ({n}), got Nq={Nq}")

    def select(self, query: Tensor, *, scale: Optional[float] = None,
               key_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """The decode selection of :meth:`attend` from the persistent pyramid (Triton):
        ``block_indices`` int32 ``[B, Hkv, Nq, M]`` (ascending, -1 padded) and
        ``block_counts`` int32 ``[B, Hkv, Nq]``; arguments as :meth:`attend`. ``key_mask``
        (bool ``[B, length]``): padding to honour in place of the cache's own (the sinks and
        the exact scores read it; the boxes are the cache's).

        Raises:
            ValueError: as :meth:`attend`, or the Triton kernels cannot run here (the reason).
        """
        self._check_query(query)
        why = dispatch.triton_refusal(query, self.values, self.config.kernel)  # raises: no warning
        if why is not None:
            raise ValueError(f"PisaKVCache.select runs the Triton selection: {why}")
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        km = key_mask if key_mask is not None else (
            None if self.key_mask is None else self.key_mask[:, :self.length])
        return self._select(query, scale, km)

    def _select(self, query: Tensor, scale: float, km: Optional[Tensor]
                ) -> tuple[Tensor, Tensor]:
        """:meth:`select` on checked inputs (the decode paths checked them already)."""
        from .kernels import triton_select
        self._sync_pyramid()
        self._unread_steps = 0
        n = self.length
        with stage_range("pisa.select", query):
            return triton_select.select_blocks(
                query, self.keys[:, :, :n], True, scale, key_mask=km,
                causal_offset=n - query.shape[2], pyramid=self.pyramid,
                **self.decode_config.selection_options())

    def decode(self, query: Tensor, key: Tensor, value: Tensor, key_mask: Optional[Tensor],
               causal_offset: int, scale: float) -> Optional[Tensor]:
        """A compiled model's decode step over this cache's keys: the sparse decode of
        :meth:`attend` where the cost model says so, under the call's own ``key_mask``
        (``[B, length]`` bool, or None), else None (the caller runs dense attention).

        ``key`` and ``value`` must be this cache's ``keys[:, :, :length]`` and values (the
        caller found them by :func:`pisa_compile.kernels.persistent.lookup`); the queries
        must be the last ones (``causal_offset == length - Nq``). A cache that was told of
        no padding adopts ``key_mask`` at the first such call and rebuilds its pyramid once
        (``O(length)``), and a later call that follows keys appended since (another
        ``generate()``'s prompt) adopts their padding the same way. A later mask that hides a
        key held as real (a sliding window) is no padding: the steps run dense from the first
        sparse step that sees it (:meth:`mark_not_padding`; one host sync per sparse step
        with a mask, none where ``full_attention`` is set or inside a CUDA-graph capture).
        The sinks, the exact scores and the attention read the call's ``key_mask``."""
        Nq = query.shape[2]
        if (value.data_ptr() != self.values.data_ptr() or value.shape[2] != self.length
                or causal_offset != self.length - Nq or query.dtype != self.keys.dtype
                or self.not_padding is not None):
            return None
        if key_mask is not None:
            known = self._mask_known  # 0 while the cache has no key mask
            if self.key_mask is None or self.length - known > Nq:
                # Keys no call's mask has covered, beyond this step's own (the prompt, which
                # transformers gives the cache no padding for; a later generate()'s prompt):
                # their padding is this call's, and the pyramid is rebuilt over them, so that
                # padded keys stop steering the walk (later tokens are real).
                self._key_mask_buffer()[:, known:self.length] = key_mask[:, known:]
                self.pyramid_length = min(self.pyramid_length, known)
            elif not self.full_attention:
                # A mask that hides a key held as real is no padding: a sliding window's,
                # whose start moves each step. Gathered on the device at every step, read
                # (one sync) only where the step would be sparse.
                hid = (self.key_mask[:, :known] & ~key_mask[:, :known]).any()
                self._hid_real = hid if self._hid_real is None else self._hid_real | hid
            self._mask_known = self.length
        if not self.decode_is_sparse(Nq, query):
            return None
        if self._hid_real is not None and not (
                query.is_cuda and torch.cuda.is_current_stream_capturing()) and bool(
                self._hid_real):
            self.mark_not_padding("a step's mask hid keys the cache holds as real")
            return None
        return self._sparse_decode(query, key, value, key_mask, float(scale))

    def mark_not_padding(self, why: str) -> None:
        """Run this cache's decode steps dense from now on (until :meth:`reset`): ``why``
        says how a mask showed structure other than causal key padding (a sliding window:
        PISA does not select inside windows, DESIGN.md). Warns once per process and reason."""
        self.not_padding = why
        dispatch._warn_once(
            f"{type(self).__name__}: {why}: not padding (a sliding window?), and PISA does "
            f"not select inside windows", "this layer's decode steps run dense SDPA "
            "under the mask (exact); with transformers, pass PisaCache(..., "
            "model_config=model.config) so window layers keep transformers' own cache")

    def _sparse_decode(self, q: Tensor, k: Tensor, v: Tensor, km: Optional[Tensor],
                       scale: float) -> Tensor:
        from torch._dynamo.utils import counters
        from .kernels.triton_decode import decode_attention
        counters["pisa"]["sparse_decode"] += 1  # tests: the pyramid really served the step
        idx, counts = self._select(q, scale, km)
        with stage_range("pisa.decode", q):
            out, _ = decode_attention(q, k, v, None, True, scale, idx, counts,
                                      block_size=self.config.block_size, query_tile=1,
                                      key_mask=km, causal_offset=k.shape[2] - q.shape[2])
        return out


# -- a static cache: the length lives on the device (CUDA graphs) --

@torch.library.custom_op("pisa::static_append",
                         mutates_args=("keys", "values", "length", "hi", "lo", "cnt", "lc"))
def _static_append_op(keys: Tensor, values: Tensor, length: Tensor, hi: Tensor, lo: Tensor,
                      cnt: Tensor, lc: Tensor, key_states: Tensor, value_states: Tensor,
                      block_size: int, branching: int, beam: int) -> None:
    # One op for the write, the length and the boxes: the decode op that reads the boxes
    # (through the registry, not as inputs) takes ``keys`` as an input, so it is ordered
    # after this op's mutation of them. That holds while Inductor runs the op in place on
    # the cache's buffers (it re-inplaces mutated graph inputs); a decode on copies would
    # miss the registry and run dense, never on stale boxes.
    n = key_states.shape[2]
    _write_at(keys, values, length, key_states, value_states)
    from .kernels.triton_pyramid import append_boxes_at  # Triton: only where it runs
    with stage_range("pisa.pyramid", keys):
        append_boxes_at(BoxPyramid(hi, lo, cnt, lc, keys.shape[2], block_size, branching,
                                   beam), keys, length, n)


def _write_at(keys: Tensor, values: Tensor, length: Tensor, key: Tensor, value: Tensor
              ) -> None:
    """Write ``key``/``value`` ``[B, Hkv, n, D]`` at positions ``[length, length + n)`` of the
    buffers and advance ``length`` (int64, on their device), all on the device."""
    pos = length + torch.arange(key.shape[2], device=keys.device, dtype=length.dtype)
    keys.index_copy_(2, pos, key)
    values.index_copy_(2, pos, value)
    length.add_(key.shape[2])


@_static_append_op.register_fake
def _(keys, values, length, hi, lo, cnt, lc, key_states, value_states, block_size, branching,
      beam):
    return None


class PisaStaticKVCache:
    """PISA's persistent pyramid beside a static KV cache whose length lives on the device
    (transformers' ``StaticLayer``: ``cumulative_length``), so that decode steps compile
    into one graph and replay from CUDA graphs (DESIGN.md "A static cache: the length on the
    device").

    :meth:`append` writes new keys and values at the device length, advances it and updates
    the pyramid's boxes in one custom op (``pisa::static_append``), without reading anything
    back to the host. A compiled model's attention is handed the whole buffers
    ``[B, Hkv, capacity, D]`` with a mask of the live keys (transformers builds it from
    ``cache_position``); ``pisa::cached_decode`` finds this cache through the key buffer and
    runs :meth:`decode`: one query per row, selected from the pyramid with the causal offset
    read on the device (the local leaves), and the split-K decode kernel over the picked
    blocks under the mask. Where the cost model says dense is cheaper (decided once, from
    the capacity: dense SDPA over a static cache reads all of it every step) no pyramid is
    kept and attention stays dense.

    Args:
        keys, values: the cache's preallocated ``[B, Hkv, capacity, D]`` / ``[..., Dv]``
            buffers (written only through :meth:`append` from now on).
        length: int64 tensor of one element on their device: the keys held (updated in place;
            ``index_copy_`` takes int64 positions).
        config: :class:`~pisa_compile.PisaConfig` of the selection (as :class:`PisaKVCache`).
        sparse_from: a capacity from which decode is sparse; None: the cost model
            (:func:`sparse_worthy`) at the capacity, and never below ``config.min_seq_len``
            (where the backend leaves the sites dense by default).
        cuda_graph: whether the steps replay from CUDA graphs (the cost model's ``"static"``
            thresholds, else ``"eager"``). Default True: a static cache is for graphs.

    Padding is not known to the cache: padded keys stay in the boxes (they can take a slot
    of the shortlist, where their exact score, under the call's mask, drops them) and never
    reach the output. Prefill calls run through :func:`pisa_compile.pisa_attention` or
    dense SDPA as the compiled graph planned them; only one-query calls read the pyramid.

    The choice between ranking every leaf box and walking the pyramid is made from the
    capacity too (``flat_leaves``, 512 leaves of 64 keys by default): with a capacity above
    it every step walks, even while the cache holds fewer keys (on Qwen2.5-Coder at 30K the
    walk kept 0.822 of the needles against 0.933 for the flat ranking; for the flat
    ranking keep ``max_cache_len`` at most ``flat_leaves * block_size``). With
    ``leaf_scoring="pooled"`` (no exact scores) a padded leaf can take a ``top_k`` slot.

    Raises:
        ValueError: buffers or length of the wrong shape, dtype or device (the buffers
            floating, of one dtype and device).
        TypeError: ``keys``, ``values`` or ``length`` not a tensor; ``config`` not a
            PisaConfig.
    """

    def __init__(self, keys: Tensor, values: Tensor, length: Tensor, *,
                 config: Optional[PisaConfig] = None, sparse_from: Optional[int] = None,
                 cuda_graph: bool = True):
        for name, t in (("keys", keys), ("values", values), ("length", length)):
            if not isinstance(t, Tensor):
                raise TypeError(f"PisaStaticKVCache: {name} must be a torch.Tensor, got "
                                f"{type(t).__name__}")
        if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"PisaStaticKVCache: keys and values must be [B, Hkv, capacity, "
                             f"D] buffers of one B, Hkv, capacity; got {tuple(keys.shape)} and "
                             f"{tuple(values.shape)}")
        if (not keys.is_floating_point() or values.dtype != keys.dtype
                or values.device != keys.device):
            raise ValueError(f"PisaStaticKVCache: keys and values must be floating buffers of "
                             f"one dtype and device, got {keys.dtype} on {keys.device} and "
                             f"{values.dtype} on {values.device}")
        if (length.numel() != 1 or length.dtype != torch.int64
                or length.device != keys.device):
            raise ValueError(f"PisaStaticKVCache: length must be one int64 on "
                             f"{keys.device}, got {tuple(length.shape)} {length.dtype} on "
                             f"{length.device}")
        config = check_options(config, sparse_from, "PisaStaticKVCache")
        self.sparse_from = None if sparse_from is None else int(sparse_from)
        self.config, self.cuda_graph = config, bool(cuda_graph)
        self.decode_config = decode_config(config)
        self.keys, self.values, self.length = keys, values, length
        # ``length`` as the host knows it, while ``_known_exact``: eager appends advance it,
        # so they check the capacity without a sync; a compiled or captured append clears
        # the flag (Dynamo replays the store on every call), and the next eager one reads
        # the device length once.
        self._known_length, self._known_exact = 0, False
        B, Hkv, cap, D = keys.shape
        self.pyramid: Optional[BoxPyramid] = None
        if self._sparse_worthy():
            self.pyramid = box_pyramid(B, Hkv, cap, D, keys.dtype, keys.device,
                                       block_size=config.block_size,
                                       branching=config.branching, beam=config.effective_beam)
            if not torch.compiler.is_compiling():
                # Fixed addresses: CUDA graphs replay the in-place updates without copies.
                for t in self.pyramid[:4]:
                    torch._dynamo.mark_static_address(t)
        persistent.register(self.keys, self)

    @property
    def view_length(self) -> int:
        """The keys a compiled step is handed: the whole buffer."""
        return self.keys.shape[2]

    __deepcopy__ = _deepcopy_registered

    def _sparse_worthy(self) -> bool:
        """Whether a one-query step is sparse (the Triton path, and the cost model at the
        capacity: dense SDPA over a static cache reads every slot)."""
        if _decode_refusal(self, self.keys) is not None:
            return False
        worthy = sparse_worthy(self.keys, self.values, self.keys.shape[2], self.decode_config,
                               self.sparse_from, self.cuda_graph, static=True)
        if worthy and self.sparse_from is None and self.keys.shape[2] < self.config.min_seq_len:
            # The backend leaves such sites dense by default: a pyramid would be upkeep only.
            # Say so once: a user who lowered the compile options' min_seq_len alone would
            # otherwise get dense steps silently.
            global _TOLD_MIN_SEQ_LEN
            if not _TOLD_MIN_SEQ_LEN:
                _TOLD_MIN_SEQ_LEN = True
                _log.warning("PisaStaticKVCache: no pyramid (dense decode steps) at capacity "
                             "%d < config.min_seq_len=%d, although its K/V bytes would make the "
                             "steps sparse; lower pisa_config's min_seq_len too, or pass "
                             "sparse_from (said once)", self.keys.shape[2],
                             self.config.min_seq_len)
            return False
        return worthy

    def append(self, key: Tensor, value: Tensor) -> None:
        """Write ``[B, Hkv, n, D]`` keys and values at positions ``[length, length + n)``,
        advance ``length`` and update the pyramid: all on the device (traceable by
        ``torch.compile``, capturable in a CUDA graph). Writing past the capacity is an
        ``ValueError`` when run eagerly (the length counted on the host, read from the device
        once after compiled or captured appends); a compiled or CUDA-graph-captured append
        reads no length, and its overflow fails in ``index_copy_``'s bounds check: on CUDA a
        device-side assert, on the CPU under Inductor an uncaught C++ error that ends the
        process (as transformers' ``StaticCache`` under Inductor).

        Raises:
            ValueError: ``key``/``value`` not ``[B, Hkv, n, D]``/``[B, Hkv, n, Dv]`` of the
                cache's batch, heads, head dims, dtype and device; or, run eagerly, more
                keys than the capacity (``max_cache_len``) has left.
        """
        B, Hkv, _, D = self.keys.shape
        n = key.shape[2] if key.dim() == 4 else -1
        for name, t, last, buf in (("key", key, D, self.keys),
                                   ("value", value, self.values.shape[3], self.values)):
            if (t.dim() != 4 or tuple(t.shape) != (B, Hkv, n, last) or t.dtype != buf.dtype
                    or t.device != buf.device):
                raise ValueError(f"PisaStaticKVCache.append: {name} must be [B={B}, Hkv={Hkv},"
                                 f" n, {last}] {buf.dtype} on {buf.device} (n as key's), got "
                                 f"{tuple(t.shape)} {t.dtype} on {t.device}")
        if n == 0:
            return
        eager = not (torch.compiler.is_compiling() or (
            key.is_cuda and torch.cuda.is_current_stream_capturing()))
        if not eager:
            self._known_exact = False
        else:
            if not self._known_exact:  # once after compiled steps (or at first use)
                self._known_length, self._known_exact = int(self.length), True
            if self._known_length + n > self.keys.shape[2]:
                # Named here: past this point it would be a device-side assert on CUDA.
                raise ValueError(f"PisaStaticKVCache.append: {n} key(s) after "
                                 f"{self._known_length} overflow max_cache_len="
                                 f"{self.keys.shape[2]} (build the cache with at least the "
                                 f"prompt length plus max_new_tokens, or call reset() before "
                                 f"a new prompt)")
        if self.pyramid is None:
            _write_at(self.keys, self.values, self.length, key, value)
        else:
            p = self.pyramid
            torch.ops.pisa.static_append(self.keys, self.values, self.length, p.hi, p.lo,
                                         p.cnt, p.lc, key, value, p.block_size, p.branching,
                                         p.beam)
        if eager:
            self._known_length += n

    def reset(self) -> None:
        """Empty the pyramid (the caller zeroes the buffers and the length)."""
        self._known_length, self._known_exact = 0, True
        if self.pyramid is not None:
            self.pyramid.clear()

    def rebuild(self) -> None:
        """Rebuild the pyramid over the first ``length`` keys (after the length was cut:
        transformers' ``crop``). Eager: reads the length on the host, ``O(length)``."""
        n = self._known_length = int(self.length)
        self._known_exact = True
        if self.pyramid is None:
            return
        self.pyramid.clear()
        if n > 0:
            from .kernels.triton_pyramid import append_boxes
            append_boxes(self.pyramid, self.keys, 0, n)

    def decode(self, query: Tensor, key: Tensor, value: Tensor, key_mask: Optional[Tensor],
               causal_offset: int, scale: float) -> Optional[Tensor]:
        """A compiled model's one-query step over the whole buffers: the sparse decode where
        a pyramid is kept, else None (the caller runs dense attention).

        Args:
            query: ``[B, Hq, 1, D]`` in the cache's dtype (``Hq`` a multiple of ``Hkv``).
            key, value: this cache's whole ``keys`` and ``values`` (found by
                :func:`pisa_compile.kernels.persistent.lookup`).
            key_mask: bool ``[B, capacity]`` (transformers' mask of the step) or None; keys
                at or past ``length`` are masked in any case.
            causal_offset: ignored (the device length gives it); scale: softmax scale.

        Returns:
            ``[B, Hq, 1, Dv]`` in the cache's dtype, or None.
        """
        from torch._dynamo.utils import counters
        from .kernels import triton_select
        from .kernels.triton_decode import decode_attention
        cap = self.keys.shape[2]
        if (self.pyramid is None or query.shape[2] != 1 or value.data_ptr() != (
                self.values.data_ptr()) or value.shape[2] != cap
                or query.dtype != self.keys.dtype
                or dispatch.triton_refusal(query, value, self.config.kernel) is not None):
            return None
        counters["pisa"]["sparse_decode"] += 1  # tests: the pyramid really served the step
        live = torch.arange(cap, device=query.device) < self.length
        km = live.expand(query.shape[0], cap) if key_mask is None else key_mask & live
        with stage_range("pisa.select", query):
            idx, counts = triton_select.select_blocks(
                query, key, True, float(scale), key_mask=km, pyramid=self.pyramid,
                key_length=self.length, **self.decode_config.selection_options())
        with stage_range("pisa.decode", query):
            out, _ = decode_attention(query, key, value, None, True, float(scale), idx, counts,
                                      block_size=self.config.block_size, query_tile=1,
                                      key_mask=km, causal_offset=cap - 1)
        return out
