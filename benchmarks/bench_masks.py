"""The calls users make, with masks, on a Llama-3.2-1B-shaped 4-layer stack (issue #14).

bf16, random init, hidden 2048, 32 query / 8 KV heads of 64, SwiGLU 8192. Side by side in
one process: ``torch.compile(backend="pisa")`` against ``torch.compile()`` (Inductor, dense
SDPA), for ``model(ids)`` and ``model(ids, attention_mask=...)``; forward ms (median of
``--reps`` after a warm-up), peak memory, and how many reference stages the PISA graphs
planned (``counters["pisa"]["reference_*"]``, must be 0).

With ``--left-padding``: a batch of 4 at 16K whose rows are left-padded by 0/1K/3K/7K tokens
(``--pads``), with the tokenizer's ``attention_mask`` and positions counted from each row's
first token, as ``generate()`` passes them, and each padded row against the same tokens run alone, unpadded:
the largest difference of the last hidden states over the real tokens, for PISA and for
dense (whose own difference is the bf16 tolerance).

    python -m benchmarks.bench_masks --json profiles/bench_masks.json
    python -m benchmarks.bench_masks --left-padding --json profiles/bench_masks_padding.json
    python -m benchmarks.bench_masks --left-padding --min-seq-len 0 --json profiles/bench_masks_padding_pisa.json
    python -m benchmarks.bench_masks --window 4096 --json profiles/bench_masks_window.json
    python -m benchmarks.bench_masks --nanogpt --json profiles/bench_masks_nanogpt.json
    python -m benchmarks.bench_masks --options '{"preset": "fast"}' --kernels --json out.json

``--options`` passes the pisa backend's options (JSON); ``--kernels`` adds each call's GPU
time per kernel (``torch.profiler``, the 20 largest), which places a mask's extra cost.

With ``--nanogpt``: one nanoGPT-style attention layer (the stack's sizes, hand-written
attention masked by a registered ``tril`` buffer) against the same layer calling SDPA with
``is_causal=True``, both under ``backend="pisa"``: the buffer's per-call check is the
difference.

With ``--window W`` the stack is Mistral-shaped instead (the same sizes, ``sliding_window=W``):
PISA hands its window sites to FlexAttention over the window's blocks, or with a key mask to
its Triton attention kernels over them (``window_paths``: the plans counted per path).
"""

from __future__ import annotations

import argparse
import json

import torch


def _model(window=None):
    import transformers
    shape = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                 num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=64, max_position_embeddings=140000)
    if window is None:
        cfg, cls = transformers.LlamaConfig(**shape), transformers.LlamaForCausalLM
    else:
        cfg = transformers.MistralConfig(sliding_window=window, **shape)
        cls = transformers.MistralForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(cfg).to("cuda", torch.bfloat16).eval()


class _NanoAttention(torch.nn.Module):
    """nanoGPT's CausalSelfAttention (slow path with ``buffer=True``, else SDPA causal)."""

    def __init__(self, d: int, heads: int, block: int, buffer: bool):
        super().__init__()
        self.qkv, self.proj, self.heads, self.buffer = (torch.nn.Linear(d, 3 * d),
                                                        torch.nn.Linear(d, d), heads, buffer)
        if buffer:
            self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(
                1, 1, block, block))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, 2))
        if self.buffer:
            att = (q @ k.transpose(-2, -1)) * (k.size(-1) ** -0.5)
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            y = att.softmax(-1) @ v
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def nanogpt(n: int, reps: int) -> list[dict]:
    """Rows of the ``--nanogpt`` bench (see the module docstring)."""
    from torch._dynamo.utils import counters

    from pisa_compile.backend import pisa_backend
    x = torch.randn(1, n, 2048, device="cuda", dtype=torch.bfloat16)
    rows = []
    for buffer in (False, True):
        torch.manual_seed(0)
        layer = _NanoAttention(2048, 32, n, buffer).to("cuda", torch.bfloat16).eval()
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(layer, backend=pisa_backend)
        with torch.no_grad():
            torch.cuda.reset_peak_memory_stats()
            ms = _time(lambda: f(x), reps)
            peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append(dict(n=n, call="registered tril buffer" if buffer else "is_causal",
                         ms=round(ms, 2), peak_gib=round(peak, 2),
                         reference_stages=_reference_stages(counters)))
        print(rows[-1], flush=True)
        del layer, f
        torch.cuda.empty_cache()
    return rows


def _time(f, reps):
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def _reference_stages(counters) -> int:
    return int(sum(v for k, v in counters["pisa"].items() if k.startswith("reference_")))


