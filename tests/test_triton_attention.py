"""Triton block-sparse attention (forward, backward, decode) against the PyTorch reference.

Runs on CPU in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` or
here, before Triton is imported), at small shapes, in float32 and float16 (bf16 ``tl.dot`` is
broken in the interpreter). On a CUDA machine the same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import use_interpreter

use_interpreter(unless_cuda=True)

triton = pytest.importorskip("triton")

from pisa_compile import PisaConfig  # noqa: E402
from pisa_compile.kernels import reference as ref  # noqa: E402
from pisa_compile.kernels import triton_attention as ta  # noqa: E402
from pisa_compile.kernels import triton_decode as td  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4) if DEV == "cpu" else dict(atol=5e-3, rtol=5e-3),
       torch.float16: dict(atol=1e-2, rtol=1e-2)}
GTOL = {torch.float32: TOL[torch.float32], torch.float16: dict(atol=3e-2, rtol=3e-2)}


def _make(B, Hkv, G, Nq, Nk, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, Dv, generator=g)
    return [x.to(DEV, dtype) for x in (q, k, v)]


def _mask(kind, B, Hq, Nq, Nk, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
        m[..., 0, :] = False  # a fully masked row
        return m.to(DEV)
    if kind == "float":
        bias = torch.randn(1, Hq, Nq, Nk, generator=g).to(dtype)
        hide = torch.rand(1, Hq, Nq, Nk, generator=g) > 0.7
        m = bias.masked_fill(hide, torch.finfo(dtype).min)
        m[:, :, 1, :] = float("-inf")  # a fully masked row
        return m.to(DEV)
    if kind == "padding":  # HF key padding [B, 1, 1, Nk], expanded (stride 0 over queries)
        m = torch.ones(B, 1, 1, Nk, dtype=torch.bool)
        m[:, :, :, Nk - 7:] = False
        # The reference's selection needs the query dim materialised as a view (see report).
        return m.to(DEV).expand(B, 1, Nq, Nk)
    raise ValueError(kind)


def _compare(q, k, v, mask, causal, cfg, backward=True, selection=None, **structure):
    """Triton against the reference over one selection; ``structure``: ``key_mask`` and
    ``causal_offset`` for every stage."""
    scale = q.shape[-1] ** -0.5
    if selection is None:
        bi, bc = ref.select_blocks(q, k, mask, causal, scale, **cfg.selection_options(),
                                   **structure)
    else:
        bi, bc = selection
    opts = {**cfg.attention_options(), **structure}
    out, lse = ta.sparse_attention(q, k, v, mask, causal, scale, bi, bc, **opts)
    r_out, r_lse = ref.sparse_attention(q, k, v, mask, causal, scale, bi, bc, **opts)
    tol = TOL[q.dtype]
    torch.testing.assert_close(out, r_out, **tol)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse, r_lse.float(), atol=tol["atol"] * 10, rtol=tol["rtol"])
    if not backward:
        return out, lse
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    grads = ta.sparse_attention_backward(go, q, k, v, mask, out, lse, bi, bc, causal, scale,
                                         **opts)
    r_grads = ref.sparse_attention_backward(go, q, k, v, mask, r_out, r_lse, bi, bc, causal,
                                            scale, **opts)
    for name, a, b in zip(("dq", "dk", "dv"), grads, r_grads):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **GTOL[q.dtype], msg=lambda m: f"{name}: {m}")
    return out, lse


CFG = PisaConfig(block_size=16, top_k=1, query_tile=16, min_seq_len=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("G", [1, 4, 6])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward_matches_reference(dtype, G, causal):
    # Nq, Nk not multiples of the block or the tile; Dv != D; fewer blocks chosen than exist.
    q, k, v = _make(1, 2, G, 90 if causal else 37, 90 if causal else 120, 32, 16, dtype, seed=G)
    _compare(q, k, v, None, causal, CFG)


@pytest.mark.parametrize("kind", ["bool", "float", "padding"])
def test_masks(kind):
    q, k, v = _make(2, 1, 4, 33, 45, 16, 16, torch.float32, seed=3)
    mask = _mask(kind, 2, 4, 33, 45, torch.float32)
    out, lse = _compare(q, k, v, mask, False, CFG)
    if kind in ("bool", "float"):  # the fully masked row: zeros and lse = -inf
        row = 0 if kind == "bool" else 1
        assert torch.all(out[:, :, row] == 0)
        assert torch.all(lse[:, :, row] == float("-inf"))


def test_float16_float_mask():
    q, k, v = _make(1, 2, 2, 30, 40, 32, 32, torch.float16, seed=4)
    _compare(q, k, v, _mask("float", 1, 4, 30, 40, torch.float16), False, CFG)


def test_head_dim_not_pow2_and_larger_tiles():
    # D = 24 (padded to 32), Dv = 40 (padded to 64), Tq = 32 with G = 4: one 128-row block.
    cfg = PisaConfig(block_size=16, top_k=2, query_tile=32, min_seq_len=0)
    q, k, v = _make(1, 1, 4, 50, 70, 24, 40, torch.float32, seed=5)
    _compare(q, k, v, None, True, cfg)


def test_row_sub_blocks():
    # G * Tq = 6 * 32 = 192 rows > 128: two row sub-blocks walk the same block list.
    cfg = PisaConfig(block_size=16, top_k=1, query_tile=32, min_seq_len=0)
    q, k, v = _make(1, 1, 6, 40, 40, 16, 16, torch.float32, seed=6)
    _compare(q, k, v, None, True, cfg)


@pytest.mark.parametrize("block_size", [8, 128])
def test_leaf_smaller_and_larger_than_key_tile(block_size):
    # C = 8 packs two leaves per 16-key tile; C = 128 is walked in two 64-key tiles.
    cfg = PisaConfig(block_size=block_size, top_k=1, query_tile=16, min_seq_len=0,
                     local_blocks=1)
    q, k, v = _make(1, 2, 2, 45, 300, 16, 16, torch.float32, seed=block_size)
    _compare(q, k, v, None, True, cfg)


@pytest.mark.parametrize("seg", [128, 1, 3])
def test_every_tile_chooses_the_same_blocks(seg, monkeypatch):
    # Hand-made selection: all tiles attend leaves 0 and 2 (the sink pattern, worst case for
    # the transposed index), in a cross-attention shape. seg < T splits those leaves' dk/dv
    # over several programs (partials + ordered reduction).
    monkeypatch.setattr(ta, "SEG_TILES", seg)
    q, k, v = _make(1, 2, 4, 64, 40, 16, 16, torch.float32, seed=8)
    T = 4
    bi = torch.full((1, 2, T, 3), -1, dtype=torch.int32)
    bi[..., 0], bi[..., 1] = 0, 2
    bc = torch.full((1, 2, T), 2, dtype=torch.int32)
    _compare(q, k, v, None, False, CFG, selection=(bi.to(DEV), bc.to(DEV)))


def test_segmented_backward_with_reference_selection(monkeypatch):
    monkeypatch.setattr(ta, "SEG_TILES", 2)
    q, k, v = _make(1, 2, 2, 90, 90, 16, 16, torch.float16, seed=12)
    _compare(q, k, v, None, True, CFG)


def test_transposed_index_is_tile_ordered():
    bi = torch.tensor([[[[0, 2, -1], [0, 1, 2], [1, -1, -1], [0, 2, 3]]]], dtype=torch.int32)
    bc = torch.tensor([[[2, 3, 1, 3]]], dtype=torch.int32)
    offsets, tiles = ta.transposed_index(bi.to(DEV), bc.to(DEV), 5)
    assert offsets.cpu().tolist() == [[[0, 3, 5, 8, 9, 9]]]
    assert tiles.cpu()[0, 0, :9].tolist() == [0, 1, 3, 1, 2, 0, 1, 3, 3]


def test_no_visible_key_anywhere():
    q, k, v = _make(1, 1, 2, 20, 20, 16, 16, torch.float32, seed=9)
    mask = torch.zeros(1, 1, 20, 20, dtype=torch.bool, device=DEV)
    out, lse = _compare(q, k, v, mask, False, CFG)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Nq,causal,n_splits", [(1, False, None), (3, False, 2), (5, True, 3)])
def test_decode_matches_reference(dtype, Nq, causal, n_splits):
    cfg = PisaConfig(block_size=16, top_k=3, query_tile=16, min_seq_len=0)
    q, k, v = _make(2, 2, 4, Nq, 150, 32, 16, dtype, seed=Nq)
    scale = 0.2
    bi, bc = ref.select_blocks(q, k, None, causal, scale, **cfg.selection_options())
    out, lse = td.decode_attention(q, k, v, None, causal, scale, bi, bc,
                                   **cfg.attention_options(), n_splits=n_splits)
    r_out, r_lse = ref.sparse_attention(q, k, v, None, causal, scale, bi, bc,
                                        **cfg.attention_options())
    torch.testing.assert_close(out, r_out, **TOL[dtype])
    torch.testing.assert_close(lse, r_lse.float(), atol=1e-3, rtol=1e-3)


def test_decode_with_mask():
    cfg = PisaConfig(block_size=8, top_k=4, query_tile=16, min_seq_len=0)
    q, k, v = _make(1, 2, 3, 2, 90, 16, 16, torch.float32, seed=11)
    mask = torch.ones(1, 1, 2, 90, dtype=torch.bool)
    mask[..., 80:] = False
    mask[..., 1, :] = False  # one query sees nothing
    mask = mask.to(DEV)
    bi, bc = ref.select_blocks(q, k, mask, False, 0.25, **cfg.selection_options())
    out, lse = td.decode_attention(q, k, v, mask, False, 0.25, bi, bc, **cfg.attention_options(),
                                   n_splits=3)
    r_out, r_lse = ref.sparse_attention(q, k, v, mask, False, 0.25, bi, bc,
                                        **cfg.attention_options())
    torch.testing.assert_close(out, r_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, r_lse.float(), atol=1e-3, rtol=1e-3)
    assert torch.all(out[:, :, 1] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Nq,Nk,causal,off,pads", [
    (90, 90, True, 0, [0, 37]),      # prefill with left padding (one row fully padded early)
    (20, 90, True, 70, [5, 64]),     # a chunk after a cache, bottom-right
    (40, 90, True, 20, [0, 0]),      # keys past the last query's position stay unseen
    (37, 120, False, 0, [3, 120]),   # padding only; batch row 1 has no key at all
])
def test_structured_masks_match_reference(dtype, Nq, Nk, causal, off, pads):
    """Key padding and a causal offset in the forward and both backward kernels."""
    q, k, v = _make(2, 2, 3, Nq, Nk, 32, 16, dtype, seed=Nq + off)
    km = (torch.arange(Nk)[None] >= torch.tensor(pads)[:, None]).to(DEV)
    cfg = PisaConfig(block_size=16, top_k=2, query_tile=16, min_seq_len=0)
    out, _ = _compare(q, k, v, None, causal, cfg, key_mask=km, causal_offset=off)
    if pads[-1] >= Nk:
        assert torch.all(out[1] == 0)  # no visible key: zeros, as SDPA's math backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_key_masks_with_holes_match_reference(dtype):
    """A key mask with holes (as packed sequences give) beside right padding, in the forward
    and both backward kernels."""
    Nq = Nk = 90
    q, k, v = _make(2, 2, 3, Nq, Nk, 32, 16, dtype, seed=5)
    km = torch.ones(2, Nk, dtype=torch.bool)
    km[0, 10:30] = False
    km[0, 50:53] = False
    km[1, 70:] = False
    cfg = PisaConfig(block_size=16, top_k=2, query_tile=16, min_seq_len=0)
    km = km.to(DEV)
    out, _ = _compare(q, k, v, None, True, cfg, key_mask=km)
    # NaN in the padding keys (K is loaded before the mask in the forward) changes nothing.
    # (The reference, like SDPA's math backend, lets a masked NaN value through.)
    k2, v2 = k.clone(), v.clone()
    hide = ~km[:, None, :].expand(-1, k.shape[1], -1)
    k2[hide], v2[hide] = float("nan"), float("nan")
    bi, bc = ref.select_blocks(q, k, None, True, 32 ** -0.5, **cfg.selection_options(),
                               key_mask=km)
    out2, _ = ta.sparse_attention(q, k2, v2, None, True, 32 ** -0.5, bi, bc,
                                  **cfg.attention_options(), key_mask=km)
    assert torch.equal(out, out2)


@pytest.mark.parametrize("Nq,n_splits", [(1, 3), (4, 2)])
def test_decode_with_structure(Nq, n_splits):
    """Decode after a left-padded prompt: causal offset = cache length - Nq + 1."""
    cfg = PisaConfig(block_size=8, top_k=3, query_tile=16, min_seq_len=0)
    Nk = 120
    q, k, v = _make(2, 2, 3, Nq, Nk, 16, 16, torch.float32, seed=Nq)
    km = (torch.arange(Nk)[None] >= torch.tensor([0, 45])[:, None]).to(DEV)
    st = dict(key_mask=km, causal_offset=Nk - Nq)
    bi, bc = ref.select_blocks(q, k, None, True, 0.25, **cfg.selection_options(), **st)
    out, lse = td.decode_attention(q, k, v, None, True, 0.25, bi, bc, **cfg.attention_options(),
                                   n_splits=n_splits, **st)
    r_out, r_lse = ref.sparse_attention(q, k, v, None, True, 0.25, bi, bc,
                                        **cfg.attention_options(), **st)
    torch.testing.assert_close(out, r_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, r_lse.float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("C", [16, 64])
def test_window_per_row_key_masks_match_dense(C):
    """The window path's two forward launches with a key mask per batch row (B=2, Hkv=2):
    row 0's only masked key is its newest (the last listed leaf of the last tiles), row 1 is
    left-padded (the first leaves of its first tiles). A program is counted in one launch by
    the leaves [first, last] of its own row, so reading a neighbour leaf's prefix count, or
    another row's, runs a masked program without its key mask."""
    from pisa_compile.kernels.geometry import dense_mask
    from pisa_compile.kernels.window import window_blocks

    B, Hkv, G, N, D, W, Tq = 2, 2, 2, 200, 16, 40, 16
    q, k, v = _make(B, Hkv, G, N, N, D, D, torch.float32, seed=11)
    km = torch.ones(B, N, dtype=torch.bool)
    km[0, -1] = False
    km[1, :37] = False
    km = km.to(DEV)
    bi, bc = window_blocks(N, N, W, 0, C, Tq, q.device)
    bi = bi.expand(B, Hkv, *bi.shape).contiguous()
    bc = bc.expand(B, Hkv, *bc.shape).contiguous()
    out, lse = ta.sparse_attention(q, k, v, None, True, 0.25, bi, bc, block_size=C,
                                   query_tile=Tq, key_mask=km, window=W)
    vis = dense_mask(B, N, N, True, 0, km, window=W)
    want = ref.dense_attention(q.double(), k.double(), v.double(), attn_mask=vis, scale=0.25)
    seen = vis.any(-1)[:, :, :, None].expand_as(want)  # rows with no key are 0 in both
    torch.testing.assert_close(out.double()[seen], want[seen], **TOL[torch.float32])


