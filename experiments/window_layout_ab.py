"""The Mistral-shaped stack's window path with ``attention_mask=ones`` (issue #14): the Triton
window forward on the model's strided q/k/v views against contiguous copies, at 3 and 2
stages, side by side in one process (the compiled graph is traced once; the variants patch
``triton_attention.sparse_attention`` for window calls at run time), beside Inductor.

The op bench measured 2 stages 10% faster than 3 on contiguous q/k/v at head dim 64 (3.73
against 4.14 ms per layer, ``profiles/window_tiles.json``), but the model, whose q/k/v are
strided views, took 19.5 ms over 4 layers with 2 stages against 17.9 with 3.

On the H200 (5 December 2026, ``profiles/window_layout_ab.json``) the committed layout was
the fastest of the four in both rounds (44.4 / 44.6 ms; contiguous copies 45.4-46.2), against
Inductor's 164.3.

    PYTHONPATH=. python -m experiments.window_layout_ab --json OUT.json

``--baseline FILE`` (a copy of ``triton_attention.py``, as ``experiments.attention_ab``
takes) compares the working tree's window kernels with that copy's instead of the layouts:

    git show REV:pisa_compile/kernels/triton_attention.py > /tmp/attention_base.py
    PYTHONPATH=. python -m experiments.window_layout_ab --baseline /tmp/attention_base.py
"""

from __future__ import annotations

import argparse
import json

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline", default=None, help="a copy of triton_attention.py")
    args = ap.parse_args(argv)
    from benchmarks.bench_masks import _model, _time
    from pisa_compile.backend import pisa_backend
    from pisa_compile.kernels import triton_attention as ta

    body = _model(4096).model
    n = args.n
    ids = torch.randint(0, 32000, (1, n), device="cuda")
    ones = torch.ones(1, n, dtype=torch.long, device="cuda")
    real = ta.sparse_attention
    variant = {}

    def patched(q, k, v, *a, window=None, tuning=None, **kw):
        fn = real
        if window is not None:
            if variant.get("contiguous"):
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            tuning = {**(tuning or {}), **variant.get("tuning", {})}
            fn = variant["module"].sparse_attention if "module" in variant else real
        return fn(q, k, v, *a, window=window, tuning=tuning or None, **kw)

    ta.sparse_attention = patched
    rows = []
    f = torch.compile(body, backend=pisa_backend)
    variants = [("strided, 3 stages (as committed)", {}),
                ("contiguous, 3 stages", dict(contiguous=True)),
                ("contiguous, 2 stages", dict(contiguous=True, tuning=dict(num_stages=2))),
                ("strided, 2 stages", dict(tuning=dict(num_stages=2)))]
    if args.baseline:
        from experiments.attention_ab import _load
        variants = [("working tree", {}), ("baseline", dict(module=_load(args.baseline)))]
    with torch.no_grad():
        f(ids, attention_mask=ones)
        for rnd in range(2):  # alternate, twice
            for name, v in variants:
                variant.clear()
                variant.update(v)
                ms = _time(lambda: f(ids, attention_mask=ones), args.reps)
                rows.append(dict(round=rnd, backend="pisa", variant=name, ms=round(ms, 2)))
                print(rows[-1], flush=True)
        variant.clear()
        out0 = f(ids, attention_mask=ones).last_hidden_state
        variant.update(variants[-1][1])
        diff = float((f(ids, attention_mask=ones).last_hidden_state - out0).abs().max())
        rows.append(dict(check=f"{variants[-1][0]} vs {variants[0][0]}, max abs", value=diff))
        print(rows[-1], flush=True)
        if args.json:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=rows), open(args.json, "w"), indent=1)
        torch._dynamo.reset()
        g = torch.compile(body)
        ms = _time(lambda: g(ids, attention_mask=ones), args.reps)
        rows.append(dict(backend="inductor", ms=round(ms, 2)))
        print(rows[-1], flush=True)
    if args.json:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       rows=rows), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
