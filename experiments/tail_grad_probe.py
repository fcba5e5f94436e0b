"""Localise the GPU gradient mismatch of the dense tail
(tests/gpu/test_pisa_compile_gpu.py::test_dense_tail_flash_matches_the_masked_path_under_compile):
per-head relative errors of dq, dk, dv against SDPA under the tail's explicit mask, for the
flash and masked tail paths, eager and compiled, and for the two tail helpers called directly.

    PYTHONPATH=. python -m experiments.tail_grad_probe
"""

from __future__ import annotations

import torch


def _rel(a, b):
    return round(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item(), 4)


def main() -> int:
    from pisa_compile import PisaConfig, ops, pisa_attention
    from pisa_compile.kernels.geometry import dense_mask

    n, G, T = 4096, 4, 64
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(1, h, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for h in (2 * G, 2, 2))
    cfg = PisaConfig(block_size=64, top_k=4, query_tile=64, min_seq_len=0, dense_tail=T)
    km = torch.ones(1, n, dtype=torch.bool, device="cuda")
    km[0, :100] = False
    go = torch.randn(1, 2 * G, T, 64, device="cuda", dtype=torch.bfloat16, generator=g)

    def want(key_mask):
        m = dense_mask(1, T, n, True, n - T, key_mask, "cuda")
        out = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, -T:], k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=m)
        return out, torch.autograd.grad(out, (q, k, v), go)

    def report(name, out, got, ref):
        w_out, w = ref
        dq = [_rel(got[0][:, h, -T:], w[0][:, h, -T:]) for h in range(2 * G)]
        print(f"{name}: out {_rel(out, w_out)} dq {_rel(got[0], w[0])} per head {dq} "
              f"dk {_rel(got[1], w[1])} dv {_rel(got[2], w[2])}", flush=True)

    # The helpers directly, on the sliced q the op passes and on a contiguous copy.
    ref = want(None)
    for label, qq in (("slice", q[:, :, -T:]), ("contiguous", q[:, :, -T:].contiguous())):
        out = ops._flash_lower_right(qq, k, v, 64 ** -0.5)
        report(f"_flash_lower_right({label})", out, torch.autograd.grad(out, (q, k, v), go), ref)
    for key_mask in (None, km):
        ref = want(key_mask)
        out = ops._dense(q[:, :, -T:], k, v, None, key_mask, True, n - T, None, 64 ** -0.5,
                         True, max_rows=T + 64)
        report(f"_dense(key_mask={key_mask is not None})", out,
               torch.autograd.grad(out, (q, k, v), go), ref)

        def f(q, k, v, key_mask):
            return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=cfg,
                                  key_mask=key_mask)

        for label, fn in (("eager", f), ("compiled", torch.compile(f, fullgraph=True)),
                          ("dynamic", torch.compile(f, fullgraph=True, dynamic=True))):
            torch._dynamo.reset()
            out = fn(q, k, v, key_mask)[:, :, -T:]
            report(f"pisa_attention {label} key_mask={key_mask is not None}", out,
                   torch.autograd.grad(out, (q, k, v), go), ref)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
