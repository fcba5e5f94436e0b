"""Exact sliding-window attention, op level, side by side in one process (issue #14): PISA's
Triton window path (``window_blocks`` lists + the attention kernels), FlexAttention over the
window's blocks (PyTorch's block-sparse path; what the op runs for a window without a key
mask), and dense SDPA under the window's ``[N, N]`` mask (what a call falls back to; K/V repeated to
the query heads beforehand).

Standard shape (bf16, Hq=32, Hkv=8, D=128), forward and forward+backward, without and with a
left-padding key mask (the first ``--pad`` keys of row 0 masked). Median of
``triton.testing.do_bench``; the outputs are compared with the dense one over the rows that
see a key.

    python -m benchmarks.bench_window --json profiles/bench_window.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def _cases(n: int, window: int, pad: int, backward: bool):
    from pisa_compile import PisaConfig, pisa_attention
    from pisa_compile.kernels.geometry import dense_mask
    from pisa_compile.kernels.window import window_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_(backward) for h in (32, 8, 8))
    km = None
    if pad:
        km = torch.ones(1, n, dtype=torch.bool, device="cuda")
        km[0, :pad] = False
    scale = 128 ** -0.5
    mask = dense_mask(1, n, n, True, 0, km, device="cuda", window=window)
    # K/V repeated per query head: SDPA's memory-efficient kernel reads a mask but takes no
    # enable_gqa, and the math kernel would build every score (128 GiB at 32K).
    k_rep, v_rep = (t.detach().repeat_interleave(4, dim=1).requires_grad_(backward)
                    for t in (k, v))
    triton_cfg = PisaConfig(kernel="triton", min_seq_len=0)
    return mask, {
        "pisa_triton_window": lambda: pisa_attention(
            q, k, v, is_causal=True, window=window, key_mask=km, scale=scale, enable_gqa=True,
            config=triton_cfg),
        "flex_window": lambda: window_attention(q, k, v, window=window, causal_offset=0,
                                                key_mask=km, scale=scale, enable_gqa=True),
        "dense_sdpa_masked": lambda: F.scaled_dot_product_attention(
            q, k_rep, v_rep, attn_mask=mask, scale=scale),
    }, (q, k, v, k_rep, v_rep)


def run(n: int, window: int, pad: int, backward: bool) -> dict:
    from triton.testing import do_bench
    mask, fns, inputs = _cases(n, window, pad, backward)
    seen = mask.any(-1)[0, 0]  # rows that see a key
    want = fns["dense_sdpa_masked"]().detach()
    row = dict(n=n, window=window, pad=pad, backward=backward)
    for name, f in fns.items():
        out = f()
        row[f"{name}_max_abs_vs_dense"] = float((out.detach() - want)[:, :, seen].abs().max())
        if backward:
            go = torch.randn_like(out)

            def step(f=f, go=go):
                for t in inputs:
                    t.grad = None
                f().backward(go)
            row[f"{name}_ms"] = do_bench(step, warmup=5, rep=50)
        else:
            with torch.no_grad():
                row[f"{name}_ms"] = do_bench(f, warmup=5, rep=50)
        print(name, row[f"{name}_ms"], flush=True)
    row["speedup_vs_dense"] = row["dense_sdpa_masked_ms"] / row["pisa_triton_window_ms"]
    row["speedup_vs_flex"] = row["flex_window_ms"] / row["pisa_triton_window_ms"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--pad", type=int, default=3072, help="left padding of the masked case")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for n in args.lengths:
        for pad in (0, args.pad):
            for backward in (False, True):
                rows.append(run(n, args.window, pad, backward))
                print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           shape="B=1 Hq=32 Hkv=8 D=128 bf16", rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
