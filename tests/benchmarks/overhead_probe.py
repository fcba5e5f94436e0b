"""GPU: where the time of one eager PISA forward goes at small N (torch.profiler table)."""
import sys
import torch
from torch.profiler import ProfilerActivity, profile
from pisa_compile import PisaConfig, pisa_attention

CFG = PisaConfig(min_seq_len=0)
for hq, hkv, d in ((32, 8, 128), (8, 2, 32)):
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    f = lambda: pisa_attention(q, k, v, is_causal=True, enable_gqa=True, config=CFG)  # noqa
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            f()
        torch.cuda.synchronize()
    print(f"== Hq={hq} Hkv={hkv} D={d} N={n}: 5 calls")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))
