"""Registers, spill stack and shared memory of the selection kernel, compiled for the H200
(sm90) on a machine without a GPU: Triton compiles the kernel to a cubin and ``cuobjdump``
(shipped with Triton) reads its resource usage. No device time; the figures are the
compiler's, not a timing (Triton here may differ from the device's).

    python -m benchmarks.kernel_resources                       # the defaults, standard shape
    python -m benchmarks.kernel_resources --preset fast --variants rolled unroll
    python -m benchmarks.kernel_resources --shape 14 2 64

Variants are launch settings of ``triton_select.SELECT_TUNING`` (see ``VARIANTS``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

VARIANTS = {
    "default": {},
    "rolled": dict(unroll=False),
    "early": dict(late_loads=False),
    "late_loads_w8": dict(late_loads=True, num_warps=8),
    "early_w4": dict(late_loads=False, num_warps=4),
}


def compile_select(preset: str, Hq: int, Hkv: int, D: int, N: int, tuning: dict):
    """The select kernel compiled for sm90 as ``select_blocks`` would launch it
    (``triton_select.select_launch``; causal, bf16, no key mask, no trace) at ``N`` queries
    and keys; returns the compiled kernel and its launch options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pisa_compile import PisaConfig
    from pisa_compile.kernels import triton_select as ts

    # The walk's kernel at every N (with flat_leaves the defaults' calls up to 32K keys run
    # the flat kernel instead).
    o = PisaConfig.preset(preset, min_seq_len=0, flat_leaves=0).selection_options()
    meta, opts = ts.select_launch(Hq // Hkv, N, N, D, **o, tuning=tuning)
    meta.pop("FLAT")
    # sqd = 1 (contiguous q): the JIT specialises an int equal to 1 as a constant.
    const = dict(meta, CAUSAL=True, HAS_LOCAL=o["local_blocks"] > 0, HAS_KEY_MASK=False,
                 LOWP=True, TRACE=False, sqd=1)
    fn = ts._select_kernel
    ptr = {"q_ptr": "*bf16", "mu_ptr": "*bf16", "lo_ptr": "*bf16", "shi_ptr": "*bf16",
           "slo_ptr": "*bf16", "lcnt_ptr": "*fp32", "slc_ptr": "*fp32"}
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr.get(name, "*i32")
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    # The JIT marks each pointer and each int divisible by 16 (tt.divisibility), which lets
    # loads vectorise and go through cp.async; without these hints a kernel compiles to
    # scalar loads and more registers than the real launch (the rescoring kernel, compiled
    # the same way by hand: 225 registers with them, the H200 reported 233; 255 and spills
    # without). At the standard shape the strides and lengths are multiples of 16; Hkv (8),
    # the counts and the offsets are not assumed to be.
    aligned = {"sqb", "sqh", "sqn", "Nq", "Nk", "Lcap", "sub_stride", "total"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or name in aligned}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=opts), opts


def resources(kernel) -> dict:
    """Registers per thread, spill stack bytes per thread and shared memory bytes."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return dict(registers=int(m[1]), stack_bytes=int(m[2]),
                shared_bytes=kernel.metadata.shared)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="quality")
    ap.add_argument("--shape", type=int, nargs=3, default=(32, 8, 128),
                    metavar=("HQ", "HKV", "D"))
    ap.add_argument("--n", type=int, default=32768, help="queries and keys")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = {}
    for name in args.variants:
        kernel, opts = compile_select(args.preset, *args.shape, args.n, VARIANTS[name])
        rows[name] = {**resources(kernel), **opts}
        print(f"{name}: {rows[name]}", flush=True)
    if args.json:
        import triton
        with open(args.json, "w") as fh:
            json.dump({"preset": args.preset, "shape": args.shape, "n": args.n,
                       "target": "sm90", "triton": triton.__version__, "rows": rows}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
