"""GPU: where the host time of one eager PISA forward goes at small N.

    python -m benchmarks.overhead_probe 8192            # torch.profiler tables
    python -m benchmarks.overhead_probe 8192 --cprofile # Python call tree

The profiler tables give GPU time per kernel and self CPU time per PISA range; ``--cprofile``
runs 200 calls under cProfile and prints the 25 most expensive functions (cumulative), which
is where the per-call host overhead (launch path, custom-op boundary) shows up.
"""

import cProfile
import pstats
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from pisa_compile import PisaConfig, pisa_attention

CFG = PisaConfig.preset("fast", min_seq_len=0)


def profile_tables(fn, repeats: int, sorts=(("self_cpu_time_total", 14),
                                             ("self_cuda_time_total", 8))) -> None:
    """Run ``fn`` ``repeats`` times under torch.profiler (CPU and CUDA) and print one
    key-averages table per ``(sort key, rows)``."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    for key, rows in sorts:
        print(p.key_averages().table(sort_by=key, row_limit=rows), flush=True)


def main(argv):
    n = int(argv[0]) if argv else 8192
    for hq, hkv, d in ((32, 8, 128), (8, 2, 32)):
        q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def f():
            return pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=CFG)
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        print(f"== Hq={hq} Hkv={hkv} D={d} N={n}")
        if "--cprofile" in argv:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                f()
            torch.cuda.synchronize()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
            continue
        profile_tables(f, 5)


if __name__ == "__main__":
    main(sys.argv[1:])
