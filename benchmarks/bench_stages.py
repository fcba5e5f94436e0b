"""Where the time of one PISA forward goes: GPU time per kernel (pyramid, boxes, selection walk,
exact rescoring, attention, glue), from ``torch.profiler``, for option sets of
``eval_llm.CANDIDATES``, with dense SDPA's kernels in the same process for scale.

    python -m benchmarks.bench_stages [--sizes 32768 131072] [--options defaults fast]
        [--backward] [--key-mask] [--json profiles/bench_stages.json]

Shape: ``bench_pisa.py``'s standard shape (B=1, Hq=32, Hkv=8, D=128, bf16, causal). The
per-kernel times are profiler device times averaged over ``--iters`` calls; their sum is close
to, not equal to, ``do_bench``'s wall time (launch gaps are not counted).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from benchmarks.bench_options import add_options_arg, option_calls
from benchmarks.bench_pisa import HKV, HQ, D, inputs
from benchmarks.eval_llm import CANDIDATES
from torch.profiler import ProfilerActivity, profile


def kernel_ms(fn, iters: int) -> dict[str, float]:
    """Mean GPU ms per call of each kernel ``fn`` launches (name -> ms), largest first."""
    for _ in range(3):  # compile and warm the caches outside the trace
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name[:80]] += ev.device_time / 1e3 / iters  # us -> ms
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[32768, 131072])
    add_options_arg(ap, ["defaults", "fast"])
    ap.add_argument("--backward", action="store_true", help="profile forward+backward")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows: dict = {}
    for n in args.sizes:
        q, k, v = inputs(n, grad=args.backward)
        do = torch.randn_like(q)
        for name, f in option_calls(ap, args.options, q, k, v, args.key_mask).items():
            if args.backward:
                call = lambda f=f: f().backward(do)  # noqa: E731
            else:
                call = f
            with torch.set_grad_enabled(args.backward):
                ms = kernel_ms(call, args.iters)
            rows[f"N={n // 1024}K {name}"] = {"total_ms": sum(ms.values()), "kernels": ms}
            print(f"N={n // 1024}K {name}: {sum(ms.values()):.2f} ms", flush=True)
            for kname, t in list(ms.items())[:8]:
                print(f"    {t:8.3f}  {kname}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": dict(B=1, Hq=HQ, Hkv=HKV, D=D, dtype="bfloat16", causal=True),
                       "backward": args.backward, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__,
                       "options": {o: CANDIDATES[o] for o in args.options}, "rows": rows},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
