"""Context-parallel PISA: causal attention over a sequence sharded across ranks (DESIGN.md
"Context parallelism").

Each of the ``W`` ranks of a process group holds two of the sequence's ``2W`` equal chunks,
the zig-zag layout that balances causal work (rank ``r``: chunks ``r`` and ``2W - 1 - r``;
:func:`zigzag_shard`). A call

1. computes the mean key of each local leaf block and all-gathers those means: ``N / C * D``
   floats per KV head, where ring attention receives ``2 (W-1)/W * N * D`` keys and values
   per rank;
2. builds the pyramid over the whole sequence from them and selects, for its own query tiles,
   the top-K blocks coarse to fine with pooled leaf scores (no key is read to select);
3. fetches from their owners only the K/V blocks it chose, per batch row and KV head
   (``all_to_all_single``); the backward sends their gradients back the same way;
4. runs PISA's block-sparse attention over them.

The selection is the one single-process PISA makes with the same options, so the outputs and
gradients equal single-process :func:`~pisa_compile.ops.pisa_attention` up to the order of
float sums (``tests/test_context_parallel.py``).
"""

from __future__ import annotations

import math
import numbers
import struct
import zlib
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .config import PisaConfig
from .kernels import dispatch, reference
from .kernels.geometry import flat_beam
from .ops import _Attention

__all__ = ["context_parallel_attention", "cap_fetch", "zigzag_shard", "zigzag_unshard",
           "CP_CONFIG"]

# Pooled leaves: exact leaf scores and box bounds would read the keys of candidate leaves,
# which other ranks hold. No dense tail: its rows (the last chunk's, on rank 0) would need
# every key.
CP_CONFIG = PisaConfig(leaf_scoring="pooled", shortlist=None, bound_block=None, dense_tail=0,
                       min_seq_len=0)


def zigzag_shard(x: Tensor, rank: int, world_size: int, *, dim: int) -> Tensor:
    """Rank ``rank``'s part of ``x`` in the zig-zag layout: of ``x`` cut along ``dim`` into
    ``2 * world_size`` equal chunks, chunks ``rank`` and ``2 * world_size - 1 - rank``,
    concatenated (a copy).

    Args:
        x: any tensor; ``x.shape[dim]`` a multiple of ``2 * world_size``.
        rank: in ``[0, world_size)``. world_size: int >= 1. dim: the sequence dimension
            (2 for ``[B, H, N, D]``, 1 for token ids ``[B, N]``); no default, since a wrong
            one cuts another dimension silently.

    Raises:
        ValueError: a ``rank`` or ``dim`` out of range, or a length not divisible into the
            chunks.
    """
    _check_dim(x, dim, "zigzag_shard")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"zigzag_shard: rank must be in [0, world_size={world_size}), "
                         f"got {rank}")
    n = x.shape[dim]
    if n % (2 * world_size):
        raise ValueError(f"zigzag_shard: x.shape[{dim}]={n} must be a multiple of "
                         f"2 * world_size = {2 * world_size}")
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def _check_dim(x: Tensor, dim: int, where: str) -> None:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{where}: dim={dim} is out of range for a {x.dim()}-D tensor")


def zigzag_unshard(shards: Sequence[Tensor], *, dim: int) -> Tensor:
    """The inverse of :func:`zigzag_shard`: ``shards[r]`` is rank ``r``'s part (for example
    from ``torch.distributed.all_gather``); returns the whole sequence along ``dim`` (the
    sequence dimension: 2 for ``[B, H, N, D]``, 1 for logits ``[B, N, V]``).

    Raises:
        ValueError: no shards, shards of different shapes, a ``dim`` out of range, or an odd
            length along ``dim``.
    """
    if not shards or any(s.shape != shards[0].shape for s in shards):
        raise ValueError("zigzag_unshard: shards must be one tensor per rank, all of one shape")
    _check_dim(shards[0], dim, "zigzag_unshard")
    if shards[0].shape[dim] % 2:
        raise ValueError(f"zigzag_unshard: each shard holds two equal chunks along dim {dim}, "
                         f"got length {shards[0].shape[dim]}")
    W = len(shards)
    pieces: list = [None] * (2 * W)
    for r, s in enumerate(shards):
        pieces[r], pieces[2 * W - 1 - r] = s.chunk(2, dim)
    return torch.cat(pieces, dim)


