"""``generate()`` end to end with the tokenizer's ``attention_mask`` (issue #16): time to the
first token and time per new token, ``backend="pisa"`` against ``torch.compile()`` (Inductor,
dense SDPA), side by side in one process.

The Llama-3.2-1B-shaped 4-layer stack of ``bench_masks`` (bf16, random init), greedy, a
``DynamicCache`` (``generate``'s default), ``model.forward`` compiled with ``dynamic=True``.
Per length ``N`` and batch ``B`` (rows left-padded by ``--pad`` tokens after the first):

- ``ttft_ms``: from the call to the first new token on the host (the prefill and one
  token), median of ``--reps`` calls of ``generate(max_new_tokens=T)``;
- ``per_token_ms``: from the first new token to the last, over ``T - 1``, in the same calls
  (median): a streamer's clock (``generate`` hands it each token on the host, a device
  sync it makes anyway), so the prefill's run-to-run spread is not in it. Before 4 December
  2026 (fourth session) it was ``(generate(T) - generate(1)) / (T - 1)``, which carried
  the spread of two prefills (25% between runs at 128K). ``min_new_tokens=T`` so that no
  row stops early;
- ``same_tokens``: the share of new tokens equal to the dense run's (random init: the logits
  are near-ties, so this is no quality measure).

    python -m benchmarks.bench_generate --lengths 8192 32768 --new-tokens 32 \\
        --json profiles/bench_generate.json

``--pisa-cache`` adds a third row: ``backend="pisa"`` with ``past_key_values=PisaCache(N +
T)`` (a fresh cache per call; its layers' update breaks the graph, so the prefill's mask
reaches the attention as a graph input and is read at run time). ``counters`` gives the
plans and run-time paths the row took (``sparse_decode``, ``runtime_mask_structured``).

``--static`` runs static caches instead, the way transformers serves them: one cache per
row, ``reset()`` before each call, ``model.forward`` left uncompiled and the decode steps
compiled by ``generate`` itself with ``compile_config`` in CUDA graphs (the recipe of
:class:`~pisa_compile.hf_cache.PisaStaticCache`; a forward compiled without graphs takes
the steps over, ``experiments/static_graph_probe.py``). Rows: ``inductor+static``
(``StaticCache``, ``CompileConfig()``: Inductor, ``mode="reduce-overhead"``) and
``pisa+static`` (``PisaStaticCache``, ``CompileConfig(backend=pisa, mode=None,
options={..., "triton.cudagraphs": True})``). The prefill is eager and dense in both, so
``ttft_ms`` is no PISA figure there. ``step_python_runs`` counts the decode op's Python runs
(``cached_decode_calls``, sparse or dense) during the timed calls: 0 when every step that
reaches the op replays a graph (steps whose sites stay dense never reach it);
``warm_step_python_runs``, during the warm-up call: above 0 when the steps reach the op at
all (a 0 there and in the timed calls says nothing about graphs). The cache's
``PisaConfig`` follows ``--options``/``--min-seq-len`` (its ``min_seq_len`` gates the
pyramid). (An earlier recipe, the forward
compiled with graphs, failed on the H200: ``profiles/generate_static.json``, recipe B.)

``--prefill-chunk C`` prefills in chunks of ``C`` tokens (transformers'
``prefill_chunk_size``), in both rows: a static cache's prefill mask is ``[B, 1, C,
capacity]`` instead of ``[B, 1, N, capacity]`` (137 GB at 128K, B=8 with left padding;
without padding, transformers 5.17 passes no mask to an empty static cache's prefill).

``--device cpu --tiny`` runs a 2-layer toy model (the CPU smoke test).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from transformers.generation.streamers import BaseStreamer


def _model(tiny: bool, device: str):
    import transformers
    shape = (dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
             if tiny else
             dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=64))
    cfg = transformers.LlamaConfig(max_position_embeddings=140000, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2, **shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return transformers.LlamaForCausalLM(cfg).to(device, dtype).eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _StepClock(BaseStreamer):
    """A ``generate`` streamer that keeps the host time of each ``put``: the prompt, then
    each new token (after the device produced it: ``generate`` moves it to the host)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _timed(gen, reps: int, device: str) -> tuple[float, float, object]:
    """Medians over ``reps`` calls of ``gen(streamer=...)``: ms to the first new token, ms
    per new token after it; and the last call's output."""
    out, ttft, per_token = None, [], []
    for _ in range(reps):
        clock = _StepClock()
        _sync(device)
        t0 = time.perf_counter()
        out = gen(streamer=clock)
        _sync(device)
        t = clock.times  # [prompt, token 1, ..., token T]
        ttft.append((t[1] - t0) * 1e3)
        per_token.append((t[-1] - t[1]) * 1e3 / (len(t) - 2))
    return statistics.median(ttft), statistics.median(per_token), out