@pytest.mark.parametrize("n_splits", [1, 3])
def test_decode_window_under_a_key_mask_matches_dense(n_splits):
    """Decode on the window path under a key mask (one launch, the mask read per key), with
    a program whose leaves hold no masked key beside one whose do, over one and three
    splits: out and lse equal dense attention under the window's mask."""
    from pisa_compile.kernels.geometry import dense_mask
    from pisa_compile.kernels.window import window_blocks

    B, Hkv, G, Nq, Nk, D, W, C = 2, 2, 2, 3, 160, 16, 70, 16
    q, k, v = _make(B, Hkv, G, Nq, Nk, D, D, torch.float32, seed=5)
    km = torch.ones(B, Nk, dtype=torch.bool)
    km[0, 10:13] = False    # row 0: masked keys outside the windows (a clean program)
    km[1, :100] = False     # row 1: its windows' first leaves hold padding, the last do not
    km[1, -1] = False       # and its newest key
    km = km.to(DEV)
    off = Nk - Nq
    bi, bc = window_blocks(Nq, Nk, W, off, C, 16, q.device)
    bi = bi.expand(B, Hkv, *bi.shape).contiguous()
    bc = bc.expand(B, Hkv, *bc.shape).contiguous()
    out, lse = td.decode_attention(q, k, v, None, True, 0.25, bi, bc, block_size=C,
                                   query_tile=16, key_mask=km, causal_offset=off, window=W,
                                   n_splits=n_splits)
    vis = dense_mask(B, Nq, Nk, True, off, km, window=W)
    want = ref.dense_attention(q.double(), k.double(), v.double(), attn_mask=vis, scale=0.25)
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(),
                     k.double().repeat_interleave(G, 1)) * 0.25
    want_lse = torch.logsumexp(s.masked_fill(~vis, float("-inf")), -1)
    torch.testing.assert_close(lse.double(), want_lse, **TOL[torch.float32])