class _Layout(NamedTuple):
    """The zig-zag layout of one call, in leaves (blocks of ``block_size`` keys)."""

    world: int
    rank: int
    chunk: int  # keys per chunk (S)
    leaves: int  # leaves per chunk (S / C)

    @property
    def n_keys(self) -> int:
        """The whole sequence's length."""
        return 2 * self.world * self.chunk

    @property
    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.world - 1 - self.rank

    def owner(self, leaf: Tensor) -> Tensor:
        c = leaf // self.leaves
        return torch.where(c < self.world, c, 2 * self.world - 1 - c)

    def slot(self, leaf: Tensor) -> Tensor:
        """A leaf's index among its owner's ``2 * leaves`` local leaves."""
        c = leaf // self.leaves
        return torch.where(c < self.world, 0, self.leaves) + leaf % self.leaves


def check_config(config: PisaConfig, where: str = "context_parallel_attention") -> None:
    """Refuse options context parallelism cannot run (see :data:`CP_CONFIG`); ``where``
    names the caller in the message.

    Raises:
        TypeError: ``config`` is not a :class:`~pisa_compile.PisaConfig`.
        ValueError: exact leaf scores, box bounds, a dense tail or no local blocks; the
            message names the option.
    """
    if not isinstance(config, PisaConfig):
        raise TypeError(f"{where}: config must be a PisaConfig, got "
                        f"{type(config).__name__}")
    if config.leaf_scoring != "pooled" or config.effective_bound_block:
        raise ValueError(f"{where}: config needs leaf_scoring='pooled' and "
                         "bound_block=None (exact leaf scores and box bounds read the keys of "
                         "candidate leaves, which other ranks hold), got "
                         f"leaf_scoring={config.leaf_scoring!r}, "
                         f"bound_block={config.bound_block}; start from CP_CONFIG")
    if config.dense_tail:
        raise ValueError(f"{where}: config.dense_tail must be 0 (the tail's "
                         f"dense rows would need every key), got {config.dense_tail}")
    if config.local_blocks < 1:
        raise ValueError(f"{where}: config.local_blocks must be >= 1 (the "
                         "leaves a tile's own positions touch are partly hidden from it and "
                         "need exact scores otherwise)")


