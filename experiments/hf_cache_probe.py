"""Where the GPU ``PisaCache`` test's scores left dense's (issue #16): one tiny fp32 Llama,
a 3000-token left-padded batch of 2, 8 greedy tokens, in the exact regime (every leaf
selected), scores compared with eager dense ``generate()`` for: Inductor with the default
cache, ``backend="pisa"`` with the default cache (prefill through PISA, dense decode), and
``backend="pisa"`` with ``PisaCache`` (sparse decode from the pyramid); under
``torch.set_float32_matmul_precision`` "highest" (PyTorch's default) and "high" (TF32).

    python -m experiments.hf_cache_probe --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch


def run(precision: str) -> dict:
    from torch._dynamo.utils import counters

    from pisa_compile import PisaConfig
    from pisa_compile.backend import pisa_backend
    from pisa_compile.hf_cache import PisaCache
    from pisa_compile.samples import tiny_llama
    torch.set_float32_matmul_precision(precision)
    m = tiny_llama(8192, num_layers=2).cuda()
    ids = torch.randint(3, 256, (2, 3000), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    am = torch.ones_like(ids)
    am[1, :300] = 0
    new = 8
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=new, do_sample=False,
              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    dense = m.generate(**kw)
    eager_forward = m.forward
    out = {}
    pc = PisaConfig(top_k=64, kernel="triton", min_seq_len=0)
    opts = dict(min_seq_len=0, kernel="triton", top_k=64)  # the exact regime
    for name, backend, cache in (
            ("inductor", "inductor", None),
            ("pisa_default_cache", lambda gm, ex: pisa_backend(gm, ex, options=opts), None),
            ("pisa_PisaCache", lambda gm, ex: pisa_backend(gm, ex, options=opts), "pisa")):
        torch._dynamo.reset()
        counters.clear()
        m.forward = torch.compile(eager_forward, dynamic=True, backend=backend)
        extra = {} if cache is None else dict(
            past_key_values=PisaCache(3000 + new, config=pc, sparse_from=0))
        with torch._dynamo.config.patch(recompile_limit=64):
            got = m.generate(**kw, **extra)
        diffs = [float((a - b).abs().max()) for a, b in zip(got.scores, dense.scores)]
        out[name] = dict(max_abs_per_step=[round(d, 5) for d in diffs],
                         same_tokens=bool(torch.equal(got.sequences, dense.sequences)))
        out[name]["counters"] = {k: v for k, v in counters["pisa"].items()}
        print(precision, name, out[name], flush=True)
    m.forward = eager_forward
    torch.set_float32_matmul_precision("highest")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               runs={p: run(p) for p in ("highest", "high")})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
