"""Hypothesis strategies for attention problems, and the dense oracles the tests compare to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from hypothesis import strategies as st

from pisa_compile import PisaConfig
from pisa_compile.kernels.reference import dense_attention, mask_parts
from pisa_compile.ops import is_decode_step

MASK_KINDS = ("none", "causal", "bool", "float", "key_padding", "fully_masked_rows")
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@dataclass
class Problem:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    is_causal: bool
    mask_kind: str

    @property
    def G(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    def visibility(self) -> torch.Tensor:
        """Dense bool ``[B or 1, Hq or 1, Nq, Nk]``: which keys each row may see."""
        Nq, Nk = self.q.shape[2], self.k.shape[2]
        vis = torch.ones(1, 1, Nq, Nk, dtype=torch.bool)
        if self.is_causal:
            vis = vis.tril()
        allowed, _ = mask_parts(self.attn_mask)
        if allowed is not None:
            vis = vis & allowed
        return vis


def make_mask(kind: str, B: int, Hq: int, Nq: int, Nk: int, dtype: torch.dtype,
              gen: torch.Generator) -> tuple[Optional[torch.Tensor], bool]:
    """A mask of one kind, as real models pass them; returns ``(attn_mask, is_causal)``."""
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    if kind == "bool":
        heads = Hq if torch.rand((), generator=gen) < 0.5 else 1
        m = torch.rand(B, heads, Nq, Nk, generator=gen) > 0.3
        m[..., 0] = True  # every row sees something; fully masked rows have their own kind
        return m, False
    if kind == "float":
        bias = torch.randn(1, Hq, Nq, Nk, generator=gen).to(dtype)
        hide = torch.rand(1, 1, Nq, Nk, generator=gen) > 0.7
        hide[..., 0] = False
        fill = float("-inf") if torch.rand((), generator=gen) < 0.5 else torch.finfo(dtype).min
        return bias.masked_fill(hide, fill), False
    if kind == "key_padding":
        lengths = torch.randint(1, Nk + 1, (B,), generator=gen)
        keep = torch.arange(Nk)[None, :] < lengths[:, None]
        return keep[:, None, None, :], False  # HF's [B, 1, 1, Nk] layout
    if kind == "fully_masked_rows":
        m = torch.ones(B, 1, Nq, Nk, dtype=torch.bool).tril(diagonal=Nk - Nq)
        dead = torch.rand(B, 1, Nq, 1, generator=gen) < 0.3
        return m & ~dead, False
    raise ValueError(kind)


@st.composite
def problems(draw, max_n: int = 300, dtypes=DTYPES, mask_kinds=MASK_KINDS,
             same_len: Optional[bool] = None) -> Problem:
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 3, 4, 6]))
    kind = draw(st.sampled_from(mask_kinds))
    Nq = draw(st.integers(1, max_n))
    same = draw(st.booleans()) if same_len is None else same_len
    Nk = Nq if same else draw(st.integers(1, max_n))
    D = draw(st.sampled_from([16, 32, 64]))
    Dv = draw(st.sampled_from([D, 16, 48]))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, Nq, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, Nk, Dv, generator=gen).to(dtype)
    mask, causal = make_mask(kind, B, Hkv * G, Nq, Nk, dtype, gen)
    return Problem(q, k, v, mask, causal, kind)


@st.composite
def sparse_configs(draw) -> PisaConfig:
    """Small configs that give several pyramid levels at N <= 300 (one level, every leaf in
    the pool, where ``flat_leaves`` is drawn non-zero and applies)."""
    return PisaConfig(
        block_size=draw(st.sampled_from([4, 8, 16])),
        top_k=draw(st.integers(1, 4)),
        branching=draw(st.sampled_from([2, 3])),
        beam=draw(st.sampled_from([None, 6])),
        sink_blocks=draw(st.integers(0, 2)),
        local_blocks=draw(st.integers(1, 2)),
        query_tile=draw(st.sampled_from([1, 4, 16, 32])),
        leaf_scoring=draw(st.sampled_from(["pooled", "exact"])),
        shortlist=draw(st.sampled_from([None, 2, 64])),
        bound_block=draw(st.sampled_from([None, None, 1, 4, 16])),
        flat_leaves=draw(st.sampled_from([0, 0, 512])),
        min_seq_len=0,
        dense_tail=0,  # every row through the selection (the tail has its own tests)
        kernel="reference",
    )


def selection_mask(block_indices: torch.Tensor, Nq: int, Nk: int, config: PisaConfig,
                   G: int) -> torch.Tensor:
    """Dense bool ``[B, Hq, Nq, Nk]``: the keys ``pisa_attention`` attends, each row's
    selected blocks; every key for a decode step (at most 16 queries after a cache), which the
    op runs dense whatever the selection would be (``ops.is_decode_step``)."""
    B, Hkv, T, _ = block_indices.shape
    if is_decode_step(Nq, Nk):
        return torch.ones(B, Hkv * G, Nq, Nk, dtype=torch.bool)
    C, L = config.block_size, (Nk + config.block_size - 1) // config.block_size
    chosen = torch.zeros(B, Hkv, T, L + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(block_indices < 0, L, block_indices).long(), True)
    m = chosen[..., :L].repeat_interleave(config.query_tile, 2)[:, :, :Nq]
    m = m.repeat_interleave(C, 3)[..., :Nk]
    return m.repeat_interleave(G, 1)


def oracle(p: Problem, extra: Optional[torch.Tensor] = None, *, dtype=torch.float64) -> torch.Tensor:
    """Dense float64 attention with hidden rows giving zero, optionally under an extra bool mask."""
    mask = p.attn_mask
    vis = p.visibility()
    if extra is not None:
        vis = vis & extra
    allowed, bias = mask_parts(mask)
    if bias is not None:
        mask = torch.where(vis, bias.double(), float("-inf"))
    else:
        mask = vis
    return dense_attention(p.q.to(dtype), p.k.to(dtype), p.v.to(dtype), attn_mask=mask)


def tolerance(dtype: torch.dtype) -> dict:
    return {torch.float64: dict(atol=1e-9, rtol=1e-9),
            torch.float32: dict(atol=2e-5, rtol=2e-5),
            torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}[dtype]
