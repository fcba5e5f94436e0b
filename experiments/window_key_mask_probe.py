"""Where an all-ones key mask's time goes on the window path (issue #14; GPU experiment, not
part of the package): the Triton window forward at 32K, window 4096, head dim 64 (the
Mistral-shaped layer's shape), with ``key_mask`` all ones and without, each call's device
kernels from ``torch.profiler`` (mean microseconds per call over ``--calls`` calls).

    PYTHONPATH=. python -m experiments.window_key_mask_probe --json OUT.json

On an H100 (5 December 2026, ``profiles/window_key_mask_split.json``) it showed that the
launch for the programs with no key-masked key ran 7-11% slower than the same loop without a
key mask while its rows were masked by a loaded value before the loop (3.67-3.71 against
3.35-3.41 ms), and 3.14-3.19 ms once they were masked only at the stores.
"""

from __future__ import annotations

import argparse
import json

import torch


def _kernels(fn, calls: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = e.device_time_total
        if us:
            out[e.key[:80]] = dict(us_per_call=round(us / calls, 1), count=e.count // calls)
    # Launches of one kernel in call order (the window path's two forward launches apart).
    fwd = [round(e.device_time_total, 1) for e in prof.events()
           if e.name == "_fwd_kernel" and e.device_time_total]
    per = len(fwd) // calls
    launches = [round(sum(fwd[i::per]) / calls, 1) for i in range(per)] if per else []
    return dict(launches_us=launches,
                kernels=dict(sorted(out.items(), key=lambda kv: -kv[1]["us_per_call"])))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from pisa_compile.kernels import triton_attention as ta
    from pisa_compile.kernels.window import WINDOW_QUERY_TILE, window_blocks

    n, w, dev = 32768, 4096, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 64, device=dev, dtype=torch.bfloat16, generator=g)
               for h in (32, 8, 8))
    bi, bc = window_blocks(n, n, w, 0, 64, WINDOW_QUERY_TILE, q.device)
    bi, bc = bi.expand(1, 8, *bi.shape), bc.expand(1, 8, *bc.shape)
    ones = torch.ones(1, n, dtype=torch.bool, device=dev)
    kw = dict(block_size=64, query_tile=WINDOW_QUERY_TILE, window=w)
    rows = {}
    for name, extra in (("key mask ones", dict(key_mask=ones)), ("no key mask", {})):
        rows[name] = _kernels(lambda: ta.sparse_attention(q, k, v, None, True, 0.125, bi, bc,
                                                          **kw, **extra), args.calls)
        print(name, json.dumps(rows[name], indent=1), flush=True)
    # The forward's launches spelled out, against one launch of every program unmasked
    # followed by the masked programs again (their rows computed twice).
    from triton.testing import do_bench

    from pisa_compile.kernels.runtime import launcher
    from pisa_compile.kernels.triton_util import LOG2E

    def launch(plan, key_mask):
        B, Hq, Hkv, Nq, Nk, D, Dv, bi_, bc_, mask, mstr, thr, meta = ta._common(
            q, k, v, None, True, bi, bc, 64, WINDOW_QUERY_TILE, None, key_mask, w)
        out = torch.empty(B, Hq, Nq, Dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
        launches = ta._fwd_launches(meta, bi_, bc_, mask[1])
        if plan == "twice" and len(launches) == 2:
            launches = [(0, bc_), launches[1]]  # every program unmasked, then the masked again
        for programs, counts in launches:
            km = meta["HAS_KEY_MASK"] and programs != 0
            launcher(ta._fwd_kernel, q)[(bi_.shape[2] * meta["N_SUB"], B * Hkv, 1)](
                q, k, v, *mask, bi_, counts, out, lse, out, lse,
                *q.stride(), *k.stride(), *v.stride(), *mstr, *out.stride(), *lse.stride(),
                *bi_.stride()[:3], *counts.stride(), Hkv, Nq, Nk, 0, w, 0.125 * LOG2E.value,
                thr, 0, 0, 0, SPLIT=False, KEY_MASK_PROGRAMS=programs,
                **{**meta, "HAS_KEY_MASK": km})
        return out

    pad = torch.ones(1, n, dtype=torch.bool, device=dev)
    pad[0, :3072] = False
    plans = {"two launches, programs told apart on the host": "split",
             "every program without the key mask, then the masked ones again": "twice"}
    ab = []
    for km_name, km in (("key mask ones", ones), ("left padding 3K", pad)):
        want = launch("split", km)
        for _ in range(2):
            for name, plan in plans.items():
                ms = do_bench(lambda: launch(plan, km))
                ab.append(dict(key_mask=km_name, plan=name, ms=round(ms, 4),
                               max_abs_diff=float((launch(plan, km) - want).abs().max())))
                print(ab[-1], flush=True)
    ab.append(dict(key_mask="none", plan="one launch", ms=round(do_bench(
        lambda: launch("split", None)), 4)))
    print(ab[-1], flush=True)
    record = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  rows=dict(rows, plans=ab))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
