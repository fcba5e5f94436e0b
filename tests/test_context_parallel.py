"""Context-parallel PISA (issue #17, ``pisa_compile.context_parallel``): 1, 2 and 4 gloo
processes on the CPU, each with its zig-zag part of one sequence, against single-process
``pisa_attention`` with the same options on the whole sequence: the outputs and the
gradients of every rank's q, k and v, the selection tile by tile, and the bytes received
(exactly the chosen blocks that other ranks own)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from pisa_compile import PisaConfig  # noqa: E402
from pisa_compile import context_parallel as cp  # noqa: E402
from pisa_compile.ops import pisa_attention, select_blocks  # noqa: E402

# Small options so that a few hundred keys span several pyramid levels and the pick is
# sparse (3 of up to 32 leaves per tile, besides the sink and local leaves).
SMALL = cp.CP_CONFIG.replace(block_size=16, query_tile=16, top_k=3, beam=4)
# (B, Hq, Hkv, N, D, Dv, config changes): GQA and MHA, Dv != D, query tiles narrower
# and wider than a leaf, more local leaves and sinks, branching 4.
CASES = [
    (2, 4, 2, 512, 16, 16, {}),
    (1, 2, 2, 256, 8, 12, dict(query_tile=32)),
    (1, 6, 2, 768, 16, 8, dict(local_blocks=3, sink_blocks=2, branching=4, top_k=5)),
    (2, 4, 1, 512, 8, 8, dict(block_size=32, query_tile=16, top_k=2)),
    # Sinks past a rank's last chunk (forced, seen by none of its queries): not fetched.
    (1, 2, 1, 128, 8, 8, dict(sink_blocks=7)),
]
# Three ranks: lengths that are multiples of 2 * 3 * 16; bfloat16 with a looser tolerance.
CASES3 = [
    (1, 4, 2, 192, 16, 12, {}),
    (2, 6, 2, 384, 8, 8, dict(query_tile=32, sink_blocks=3, local_blocks=2)),
    (1, 4, 2, 192, 16, 16, dict(dtype=torch.bfloat16)),
]
TOL = dict(atol=2e-5, rtol=1e-4)  # fp32; only the order of gradient sums differs


def _inputs(case, seed):
    B, Hq, Hkv, N, D, Dv, opts = case
    g = torch.Generator().manual_seed(seed)
    dt = opts.get("dtype", torch.float32)
    return tuple(torch.randn(*shape, generator=g).to(dt) for shape in
                 ((B, Hq, N, D), (B, Hkv, N, D), (B, Hkv, N, Dv), (B, Hq, N, Dv)))


def _config(case, **extra):
    return SMALL.replace(**{k: v for k, v in case[-1].items() if k != "dtype"}, **extra)


def _expected_block_bytes(config, q, k, v, rank, world):
    """Bytes of the K/V blocks this rank's tiles select that other ranks own and that their
    queries can see, from the single-process selection (the union per batch row and KV
    head; a forced sink past the tile's chunk is seen by none of its queries)."""
    bi, _ = select_blocks(q, k, is_causal=True, enable_gqa=True, config=config)
    T, C = bi.shape[2], config.block_size
    L = k.shape[2] // C
    tiles_per_chunk, leaves_per_chunk = T // (2 * world), L // (2 * world)
    # Per tile, the first leaf past its chunk (0 for other ranks' tiles: nothing counts).
    end = torch.zeros(T, dtype=torch.long)
    for c in (rank, 2 * world - 1 - rank):
        end[c * tiles_per_chunk:(c + 1) * tiles_per_chunk] = (c + 1) * leaves_per_chunk
    need = torch.zeros(bi.shape[0], bi.shape[1], L + 1, dtype=torch.bool)
    idx = torch.where((bi >= 0) & (bi < end[:, None]), bi, L).long().flatten(2)
    need.scatter_(2, idx, True)
    chunk = torch.arange(L) // leaves_per_chunk
    owner = torch.where(chunk < world, chunk, 2 * world - 1 - chunk)
    n = (need[..., :L] & (owner != rank)).sum().item()
    return n * C * (k.shape[3] + v.shape[3]) * k.element_size()


def _worker(rank, world, path, kernel, cases):
    from torch._dynamo.utils import counters

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for i, case in enumerate(cases):
            config = _config(case, kernel=kernel)
            q, k, v, go = _inputs(case, seed=i)
            # bf16: each side rounds its outputs and gradients once, not at the same sums.
            tol = TOL if q.dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
            ql, kl, vl = (cp.zigzag_shard(x, rank, world, dim=2).requires_grad_()
                          for x in (q, k, v))
            counters.clear()
            out = cp.context_parallel_attention(ql, kl, vl, enable_gqa=True, config=config)
            out.backward(cp.zigzag_shard(go, rank, world, dim=2))
            got = dict(counters["pisa"])

            # Single-process PISA on the whole sequence, on every rank (small).
            qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
            ref = pisa_attention(qf, kf, vf, is_causal=True, enable_gqa=True, config=config)
            ref.backward(go)
            for name, a, b in [("out", out, ref), ("dq", ql.grad, qf.grad),
                               ("dk", kl.grad, kf.grad), ("dv", vl.grad, vf.grad)]:
                torch.testing.assert_close(a, cp.zigzag_shard(b, rank, world, dim=2), **tol,
                                           msg=lambda m: f"case {i} rank {rank} {name}: {m}")
            expected = _expected_block_bytes(config, q, k, v, rank, world)
            assert got.get("cp_block_bytes", 0) == expected, (i, rank, got, expected)
            L = case[3] // config.block_size
            # Leaf means, and on the Triton path their log counts (non-finite flags).
            per_leaf = case[4] + (kernel == "triton")
            summaries = (world - 1) * (L // world) * case[2] * case[0] * per_leaf * 4
            assert got.get("cp_summary_bytes", 0) == summaries, (i, rank, got, summaries)
            index = (world - 1) * L * case[2] * case[0]  # one byte per (b, h, leaf)
            assert got.get("cp_index_bytes", 0) == index, (i, rank, got, index)
    finally:
        dist.destroy_process_group()


def _spawn(fn, world, *args):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(fn, args=(world, os.path.join(d, "store"), *args), nprocs=world)


@pytest.mark.parametrize("world, cases", [(1, CASES), (2, CASES), (3, CASES3), (4, CASES)])
def test_equals_single_process_pisa(world, cases):
    """Outputs, dq, dk and dv of every rank equal single-process PISA's rows (3 to 5 shapes
    per world size: GQA and MHA, Dv != D, tiles narrower and wider than a leaf, branching 4,
    sinks past a chunk, bfloat16), and each rank receives exactly the bytes of the chosen
    blocks it does not own (counted from the single-process selection), the other ranks'
    leaf means and their block marks. Equal outputs mean equal selections: with random keys,
    one different block moves the rows far past the tolerance."""
    _spawn(_worker, world, "reference", cases)


def test_equals_single_process_on_the_triton_kernels():
    """The same with ``kernel="triton"`` (the interpreter here, as on CUDA), two ranks,
    query tiles narrower and wider than a leaf, Dv != D."""
    _spawn(_worker, 2, "triton", CASES[:2])


def _capped(bi, bc, world, rank, config, budget):
    """The single-process selection ``bi``/``bc`` with rank ``rank``'s tiles capped by
    ``cap_fetch`` (its two chunks' tiles; the others' as they are), and its fetch count."""
    tiles = bi.shape[2] // (2 * world)
    rows = [slice(c * tiles, (c + 1) * tiles) for c in (rank, 2 * world - 1 - rank)]
    return cp.cap_fetch([(bi[:, :, r], bc[:, :, r]) for r in rows], world=world, rank=rank,
                        chunk_leaves=bi.shape[2] * config.query_tile // config.block_size
                        // (2 * world), config=config, fetch_budget=budget), rows


def _dense_under(q, k, v, bi, config):
    """Causal SDPA restricted to each query tile's blocks ``bi`` ``[B, Hkv, T, M]``: an
    oracle independent of PISA's kernels."""
    B, Hq, N, _ = q.shape
    Hkv, C, Tq = k.shape[1], config.block_size, config.query_tile
    allowed = torch.zeros(B, Hkv, bi.shape[2], N // C + 1, dtype=torch.bool)
    allowed.scatter_(3, torch.where(bi < 0, N // C, bi).long(), True)
    keys = allowed[..., :N // C].repeat_interleave(C, 3).repeat_interleave(Tq, 2)[:, :, :N]
    mask = keys & torch.ones(N, N, dtype=torch.bool).tril()
    mask = mask.repeat_interleave(Hq // Hkv, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1), attn_mask=mask)


def _budget_worker(rank, world, path, budget):
    from torch._dynamo.utils import counters

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for i, case in enumerate(CASES[:3]):
            config = _config(case)
            q, k, v, go = _inputs(case, seed=10 + i)
            ql, kl, vl = (cp.zigzag_shard(x, rank, world, dim=2).requires_grad_()
                          for x in (q, k, v))
            counters.clear()
            out = cp.context_parallel_attention(ql, kl, vl, enable_gqa=True, config=config,
                                                fetch_budget=budget)
            out.backward(cp.zigzag_shard(go, rank, world, dim=2))
            got = dict(counters["pisa"])
            # Every rank's capped selection (cap_fetch is pure), so that dk and dv, which
            # gather every rank's tiles, compare too.
            bi, bc = select_blocks(q, k, is_causal=True, enable_gqa=True, config=config)
            full = bi.clone()
            for r in range(world):
                (capped, n), rows = _capped(bi, bc, world, r, config, budget)
                for sl, (ci, _) in zip(rows, capped):
                    full[:, :, sl] = ci
                if r == rank:
                    fetched = int(n)
            qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
            ref = _dense_under(qf, kf, vf, full, config)
            ref.backward(go)
            for name, a, b in [("out", out, ref), ("dq", ql.grad, qf.grad),
                               ("dk", kl.grad, kf.grad), ("dv", vl.grad, vf.grad)]:
                torch.testing.assert_close(a, cp.zigzag_shard(b, rank, world, dim=2), **TOL,
                                           msg=lambda m: f"case {i} rank {rank} {name}: {m}")
            C, D, Dv = config.block_size, case[4], case[5]
            assert got.get("cp_block_bytes", 0) == fetched * C * (D + Dv) * 4, (i, got, fetched)
            remote = (2 * world - 2) * (case[3] // C // (2 * world))
            forced = config.sink_blocks + 2 * (config.local_blocks - 1)
            assert fetched <= case[0] * case[2] * max(int(budget * remote), forced), (i, fetched)
            # The budget bound: some chosen remote block was dropped.
            assert not torch.equal(full, bi), (i, rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("budget", [0.1, 0.3])
def test_fetch_budget_caps_the_bytes_and_equals_the_capped_selection(budget):
    """With ``fetch_budget`` each rank fetches exactly the blocks :func:`cap_fetch` keeps
    (at most the budget's share of the remote leaves, or the forced ones, per batch row
    and KV head), and the output and the gradients of q, k and v equal causal SDPA
    restricted to every rank's capped selection (3 shapes, 2 ranks; at 0.1 the forced
    leaves fill the budget, at 0.3 ranked remote leaves are fetched too)."""
    _spawn(_budget_worker, 2, budget)


def test_cap_fetch_keeps_the_most_chosen_remote_leaves():
    """``cap_fetch`` on a single-process selection (no process group): a budget of 1 keeps
    it as it is; a smaller one never drops a block the rank owns, keeps at most the budget's
    share of the remote leaves (the forced ones included, unless they alone exceed it), and
    keeps no remote leaf that fewer of the rank's tiles chose than one it dropped."""
    case = CASES[2]
    config = _config(case)
    q, k, _, _ = _inputs(case, seed=3)
    bi, bc = select_blocks(q, k, is_causal=True, enable_gqa=True, config=config)
    world = 3
    L = k.shape[2] // config.block_size
    leaves = L // (2 * world)
    chunk_of = torch.arange(L) // leaves
    owner = torch.where(chunk_of < world, chunk_of, 2 * world - 1 - chunk_of)
    tiles = bi.shape[2] // (2 * world)
    for rank in range(world):
        (same, _), rows = _capped(bi, bc, world, rank, config, 1.0)
        for r, (ci, cc) in zip(rows, same):
            assert torch.equal(ci, bi[:, :, r]) and torch.equal(cc, bc[:, :, r])
        (capped, fetched), rows = _capped(bi, bc, world, rank, config, 0.4)
        fetched = int(fetched)
        chunks = (rank, 2 * world - 1 - rank)
        demand = torch.zeros(bi.shape[0], bi.shape[1], L + 1)
        kept = torch.zeros(bi.shape[0], bi.shape[1], L + 1, dtype=torch.bool)
        for c, r, (ci, cc) in zip(chunks, rows, capped):
            before, end = bi[:, :, r], (c + 1) * leaves
            seen = torch.where((before >= 0) & (before < end), before, L).long()
            demand.scatter_add_(2, seen.flatten(2), torch.ones(seen.flatten(2).shape))
            kept.scatter_(2, torch.where(ci < 0, L, ci).long().flatten(2), True)
            assert torch.equal(cc, (ci >= 0).sum(-1).to(cc.dtype))
            # Every kept block was chosen; every own block is kept.
            for b in range(bi.shape[0]):
                for h in range(bi.shape[1]):
                    for t in range(tiles):
                        was = set(before[b, h, t][before[b, h, t] >= 0].tolist())
                        now = set(ci[b, h, t][ci[b, h, t] >= 0].tolist())
                        assert now <= was
                        assert {x for x in was if owner[x] == rank or x >= end} <= now
        remote = (owner != rank)
        forced = torch.zeros(L, dtype=torch.bool)
        forced[:config.sink_blocks] = True
        for c in chunks:
            forced[max(0, c * leaves - config.local_blocks + 1):c * leaves] = True
        kept_remote = kept[..., :L] & remote & (demand[..., :L] > 0)
        assert int(kept_remote.sum()) == fetched
        free = kept_remote & ~forced
        n_forced = (kept_remote & forced).sum(-1)
        assert (kept_remote.sum(-1) <= n_forced.clamp(min=int(0.4 * int(remote.sum())))).all()
        dropped = remote & ~kept[..., :L] & (demand[..., :L] > 0)
        lo = torch.where(free, demand[..., :L], float("inf")).amin(-1)
        hi = torch.where(dropped, demand[..., :L], -1.0).amax(-1)
        assert (hi <= lo).all(), (rank, hi, lo)
        assert dropped.any() and free.any(), rank  # the cap bound, and ranked
        assert (kept[..., :L] >= (forced & remote & (demand[..., :L] > 0))).all(), rank


def _select_worker(rank, world, path, kernel):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        case = CASES[2]
        config = _config(case, kernel=kernel)
        q, k, _, _ = _inputs(case, seed=7)
        ql, kl = cp.zigzag_shard(q, rank, world, dim=2), cp.zigzag_shard(k, rank, world, dim=2)
        lay = cp._Layout(world, rank, ql.shape[2] // 2, ql.shape[2] // 2 // config.block_size)
        impl = "triton" if kernel == "triton" else "reference"
        pyramid = cp._gathered_pyramid(kl, lay, config, impl, None)
        whole, whole_counts = select_blocks(q, k, is_causal=True, enable_gqa=True,
                                            config=config)
        tiles = lay.chunk // config.query_tile
        for i, c in enumerate(lay.chunks):
            bi, bc = cp._select_chunk(ql, i, lay, k.shape[1], pyramid, config,
                                      q.shape[-1] ** -0.5, impl)
            assert torch.equal(bi, whole[:, :, c * tiles:(c + 1) * tiles]), (rank, c)
            assert torch.equal(bc, whole_counts[:, :, c * tiles:(c + 1) * tiles]), (rank, c)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_selection_equals_single_process_tile_by_tile(kernel):
    """Each rank's block lists, selected over the gathered leaf summaries, are the
    single-process selection's lists of its tiles, bit for bit (3 ranks, 6 chunks), on the
    reference and on the Triton selection (the interpreter here)."""
    _spawn(_select_worker, 3, kernel)


def _mismatch_worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        x = torch.randn(1, 2, 128, 8)
        differs = [dict(q=torch.randn(1, 2, 256, 8)), dict(q=x.half(), k=x.half(), v=x.half()),
                   dict(config=SMALL.replace(top_k=4)), dict(config={"top_k": 3}),
                   dict(k=torch.randn(2, 128, 8)), dict(scale=0.1),
                   dict(k=x.clone().requires_grad_()),  # a backward only some ranks run
                   dict(fetch_budget=0.5)]
        names = ["q", "q", "config", "config", "k", "scale", "k", "fetch_budget"]
        for change, name in zip(differs, names):
            args = dict(q=x, k=x, v=x, config=SMALL)
            if rank == 1:
                args.update(change)
            with pytest.raises(ValueError, match=rf"every rank must pass.*these differ: "
                                                 rf"\[[^]]*'{name}'"):
                cp.context_parallel_attention(**args)
        # One budget, spelled 1 on one rank and 1.0 on the other: agreed; so is the scale
        # left to its default on one rank and given as its value, 1 / sqrt(8), on the other.
        cp.context_parallel_attention(x, x, x, config=SMALL, fetch_budget=1 if rank else 1.0)
        cp.context_parallel_attention(x, x, x, config=SMALL, scale=8 ** -0.5 if rank else None)
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_calls_are_all_refused():
    """A rank passing another length, dtype, config (or a config that is not one), scale,
    fetch budget, a tensor of another rank, or wanting gradients where the others do not
    (whose backward would wait for theirs), is refused on every rank's forward (none is left
    waiting in a collective)."""
    _spawn(_mismatch_worker, 2)


def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    x = torch.randn(1, 2, 64, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp.context_parallel_attention(x, x, x)


@pytest.fixture
def one_rank():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("kwargs, match", [
    (dict(fetch_budget=0), "fetch_budget must be None or a number in"),
    (dict(fetch_budget=1.5), "fetch_budget must be None or a number in"),
    (dict(fetch_budget=True), "fetch_budget must be None or a number in"),
    (dict(config=PisaConfig(min_seq_len=0)), "leaf_scoring='pooled'"),
    (dict(config=cp.CP_CONFIG.replace(bound_block=16)), "bound_block=None"),
    (dict(config=SMALL.replace(dense_tail=16)), "dense_tail must be 0"),
    (dict(config=SMALL.replace(local_blocks=0)), "local_blocks must be >= 1"),
    (dict(config=SMALL, scale="0.1"), "scale must be None or a real number"),
    (dict(config=SMALL, scale=True), "scale must be None or a real number"),
])
def test_bad_config_is_refused_by_name(one_rank, kwargs, match):
    x = torch.randn(1, 2, 64, 8)
    with pytest.raises(ValueError, match=match):
        cp.context_parallel_attention(x, x, x, **kwargs)
    with pytest.raises(TypeError, match="config must be a PisaConfig"):
        cp.context_parallel_attention(x, x, x, config={"top_k": 3})
    with pytest.raises(TypeError, match="group must be None or a torch.distributed"):
        cp.context_parallel_attention(x, x, x, group="x")
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        cp.context_parallel_attention(x, x, x, enable_gqa="yes")


@pytest.mark.parametrize("q, k, v, match", [
    ((1, 2, 64, 8), (1, 2, 64), (1, 2, 64, 8), "k must be a 4-D tensor"),
    ((1, 4, 64, 8), (1, 2, 64, 8), (1, 2, 64, 8), "enable_gqa=True"),
    ((1, 2, 64, 8), (1, 2, 64, 4), (1, 2, 64, 8), r"k must be \[B, Hkv, N_local, D\]"),
    ((1, 2, 48, 8), (1, 2, 48, 8), (1, 2, 48, 8), "multiple of block_size=16"),
])
def test_bad_shapes_are_refused_by_name(one_rank, q, k, v, match):
    with pytest.raises(ValueError, match=match):
        cp.context_parallel_attention(torch.randn(q), torch.randn(k), torch.randn(v),
                                      config=SMALL)


def test_mixed_and_unsupported_dtypes_are_refused(one_rank):
    x = torch.randn(1, 2, 64, 8)
    with pytest.raises(ValueError, match="one dtype and device"):
        cp.context_parallel_attention(x, x.half(), x, config=SMALL)
    with pytest.raises(ValueError, match="q must be float16, bfloat16 or float32"):
        cp.context_parallel_attention(x.double(), x.double(), x.double(), config=SMALL)


@pytest.mark.parametrize("world, rank", [(w, r) for w in (1, 2, 3) for r in range(w)])
def test_zigzag_unshard_inverts_shard(world, rank):
    x = torch.arange(2 * 3 * 12).view(2, 3, 12)
    shards = [cp.zigzag_shard(x, r, world, dim=2) for r in range(world)]
    assert torch.equal(cp.zigzag_unshard(shards, dim=2), x)
    # Rank r holds chunks r and 2W-1-r: its first element is chunk r's start.
    chunk = 12 // (2 * world)
    assert shards[rank][0, 0, 0].item() == rank * chunk
    assert shards[rank][0, 0, chunk].item() == (2 * world - 1 - rank) * chunk


def test_zigzag_bad_arguments():
    x = torch.zeros(1, 1, 10, 1)
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size = 4"):
        cp.zigzag_shard(x, 0, 2, dim=2)
    with pytest.raises(ValueError, match="rank must be in"):
        cp.zigzag_shard(torch.zeros(1, 1, 8, 1), 2, 2, dim=2)
    with pytest.raises(ValueError, match="one tensor per rank"):
        cp.zigzag_unshard([torch.zeros(2), torch.zeros(4)], dim=0)
    with pytest.raises(ValueError, match="dim=2 is out of range for a 2-D tensor"):
        cp.zigzag_shard(torch.zeros(1, 8), 0, 2, dim=2)
    with pytest.raises(TypeError):  # no default: a wrong one would cut another dimension
        cp.zigzag_shard(torch.zeros(1, 8), 0, 2)


# -- a transformers model trained context-parallel ----------------------------------------

def _train_worker(rank, world, path):
    from experiments.train_context_parallel import train

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        quiet = dict(seq_len=256, steps=2, log=lambda *_: None)
        exact = SMALL.replace(top_k=64)  # every leaf: dense attention
        runs = {"exact": (train(config=exact, **quiet), train(config=exact, attn="sdpa", **quiet))}
        ones = [dist.new_group([r]) for r in range(world)]  # single-process PISA per rank
        runs["sparse"] = (train(config=SMALL, **quiet),
                          train(config=SMALL, group=ones[rank], **quiet))
        for name, (got, want) in runs.items():
            torch.testing.assert_close(torch.tensor(got["losses"]),
                                       torch.tensor(want["losses"]), atol=1e-5, rtol=1e-5)
            for p, g in want["grads"].items():
                assert g.abs().max() > 0, p
                torch.testing.assert_close(got["grads"][p], g, atol=1e-6, rtol=1e-4,
                                           msg=lambda m: f"{name} rank {rank} {p}: {m}")
        # The sparse run really selected: its loss differs from the dense one.
        assert abs(runs["sparse"][0]["losses"][0] - runs["exact"][1]["losses"][0]) > 1e-4
    finally:
        dist.destroy_process_group()


def test_llama_trains_context_parallel():
    """Two AdamW steps of a tiny Llama (GQA, RoPE at the global positions) on one 256-token
    sequence sharded over 2 ranks: with every leaf selected, losses and summed gradients
    equal dense SDPA on the whole sequence in one process; with a sparse selection, they
    equal single-process PISA with the same options."""
    _spawn(_train_worker, 2)


def test_the_example_runs_under_torchrun(tmp_path):
    """``torchrun -m experiments.train_context_parallel``, as the README gives it."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cp.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "experiments.train_context_parallel", "--seq-len", "256", "--layers",
           "1", "--steps", "2", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = torch.load(out, weights_only=False)
    assert len(res["losses"]) == 2 and res["losses"][1] < res["losses"][0], res["losses"]


def test_hf_attention_refuses_padding_and_dropout(one_rank):
    from pisa_compile import hf_context_parallel as hcp
    from pisa_compile.samples import tiny_llama

    name = hcp.register(config=SMALL)
    model = tiny_llama(max_positions=128, num_layers=1)
    model.set_attn_implementation(name)
    ids = torch.randint(0, 256, (1, 64))
    am = torch.ones_like(ids)
    am[0, :8] = 0
    with pytest.raises(ValueError, match="padding"):
        model(input_ids=ids, attention_mask=am)
    model(input_ids=ids, attention_mask=torch.ones_like(ids))  # all ones: accepted
    with torch.inference_mode():  # evaluation loops: inference tensors have no version
        model(input_ids=ids, use_cache=False)
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="dropout"):
        model.train()(input_ids=ids)
    with pytest.raises(TypeError, match="register: config must be a PisaConfig"):
        hcp.register(config={"top_k": 2})
    with pytest.raises(ValueError, match="register: config.dense_tail must be 0"):
        hcp.register(config=SMALL.replace(dense_tail=64))
    with pytest.raises(ValueError, match="leaf_scoring='pooled'"):
        hcp.register(config=PisaConfig())
    with pytest.raises(ValueError, match="fetch_budget must be None or a number in"):
        hcp.register(config=SMALL, fetch_budget=2)


def test_hf_attention_refuses_a_sliding_window(one_rank):
    import transformers
    from pisa_compile import hf_context_parallel as hcp

    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, sliding_window=32)
    model = transformers.MistralForCausalLM(cfg).eval()
    model.set_attn_implementation(hcp.register(config=SMALL))
    with pytest.raises(ValueError, match="sliding_window=32"):
        model(input_ids=torch.randint(0, 64, (1, 64)))


def _padding_worker(rank, world, path):
    from pisa_compile import hf_context_parallel as hcp
    from pisa_compile.samples import tiny_llama

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        model = tiny_llama(max_positions=128, num_layers=1)
        model.set_attn_implementation(hcp.register(config=SMALL))
        am = torch.ones(1, 128, dtype=torch.long)
        am[0, -8:] = 0  # right padding: in the last chunk, rank 0's
        ids = cp.zigzag_shard(torch.randint(0, 256, (1, 128)), rank, world, dim=1)
        with pytest.raises(ValueError, match="on some rank"):
            model(input_ids=ids, attention_mask=cp.zigzag_shard(am, rank, world, dim=1))
    finally:
        dist.destroy_process_group()


def test_hf_padding_on_one_rank_is_refused_by_every_rank():
    _spawn(_padding_worker, 2)


def _positions_worker(rank, world, path):
    from pisa_compile import hf_context_parallel as hcp
    from pisa_compile.samples import tiny_llama

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        model = tiny_llama(max_positions=128, num_layers=2)
        model.set_attn_implementation(hcp.register(config=SMALL))
        ids = cp.zigzag_shard(torch.randint(0, 256, (2, 128)), rank, world, dim=1)
        good = cp.zigzag_shard(torch.arange(128)[None], rank, world, dim=1)
        packed = cp.zigzag_shard(torch.arange(128)[None] % 64, rank, world, dim=1)
        bad = [dict(), dict(position_ids=packed)]
        if rank == 1:  # one rank's positions wrong: every rank refuses
            bad.append(dict(position_ids=good + 1))
        else:
            bad.append(dict(position_ids=good))
        for kwargs in bad:
            with pytest.raises(ValueError, match="position_ids must be each rank's zig-zag"):
                model(input_ids=ids, use_cache=False, **kwargs)
        model(input_ids=ids, position_ids=good, use_cache=False)  # accepted
        mask4 = torch.ones(2, 1, 64, 64, dtype=torch.bool)
        with pytest.raises(ValueError, match="4-D attention_mask"):
            model(input_ids=ids, position_ids=good, attention_mask=mask4, use_cache=False)
        with pytest.raises(ValueError, match="KV cache"):
            model.generate(input_ids=ids, position_ids=good, max_new_tokens=2,
                           do_sample=False)
    finally:
        dist.destroy_process_group()


def test_hf_positions_masks_and_decode_are_checked():
    """Missing position_ids (each rank's RoPE from 0), a packed sequence's resets, or one
    rank's wrong positions are refused on every rank; a 4-D mask and a KV cache (decode,
    ``generate()``) are refused by name: each of them ran silently wrong or failed
    obscurely before (new-user trial)."""
    _spawn(_positions_worker, 2)


# -- the Triton pyramid from a gathered leaf level -----------------------------------------

@pytest.mark.parametrize("n_keys, branching, beam", [(16 * 40, 2, 4), (16 * 37, 4, 2)])
def test_triton_pyramid_from_leaves_equals_the_one_from_keys(n_keys, branching, beam):
    """``pyramid_from_leaves`` over the leaf rows of ``pyramid_buffers`` gives every level's
    rows bit for bit (fp32, the interpreter), a NaN key's flag included."""
    from pisa_compile.kernels import triton_pyramid
    from pisa_compile.kernels.geometry import level_sizes

    k = torch.randn(2, 3, n_keys, 8)
    k[1, 2, 100, 3] = float("nan")
    mu, cnt, lcnt, total = triton_pyramid.pyramid_buffers(k, 16, branching, beam)
    L = n_keys // 16
    got = triton_pyramid.pyramid_from_leaves(mu[:, :, :L], cnt[:, :, :L], lcnt[:, :, :L],
                                             branching, beam)
    rows = sum(level_sizes(n_keys, 16, branching, beam))
    assert got[3] == total
    for a, b in zip(got[:3], (mu, cnt, lcnt)):
        assert torch.equal(a[:, :, :rows], b[:, :, :rows])
    assert torch.isinf(lcnt[1, 2, 100 // 16]) and not torch.isinf(lcnt[0, 0, 0])


def test_triton_selection_from_summaries_refuses_what_reads_keys():
    from pisa_compile.kernels import triton_pyramid, triton_select

    q, k = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    summaries = triton_pyramid.pyramid_buffers(k, 16, 2, 4)
    opts = dict(block_size=16, top_k=2, branching=2, beam=4, sink_blocks=1, local_blocks=1,
                query_tile=16, summaries=summaries)
    for bad in (dict(leaf_scoring="exact"), dict(leaf_scoring="pooled", bound_block=16)):
        with pytest.raises(ValueError, match="summaries need leaf_scoring='pooled'"):
            triton_select.select_blocks(q, k, True, 0.35, **opts, **bad)


def _compiled_worker(rank, world, path):
    from pisa_compile import hf_context_parallel
    from pisa_compile.samples import tiny_llama

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        ids = cp.zigzag_shard(torch.randint(0, 256, (1, 256), generator=g), rank, world, dim=1)
        pos = cp.zigzag_shard(torch.arange(256)[None], rank, world, dim=1)
        outs = []
        for compiled in (False, True):
            torch._dynamo.reset()
            model = tiny_llama(max_positions=256, num_layers=2).train()
            model.set_attn_implementation(hf_context_parallel.register(None, SMALL))
            fn = torch.compile(model, backend="pisa") if compiled else model
            logits = fn(input_ids=ids, position_ids=pos, use_cache=False).logits
            logits.float().square().mean().backward()
            outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-4)
        for n, g_eager in outs[0][1].items():
            torch.testing.assert_close(outs[1][1][n], g_eager, atol=1e-6, rtol=1e-3,
                                       msg=lambda m: f"rank {rank} {n}: {m}")
    finally:
        dist.destroy_process_group()


def test_a_model_compiled_with_pisa_runs_the_exchange_eagerly():
    """``torch.compile(model, backend="pisa")`` on a model with the context-parallel
    attention: Dynamo runs each attention call eagerly between compiled graphs, and logits
    and gradients equal the eager model's (2 ranks)."""
    _spawn(_compiled_worker, 2)


def test_context_parallel_bench_runs_and_matches_one_process(tmp_path):
    """The 2-GPU benchmark's CPU smoke run (gloo, 2 ranks): its gathered output equals the
    single-process op's (the same selection), and it records both timings and the bytes
    each rank received against ring attention's."""
    import json

    from benchmarks import bench_context_parallel as bench
    out = tmp_path / "cp.json"
    bench.main(["--nproc", "2", "--device", "cpu", "--tiny", "--lengths", "512",
                "--reps", "1", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["max_abs_diff"] < 1e-5
    assert row["single_ms"] > 0 and row["cp_ms"] > 0 and row["world"] == 2
    assert len(row["bytes_received"]) == 2 and row["ring_bytes"] == 512 * 2 * 16 * 4 * 2 // 2
    assert all(r["cp_block_bytes"] > 0 for r in row["bytes_received"])
