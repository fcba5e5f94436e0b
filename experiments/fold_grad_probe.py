"""Which part of the dense tail's masked GQA fold loses gradients under torch.compile on the
GPU (experiments/tail_grad_probe.py: compiled dq wrong for every query head but head 0). Each variant runs eager and compiled (Inductor) on the same inputs; printed:
relative error of the compiled dq/dk/dv against the variant's own eager gradients.

    PYTHONPATH=. python -m experiments.fold_grad_probe
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    return round(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item(), 4)


def main() -> int:
    from pisa_compile import ops
    from pisa_compile.kernels.geometry import dense_mask

    n, G, T, D = 4096, 4, 64, 64
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(1, h, n, D, device=DEV, dtype=torch.bfloat16, generator=g)
               .requires_grad_() for h in (2 * G, 2, 2))
    km = torch.ones(1, n, dtype=torch.bool, device=DEV)
    km[0, :100] = False
    go = torch.randn(1, 2 * G, T, D, device=DEV, dtype=torch.bfloat16, generator=g)
    s = D ** -0.5

    def fold(qt, k, v, m, contiguous_out=False):
        B, Hq, Nq, _ = qt.shape
        rows = qt.reshape(B, 2, G * Nq, D)
        mask = m.expand(B, 1, Nq, n).unsqueeze(2).expand(-1, -1, G, -1, -1)
        mask = mask.reshape(B, 1, G * Nq, n)
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=s)
        if contiguous_out:
            out = out.contiguous()
        return out.reshape(B, Hq, Nq, D)

    def repeat(qt, k, v, m):
        return F.scaled_dot_product_attention(qt, k.repeat_interleave(G, 1),
                                              v.repeat_interleave(G, 1), attn_mask=m, scale=s)

    def mask_of(key_mask, rows=T):
        return dense_mask(1, rows, n, True, n - rows, key_mask, DEV)

    variants = {
        "op _dense_sdpa (fold), tail slice in a cat": lambda q, k, v: torch.cat(
            [q[:, :, :-T] * 2, ops._dense_sdpa(q[:, :, -T:], k, v, mask_of(km), False, s, True,
                                                T + 64)], 2)[:, :, -T:],
        "fold, tail slice in a cat": lambda q, k, v: torch.cat(
            [q[:, :, :-T] * 2, fold(q[:, :, -T:], k, v, mask_of(km))], 2)[:, :, -T:],
        "fold, contiguous tail, in a cat": lambda q, k, v: torch.cat(
            [q[:, :, :-T] * 2, fold(q[:, :, -T:].contiguous(), k, v, mask_of(km))], 2)[:, :, -T:],
        "fold, out contiguous, in a cat": lambda q, k, v: torch.cat(
            [q[:, :, :-T] * 2, fold(q[:, :, -T:], k, v, mask_of(km), True)], 2)[:, :, -T:],
        "fold, tail slice, no cat": lambda q, k, v: fold(q[:, :, -T:], k, v, mask_of(km)),
        "fold, no mask padding (causal offset only)": lambda q, k, v: fold(
            q[:, :, -T:], k, v, mask_of(None)),
        "repeat K/V, tail slice in a cat": lambda q, k, v: torch.cat(
            [q[:, :, :-T] * 2, repeat(q[:, :, -T:], k, v, mask_of(km))], 2)[:, :, -T:],
        "repeat K/V + contiguous grad, tail slice in a cat": lambda q, k, v: torch.cat(
            [q[:, :, :-T] * 2, ops._ContiguousGrad.apply(repeat(q[:, :, -T:], k, v,
                                                                 mask_of(km)))], 2)[:, :, -T:],
        "op _dense_sdpa (repeat: G*rows over the fold bound), tail slice in a cat":
            lambda q, k, v: torch.cat([q[:, :, :-T] * 2, ops._dense_sdpa(
                q[:, :, -T:], k, v, mask_of(km), False, s, True)], 2)[:, :, -T:],
        "op _dense_sdpa (fold), whole call of 512 rows": lambda q, k, v: ops._dense_sdpa(
            q[:, :, :512], k[:, :, :512], v[:, :, :512],
            dense_mask(1, 512, 512, True, 0, km[:, :512], DEV), False, s, True)[:, :, -T:],
    }
    for name, fn in variants.items():
        try:
            want = torch.autograd.grad(fn(q, k, v), (q, k, v), go)
            torch._dynamo.reset()
            got_out = torch.compile(fn, fullgraph=True)(q, k, v)
            got = torch.autograd.grad(got_out, (q, k, v), go)
            print(f"{name}: out {_rel(got_out, fn(q, k, v))} dq {_rel(got[0], want[0])} "
                  f"dk {_rel(got[1], want[1])} dv {_rel(got[2], want[2])}", flush=True)
        except Exception as e:  # noqa: BLE001 (a probe: report and go on)
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
