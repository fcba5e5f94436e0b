"""The key mask (``key_mask [B, Nk]``, padding) as the Triton kernels read it.

A tokenizer's ``attention_mask`` is one run of real tokens per row (left or right padding,
or none). :func:`key_mask_args` finds, per batch row, the first live key, one past the last,
and whether the live keys form that one run (one small kernel over the mask); a kernel then
tests ``lo <= key < hi`` in registers instead of loading the mask per key, whose latency
sat in front of every K/V tile load (an all-ones mask cost the forward 13% at 32K on the
H200, ``profiles/bench_stages_key_mask.json``). A row that is not one run (holes: packed
sequences, arbitrary masks) is read per key as before.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .runtime import launcher

__all__ = ["key_mask_args", "key_run", "live_keys"]


@triton.jit
def _key_runs_kernel(KM, Out, Nk, skmb, skmn, BLOCK: tl.constexpr):
    """Row ``b`` of ``KM``: ``Out[b] = (first live key, one past the last, one run?)``."""
    b = tl.program_id(0).to(tl.int64)
    offs0 = tl.arange(0, BLOCK)
    lo = tl.full([BLOCK], Nk, tl.int32)
    hi = tl.zeros([BLOCK], tl.int32)
    n = tl.zeros([BLOCK], tl.int32)
    for s in range(0, Nk, BLOCK):
        offs = s + offs0
        live = tl.load(KM + b * skmb + offs.to(tl.int64) * skmn, mask=offs < Nk, other=0) != 0
        lo = tl.minimum(lo, tl.where(live, offs, Nk))
        hi = tl.maximum(hi, tl.where(live, offs + 1, 0))
        n += live.to(tl.int32)
    lo_s = tl.min(lo, 0)
    hi_s = tl.max(hi, 0)
    one_run = tl.sum(n, 0) == tl.maximum(hi_s - lo_s, 0)  # an empty row is an empty run
    tl.store(Out + b * 3, lo_s)
    tl.store(Out + b * 3 + 1, hi_s)
    tl.store(Out + b * 3 + 2, one_run.to(tl.int32))


def key_mask_args(key_mask: Optional[Tensor], q: Tensor, Nk: int):
    """What the kernels take for a key mask: ``(km, runs, (stride_b, stride_n, runs_stride_b),
    has_key_mask)``.

    Args:
        key_mask: None, or bool/integer ``[B, Nk]`` or ``[1, Nk]`` (nonzero = live key).
        q: ``[B, ...]``, the call's queries (stands in for absent tensors: never read).
        Nk: keys of the call.

    Returns:
        ``km`` uint8 ``[B, Nk]`` (a value cast: Inductor cannot lower bool->uint8 views),
        ``runs`` int32 ``[B, 3]``: first live key, one past the last live key, and 1 where
        the live keys of the row are exactly that run (else read ``km`` per key); strides
        (batch strides 0 for a mask shared by the batch); whether there is a key mask.

    Raises:
        ValueError: ``key_mask`` is not ``[B, Nk]`` or ``[1, Nk]``.
    """
    if key_mask is None:
        return q, q, (0, 0, 0), False
    if key_mask.dim() != 2 or key_mask.shape[1] != Nk or key_mask.shape[0] not in (1, q.shape[0]):
        raise ValueError(f"key_mask must be [B={q.shape[0]}, Nk={Nk}], got shape "
                         f"{tuple(key_mask.shape)}")
    km = key_mask.to(torch.uint8)
    runs = torch.empty(km.shape[0], 3, dtype=torch.int32, device=km.device)
    launcher(_key_runs_kernel, q)[(km.shape[0],)](
        km, runs, Nk, km.stride(0), km.stride(1),
        BLOCK=min(4096, max(16, triton.next_power_of_2(Nk))), num_warps=8)
    shared = km.shape[0] == 1
    return km, runs, (0 if shared else km.stride(0), km.stride(1), 0 if shared else 3), True


@triton.jit
def key_run(KeyRun, b, skrb, HAS_KEY_MASK: tl.constexpr):
    """``(lo, hi, one_run)`` of batch row ``b`` (from :func:`key_mask_args`'s ``runs``);
    zeros without a key mask. Load once per program, outside the key loop."""
    lo = 0
    hi = 0
    one_run = 0
    if HAS_KEY_MASK:
        p = KeyRun + b.to(tl.int64) * skrb
        lo = tl.load(p)
        hi = tl.load(p + 1)
        one_run = tl.load(p + 2)
    return lo, hi, one_run


@triton.jit
def live_keys(kpos, kvalid, km_row, skmn, lo, hi, one_run, HAS_KEY_MASK: tl.constexpr):
    """``kvalid`` without the padding keys: a range test where the row's live keys are one
    run, else the mask read per key (``km_row``: this batch row of ``km``)."""
    if HAS_KEY_MASK:
        if one_run != 0:
            kvalid = kvalid & (kpos >= lo) & (kpos < hi)
        else:
            km = tl.load(km_row + kpos.to(tl.int64) * skmn, mask=kvalid, other=0)
            kvalid = kvalid & (km != 0)
    return kvalid
