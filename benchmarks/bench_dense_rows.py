"""The rows PISA runs densely under a key mask: decode steps and the dense tail of a prefill,
with a tokenizer's ``attention_mask`` (all ones, or left padding), against SDPA under the
same mask, side by side in one process.

    python -m benchmarks.bench_dense_rows [--sizes 32768 131072] [--batches 1 8]
        [--json profiles/bench_dense_rows.json]

Shape: bf16, Hq=32, Hkv=8, D=128 (the standard shape), B and N as given; ``Nq`` = 1 (a
decode step) and 64 (the defaults' dense tail), aligned bottom-right (``causal_offset = N -
Nq``). Rows, median ms by ``triton.testing.do_bench``, no gradient:

- ``pisa``: ``pisa_attention`` with the defaults and ``key_mask`` (the split-K kernel over
  every key block);
- ``pisa, masked SDPA``: the same call with ``kernel="reference"``, which runs its dense rows
  through SDPA under the mask with the GQA group as rows (the path before the split-K one);
- ``SDPA, mask, repeat_kv``: what transformers' SDPA attention runs with a mask (K/V
  repeated to the query heads, a ``[B, 1, Nq, N]`` bool mask);
- ``SDPA, mask, enable_gqa``;
- ``SDPA, no mask``: the same rows without padding (FlashAttention), for scale;
- with ``--splits``, decode steps only: ``split-K xS``, the kernel behind ``pisa`` launched
  directly with ``S`` times its default number of slices per block list
  (``triton_decode.num_splits``: about two programs per SM), to tune that default.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pisa_compile import PisaConfig, pisa_attention
from pisa_compile.kernels.geometry import dense_mask

HQ, HKV, D = 32, 8, 128


def split_k_calls(q, k, v, key_mask, factors) -> dict:
    """``split-K xS``: ``decode_attention`` over every key block as ``pisa`` runs it, with
    ``S`` times the default number of slices."""
    from pisa_compile.kernels import triton_decode as td
    from pisa_compile.kernels.geometry import cdiv
    B, nq, n = q.shape[0], q.shape[2], k.shape[2]
    L = cdiv(n, 64)
    bi = torch.arange(L, device="cuda", dtype=torch.int32).expand(B, HKV, 1, L)
    bc = torch.full((B, HKV, 1), L, device="cuda", dtype=torch.int32)
    tq = PisaConfig().dense_tail + PisaConfig().query_tile
    base, _ = td.num_splits(B * HKV, L, q.device)  # one program per (batch, KV head)
    return {f"split-K x{f}": (lambda f=f: td.decode_attention(
        q, k, v, None, True, D ** -0.5, bi, bc, block_size=64, query_tile=tq,
        key_mask=key_mask, causal_offset=n - nq, n_splits=base * f)) for f in factors}


def calls(batch: int, n: int, nq: int, left_pad: int, factors=()) -> dict:
    """The timed callables of one case (see the module docstring)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, HQ, nq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(batch, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    key_mask = torch.ones(batch, n, dtype=torch.bool, device="cuda")
    key_mask[:, :left_pad] = False
    mask = dense_mask(batch, nq, n, True, n - nq, key_mask, q.device)
    mask = mask.view(batch, 1, nq, n)
    kr, vr = (t.repeat_interleave(HQ // HKV, 1) for t in (k, v))
    cfg = PisaConfig()
    kw = dict(is_causal=True, enable_gqa=True, key_mask=key_mask, causal_offset=n - nq)
    return {
        "pisa": lambda: pisa_attention(q, k, v, config=cfg, **kw),
        "pisa, masked SDPA": lambda: pisa_attention(q, k, v, config=cfg.replace(
            kernel="reference"), **kw),
        "SDPA, mask, repeat_kv": lambda: F.scaled_dot_product_attention(q, kr, vr,
                                                                        attn_mask=mask),
        "SDPA, mask, enable_gqa": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True),
        # FlashAttention's causal flag is bottom-right (SDPA's is top-left).
        "SDPA, no mask": lambda: torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, nq > 1, False, scale=D ** -0.5)[0],
        **(split_k_calls(q, k, v, key_mask, factors) if nq == 1 else {}),
    }, (q, k, v, key_mask, mask, kr, vr)


def main(argv=None) -> int:
    import triton.testing
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # From min_seq_len (32768) on: below it the op is masked SDPA, not the split-K kernel.
    ap.add_argument("--sizes", type=int, nargs="*", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="also time the split-K kernel with these multiples of its default "
                         "slices (e.g. 1 2 4 8)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows: dict = {}
    with torch.no_grad():
        for n in args.sizes:
            for batch in args.batches:
                for nq in (1, 64):
                    for left_pad in (0, n // 4):
                        fns, tensors = calls(batch, n, nq, left_pad, args.splits)
                        ref = fns["SDPA, mask, repeat_kv"]()
                        case = f"N={n // 1024}K B={batch} Nq={nq} left_pad={left_pad}"
                        row = {"max_abs_diff_pisa_vs_sdpa": float(
                            (fns["pisa"]().float() - ref.float()).abs().max())}
                        for name, f in fns.items():
                            row[name] = triton.testing.do_bench(f, warmup=25, rep=100,
                                                                return_mode="median")
                        rows[case] = row
                        print(case, {k: round(v, 4) for k, v in row.items()}, flush=True)
                        del fns, tensors
                        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"what": __doc__.split("\n\n")[0], "shape": dict(Hq=HQ, Hkv=HKV, D=D,
                                                                       dtype="bfloat16"),
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "ms": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
