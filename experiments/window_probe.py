"""Localise the GPU mismatch of the traced FlexAttention window path with left padding
(tests/gpu/test_masks_gpu.py::test_window_op_with_padding_inside_the_windows[compiled]).

    PYTHONPATH=. python -m experiments.window_probe
"""

from __future__ import annotations

import torch


def main() -> int:
    from torch.nn.attention.flex_attention import flex_attention

    from pisa_compile.kernels.geometry import dense_mask
    from pisa_compile.kernels.window import window_block_mask

    N, W = 2048, 512
    am = torch.ones(2, N, dtype=torch.long, device="cuda")
    am[1, :700] = 0

    def lists(am):
        bm = window_block_mask(2, N, N, W, 0, am.bool(), am.device)
        return (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)

    eager = lists(am)
    traced = torch.compile(lists, fullgraph=True)(am)
    print("block lists equal (eager vs Inductor):", [torch.equal(a, b) for a, b in zip(eager, traced)])

    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, h, N, 64, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (8, 2, 2))
    m = dense_mask(2, N, N, True, 0, am.bool(), window=W)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    rows = m[:, 0].any(-1)

    def err(out):
        e = (out.float() - want.float()).abs().amax(-1).amax(1) * rows
        return round(e.max().item(), 4), e.flatten().argmax().item()

    def in_graph(q, k, v, am):
        return flex_attention(q, k, v, block_mask=window_block_mask(2, N, N, W, 0, am.bool(), q.device),
                              enable_gqa=True)

    def mask_outside(q, k, v, km):
        return flex_attention(q, k, v, block_mask=window_block_mask(2, N, N, W, 0, km, q.device),
                              enable_gqa=True)

    bm = window_block_mask(2, N, N, W, 0, am.bool(), q.device)
    print("eager lists, compiled flex:", err(torch.compile(flex_attention)(q, k, v, block_mask=bm, enable_gqa=True)))
    torch._dynamo.reset()
    print("all in one graph:", err(torch.compile(in_graph, fullgraph=True)(q, k, v, am)))
    torch._dynamo.reset()
    print("key mask a graph input:", err(torch.compile(mask_outside, fullgraph=True)(q, k, v, am.bool())))
    torch._dynamo.reset()
    print("one graph, aot_eager:", err(torch.compile(in_graph, fullgraph=True, backend="aot_eager")(q, k, v, am)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
