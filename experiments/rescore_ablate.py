"""Where the exact rescoring kernel's time goes (GPU experiment, not part of the package).

A stand-alone copy of ``triton_select._rescore_kernel``'s core (per query tile: every row's
exact LSE over each shortlisted leaf, then the tile vote ``sum_r softmax``) with stages that
can be left out or changed, timed side by side at 32K on the standard shape with random
shortlists of 128 visible leaves per 16-query tile (the defaults' shape of work). Differences
between variants place the time (METHOD.md: leave a stage out, take the difference).

    PYTHONPATH=. python -m experiments.rescore_ablate --out $OUT/rescore_ablate.json
"""
import argparse
import json
import math

import torch
import triton
import triton.language as tl
from pisa_compile.kernels.triton_select import _leaf_lse2, _prioritise, _top_mask

LOG2E = 1.4426950408889634


@triton.jit
def _ablate_kernel(q_ptr, k_ptr, short_ptr, out_ptr, scr_ptr, Nq, Nk, T, Hkv, scale,
                   D: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr, C: tl.constexpr,
                   W: tl.constexpr, RB: tl.constexpr, STORE: tl.constexpr,
                   MASK: tl.constexpr, INDIRECT: tl.constexpr, EXP: tl.constexpr,
                   DOT: tl.constexpr, PAIR: tl.constexpr, FP8: tl.constexpr,
                   STAGES: tl.constexpr, LEAN: tl.constexpr, PKG_LSE: tl.constexpr,
                   IFWRAP: tl.constexpr, TAIL: tl.constexpr):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    tile = bh.to(tl.int64) * T + t
    q_first = t * TQ
    rr = tl.arange(0, RB)
    d = tl.arange(0, D)
    kc = tl.arange(0, C * PAIR)
    ws = tl.arange(0, W)
    short_row = short_ptr + tile * W
    ids = tl.load(short_row + ws)
    ok = ids >= 0
    n_ok = tl.sum(ok.to(tl.int32), axis=0)
    Hq = Hkv * G
    qbase = q_ptr + (b * Hq + h * G).to(tl.int64) * Nq * D
    kbase = k_ptr + bh.to(tl.int64) * Nk * D
    qk_scale = scale * 1.4426950408889634
    S = tl.zeros([W], dtype=tl.float32)
    scr = scr_ptr + tile * (W * RB)
    n_c = (TQ * G + RB - 1) // RB
    if IFWRAP:  # as the package: no scoring when every shortlisted leaf is picked
        n_c = tl.where(n_ok > 16, n_c, 0)
    for c in range(n_c):
        r = c * RB + rr
        qpos = q_first + r // G
        row_ok = qpos < Nq
        qv = tl.load(qbase + ((r % G) * Nq * D + qpos * D).to(tl.int64)[:, None] + d[None, :],
                     mask=row_ok[:, None], other=0.0)
        if FP8:
            qv = qv.to(tl.float8e4nv)
        s = tl.full([RB, W], float("-inf"), tl.float32)
        acc = tl.zeros([RB], dtype=tl.float32)
        for j in tl.range(0, n_ok, PAIR, num_stages=STAGES):
            if INDIRECT:
                if PAIR == 1:
                    kp = tl.load(short_row + j) * C + kc
                else:
                    lf = tl.load(short_row + j + kc // C, mask=j + kc // C < n_ok, other=0)
                    kp = lf * C + kc % C
            else:
                kp = (j * 7 % (Nk // C)) * C + kc
            kk = tl.load(kbase + kp.to(tl.int64)[:, None] * D + d[None, :], mask=kp[:, None] < Nk,
                         other=0.0)
            if FP8:
                kk = kk.to(tl.float8e4nv)
            if DOT and LEAN:
                sk = tl.dot(qv, tl.trans(kk))
            elif DOT:
                sk = tl.dot(qv, tl.trans(kk)) * qk_scale
            else:
                sk = tl.zeros([RB, C * PAIR], dtype=tl.float32) + tl.sum(kk.to(tl.float32), 1)[None, :]
            if MASK:
                sk = tl.where((kp[None, :] <= qpos[:, None]) & row_ok[:, None], sk,
                              float("-inf"))
            if PKG_LSE:
                lse = _leaf_lse2(qv, qpos, kbase, D, 1, kbase, 0, tl.load(short_row + j), Nk,
                                 q_first, 0, qk_scale, d, D, C, C, MASK, False, True)
                tl.store(scr + j * RB + rr, lse)
            elif LEAN:  # raw dot: max, then one FMA per score (scale and shift) before exp2
                m = tl.max(sk, axis=1) * qk_scale
                lse = m + tl.log2(tl.sum(tl.exp2(sk * qk_scale - m[:, None]), axis=1))
                tl.store(scr + j * RB + rr, lse)
            elif PAIR == 1:
                m = tl.max(sk, axis=1)
                mu = tl.where(m == float("-inf"), 0.0, m)
                if EXP:
                    lse = mu + tl.log2(tl.sum(tl.exp2(sk - mu[:, None]), axis=1))
                else:
                    lse = m
                if STORE == 0:
                    s = tl.where((ws == j)[None, :], lse[:, None], s)
                elif STORE == 1:
                    tl.store(scr + j * RB + rr, lse)
                else:
                    acc += lse
            else:
                s3 = tl.reshape(sk, [RB, PAIR, C])
                m = tl.max(s3, axis=2)
                mu = tl.where(m == float("-inf"), 0.0, m)
                lse = mu + tl.log2(tl.sum(tl.exp2(s3 - mu[:, :, None]), axis=2))  # [RB, PAIR]
                pp = tl.arange(0, PAIR)
                tl.store(scr + (j + pp)[None, :] * RB + rr[:, None], lse,
                         mask=(j + pp < n_ok)[None, :])
        if STORE == 1:
            tl.debug_barrier()
            s = tl.load(scr + ws[None, :] * RB + rr[:, None], mask=(ws < n_ok)[None, :],
                        other=float("-inf"))
        if STORE == 2:
            S += tl.sum(acc)
        else:
            s = tl.where(ok[None, :], s, float("-inf"))
            z = tl.max(s, axis=1)
            zs = tl.where(z == float("-inf"), 0.0, z)
            e = tl.exp2(s - zs[:, None])
            den = tl.sum(e, axis=1)
            w = tl.where(row_ok & (den > 0), 1.0 / tl.where(den > 0, den, 1.0), 0.0)
            S += tl.sum(e * w[:, None], axis=0)
    if TAIL:  # as the package: pick the top 16 by an all-pairs rank count
        bad = ok & (S < 0)
        S = tl.where(_top_mask(_prioritise(S, bad, ok), ok, 16, W), S, 0.0)
    tl.store(out_ptr + tile * W + ws, S)


VARIANTS = {  # name: (launch, kernel flags)
    "prod_w4": (dict(num_warps=4), dict(STORE=0)),
    "prod_w4_st2": (dict(num_warps=4), dict(STORE=0, STAGES=2)),
    "prod_w4_st4": (dict(num_warps=4), dict(STORE=0, STAGES=4)),
    "prod_w8": (dict(num_warps=8), dict(STORE=0)),
    "no_store": (dict(num_warps=4), dict(STORE=2)),
    "scratch": (dict(num_warps=4), dict(STORE=1)),
    "scratch_w8": (dict(num_warps=8), dict(STORE=1)),
    "scratch_st4": (dict(num_warps=4), dict(STORE=1, STAGES=4)),
    "scratch_nomask": (dict(num_warps=4), dict(STORE=1, MASK=False)),
    "scratch_direct": (dict(num_warps=4), dict(STORE=1, INDIRECT=False)),
    "scratch_noexp": (dict(num_warps=4), dict(STORE=1, EXP=False)),
    "scratch_nodot": (dict(num_warps=4), dict(STORE=1, DOT=False)),
    "scratch_fp8": (dict(num_warps=4), dict(STORE=1, FP8=True)),
    "lean": (dict(num_warps=4), dict(STORE=1, MASK=False, LEAN=True)),
    "lean_w8": (dict(num_warps=8), dict(STORE=1, MASK=False, LEAN=True)),
    "lean_fp8": (dict(num_warps=4), dict(STORE=1, MASK=False, LEAN=True, FP8=True)),
    # Package pieces added to the lean core one at a time (which one costs the difference):
    "lean_pkg_lse": (dict(num_warps=4), dict(STORE=1, MASK=False, PKG_LSE=True)),
    "lean_pkg_lse_mask": (dict(num_warps=4), dict(STORE=1, PKG_LSE=True)),
    "lean_ifwrap": (dict(num_warps=4), dict(STORE=1, MASK=False, LEAN=True, IFWRAP=True)),
    "lean_tail": (dict(num_warps=4), dict(STORE=1, MASK=False, LEAN=True, TAIL=True)),
    "scratch_pair": (dict(num_warps=4), dict(STORE=1, PAIR=2)),
    "scratch_pair_w8": (dict(num_warps=8), dict(STORE=1, PAIR=2)),
    "scratch_pair_fp8": (dict(num_warps=4), dict(STORE=1, PAIR=2, FP8=True)),
    # 128 rows per program (32-query tiles): each leaf's keys serve twice the rows, the bound
    # on what sharing one shortlist between two 16-query tiles could gain.
    "rows128_prod_w8": (dict(num_warps=8), dict(STORE=0), dict(TQ=32, RB=128)),
    "rows128_scratch_w4": (dict(num_warps=4), dict(STORE=1), dict(TQ=32, RB=128)),
    "rows128_scratch_w8": (dict(num_warps=8), dict(STORE=1), dict(TQ=32, RB=128)),
    "rows128_scratch_fp8_w8": (dict(num_warps=8), dict(STORE=1, FP8=True), dict(TQ=32, RB=128)),
}
DEFAULT_FLAGS = dict(STORE=0, MASK=True, INDIRECT=True, EXP=True, DOT=True, PAIR=1, FP8=False,
                     STAGES=3,
                     LEAN=False, PKG_LSE=False, IFWRAP=False, TAIL=False)


def shortlists(B, Hkv, N, TQ, C, W, device, seed=0):
    """``[B * Hkv * T, W]`` int32: per tile ``min(W, visible)`` distinct visible leaves,
    ascending, ``-1`` padded (random: the timing does not depend on which)."""
    T, L = N // TQ, N // C
    g = torch.Generator(device=device).manual_seed(seed)
    vis = (torch.arange(T, device=device) * TQ + TQ - 1) // C + 1  # leaves visible per tile
    r = torch.rand(B * Hkv, T, L, generator=g, device=device)
    r = r.masked_fill(torch.arange(L, device=device) >= vis[:, None], 2.0)
    pick = r.topk(W, dim=-1, largest=False).indices
    keep = torch.gather(r, -1, pick) < 2.0
    pick = torch.where(keep, pick, L + 1).sort(-1).values
    return torch.where(pick <= L, pick, -1).to(torch.int32).reshape(-1, W).contiguous()


def run(N=32768, B=1, Hq=32, Hkv=8, D=128, TQ=16, C=64, W=128, RB=64, only=None, dev="cuda"):

    q = torch.randn(B, Hq, N, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, N, D, device=dev, dtype=torch.bfloat16)
    bufs = {}

    def buffers(TQ, RB):
        if (TQ, RB) not in bufs:
            bufs.clear()
            torch.cuda.empty_cache()
            short = shortlists(B, Hkv, N, TQ, C, W, dev)
            T = N // TQ
            out = torch.empty(B * Hkv * T, W, device=dev, dtype=torch.float32)
            scr = torch.empty(B * Hkv * T * W * RB, device=dev, dtype=torch.float32)
            flops = 2.0 * int((short >= 0).sum()) * (TQ * Hq // Hkv) * C * D
            bufs[TQ, RB] = short, T, out, scr, flops
        return bufs[TQ, RB]
    flops = buffers(TQ, RB)[-1]
    res = {"shape": dict(N=N, B=B, Hq=Hq, Hkv=Hkv, D=D, query_tile=TQ, block_size=C,
                         shortlist=W, row_block=RB),
           "device": torch.cuda.get_device_name() if dev == "cuda" else dev, "torch": torch.__version__,
           "triton": triton.__version__, "qk_tflop": flops / 1e12, "ms": {}, "tflops": {},
           "variants": {k: [str(x) for x in v] for k, v in VARIANTS.items()},
           "compiled": {}}
    ref = None
    seen = set()
    for name, (launch, flags, *shape) in VARIANTS.items():
        if only and name not in only:
            continue
        fl = {**DEFAULT_FLAGS, **flags}
        sh = {"TQ": TQ, "RB": RB, **(shape[0] if shape else {})}
        short, T, out, scr, flops = buffers(sh["TQ"], sh["RB"])

        def call():
            _ablate_kernel[(T, B * Hkv)](q, k, short, out, scr, N, N, T, Hkv, 1 / math.sqrt(D),
                                         D=D, G=Hq // Hkv, C=C, W=W, **sh, **fl, **launch)
        try:
            call()
            torch.cuda.synchronize()
            if shape:
                pass  # other tiles: no reference to compare with
            elif ref is None and fl["STORE"] == 0:
                ref = out.clone()
            elif ref is not None and fl["STORE"] == 1 and fl["INDIRECT"] and fl["EXP"] and \
                    fl["DOT"] and not fl["FP8"]:
                res.setdefault("max_vote_diff", {})[name] = float((out - ref).abs().max())
            ms = triton.testing.do_bench(call, warmup=25, rep=100)
            res["ms"][name] = ms
            res["tflops"][name] = flops / ms / 1e9
            for ck in _ablate_kernel.device_caches[0][0].values():
                if id(ck) not in seen:
                    seen.add(id(ck))
                    res["compiled"][name] = dict(n_regs=ck.n_regs, n_spills=ck.n_spills,
                                                 shared=ck.metadata.shared)
            print(f"{name}: {ms:.2f} ms  {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001 (resource limits on some variants)
            res["ms"][name] = repr(e)[:120]
            print(name, repr(e)[:200], flush=True)
    return res


def run_real(N=32768, B=1, Hq=32, Hkv=8, D=128):
    """The package's rescoring launch and the stand-alone core on the same shortlists (the
    defaults' flat selection of random bf16 q/k), timed side by side."""
    from pisa_compile import PisaConfig
    from pisa_compile.kernels import triton_select as ts
    cfg = PisaConfig(min_seq_len=0)
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16)
    seen = {}
    orig = ts._rescore

    def grab(*args, **kw):
        seen["args"], seen["kw"] = args, kw
        return orig(*args, **kw)
    ts._rescore = grab
    ts.select_blocks(q, k, True, 1 / math.sqrt(D), **cfg.selection_options())
    ts._rescore = orig
    args, kw = seen["args"], seen["kw"]
    short = args[4]
    W = 128
    T = N // 16
    out = torch.empty(B * Hkv * T, W, device="cuda", dtype=torch.float32)
    scr = torch.empty(B * Hkv * T * W * 64, device="cuda", dtype=torch.float32)
    res = {"package_rescore_ms": triton.testing.do_bench(lambda: orig(*args, **kw))}
    for name in ("lean", "scratch", "prod_w4", "lean_pkg_lse", "lean_pkg_lse_mask",
                 "lean_ifwrap", "lean_tail"):
        launch, flags = VARIANTS[name][:2]
        fl = {**DEFAULT_FLAGS, **flags}
        res[f"core_{name}_ms"] = triton.testing.do_bench(lambda: _ablate_kernel[(T, B * Hkv)](
            q, k, short, out, scr, N, N, T, Hkv, 1 / math.sqrt(D), D=D, G=Hq // Hkv, C=64, W=W,
            TQ=16, RB=64, **fl, **launch))
    res["shortlisted_per_tile"] = float((short.view(-1, W) >= 0).sum(-1).float().mean())
    print(res, flush=True)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--real", action="store_true", help="the package's rescoring beside the core")
    a = ap.parse_args()
    r = run_real() if a.real else run(only=a.only)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
