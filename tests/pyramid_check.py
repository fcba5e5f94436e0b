"""A persistent pyramid against the pyramid built from scratch (CPU interpreter and GPU tests)."""

from __future__ import annotations

import torch

from pisa_compile import PisaKVCache
from pisa_compile.kernels import triton_pyramid as tp
from pisa_compile.kernels import triton_select as ts
from pisa_compile.kernels.geometry import level_sizes


def _scratch_levels(k, key_mask, C, g, beam, dtype):
    """The box levels of a pyramid built from scratch over ``k`` (``box_buffers``)."""
    n = k.shape[2]
    live = None if key_mask is None else key_mask[:, None, :n].to(torch.uint8)
    _, cnt, _, total = tp.pyramid_buffers(k, C, g, beam, key_live=live)
    hi, lo, lc, *_ = ts.box_buffers(k, cnt, total, C, C, g, beam, dtype,
                                    key_live=None if key_mask is None else key_mask[:, None, :n])
    out, off = [], 0
    for size in level_sizes(n, C, g, beam):
        out.append((hi[:, :, off:off + size], lo[:, :, off:off + size], lc[:, :, off:off + size]))
        off += size
    return out


def assert_pyramid_is_scratch(cache: PisaKVCache):
    pyr, n = cache.pyramid, cache.length
    km = None if cache.key_mask is None else cache.key_mask[:, :n]
    want = _scratch_levels(cache.keys[:, :, :n], km, pyr.block_size, pyr.branching, pyr.beam,
                           cache.keys.dtype)
    for lev, (off, (hi, lo, lc)) in enumerate(zip(pyr.level_offsets(), want)):
        size = hi.shape[2]
        assert torch.equal(pyr.hi[:, :, off:off + size], hi), f"level {lev} hi after {n} keys"
        assert torch.equal(pyr.lo[:, :, off:off + size], lo), f"level {lev} lo after {n} keys"
        # log2 of the counts: the GPU's tl.log2 is not torch's to the last bit.
        torch.testing.assert_close(pyr.lc[:, :, off:off + size], lc, rtol=1e-6, atol=0,
                                   msg=f"level {lev} lc after {n} keys")