def left_padding(body, n: int, pads: list[int], reps: int, options=None,
                 kernels: bool = False) -> list[dict]:
    """Rows of the left-padding bench (see the module docstring); ``options``: the pisa
    backend's ``torch.compile(options=...)`` (None: the defaults); ``kernels``: also each
    call's GPU ms per kernel (torch.profiler), the 20 largest."""
    from torch._dynamo.utils import counters

    from pisa_compile.backend import pisa_backend
    B = len(pads)
    ids = torch.randint(0, 32000, (B, n), device="cuda")
    mask = (torch.arange(n, device="cuda")[None, :] >= torch.tensor(pads, device="cuda")[:, None])
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    mask = mask.long()
    rows = []
    for backend in ("pisa", "inductor"):
        torch._dynamo.reset()
        counters.clear()
        f = (torch.compile(body, backend=pisa_backend, options=options) if backend == "pisa"
             else torch.compile(body))
        with torch.no_grad():
            torch.cuda.reset_peak_memory_stats()
            ms = _time(lambda: f(ids, attention_mask=mask, position_ids=pos), reps)
            peak = torch.cuda.max_memory_allocated() / 2**30
            per_kernel = None
            if kernels:
                from benchmarks.bench_stages import kernel_ms
                per_kernel = {k: round(v, 3) for k, v in list(kernel_ms(
                    lambda: f(ids, attention_mask=mask, position_ids=pos), 3).items())[:20]}
            batch = f(ids, attention_mask=mask, position_ids=pos).last_hidden_state
            diffs = {}
            for b, pad in enumerate(pads):
                alone = f(ids[b:b + 1, pad:]).last_hidden_state[0].float()
                got = batch[b, pad:].float()
                diffs[str(pad)] = dict(
                    max_abs=round(float((got - alone).abs().max()), 4),
                    rel_fro=round(float((got - alone).norm() / alone.norm()), 5))
        rows.append(dict(n=n, batch=B, pads=pads, backend=backend,
                         options=options if backend == "pisa" else None,
                         call="model(ids, attention_mask=left padding, position_ids)",
                         ms=round(ms, 2), kernels=per_kernel, peak_gib=round(peak, 2),
                         reference_stages=_reference_stages(counters),
                         padded_vs_alone=diffs))
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--reps", type=int, default=3, help="timed repeats per call")
    ap.add_argument("--lengths", default="32768", help="comma-separated sequence lengths")
    ap.add_argument("--left-padding", action="store_true",
                    help="the batch-of-4 left-padding bench at 16K instead")
    ap.add_argument("--pads", default="0,1024,3072,7168",
                    help="with --left-padding: comma-separated left padding per row")
    ap.add_argument("--min-seq-len", type=int, default=None,
                    help="with --left-padding: the pisa backend's min_seq_len (the defaults "
                         "run plain SDPA below 32768 keys)")
    ap.add_argument("--window", type=int, default=None,
                    help="a Mistral-shaped stack with this sliding window")
    ap.add_argument("--nanogpt", action="store_true",
                    help="a nanoGPT-style layer: registered tril buffer against is_causal")
    ap.add_argument("--options", type=json.loads, default=None,
                    help='the pisa backend\'s options as JSON, e.g. \'{"preset": "fast"}\' '
                         "(default: none, the defaults)")
    ap.add_argument("--kernels", action="store_true",
                    help="also record each call's GPU time per kernel (torch.profiler)")
    args = ap.parse_args(argv)
    if args.min_seq_len is not None and not args.left_padding:
        ap.error("--min-seq-len applies to --left-padding only")
    if args.options is not None and args.nanogpt:
        ap.error("--options does not apply to --nanogpt")
    from torch._dynamo.utils import counters
    if args.nanogpt:
        rows = [r for n in args.lengths.split(",") for r in nanogpt(int(n), args.reps)]
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                               rows=rows), fh, indent=1)
        return
    model = _model(args.window)
    body = model.model  # hidden states: the LM head's logits would dominate memory
    if args.left_padding:
        opts = dict(args.options or {})
        if args.min_seq_len is not None:
            opts["min_seq_len"] = args.min_seq_len
        rows = left_padding(body, 16384, [int(p) for p in args.pads.split(",")], args.reps,
                            opts or None, args.kernels)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                               rows=rows), fh, indent=1)
        return
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(0, 32000, (1, n), device="cuda")
        ones = torch.ones(1, n, dtype=torch.long, device="cuda")
        for backend in ("pisa", "inductor"):
            torch._dynamo.reset()
            counters.clear()
            from pisa_compile.backend import pisa_backend  # works without the entry point
            f = (torch.compile(body, backend=pisa_backend, options=args.options)
                 if backend == "pisa" else torch.compile(body))
            for call, kw in (("model(ids)", {}), ("model(ids, attention_mask=ones)",
                                                  dict(attention_mask=ones))):
                counters.clear()  # this call's plans only
                with torch.no_grad():
                    torch.cuda.reset_peak_memory_stats()
                    ms = _time(lambda: f(ids, **kw), args.reps)
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    kernels = None
                    if args.kernels:
                        from benchmarks.bench_stages import kernel_ms
                        kernels = {k: round(v, 3) for k, v in
                                   list(kernel_ms(lambda: f(ids, **kw), 3).items())[:20]}
                rows.append(dict(n=n, backend=backend, call=call, window=args.window,
                                 options=args.options if backend == "pisa" else None,
                                 ms=round(ms, 2), kernels=kernels,
                                 peak_gib=round(peak, 2),
                                 reference_stages=_reference_stages(counters),
                                 window_paths={k: v for k, v in counters["pisa"].items()
                                               if "window" in k}))
                print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