def _check(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool, config: PisaConfig,
           world: int) -> tuple[int, int]:
    check_config(config)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"context_parallel_attention: {name} must be a 4-D tensor "
                             f"[B, H, N_local, D], got "
                             f"{list(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"context_parallel_attention: q must be float16, bfloat16 or float32, "
                         f"got {q.dtype}")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or (
            q.device != v.device):
        raise ValueError(f"context_parallel_attention: q, k and v must share one dtype and "
                         f"device, got {q.dtype}/{k.dtype}/{v.dtype} on "
                         f"{q.device}/{k.device}/{v.device}")
    B, Hq, N, D = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != B or k.shape[2] != N or k.shape[3] != D:
        raise ValueError(f"context_parallel_attention: k must be [B, Hkv, N_local, D] and v "
                         f"[B, Hkv, N_local, Dv] for q {list(q.shape)}, got k {list(k.shape)}, "
                         f"v {list(v.shape)}")
    Hkv = k.shape[1]
    if Hq != Hkv and not (enable_gqa and Hq % Hkv == 0):
        raise ValueError(f"context_parallel_attention: {Hq} query heads and {Hkv} KV heads "
                         "need enable_gqa=True and Hq a multiple of Hkv")
    C, Tq = config.block_size, config.query_tile
    if N % 2 or (N // 2) % C or (N // 2) % Tq:
        raise ValueError(f"context_parallel_attention: the local length {N} must be two chunks "
                         f"whose length is a multiple of block_size={C} and query_tile={Tq} "
                         f"(a global length that is a multiple of "
                         f"{2 * world * math.lcm(C, Tq)} for {world} ranks)")
    return Hkv, N // 2


# Dynamo runs it eagerly (the exchange's sizes depend on the selection): a compiled model
# breaks its graph around each call instead of failing to trace the collectives.
@torch.compiler.disable
def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None,
                               enable_gqa: bool = False,
                               group: Optional[dist.ProcessGroup] = None,
                               config: Optional[PisaConfig] = None,
                               fetch_budget: Optional[float] = None) -> Tensor:
    """Causal PISA attention of a sequence sharded across the ranks of ``group``.

    Every rank calls it with its zig-zag part of the same global batch (:func:`zigzag_shard`
    along the sequence dimension of ``q``, ``k`` and ``v``). It is differentiable: the
    gradients of the fetched K/V blocks return to their owners, so each rank gets ``dq``,
    ``dk`` and ``dv`` of its own part. Under ``torch.compile`` it runs eagerly (collectives
    with data-dependent sizes; ``torch.compiler.disable``), between the compiled graphs.

    Args:
        q: ``[B, Hq, N_local, D]`` float16, bfloat16 or float32; ``N_local = 2 * S`` with the
            chunk length ``S`` a multiple of ``config.block_size`` and ``config.query_tile``.
        k: ``[B, Hkv, N_local, D]``; v: ``[B, Hkv, N_local, Dv]``; same dtype and device.
        scale: softmax scale; default ``1 / sqrt(D)``.
        enable_gqa: allow ``Hq != Hkv`` (``Hq`` a multiple of ``Hkv``).
        group: the process group (default: the world); every member must pass the same
            shapes, options and ``config``.
        config: a :class:`~pisa_compile.PisaConfig` with pooled leaves, no box bounds, no
            dense tail and ``local_blocks >= 1``; default :data:`CP_CONFIG`.
            ``min_seq_len`` is ignored: the call is always sparse.
        fetch_budget: None (default) fetches every chosen block. A number in ``(0, 1]``
            caps the fetch at that fraction of the K/V bytes ring attention moves, except
            where the forced leaves (sinks, the local window before each chunk) alone
            exceed it, as with short chunks: see :func:`cap_fetch` (lossy: the tiles drop
            the other remote blocks they chose).

    Returns:
        ``[B, Hq, N_local, Dv]``, this rank's rows of single-process PISA with ``config`` on
        the whole sequence (query ``i`` sees keys ``j <= i``); with ``fetch_budget``, under
        the capped selection of :func:`cap_fetch`.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
        TypeError: ``config`` is not a :class:`~pisa_compile.PisaConfig`, ``group`` not a
            ``ProcessGroup``, or ``enable_gqa`` not a bool.
        ValueError: bad shapes, dtypes or options in ``config``, or ``fetch_budget`` not
            None or in ``(0, 1]``; the message names the argument. A small all-gather first
            compares every rank's shapes, dtypes, whether q, k, v want gradients,
            ``config``, ``scale``, ``fetch_budget`` and ``enable_gqa``: a mismatch is refused
            by every rank.

    The backward is a collective too: every rank that ran the forward with gradients must
    run its backward (a rank that skips it leaves the others waiting). Memory: each rank
    builds K/V buffers up to the end of its second chunk (rank 0: the whole sequence), which
    autograd keeps for the backward; ring attention keeps ``1 / W`` of the keys.

    Bytes received per call and rank (``torch._dynamo.utils.counters["pisa"]``):
    ``cp_summary_bytes`` (the other ranks' leaf means, and on the Triton path their log
    counts), ``cp_index_bytes`` (which blocks each rank chose) and ``cp_block_bytes`` (the
    K/V blocks); the backward sends back as many bytes of gradients as ``cp_block_bytes``.
    Method: PISA's selection (DESIGN.md "The algorithm") over all-gathered leaf summaries;
    the zig-zag layout as in ring-attention implementations of causal context parallelism.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"context_parallel_attention: group must be None or a "
                        f"torch.distributed ProcessGroup, got {type(group).__name__}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"context_parallel_attention: enable_gqa must be a bool, got "
                        f"{type(enable_gqa).__name__}")
    config = CP_CONFIG if config is None else config
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # First, so that a call some rank makes differently is refused by every rank together,
    # instead of some raising while the others wait in a collective.
    # 1 and 1.0, or a numpy float and its value, are one budget on every rank.
    # The scale as the kernels read it (fp32): None, 1 / sqrt(D) and D ** -0.5 (an ulp
    # apart in fp64) are one scale on every rank.
    scale = _as_float(scale) if scale is not None else (
        1.0 / math.sqrt(q.shape[-1]) if isinstance(q, Tensor) and q.dim() else None)
    scale_fp32 = scale
    if isinstance(scale, float) and abs(scale) < 3e38:  # else pack overflows
        scale_fp32 = struct.unpack("f", struct.pack("f", scale))[0]
    _agree(q, k, v, enable_gqa, (config, _as_float(fetch_budget)), scale_fp32, group, world)
    check_fetch_budget(fetch_budget)
    Hkv, S = _check(q, k, v, enable_gqa, config, world)
    if not isinstance(scale, float):
        raise ValueError(f"context_parallel_attention: scale must be None or a real number, "
                         f"got {scale!r}")
    lay = _Layout(world, rank, S, S // config.block_size)
    # The Triton selection where the kernels take the inputs (CUDA, or the interpreter with
    # kernel="triton"), else the reference: each rank builds its leaves as the single-process
    # selection of that implementation would, so the gathered pyramid is the same.
    impl = dispatch.plan(q, k, v, None, True, kernel=config.kernel,
                         local_blocks=config.local_blocks, selection_only=True).select
    pyramid = _gathered_pyramid(k, lay, config, impl, group)
    selections = [_select_chunk(q, i, lay, Hkv, pyramid, config, scale, impl)
                  for i in range(2)]
    if fetch_budget is not None:
        selections, _ = cap_fetch(selections, world=world, rank=rank, chunk_leaves=lay.leaves,
                                  config=config, fetch_budget=fetch_budget)
    k_ctx, v_ctx = _context(k, v, selections, lay, config, group)
    outs = []
    for i, (c, (block_indices, block_counts)) in enumerate(zip(lay.chunks, selections)):
        end = (c + 1) * S  # keys the chunk's queries can see
        qc = q[:, :, i * S:(i + 1) * S]
        kc, vc = k_ctx[:, :, :end], v_ctx[:, :, :end]
        how = dispatch.plan(qc, kc, vc, None, True, kernel=config.kernel,
                            local_blocks=config.local_blocks)
        out, _lse = _Attention.apply(qc, kc, vc, None, None, block_indices, block_counts, True,
                                     c * S, scale, config.block_size, config.query_tile,
                                     how.attention, 0)
        outs.append(out)
    return torch.cat(outs, dim=2)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _signature(q, k, v, enable_gqa: bool, config, scale) -> list[int]:
    """What every rank's call must share: ranks, dtypes and sizes of q, k, v, whether they
    want gradients (the backward is a collective), the options (``config``: the PisaConfig
    and the fetch budget) and the scale."""
    sig = []
    for t in (q, k, v):
        if not isinstance(t, Tensor):
            sig += [-1] * 7
            continue
        dims = list(t.shape[:4]) + [-1] * (4 - min(t.dim(), 4))
        sig += [t.dim(), _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1,
                int(t.requires_grad and torch.is_grad_enabled()), *dims]
    pisa_config, budget = config
    hashes = [zlib.crc32(repr(x).encode()) for x in (pisa_config, budget, scale)]
    if not isinstance(pisa_config, PisaConfig):
        hashes[0] = -1
    return sig + hashes + [int(bool(enable_gqa))]


def _agree(q, k, v, enable_gqa: bool, config, scale, group, world: int) -> None:
    dev = q.device if isinstance(q, Tensor) else torch.device("cpu")
    mine = torch.tensor(_signature(q, k, v, enable_gqa, config, scale), device=dev)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(s, mine) for s in every):
        names = ["q", "k", "v", "config", "fetch_budget", "scale", "enable_gqa"]
        cols = [slice(0, 7), slice(7, 14), slice(14, 21), 21, 22, 23, 24]
        differ = [n for n, c in zip(names, cols)
                  if any(not torch.equal(s[c], mine[c]) for s in every)]
        raise ValueError(
            "context_parallel_attention: every rank must pass q, k and v of the same shapes "
            "and dtypes, all wanting gradients or none, and the same config, fetch_budget, "
            f"scale and enable_gqa; these differ: {differ}. Per rank (q, k, v as [dims, "
            "dtype, gradient, sizes...], then hashes of config, fetch_budget and scale, then "
            f"enable_gqa): {[s.tolist() for s in every]}")


def _gathered_pyramid(k: Tensor, lay: _Layout, config: PisaConfig, impl: str, group):
    """The whole sequence's pyramid, from every rank's leaves: the reference's ``(mus,
    counts)`` per level, or the Triton selection's ``summaries``. Each rank builds its
    leaves as that implementation's single-process selection would, so the pyramid is the
    same; every key is live, so only the means (and the Triton leaves' log counts, which flag
    a non-finite key) are gathered."""
    n_keys, C = lay.n_keys, config.block_size
    beam = _beam(n_keys, config)
    if impl == dispatch.TRITON:
        from .kernels import triton_pyramid
        mu, _, lcnt, _ = triton_pyramid.pyramid_buffers(k.detach(), C, config.branching, beam)
        mu, lcnt = (_gather(t[:, :, :2 * lay.leaves].contiguous(), lay, group)
                    for t in (mu, lcnt))
        cnt = torch.full_like(lcnt, float(C))
        return triton_pyramid.pyramid_from_leaves(mu, cnt, lcnt, config.branching, beam)
    live = torch.ones(1, 1, k.shape[2], dtype=torch.bool, device=k.device)
    sums, n = reference.leaf_sums(k.detach(), live, C)
    means = _gather(sums / n.clamp(min=1)[..., None], lay, group)
    counts = means.new_full(means.shape[:3], float(C))
    return reference.pyramid_levels(means, counts, n_keys, C, config.branching, beam)


def _gather(t: Tensor, lay: _Layout, group) -> Tensor:
    """Every rank's ``t`` (leaves along dim 2), in sequence order."""
    parts = [torch.empty_like(t) for _ in range(lay.world)]
    dist.all_gather(parts, t, group=group)
    dispatch._count("cp_summary_bytes", (lay.world - 1) * t.numel() * t.element_size())
    return zigzag_unshard(parts, dim=2)