def test_errors_name_the_problem():
    q, k, v = _make(1, 1, 1, 16, 16, 16, 16, torch.float32)
    bi, bc = ref.select_blocks(q, k, None, False, 0.25, **CFG.selection_options())
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        ta.sparse_attention(q.double(), k.double(), v.double(), None, False, 0.25, bi, bc,
                            **CFG.attention_options())
    with pytest.raises(ValueError, match="block_indices"):
        ta.sparse_attention(q, k, v, None, False, 0.25, bi[:, :, :0], bc, **CFG.attention_options())


@pytest.mark.parametrize("C,dtype", [(16, torch.float32), (128, torch.float32)])
def test_window_with_a_broadcast_key_mask_matches_dense(C, dtype):
    """The window path under a key mask of batch 1 broadcast to B=2: programs whose leaves
    hold no masked key (run without the key mask) beside programs that do, one and several
    key tiles per leaf; out, dq, dk, dv equal dense attention, and NaN in the masked keys
    reaches nothing (a review's mutant: every batch row given row 0's partial-leaf counts)."""
    from pisa_compile.kernels.geometry import dense_mask
    from pisa_compile.kernels.window import window_blocks

    B, Hkv, G, N, D, W, Tq = 2, 2, 2, 200, 16, 40, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, h, N, D, generator=gen, dtype=dtype) for h in (Hkv * G, Hkv, Hkv))
    km = torch.ones(1, N, dtype=torch.bool)
    km[0, 150:152] = False
    bi, bc = window_blocks(N, N, W, 0, C, Tq, q.device)
    n_tiles_masked = sum(int(((bi[t, :bc[t]] * C <= 151) & (bi[t, :bc[t]] * C + C > 150)).any())
                         for t in range(bi.shape[0]))
    assert 0 < n_tiles_masked < bi.shape[0]  # clean and masked programs in one call
    bi, bc = bi.expand(B, Hkv, *bi.shape).contiguous(), bc.expand(B, Hkv, *bc.shape).contiguous()
    go = torch.randn(B, Hkv * G, N, D, generator=gen, dtype=dtype)

    def run(k_, v_):
        out, lse = ta.sparse_attention(q, k_, v_, None, True, 0.25, bi, bc, block_size=C,
                                       query_tile=Tq, key_mask=km, window=W)
        grads = ta.sparse_attention_backward(go, q, k_, v_, None, out, lse, bi, bc, True, 0.25,
                                             block_size=C, query_tile=Tq, key_mask=km,
                                             window=W)
        return (out, *grads)

    got = run(k, v)
    vis = dense_mask(B, N, N, True, 0, km.expand(B, N), window=W)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = ref.dense_attention(*leaves, attn_mask=vis, scale=0.25)
    want.backward(go.double())
    for a, b in zip(got, (want, *(t.grad for t in leaves))):
        torch.testing.assert_close(a.double(), b.detach(), atol=1e-4, rtol=1e-4)
    hide = ~km[:, None, :, None]
    poisoned = run(torch.where(hide, float("nan"), k), torch.where(hide, float("nan"), v))
    live = km[:, None, :, None].expand_as(k)
    assert torch.equal(poisoned[0], got[0]) and torch.equal(poisoned[1], got[1])
    assert torch.equal(poisoned[2][live], got[2][live])
    assert torch.equal(poisoned[3][live], got[3][live])
