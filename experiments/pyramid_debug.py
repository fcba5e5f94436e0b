"""Debug: a persistent pyramid (stepwise and one-shot appends) against the scratch boxes, GPU."""
import torch
from pisa_compile import PisaConfig, PisaKVCache
from tests.pyramid_check import _scratch_levels

B, HKV, D = 2, 8, 128
torch.manual_seed(0)
n0 = 20000
k = torch.randn(B, HKV, n0 + 12, D, device="cuda").to(torch.bfloat16)
km = torch.ones(B, n0, dtype=torch.bool, device="cuda")
km[1, :1000] = False
for chunk in (8192, 20000, 64, 1):
    c = PisaKVCache(B, HKV, n0, D, device="cuda", config=PisaConfig(), sparse_from=0)
    for i in range(0, n0, chunk):
        c.append(k[:, :, i:i + chunk][:, :, :n0 - i], k[:, :, i:i + chunk][:, :, :n0 - i],
                 km[:, i:i + chunk])
    torch.cuda.synchronize()
    pyr = c.pyramid
    want = _scratch_levels(c.keys[:, :, :n0], km, 64, 2, pyr.beam, torch.bfloat16)
    for lev, (off, (hi, lo, lc)) in enumerate(zip(pyr.level_offsets(), want)):
        size = hi.shape[2]
        got = pyr.hi[:, :, off:off + size]
        bad = (got != hi).any(-1)
        print("chunk", chunk, "level", lev, "mismatching nodes", int(bad.sum()),
              "cnt diff", float((pyr.cnt[:, :, off:off + size] - torch.exp2(lc)).abs().nan_to_num().max()))
        if bad.any():
            b, h, i = (int(x) for x in bad.nonzero()[0])
            print("  first", b, h, i, "got", got[b, h, i, :6].tolist(), "want", hi[b, h, i, :6].tolist())
            offc = pyr.level_offsets()[lev - 1]
            print("  children", pyr.hi[b, h, offc + 2 * i, :6].tolist(), pyr.hi[b, h, offc + 2 * i + 1, :6].tolist(),
                  "cnt", pyr.cnt[b, h, offc + 2 * i].item(), pyr.cnt[b, h, offc + 2 * i + 1].item())
            print("  bad nodes (b,h,i) up to 8:", bad.nonzero()[:8].tolist())