def _beam(n_keys: int, config: PisaConfig) -> int:
    (_, _, branching, beam, _, _, _, leaf_scoring, shortlist, bound_block,
     flat_leaves) = config.selection_args()
    return flat_beam(n_keys, config.block_size, branching, beam, flat_leaves,
                     leaf_scoring=leaf_scoring, shortlist=shortlist, bound_block=bound_block)


def _select_chunk(q: Tensor, i: int, lay: _Layout, Hkv: int, pyramid, config: PisaConfig,
                  scale: float, impl: str) -> tuple[Tensor, Tensor]:
    """Local chunk ``i``'s selection over the whole sequence's pyramid (the keys stand in
    as a meta tensor of their shape: pooled scores read none)."""
    S, c, n_keys = lay.chunk, lay.chunks[i], lay.n_keys
    qc = q[:, :, i * S:(i + 1) * S].detach()
    k_shape = torch.empty((q.shape[0], Hkv, n_keys, q.shape[3]), device="meta", dtype=q.dtype)
    (block_size, top_k, branching, _, sink_blocks, local_blocks, query_tile, leaf_scoring,
     shortlist, bound_block, flat_leaves) = config.selection_args()
    options = dict(block_size=block_size, top_k=top_k, branching=branching,
                   beam=_beam(n_keys, config), sink_blocks=sink_blocks,
                   local_blocks=local_blocks, query_tile=query_tile, leaf_scoring=leaf_scoring,
                   shortlist=shortlist, bound_block=bound_block, flat_leaves=flat_leaves,
                   causal_offset=c * S)
    if impl == dispatch.TRITON:
        from .kernels import triton_select
        return triton_select.select_blocks(qc, k_shape, True, scale, summaries=pyramid,
                                           **options)
    return reference.select_blocks(qc, k_shape, None, True, scale, pyramid=pyramid, **options)