def run(model, backend: str, n: int, batch: int, pad: int, new_tokens: int, reps: int,
        device: str, options=None, sparse_from=None, prefill_chunk=None) -> dict:
    """One row: compile ``model.forward`` with ``backend`` (``+static``: the steps, through
    ``generate``'s ``compile_config``), warm up, time (see the module docstring). Returns the
    row with the generated tokens under ``"tokens"``."""
    from torch._dynamo.utils import counters

    from pisa_compile.backend import pisa_backend
    torch._dynamo.reset()
    counters.clear()
    # The last row's cache and graph pools go before this row allocates (128K, B=8 needs
    # most of an 80 GB card for its eager prefill alone).
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (batch, n), generator=g).to(device)
    am = torch.ones(batch, n, dtype=torch.long, device=device)
    am[1:, :pad] = 0
    ids[1:, :pad] = 0
    eager_forward = model.forward
    static = backend.endswith("+static")
    if not static:
        model.forward = (torch.compile(eager_forward, backend=pisa_backend, options=options,
                                       dynamic=True) if backend.startswith("pisa")
                         else torch.compile(eager_forward, dynamic=True))
    kw = dict(attention_mask=am, do_sample=False, pad_token_id=0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens)
    if prefill_chunk is not None:
        kw["prefill_chunk_size"] = prefill_chunk
    if static:  # the steps compiled by generate in CUDA graphs, the prefill eager
        from transformers import CompileConfig, StaticCache
        from pisa_compile.hf_cache import PisaStaticCache
        if backend.startswith("pisa"):
            # The cache's selection and min_seq_len follow the backend's options (its
            # min_seq_len gates the pyramid).
            from pisa_compile import PisaConfig
            cache = PisaStaticCache(model.config, n + new_tokens,
                                    pisa_config=PisaConfig.from_options(options),
                                    sparse_from=sparse_from)
            cc = CompileConfig(backend=pisa_backend, mode=None,
                               options={**(options or {}), "triton.cudagraphs": True})
        else:
            cache, cc = StaticCache(model.config, n + new_tokens), CompileConfig()

        def gen(ids, **k):  # one cache, emptied per call (a new one would recompile)
            cache.reset()
            return model.generate(ids, past_key_values=cache, compile_config=cc, **k)
    elif backend == "pisa+cache":
        from pisa_compile.hf_cache import PisaCache

        def gen(ids, **k):  # a fresh cache per call: a used one would hold the last prompt
            return model.generate(ids, past_key_values=PisaCache(n + new_tokens), **k)
    else:
        gen = model.generate
    try:
        with torch.no_grad():
            gen(ids, **kw)
            warm_runs = counters["pisa"]["cached_decode_calls"]  # recording included
            first, per_token, out = _timed(lambda **s: gen(ids, **kw, **s), reps, device)
    finally:
        model.forward = eager_forward
    step_python_runs = int(counters["pisa"]["cached_decode_calls"] - warm_runs)
    ref_stages = int(sum(v for k, v in counters["pisa"].items() if k.startswith("reference_")))
    return dict(n=n, batch=batch, pad=pad, backend=backend, options=options,
                **({"sparse_from": sparse_from} if sparse_from is not None else {}),
                **({"prefill_chunk": prefill_chunk} if prefill_chunk is not None else {}),
                new_tokens=new_tokens, ttft_ms=round(first, 2),
                per_token_ms=round(per_token, 3),
                reference_stages=ref_stages, graphs=int(counters["stats"]["unique_graphs"]),
                graph_breaks=int(sum(counters["graph_break"].values())),
                cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]),
                step_python_runs=step_python_runs, warm_step_python_runs=int(warm_runs),
                sites={k: v for k, v in counters["pisa"].items()
                       if k in ("rewritten", "left_dense")},
                counters={k: v for k, v in counters["pisa"].items()
                          if k not in ("rewritten", "left_dense")},
                tokens=out[:, n:].cpu())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--pad", type=int, default=0,
                    help="left padding of every row after the first (tokens)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="times each length runs the pair, the first one of the two alternating")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke)")
    ap.add_argument("--min-seq-len", type=int, default=None,
                    help="the pisa backend's min_seq_len (None: the defaults)")
    ap.add_argument("--options", type=json.loads, default=None,
                    help='the pisa backend\'s options as JSON, e.g. \'{"preset": "fast"}\' '
                         "(--min-seq-len, if given, is added to them)")
    ap.add_argument("--pisa-cache", action="store_true",
                    help="also run backend='pisa' with past_key_values=PisaCache(N + T)")
    ap.add_argument("--static", action="store_true",
                    help="static caches, the steps compiled by generate in CUDA graphs: rows "
                         "inductor+static and pisa+static instead of the others")
    ap.add_argument("--sparse-from", type=int, default=None,
                    help="PisaStaticCache's sparse_from with --static (None: its cost model)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="transformers' prefill_chunk_size, both rows (None: one prefill)")
    ap.add_argument("--only", choices=["pisa", "inductor"], default=None,
                    help="run one row per length (no same_tokens): to tell which row fails")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.sparse_from is not None and not args.static:
        ap.error("--sparse-from sets PisaStaticCache's sparse_from: it needs --static")
    if args.sparse_from is not None and args.sparse_from < 0:
        ap.error(f"--sparse-from must be >= 0, got {args.sparse_from}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        ap.error(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if not args.lengths or min(args.lengths) < 1:
        ap.error(f"--lengths needs one or more lengths >= 1, got {args.lengths}")
    if args.batch < 1 or args.reps < 1:
        ap.error(f"--batch and --reps must be >= 1, got {args.batch} and {args.reps}")
    if args.pad < 0 or args.pad >= min(args.lengths):
        ap.error(f"--pad must be in [0, min(--lengths)), got {args.pad}")
    if args.pad and args.batch < 2:
        ap.error("--pad pads the rows after the first: give --batch 2 or more")
    model = _model(args.tiny, args.device)
    if args.options is not None and not isinstance(args.options, dict):
        ap.error(f"--options must be a JSON object, got {args.options!r}")
    opts = dict(args.options or {})
    if args.min_seq_len is not None:
        opts["min_seq_len"] = args.min_seq_len
    opts = opts or None
    rows = []
    for i, n in enumerate(n for n in args.lengths for _ in range(args.rounds)):
        # Odd rounds run Inductor first: an order effect shows as a swap between rounds.
        order = ("pisa", "inductor") if i % args.rounds % 2 == 0 else ("inductor", "pisa")
        if args.static:
            order = tuple(b + "+static" for b in order)
        order += ("pisa+cache",) if args.pisa_cache else ()
        if args.only:
            order = tuple(b for b in order if b.split("+")[0] == args.only)
        pair = {b: run(model, b, n, args.batch, args.pad, args.new_tokens, args.reps,
                       args.device, None if b.startswith("inductor") else opts,
                       sparse_from=None if b.startswith("inductor") else args.sparse_from,
                       prefill_chunk=args.prefill_chunk)
                for b in order}
        for b in order:
            pair[b]["ran_first"] = b == order[0]
        tokens = {b: pair[b].pop("tokens") for b in order}
        dense = tokens.get("inductor+static" if args.static else "inductor")
        for b in order:
            r = pair[b]
            if dense is not None:
                r["same_tokens"] = round(float((tokens[b] == dense).float().mean()), 3)
            print(r, flush=True)
            rows.append(r)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=(torch.cuda.get_device_name() if args.device == "cuda"
                                   else "cpu"), torch=torch.__version__,
                           command="python -m benchmarks.bench_generate " + " ".join(
                               argv if argv is not None else __import__("sys").argv[1:]),
                           rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
