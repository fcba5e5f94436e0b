"""The Triton selection against a baseline copy of its module, side by side in one process
(GPU experiment, not part of the package).

The defaults' selection (``PisaConfig()``: the flat kernel up to ``flat_leaves``, the walk
past it, then the exact rescoring) on the standard shape (32 query / 8 KV heads of 128) at
16K, 32K (with and without an all-ones key mask) and 128K, on the Llama-1B shape (32 / 8
heads of 64) at 32K and on Qwen2.5-Coder-0.5B's (14 / 2 heads of 64, G = 7) at 30K; bf16,
causal, random q/k. Each call
is timed for both modules (``triton.testing.do_bench``, medians of three, alternating), and
their block lists are compared (``tiles_equal``: the share of (batch, KV head, query tile)
rows whose blocks are the same).

    git show REV:pisa_compile/kernels/triton_select.py > experiments/_select_base.py
    PYTHONPATH=. python -m experiments.select_ab --baseline experiments/_select_base.py \\
        --json $OUT/select_ab.json
"""

from __future__ import annotations

import argparse
import json

import torch

from experiments.attention_ab import _load


def _cases(dev):
    g = torch.Generator(device=dev).manual_seed(0)

    def qk(Hq, Hkv, n, D):
        return tuple(torch.randn(1, h, n, D, device=dev, dtype=torch.bfloat16, generator=g)
                     for h in (Hq, Hkv))

    for n in (16384, 32768):
        q, k = qk(32, 8, n, 128)
        yield f"standard shape, {n // 1024}K", q, k, None
        if n == 32768:
            yield (f"standard shape, {n // 1024}K, key mask ones", q, k,
                   torch.ones(1, n, dtype=torch.bool, device=dev))
    q, k = qk(32, 8, 131072, 128)
    yield "standard shape, 128K (the walk)", q, k, None
    del q, k
    q, k = qk(32, 8, 32768, 64)
    yield "Llama-1B shape (32/8 heads of 64), 32K", q, k, None
    q, k = qk(14, 2, 30000, 64)
    yield "Qwen2.5-0.5B shape (14/2 heads of 64), 30K", q, k, None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a copy of triton_select.py")
    p.add_argument("--tuning", type=json.loads, action="append", default=None,
                   help="select_blocks tuning of an extra row per case (JSON; repeatable)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    from triton.testing import do_bench

    from pisa_compile import PisaConfig
    from pisa_compile.kernels import triton_select as new

    old = _load(args.baseline)
    opts = PisaConfig().selection_options()
    rows = []
    for name, q, k, km in _cases("cuda"):
        scale = q.shape[-1] ** -0.5

        def call(mod, tuning=None):
            return mod.select_blocks(q, k, True, scale, **opts, key_mask=km, tuning=tuning)

        (i_new, c_new), (i_old, c_old) = call(new), call(old)
        same = (i_new == i_old).all(-1) & (c_new == c_old)
        variants = {"baseline": lambda: call(old), "new": lambda: call(new)}
        for tu in args.tuning or []:
            variants[f"new {json.dumps(tu)}"] = lambda tu=tu: call(new, tu)
        ms = {key: [] for key in variants}
        for _ in range(3):  # alternate, so drift hits all alike
            for key, f in variants.items():
                ms[key].append(do_bench(f))
        row = dict(case=name, **{key: round(sorted(x)[1], 3) for key, x in ms.items()},
                   tiles_equal=round(same.float().mean().item(), 6))
        row["speedup"] = round(row["baseline"] / row["new"], 3)
        rows.append(row)
        print(row, flush=True)
    from benchmarks.bench_select import compiled_info
    kernels = {f"{tag} {name}": compiled_info(getattr(mod, name)) for tag, mod in
               (("baseline", old), ("new", new))
               for name in ("_select_kernel", "_flat_kernel", "_rescore_kernel")}
    print(kernels, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           options=opts, rows=rows, compiled=kernels), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