def _as_float(x):
    return float(x) if isinstance(x, numbers.Real) and not isinstance(x, bool) else x


def check_fetch_budget(fetch_budget, where: str = "context_parallel_attention") -> None:
    """Raise ValueError unless ``fetch_budget`` is None or a real number in ``(0, 1]``
    (Python or numpy); ``where`` names the caller in the message."""
    if fetch_budget is not None and (isinstance(fetch_budget, bool) or not isinstance(
            fetch_budget, numbers.Real) or not 0 < fetch_budget <= 1):
        raise ValueError(f"{where}: fetch_budget must be None or a number in (0, 1] (a "
                         f"fraction of ring attention's bytes), got {fetch_budget!r}")


def cap_fetch(selections: Sequence[tuple[Tensor, Tensor]], *, world: int, rank: int,
              chunk_leaves: int, config: PisaConfig, fetch_budget: float
              ) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """Cap the remote blocks one rank fetches at ``fetch_budget`` of ring attention's bytes.

    Per (batch row, KV head) the rank fetches at most ``floor(fetch_budget * R)`` of the
    ``R = (2 * world - 2) * chunk_leaves`` leaves other ranks own (ring attention moves all
    ``R``): first the forced ones its queries see (the sinks, and the ``local_blocks - 1``
    leaves before each of its chunks; these are fetched even past the budget), then those
    that most of its tiles chose (ties: the lower leaf). Its tiles drop the other remote
    blocks they chose and attend fewer than ``top_k`` blocks. Blocks past a tile's chunk
    (sinks no query of it sees) are left as they are: never fetched. On top of the blocks
    each rank receives the other ranks' leaf summaries, ``1 / block_size`` of ring's bytes
    in fp32 (1.6% at 64; ``cp_summary_bytes``), and one byte per leaf of block marks.

    Args:
        selections: the rank's two chunks' ``(block_indices, block_counts)`` in the order of
            its chunks ``(rank, 2 * world - 1 - rank)``: int32 ``[B, Hkv, T_chunk, M]``
            ascending, -1 padded, and ``[B, Hkv, T_chunk]``, leaves of the whole sequence
            (``T_chunk``: the chunk's query tiles, ``S / query_tile``).
        world, rank: the layout (ints, ``0 <= rank < world``).
        chunk_leaves: leaves per chunk (``S / block_size``).
        config: the call's options (``sink_blocks``, ``local_blocks``).
        fetch_budget: a real number in ``(0, 1]``.

    Returns:
        The capped selections (same shapes; dropped blocks removed, -1 last) and the number
        of remote ``(batch row, KV head, leaf)`` blocks the rank now fetches (a 0-dim int64
        tensor on their device: read it only where needed, it syncs on CUDA).

    Raises:
        ValueError: ``fetch_budget`` not in ``(0, 1]``, ``rank`` not in ``[0, world)``, or
            not two selections.

    Method: ours (issue #17's byte budget); the estimate it replaces,
    ``experiments/cp_bytes.py --budgets``, measures it: at 0.08 the code model moves 9.2-9.4%
    of ring's bytes and loses 1.8-8.2 points of attention mass (docs/results.md
    "Context-parallel PISA").
    """
    if fetch_budget is None:
        raise ValueError("cap_fetch: fetch_budget must be a number in (0, 1], got None")
    check_fetch_budget(fetch_budget, "cap_fetch")
    if not 0 <= rank < world or len(selections) != 2:
        raise ValueError(f"cap_fetch: needs 0 <= rank < world and the two chunks' selections, "
                         f"got rank={rank}, world={world}, {len(selections)} selections")
    lay = _Layout(world, rank, chunk_leaves * config.block_size, chunk_leaves)
    bi0 = selections[0][0]
    B, Hkv, dev = bi0.shape[0], bi0.shape[1], bi0.device
    n_leaves = 2 * world * chunk_leaves
    leaf = torch.arange(n_leaves, device=dev)
    remote = lay.owner(leaf) != rank
    demand = _remote_picks(selections, lay)
    forced = leaf < config.sink_blocks
    for c in lay.chunks:
        forced |= (leaf >= c * chunk_leaves - (config.local_blocks - 1)) & (
            leaf < c * chunk_leaves)
    forced &= remote
    n_keep = int(fetch_budget * int(remote.sum()))
    needed = forced & (demand > 0)  # fetched whatever the budget, and counted in it
    n_free = (n_keep - needed.sum(-1, keepdim=True)).clamp(min=0)  # [B, Hkv, 1]
    # One int64 key per leaf: demand first, then the lower leaf (a deterministic order).
    key = torch.where(forced | (demand == 0), -1, demand * (n_leaves + 1) + (n_leaves - leaf))
    keep = needed.clone()
    if n_keep > 0:
        top = torch.topk(key, min(n_keep, n_leaves), dim=-1)  # sorted, best first
        rank_ok = torch.arange(top.indices.shape[-1], device=dev) < n_free
        keep.scatter_(2, top.indices, (top.values >= 0) & rank_ok | keep.gather(2, top.indices))
    allowed = ~remote | keep  # [B, Hkv, L]
    out = []
    for c, (block_indices, _) in zip(lay.chunks, selections):
        T = block_indices.shape[2]
        ok = torch.gather(allowed[:, :, None, :].expand(B, Hkv, T, n_leaves), 3,
                          block_indices.clamp(min=0).long())
        ok |= block_indices >= (c + 1) * chunk_leaves  # seen by none of the chunk's queries
        bi = torch.where((block_indices >= 0) & ok, block_indices, n_leaves)
        bi = torch.sort(bi, dim=-1).values
        bi = torch.where(bi >= n_leaves, -1, bi).to(block_indices.dtype)
        out.append((bi, (bi >= 0).sum(-1).to(selections[0][1].dtype)))
    return out, keep.sum()


