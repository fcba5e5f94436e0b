"""PisaKVCache on the GPU (bf16): the persistent pyramid after a prefill and decode appends is
the pyramid built from scratch, decode selects as the from-scratch selection does, the exact
regime equals dense SDPA, padding never leaks, and a step can be captured in a CUDA graph.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from pisa_compile import PisaConfig, PisaKVCache  # noqa: E402
from pisa_compile.kernels import triton_select as ts  # noqa: E402
from pisa_compile.kernels.geometry import dense_mask  # noqa: E402
from tests.pyramid_check import assert_pyramid_is_scratch  # noqa: E402

pytestmark = pytest.mark.gpu
B, HKV, G, D = 2, 8, 4, 128


def _filled(n0, steps, cfg, pad=(0, 1000), seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cap = n0 + steps
    k = torch.randn(B, HKV, cap, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(B, HKV, cap, D, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(B, HKV * G, cap, D, device="cuda", generator=g).to(torch.bfloat16)
    cache = PisaKVCache(B, HKV, cap, D, dtype=torch.bfloat16, device="cuda", config=cfg,
                        sparse_from=0)
    km = torch.ones(B, n0, dtype=torch.bool, device="cuda")
    for b, p in enumerate(pad):
        km[b, :p] = False
    for i in range(0, n0, 8192):
        cache.append(k[:, :, i:i + 8192][:, :, :n0 - i], v[:, :, i:i + 8192][:, :, :n0 - i],
                     km[:, i:i + 8192])
    return cache, q, k, v


def test_decode_steps_match_scratch():
    """Step by step appends give the pyramid, and the selection, of one append of every key;
    the pyramid is the from-scratch one (its log counts to rounding: tl.log2 on the GPU), and
    the selection the from-scratch selection's but for near-ties."""
    cfg = PisaConfig()
    n0, steps = 20000, 12
    cache, q, k, v = _filled(n0, steps, cfg)
    differ = 0
    for s in range(steps):
        n = n0 + s
        if s:
            cache.append(k[:, :, n - 1:n], v[:, :, n - 1:n])
        qs = q[:, :, n - 1:n]
        got = cache.select(qs)
        once = PisaKVCache(B, HKV, n, D, dtype=torch.bfloat16, device="cuda", config=cfg,
                           sparse_from=0)
        once.append(k[:, :, :n], v[:, :, :n], cache.key_mask[:, :n])
        want = once.select(qs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {s}"
        scratch = ts.select_blocks(qs, k[:, :, :n], True, D ** -0.5,
                                   key_mask=cache.key_mask[:, :n], causal_offset=n - 1,
                                   **cache.decode_config.selection_options())
        differ += int((got[0] != scratch[0]).any(-1).sum())
    assert differ <= 0.02 * steps * B * HKV, f"{differ} tiles differ from the scratch selection"
    assert_pyramid_is_scratch(cache)


def test_exact_regime_equals_dense():
    cfg = PisaConfig(top_k=128, block_size=64)
    n0 = 4096
    cache, q, k, v = _filled(n0, 1, cfg, pad=(0, 300))
    qs = q[:, :, n0 - 1:n0]
    out = cache.attend(qs)
    mask = dense_mask(B, 1, n0, True, n0 - 1, cache.key_mask[:, :n0])
    want = F.scaled_dot_product_attention(qs, k[:, :, :n0], v[:, :, :n0], attn_mask=mask,
                                          enable_gqa=True)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


def test_padding_never_leaks_and_graph_capture():
    """Padded keys poisoned before they are appended (huge keys, NaN values): the pyramid,
    the selection and the output are bit-identical."""
    cfg = PisaConfig()
    outs = []
    g = torch.Generator(device="cuda").manual_seed(1)
    n0 = 40000
    k = torch.randn(B, HKV, n0, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(B, HKV, n0, D, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(B, HKV * G, n0, D, device="cuda", generator=g).to(torch.bfloat16)
    km = torch.ones(B, n0, dtype=torch.bool, device="cuda")
    km[1, :3000] = False
    for poison in (False, True):
        kk, vv = k.clone(), v.clone()
        if poison:
            kk[1, :, :3000] = 100.0
            vv[1, :, :3000] = float("nan")
        cache = PisaKVCache(B, HKV, n0, D, dtype=torch.bfloat16, device="cuda", config=cfg,
                            sparse_from=0)
        for i in range(0, n0, 8192):
            cache.append(kk[:, :, i:i + 8192], vv[:, :, i:i + 8192], km[:, i:i + 8192])
        qs = q[:, :, n0 - 1:n0].clone()
        outs.append(cache.attend(qs))
    assert torch.equal(outs[0], outs[1])
    # One decode step in a CUDA graph (static shapes, no host synchronisation).
    static_q = qs.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cache.attend(static_q)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = cache.attend(static_q)
    static_q.copy_(q[:, :, 100:101])
    graph.replay()
    torch.testing.assert_close(static_out, cache.attend(static_q), atol=0, rtol=0)
