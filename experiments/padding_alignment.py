"""A prompt alone against the same prompt left-padded in a batch, on a real model.

Qwen2.5-Coder-0.5B (GGUF, ``../shared/models``), float32 on the CPU: a 200-token prompt of
standard-library source (``json/decoder.py``) alone, and as the second row of a 256-token
batch, left-padded by 56 (not a multiple of the block or the query tile), positions counted
from its first token as ``generate()`` passes them. Lossy options (``block_size=16,
top_k=2, query_tile=16``, ``min_seq_len=0``), the dense tail off and on; with the rows
aligned to their first token (what the pass does where it proves self-attention) and with
that switched off (``ops._rows_align`` patched: tiles from position 0 of the batch, as
before). Reports, over the prompt's 200 positions, the largest logit difference, how many
positions differ by more than 0.01, and how many greedy argmaxes agree.

    PYTHONPATH=.:DIR_WITH_GGUF_PACKAGE python -m experiments.padding_alignment --gguf PATH --json OUT.json
"""

from __future__ import annotations

import argparse
import inspect
import json

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", required=True, help="qwen2.5-coder-0.5b-instruct.gguf")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    from benchmarks.eval_llm import load_gguf
    from pisa_compile import ops
    from pisa_compile.backend import pisa_backend
    model, tok = load_gguf(args.gguf, device="cpu", dtype=torch.float32)
    L, N = 200, 256
    ids = tok(open(inspect.getsourcefile(json.decoder)).read(), return_tensors="pt").input_ids
    ids = ids[:, :L]
    torch.manual_seed(0)
    other = torch.randint(100, 5000, (1, N))
    pad = torch.full((1, N - L), tok.pad_token_id or 0)
    batch_ids = torch.cat([other, torch.cat([pad, ids], 1)])
    am = torch.ones(2, N, dtype=torch.long)
    am[1, :N - L] = 0
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    rows = {}
    for tail in (0, 64):
        opts = dict(min_seq_len=0, block_size=16, top_k=2, query_tile=16, dense_tail=tail)
        for aligned in (True, False):
            torch._dynamo.reset()
            real = ops._rows_align
            if not aligned:
                ops._rows_align = lambda *a, **k: False
            try:
                fwd = torch.compile(model.forward, backend=pisa_backend, options=opts)
                with torch.no_grad():
                    alone = fwd(input_ids=ids).logits[0]
                    batch = fwd(input_ids=batch_ids, attention_mask=am,
                                position_ids=pos).logits[1, N - L:]
            finally:
                ops._rows_align = real
            diff = (batch - alone).abs().amax(-1)
            rows[f"dense_tail={tail}, aligned={aligned}"] = r = dict(
                max_abs=float(diff.max()), positions_over_0_01=int((diff > 1e-2).sum()),
                argmax_agree=int((batch.argmax(-1) == alone.argmax(-1)).sum()), positions=L)
            print(tail, aligned, r, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(model="qwen2.5-coder-0.5b-instruct.gguf", dtype="float32",
                           device="cpu", rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