def _remote_picks(selections, lay: _Layout) -> Tensor:
    """Per (batch row, KV head, leaf) ``[B, Hkv, L]`` int64: how many of the rank's tiles
    chose the leaf, for leaves another rank owns and the choosing tile's queries can see (a
    forced sink past the tile's chunk is seen by none of them: never fetched; the attention
    masks keys past its buffer, as a causal call does)."""
    bi0 = selections[0][0]
    n_leaves = 2 * lay.world * lay.leaves
    picks = torch.zeros(bi0.shape[0], bi0.shape[1], n_leaves + 1, dtype=torch.long,
                        device=bi0.device)
    for c, (block_indices, _) in zip(lay.chunks, selections):
        end = (c + 1) * lay.leaves
        idx = torch.where((block_indices < 0) | (block_indices >= end), n_leaves,
                          block_indices).long().flatten(2)
        picks.scatter_add_(2, idx, torch.ones_like(idx))
    leaf = torch.arange(n_leaves, device=bi0.device)
    return picks[..., :n_leaves] * (lay.owner(leaf) != lay.rank)


def _context(k: Tensor, v: Tensor, selections, lay: _Layout, config: PisaConfig, group):
    """K and V of the keys up to the end of the rank's second chunk, ``[B, Hkv, end, D]``
    and ``[..., Dv]``: the local chunks and the fetched blocks in place, zeros in the blocks
    nobody selected (never read); each chunk attends a prefix of it."""
    B, Hkv, _, D = k.shape
    C, W = config.block_size, lay.world
    n_leaves = 2 * W * lay.leaves
    dev = k.device
    # Blocks this rank's tiles chose, per (batch row, KV head), owned elsewhere.
    need = _remote_picks(selections, lay) > 0
    leaf = torch.arange(n_leaves, device=dev)
    owner = lay.owner(leaf)
    needs = [torch.empty_like(need, dtype=torch.uint8) for _ in range(W)]
    dist.all_gather(needs, need.to(torch.uint8), group=group)
    dispatch._count("cp_index_bytes", (W - 1) * need.numel())

    # Sends, to each rank in turn: the blocks it needs that this rank owns, in (b, h, leaf)
    # order; receives, from each rank in turn, in the same order. Every rank derives both
    # from the gathered needs.
    send_idx, send_splits, recv_pos, recv_splits = [], [], [], []
    mine = owner == lay.rank
    for r in range(W):
        b, h, l = torch.nonzero(needs[r].bool() & mine, as_tuple=True)
        send_idx.append((b * Hkv + h) * 2 * lay.leaves + lay.slot(l))
        send_splits.append(len(l))
        b, h, l = torch.nonzero(need & (owner == r), as_tuple=True)
        recv_pos.append(torch.stack([b, h, l]))
        recv_splits.append(len(l))
    kv = torch.cat([k, v], -1)  # one message for both
    E = kv.shape[-1]
    local_blocks = kv.view(B * Hkv * 2 * lay.leaves, C, E)
    recv = _FetchBlocks.apply(local_blocks, torch.cat(send_idx), send_splits, recv_splits,
                              group)
    dispatch._count("cp_block_bytes", recv.numel() * recv.element_size())

    # The local chunks' blocks and the fetched ones, placed by (b, h, leaf).
    L_end = (lay.chunks[1] + 1) * lay.leaves
    b, h, s = torch.meshgrid(torch.arange(B, device=dev), torch.arange(Hkv, device=dev),
                             torch.arange(2 * lay.leaves, device=dev), indexing="ij")
    c = torch.where(s < lay.leaves, lay.chunks[0], lay.chunks[1])
    own = torch.stack([b.flatten(), h.flatten(), (c * lay.leaves + s % lay.leaves).flatten()])
    pos = torch.cat([own, *recv_pos], 1)
    values = torch.cat([local_blocks, recv], 0)
    ctx = kv.new_zeros(B, Hkv, L_end, C, E).index_put((pos[0], pos[1], pos[2]), values)
    ctx = ctx.view(B, Hkv, L_end * C, E)
    return ctx[..., :D].contiguous(), ctx[..., D:].contiguous()


class _FetchBlocks(torch.autograd.Function):
    """The K/V blocks other ranks need, sent; the ones this rank needs, received
    (``all_to_all_single``). Backward: their gradients back to the owners, summed there."""

    @staticmethod
    def forward(ctx, local_blocks: Tensor, send_idx: Tensor, send_splits: list,
                recv_splits: list, group) -> Tensor:
        send = local_blocks.index_select(0, send_idx)
        recv = local_blocks.new_empty((sum(recv_splits), *local_blocks.shape[1:]))
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        ctx.save_for_backward(send_idx)
        ctx.splits, ctx.group, ctx.n_local = (send_splits, recv_splits), group, len(local_blocks)
        return recv

    @staticmethod
    def backward(ctx, grad_recv: Tensor):
        (send_idx,) = ctx.saved_tensors
        send_splits, recv_splits = ctx.splits
        grad_send = grad_recv.new_empty((sum(send_splits), *grad_recv.shape[1:]))
        dist.all_to_all_single(grad_send, grad_recv.contiguous(), send_splits, recv_splits,
                               group=ctx.group)
        # The remote contributions summed in float32 and rounded once: a block several ranks
        # fetched (the sinks: all of them) is not rounded at each addition. Each was rounded
        # once on its rank, and autograd adds the owner's own part in the inputs' dtype.
        grad = grad_recv.new_zeros((ctx.n_local, *grad_recv.shape[1:]), dtype=torch.float32)
        grad.index_add_(0, send_idx, grad_send.float())
        return grad.to(grad_recv.dtype), None, None, None, None
