"""Does PISA keep what dense attention finds, on a pretrained LLM? Needle retrieval and
long-context loss of one model under dense SDPA and under PISA option sets, side by side in
one process, with each set's prefill time.

    python -m benchmarks.eval_llm --gguf DIR/qwen2.5-coder-0.5b-instruct.gguf \
        [--lengths 4096 8192 16384 30000] [--repeats 3] [--configs defaults exact ...] \
        [--pyramid-decode defaults ...] [--json profiles/eval_llm.json] \
        [--png profiles/eval_llm.png]

The model (``../shared/models/README.md``): Qwen2.5-Coder-0.5B-Instruct, 24 layers, 14 query and
2 KV heads of 64 (G = 7), de-quantized from GGUF by transformers, bf16 on CUDA.

Tasks, all built from the Python standard library at exactly ``N`` tokens (prompt and answer);
the prompt is prefilled and the answer decoded token by token through the KV cache, as
``generate()`` does; a case counts as retrieved when every answer token is the model's argmax
(greedy decoding would write the answer; 5 digits, so chance is nil):

* ``code``: ``NAME = "12345"`` planted in real source, asked for by ``assert NAME == "``;
* ``multikey``: four such lines with different names, one of them asked for;
* ``prose``: "The access code of the red door is 12345." planted in the library's reference
  prose (``pydoc_data.topics``), asked for as a question.

Each task plants its needle at depths of 10, 30, 50, 70 and 90% and repeats ``--repeats``
times with other haystacks and values: ``3 * 5 * repeats`` cases per length (45 by default).
Loss: the mean next-token NLL over the last quarter of ``--loss-windows`` held-out windows of
source (files the needle tasks do not use), per length.

PISA runs through transformers' attention interface, which calls :func:`pisa_attention` with
``is_causal=True`` at every layer: the op ``torch.compile(backend="pisa")`` puts in the graph
for these calls, without a compile per option set (``tests/test_eval_llm.py`` checks that the
two agree).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch._dynamo.utils import counters

from pisa_compile import PisaConfig, pisa_attention
from pisa_compile.samples import stdlib_files

__all__ = ["CANDIDATES", "candidate_config", "Case", "needle_cases", "loss_windows", "evaluate",
           "flat_exact_kernel_attention",
           "main"]

# Option sets compared against dense: PisaConfig keys over the "fast" preset (the defaults
# these names were first measured with), or over the preset a "preset" key names. "defaults"
# is PisaConfig() itself (plain SDPA below its min_seq_len); "quality" is the defaults'
# selection from 2048 keys on.
CANDIDATES: dict[str, dict] = {
    "defaults": {"preset": "quality"},
    "quality": {"preset": "quality", "min_seq_len": 2048},
    "fast": {},
    "exact": {"leaf_scoring": "exact"},
    "exact_tq16_k32": {"leaf_scoring": "exact", "query_tile": 16, "top_k": 32},
    "exact_tq16_k32_beam128": {"leaf_scoring": "exact", "query_tile": 16, "top_k": 32,
                               "beam": 128},
    "exact_beam128": {"leaf_scoring": "exact", "beam": 128},
    "exact_beam64": {"leaf_scoring": "exact", "beam": 64},
    "exact_tq16_k32_beam64": {"leaf_scoring": "exact", "query_tile": 16, "top_k": 32,
                              "beam": 64},
    "exact_beam64_short32": {"leaf_scoring": "exact", "beam": 64, "shortlist": 32},
    "exact_beam128_short32": {"leaf_scoring": "exact", "beam": 128, "shortlist": 32},
    "exact_beam128_short64": {"leaf_scoring": "exact", "beam": 128, "shortlist": 64},
    "exact_k32_beam128_short64": {"leaf_scoring": "exact", "top_k": 32, "beam": 128,
                                  "shortlist": 64},
    "exact_tq16_k32_beam128_short64": {"leaf_scoring": "exact", "query_tile": 16, "top_k": 32,
                                       "beam": 128, "shortlist": 64},
    "exact_tq4_k32": {"leaf_scoring": "exact", "query_tile": 4, "top_k": 32},
    "pooled_tq16_k32_beam128": {"query_tile": 16, "top_k": 32, "beam": 128},
    "exact_tq1": {"leaf_scoring": "exact", "query_tile": 1},
    # Box bounds rank, exact scores pick: the pyramid's pruning on bounds. beam 60 is the
    # widest beam whose pool stays 128 wide (pool_size: pow2(2 * (beam + 4 forced)));
    # beam 256 holds every leaf up to 32K (the flat oracle's 0.98 at 8K).
    "bound16_short64": {"leaf_scoring": "exact", "bound_block": 16, "shortlist": 64,
                        "beam": 64},
    "bound16_short64_beam256": {"leaf_scoring": "exact", "bound_block": 16, "shortlist": 64,
                                "beam": 256},
    "bound16_b60": {"bound_block": 16, "beam": 60},
    "bound16_b60_s32": {"leaf_scoring": "exact", "bound_block": 16, "beam": 60,
                        "shortlist": 32},
    "bound16_b60_s64": {"leaf_scoring": "exact", "bound_block": 16, "beam": 60,
                        "shortlist": 64},
    "bound8_b60_s32": {"leaf_scoring": "exact", "bound_block": 8, "beam": 60,
                       "shortlist": 32},
    "bound64_b60_s32": {"leaf_scoring": "exact", "bound_block": 64, "beam": 60,
                        "shortlist": 32},
    "exact_b60_s32": {"leaf_scoring": "exact", "beam": 60, "shortlist": 32},
    "bound16_k32_b60_s64": {"leaf_scoring": "exact", "bound_block": 16, "top_k": 32,
                            "beam": 60, "shortlist": 64},
    "bound16_tq16_b60_s64": {"leaf_scoring": "exact", "bound_block": 16, "query_tile": 16,
                             "beam": 60, "shortlist": 64},
    "exact_b60": {"leaf_scoring": "exact", "beam": 60},
    # Changes to the defaults (from 2048 keys): what each part of the default selection buys.
    "quality_s32": {"preset": "quality", "min_seq_len": 2048, "shortlist": 32},
    "quality_k32": {"preset": "quality", "min_seq_len": 2048, "top_k": 32},
    "quality_all_leaves": {"preset": "quality", "min_seq_len": 2048, "shortlist": None},
    "quality_b124": {"preset": "quality", "min_seq_len": 2048, "beam": 124},
    "quality_b124_pooled_walk": {"preset": "quality", "min_seq_len": 2048, "beam": 124,
                                 "bound_block": None},
    "quality_pooled_walk": {"preset": "quality", "min_seq_len": 2048, "bound_block": None},
    # Smaller query tiles: fewer rows share one selection (a single row's need weighs more).
    "quality_tq4": {"preset": "quality", "min_seq_len": 2048, "query_tile": 4},
    "quality_tq1": {"preset": "quality", "min_seq_len": 2048, "query_tile": 1},
    # The one-level pool (flat_leaves; 2 December 2026): every visible leaf ranked by its
    # sub-block bounds, then the shortlist's exact scores. "quality" is the new defaults
    # (shortlist 128); "quality_walk" the walk at every length.
    "quality_walk": {"preset": "quality", "min_seq_len": 2048, "flat_leaves": 0},
    "quality_flat_s64": {"preset": "quality", "min_seq_len": 2048, "shortlist": 64},
    "quality_flat_k24_s64": {"preset": "quality", "min_seq_len": 2048, "shortlist": 64,
                             "top_k": 24},
    "quality_flat_k32_s64": {"preset": "quality", "min_seq_len": 2048, "shortlist": 64,
                             "top_k": 32},
    "quality_flat_b8_s64": {"preset": "quality", "min_seq_len": 2048, "shortlist": 64,
                            "bound_block": 8},
    "quality_flat_k32": {"preset": "quality", "min_seq_len": 2048, "top_k": 32},
    # Wider beams: the prefill's flat scan ignores them (up to flat_leaves), so with
    # --pyramid-decode they change only the decode walk's pool (pow2(2 * (beam + 4))).
    "quality_flat_b124": {"preset": "quality", "min_seq_len": 2048, "beam": 124},
    "quality_flat_b252": {"preset": "quality", "min_seq_len": 2048, "beam": 252},
    "quality_b124_all_k32": {"preset": "quality", "min_seq_len": 2048, "beam": 124,
                             "shortlist": None, "top_k": 32},
    "quality_b124_all_k64": {"preset": "quality", "min_seq_len": 2048, "beam": 124,
                             "shortlist": None, "top_k": 64},
    "quality_b124_s128_k64": {"preset": "quality", "min_seq_len": 2048, "beam": 124,
                              "shortlist": 128, "top_k": 64},
    # The dense tail (the last queries of a prompt and every decode step attend densely):
    # off (the selection alone, as measured before the option existed) and wider.
    "quality_no_tail": {"preset": "quality", "min_seq_len": 2048, "dense_tail": 0},
    "quality_tail16": {"preset": "quality", "min_seq_len": 2048, "dense_tail": 16},
    "quality_tail256": {"preset": "quality", "min_seq_len": 2048, "dense_tail": 256},
    # Finer leaves, the same keys: 32-key leaves, twice the blocks.
    "quality_c32_k32": {"preset": "quality", "min_seq_len": 2048, "block_size": 32,
                        "top_k": 32},
    # A wider local window (8 leaves: the last 449-512 keys, as NSA's 512-key window): whether
    # the loss the walk loses against the flat scan is recent context. (beam 55 meant to keep
    # the pool 128 wide, but the local bound is 9 leaves, 10 forced: it is 256 wide.)
    "quality_local8": {"preset": "quality", "min_seq_len": 2048, "local_blocks": 8,
                       "beam": 55},
    "quality_local8_b23_s32": {"preset": "quality", "min_seq_len": 2048, "local_blocks": 8,
                               "beam": 23, "shortlist": 32},
    "fast_local8": {"preset": "fast", "local_blocks": 8},
    "fast_local16": {"preset": "fast", "local_blocks": 16},
    "fast_k32_local8": {"preset": "fast", "local_blocks": 8, "top_k": 32},
}

# The option sets over "quality" measured before flat leaves (2 December 2026) keep the
# defaults they were measured with, so that their names still mean their recorded runs.
for _name, _opts in CANDIDATES.items():
    if (_opts.get("preset") == "quality" and _name not in ("defaults", "quality")
            and not _name.startswith(("quality_flat", "quality_walk"))):
        for _key, _value in (("shortlist", 64), ("flat_leaves", 0)):
            _opts.setdefault(_key, _value)


def candidate_config(name: str) -> PisaConfig:
    """The :class:`PisaConfig` of ``CANDIDATES[name]`` (its keys over its preset)."""
    opts = dict(CANDIDATES[name])
    return PisaConfig.preset(opts.pop("preset", "fast"), **opts)


# Block-level ceilings: a flat exact scan (every visible leaf scored by the LSE of its keys,
# no pyramid) with the defaults' budget of blocks, per query tile of 64 and per query; and
# the same scan over a shortlist ranked by the tile's mean query (the ranking a fast kernel
# could afford), to learn whether that ranking keeps the needle before building it.
CEILINGS: dict[str, dict] = {
    "flat_exact_tile64": {"query_tile": 64},
    "flat_exact_query": {"query_tile": 1},
    "flat_exact_tile16": {"query_tile": 16},
    "flat_exact_tile16_k32": {"query_tile": 16, "top_k": 32},
    # The same ceilings through PISA's kernels (flat_exact_kernel_attention; GPU): fast enough
    # for 45 cases at 30K, where the PyTorch oracle is not.
    "flat_kernel_tile16": {"query_tile": 16, "kernel": True},
    "flat_kernel_tile16_k32": {"query_tile": 16, "top_k": 32, "kernel": True},
    "flat_kernel_tile64": {"query_tile": 64, "kernel": True},
    "flat_kernel_query": {"query_tile": 1, "kernel": True},
    "flat_kernel_tile16_k64": {"query_tile": 16, "top_k": 64, "kernel": True},
    # Finer leaves at the same budget of keys as 16 and 32 blocks of 64.
    "flat_kernel_c32_k32": {"query_tile": 16, "block_size": 32, "top_k": 32, "kernel": True},
    "flat_kernel_c32_k64": {"query_tile": 16, "block_size": 32, "top_k": 64, "kernel": True},
    "flat_meanq32_tile64": {"query_tile": 64, "mean_query_shortlist": 32},
    "flat_meanq64_tile64": {"query_tile": 64, "mean_query_shortlist": 64},
    "flat_sub8_tile64": {"query_tile": 64, "sub_block": 8},
    "flat_sub16_tile64": {"query_tile": 64, "sub_block": 16},
    "flat_sub16_short64_tile64": {"query_tile": 64, "sub_block": 16,
                                  "sub_block_shortlist": 64},
    "flat_sub64_short64_tile64": {"query_tile": 64, "sub_block": 64,
                                  "sub_block_shortlist": 64},
    "flat_quest16_tile64": {"query_tile": 64, "sub_block": 16, "sub_block_bound": True},
    "flat_quest16_short64_tile64": {"query_tile": 64, "sub_block": 16,
                                    "sub_block_bound": True, "sub_block_shortlist": 64},
}

# The keys of a CEILINGS entry that go to flat_exact_attention (the rest: PisaConfig).
ORACLE_KEYS = ("mean_query_shortlist", "sub_block", "sub_block_bound", "sub_block_shortlist",
               "kernel")

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
TASKS = ("code", "multikey", "prose")
_WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "fable", "grove", "harbor", "ivory",
          "juniper", "kettle", "lunar", "maple", "nectar", "onyx", "pepper", "quartz", "raven",
          "saffron", "timber", "umber", "velvet", "willow", "zephyr")
_COLORS = ("red", "blue", "green", "amber", "violet", "silver", "copper", "golden")
_THINGS = ("door", "vault", "locker", "gate", "cabinet", "drawer", "hatch", "safe")


@dataclass
class Case:
    """One retrieval case: ``input_ids`` int64 ``[N]``; the answer is ``input_ids[-n_answer:]``."""
    task: str
    depth: float
    input_ids: torch.Tensor
    n_answer: int


class Tokens:
    """``encode(text) -> list[int]`` and the ids whose text ends a line, over any tokenizer
    with ``encode(text, add_special_tokens=False)`` (transformers) or ``encode(text)``."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def encode(self, text: str) -> list[int]:
        try:
            return list(self.tok.encode(text, add_special_tokens=False))
        except TypeError:
            return list(self.tok.encode(text))

    def line_ends(self, ids: Sequence[int]) -> list[int]:
        """Positions ``i`` such that a line ends with ``ids[i]``."""
        cache: dict = {}
        out = []
        for i, t in enumerate(ids):
            if t not in cache:
                cache[t] = self.tok.decode([t]).endswith("\n")
            if cache[t]:
                out.append(i)
        return out


def _code_text(reverse: bool, min_chars: int) -> str:
    """Standard-library source, files in name order (needles) or reverse order (loss), so the
    two never share a file until ``min_chars`` runs past half the library."""
    files = stdlib_files()
    parts, n = [], 0
    for path in reversed(files) if reverse else files:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        n += len(text)
        if n >= min_chars:
            break
    return "\n".join(parts)


def _prose_text(min_chars: int) -> str:
    """The interpreter's reference prose (``help()`` topics), in topic order."""
    from pydoc_data.topics import topics

    parts, n = [], 0
    for key in sorted(topics):
        parts.append(topics[key])
        n += len(topics[key])
        if n >= min_chars:
            break
    return "\n".join(parts)


def _haystack(tokens: Tokens, ids: list[int], ends: list[int], n: int, rng: random.Random
              ) -> list[int]:
    """``n`` tokens of ``ids`` starting after a random line end."""
    starts = [e + 1 for e in ends if e + 1 + n <= len(ids)] or [0]
    s = rng.choice(starts)
    if s + n > len(ids):
        raise ValueError(f"the haystack text has {len(ids)} tokens, fewer than {n}: pass a "
                         f"shorter length")
    return ids[s:s + n]


def _plant(hay: list[int], needles: list[tuple[float, list[int]]], tokens: Tokens
           ) -> list[int]:
    """Insert each needle's tokens after the first line end at or past its depth."""
    ends = tokens.line_ends(hay)
    cuts = []
    for depth, ids in needles:
        at = int(depth * len(hay))
        cut = next((e + 1 for e in ends if e >= at), at)
        cuts.append((cut, ids))
    out, prev = [], 0
    for cut, ids in sorted(cuts, key=lambda c: c[0]):
        out += hay[prev:cut] + ids
        prev = cut
    return out + hay[prev:]


def needle_cases(tokenizer, n_tokens: int, repeats: int = 3, seed: int = 0,
                 tasks: Sequence[str] = TASKS, depths: Sequence[float] = DEPTHS,
                 bos: Optional[int] = None) -> list[Case]:
    """Retrieval cases of exactly ``n_tokens`` tokens: ``len(tasks) * len(depths) * repeats``.

    Args:
        tokenizer: transformers tokenizer (or any object with ``encode``/``decode``).
        n_tokens: total length N of each case (haystack + needles + question + answer).
        repeats: cases per (task, depth), each with another haystack window, name and value.
        seed: the cases are a function of ``seed`` and the tokenizer only.
        bos: a token id to put first, or None.

    Raises:
        ValueError: an unknown task, or a length the question does not fit in or the
            standard library cannot fill.
    """
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"tasks: expected some of {TASKS}, got {t!r}")
    tokens = Tokens(tokenizer)
    rng = random.Random(seed)
    chars = 6 * n_tokens + 200_000  # code is ~3-4 characters per token
    text = {"code": _code_text(False, chars), "prose": _prose_text(chars)}
    ids = {k: tokens.encode(v) for k, v in text.items()}
    ends = {k: tokens.line_ends(v) for k, v in ids.items()}
    cases = []
    for task in tasks:
        for depth in depths:
            for _ in range(repeats):
                digits = "".join(rng.choice("0123456789") for _ in range(5))
                answer = tokens.encode(digits)
                if task == "prose":
                    what = f"{rng.choice(_COLORS)} {rng.choice(_THINGS)}"
                    needles = [(depth, tokens.encode(
                        f"The access code of the {what} is {digits}.\n"))]
                    question = tokens.encode(f"\n\nQuestion: what is the access code of the "
                                             f"{what}?\nAnswer: The access code of the {what} "
                                             f"is ")
                    src = "prose"
                else:
                    names = rng.sample(_WORDS, 8)
                    name = f"{names[0]}_{names[1]}".upper()
                    needles = [(depth, tokens.encode(f'{name} = "{digits}"\n'))]
                    if task == "multikey":
                        for j in range(3):
                            other = f"{names[2 + 2 * j]}_{names[3 + 2 * j]}".upper()
                            value = "".join(rng.choice("0123456789") for _ in range(5))
                            needles.append((rng.uniform(0.05, 0.95),
                                            tokens.encode(f'{other} = "{value}"\n')))
                    question = tokens.encode(f"\n\n# What is the value of {name}?\nassert "
                                             f"{name} == \"")
                    src = "code"
                extra = sum(len(n[1]) for n in needles) + len(question) + len(answer)
                extra += bos is not None
                if n_tokens - extra < 64:
                    raise ValueError(f"n_tokens={n_tokens} leaves no room for a haystack")
                hay = _haystack(tokens, ids[src], ends[src], n_tokens - extra, rng)
                seq = ([bos] if bos is not None else []) + _plant(hay, needles, tokens)
                seq += question + answer
                cases.append(Case(task, depth, torch.tensor(seq, dtype=torch.long),
                                  len(answer)))
    return cases


def loss_windows(tokenizer, n_tokens: int, n_windows: int, bos: Optional[int] = None
                 ) -> list[torch.Tensor]:
    """``n_windows`` disjoint windows of ``n_tokens`` ids of held-out source (the library's
    files in reverse name order), int64 ``[n_tokens]`` each."""
    tokens = Tokens(tokenizer)
    need = n_windows * n_tokens
    ids = tokens.encode(_code_text(True, 5 * need + 100_000))
    if len(ids) < need:
        raise ValueError(f"the held-out source has {len(ids)} tokens, fewer than "
                         f"{n_windows} x {n_tokens}")
    head = [bos] if bos is not None else []
    m = n_tokens - len(head)
    return [torch.tensor(head + ids[i * m:(i + 1) * m], dtype=torch.long)
            for i in range(n_windows)]


def _refuse_extras(kwargs: dict) -> None:
    """The evaluation's attention functions implement plain causal attention: a model that
    asks for a sliding window or a logit soft-cap gets an error, not a silent change."""
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"eval_llm's attention does not implement {name}="
                             f"{kwargs[name]!r}; evaluate this model with another harness")


def attention_function(config: PisaConfig) -> Callable:
    """A transformers attention function (``AttentionInterface``) that runs
    :func:`pisa_attention` with ``config``: causal, no padding (the evaluation's prompts)."""

    def pisa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        _refuse_extras(kwargs)
        nq, nk = query.shape[2], key.shape[2]
        if attention_mask is not None:  # decode steps get one; it must be plain causal
            dev = query.device
            causal = (torch.arange(nk, device=dev)[None, :]
                      <= torch.arange(nq, device=dev)[:, None] + (nk - nq))
            if attention_mask.dtype != torch.bool or not bool((attention_mask == causal).all()):
                raise ValueError("eval_llm's PISA attention takes unpadded causal prompts only "
                                 "(attention_mask must be None or plain causal)")
        # Bottom-right causal: with a KV cache (decode) the queries are the last positions.
        out = pisa_attention(query, key, value, is_causal=True, scale=scaling,
                             enable_gqa=True, config=config,
                             causal_offset=nk - nq)
        return out.transpose(1, 2).contiguous(), None

    return pisa


@torch.no_grad()
def flat_exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         config: PisaConfig, chunk: int = 512,
                         mean_query_shortlist: Optional[int] = None,
                         sub_block: Optional[int] = None, sub_block_bound: bool = False,
                         sub_block_shortlist: Optional[int] = None) -> torch.Tensor:
    """The block-level ceiling: causal attention over the forced leaves plus the ``top_k``
    leaves of best tile score, each leaf scored exactly (the LSE of its visible keys) against
    every visible leaf, no pyramid. Quadratic; an oracle for the evaluation, not a kernel.

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, N, D]``; v: ``[B, Hkv, N, Dv]``; float dtypes
            (computed in fp32); ``Hq % Hkv == 0``; causal, bottom-right (``Nq <= N``: the
            queries are the last positions, as with a KV cache).
        scale: softmax scale.
        chunk: queries per step (memory ``B * Hq * chunk * N`` floats).
        config: ``block_size``, ``top_k``, ``query_tile``, ``sink_blocks`` and
            ``local_blocks`` are read (the tile vote is :func:`reference.tile_scores`'s: the
            sum over the tile's rows of each row's softmax over candidate leaves).
        mean_query_shortlist: None, or ``M >= top_k``: first rank the candidates by the same
            vote cast by each head's mean query over the tile (``G`` rows, exact leaf LSE),
            keep the ``M`` best, and let the tile's rows pick ``top_k`` among them.
        sub_block: None, or ``S`` dividing ``block_size``: score each leaf roughly from its
            ``S``-key sub-blocks (:func:`_sub_block_lse`; ``sub_block_bound``: Quest's upper
            bound instead of the pooled mean). With ``sub_block_shortlist=M`` the rough
            scores keep ``M`` candidates for the exact scores to pick from; without, the
            rough scores pick.

    Returns:
        ``[B, Hq, Nq, Dv]`` in q's dtype.
    """
    B, Hq, Nq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    off = N - Nq  # bottom-right: with a KV cache the queries are the last positions
    C, Tq = config.block_size, config.query_tile
    L = -(-N // C)
    chunk = max(Tq, chunk // Tq * Tq)
    kf, vf = k.float(), v.float()
    leaf = torch.arange(L, device=q.device)
    out = q.new_empty(B, Hq, Nq, v.shape[-1])
    for q0 in range(0, Nq, chunk):
        q1 = min(q0 + chunk, Nq)
        n = q1 - q0
        nt = -(-n // Tq)
        qc = q[:, :, q0:q1].float().view(B, Hkv, G, n, D)
        s = torch.einsum("bhgnd,bhkd->bhgnk", qc, kf) * scale
        qi = torch.arange(q0, q1, device=q.device)
        s = s.masked_fill(torch.arange(N, device=q.device)[None, :] > qi[:, None] + off,
                          float("-inf"))
        lse = torch.nn.functional.pad(s, (0, L * C - N), value=float("-inf"))
        lse = torch.logsumexp(lse.view(B, Hkv, G, n, L, C), -1)  # [B, Hkv, G, n, L]
        tiles = torch.arange(nt, device=q.device)
        first = q0 + tiles * Tq + off  # key positions of each tile's first and last query
        last = torch.clamp(q0 + tiles * Tq + Tq, max=q1) - 1 + off
        local = (leaf[None] >= (first[:, None] // C - (config.local_blocks - 1))) & (
            leaf[None] <= last[:, None] // C) if config.local_blocks > 0 else (
            torch.zeros(nt, L, dtype=torch.bool, device=q.device))
        forced = local | (leaf[None] < config.sink_blocks)
        cand = (leaf[None] * C <= last[:, None]) & ~forced  # [nt, L]
        tile_of = (qi - q0) // Tq
        if mean_query_shortlist is not None:
            cand = _mean_query_shortlist(qc, kf, scale, cand, last, Tq, C,
                                         mean_query_shortlist)
        cand = cand.expand(B, Hkv, nt, L)
        if sub_block is not None:
            rough = _sub_block_lse(qc, kf, scale, qi + off, C, sub_block, sub_block_bound)
            if sub_block_shortlist is None:  # the rough scores pick
                lse = rough
            else:
                cand = cand & _top_votes(rough, cand, tile_of, nt, sub_block_shortlist)
        picked = _top_votes(lse, cand, tile_of, nt, config.top_k)
        keep = (picked | forced)[:, :, tile_of]  # [B, Hkv, n, L]
        keys = keep.repeat_interleave(C, -1)[..., :N]
        s = s.masked_fill(~keys[:, :, None], float("-inf"))
        o = torch.softmax(s, -1) @ vf[:, :, None]
        out[:, :, q0:q1] = o.view(B, Hq, n, v.shape[-1]).to(q.dtype)
    return out


# -- the same ceiling on PISA's kernels (GPU; the interpreter in tests) ---------------------
# The PyTorch oracle above builds fp32 [tile rows, Nk] tensors and passes over them several
# times: more than 430 s for 45 cases at 30K on the H200. Here the selection runs through the
# exact rescoring kernel, fed every candidate leaf as its shortlist, and the attention through
# PISA's block-sparse kernel. Causal self-attention or a KV cache only, no key mask, no check
# for non-finite keys.

def _ascending(sel: torch.Tensor, width: int) -> torch.Tensor:
    """The columns where ``sel [T, L]`` holds, ascending, -1 padded to ``width``: int32."""
    L = sel.shape[-1]
    leaf = torch.arange(L, device=sel.device)
    order = torch.sort(torch.where(sel, leaf, L + leaf), dim=-1).values[..., :width]
    out = torch.where(order < L, order, -1)
    if out.shape[-1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[-1]), value=-1)
    return out.to(torch.int32)


def flat_exact_select(q: torch.Tensor, k: torch.Tensor, scale: float, config: PisaConfig,
                      causal_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile: the forced leaves plus the ``top_k`` of every visible leaf by the tile
    vote of exact leaf scores (``reference.tile_scores`` over per-row LSEs), causal.

    Args:
        q: ``[B, Hq, Nq, D]`` fp16/bf16/fp32 (CUDA, or the Triton interpreter); k:
            ``[B, Hkv, Nk, D]``; scale: softmax scale; config: ``block_size``, ``top_k``,
            ``query_tile``, ``sink_blocks``, ``local_blocks`` (>= 1) are read;
            causal_offset: query ``i`` sees keys ``j <= i + causal_offset``.

    Returns:
        ``block_indices`` int32 ``[B, Hkv, T, M]`` (ascending, -1 padded) and
        ``block_counts`` int32 ``[B, Hkv, T]``, as ``pisa_compile.select_blocks``.
    """
    import triton

    from pisa_compile.kernels import triton_select
    from pisa_compile.kernels.geometry import block_width, cdiv, forced_ranges

    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    C, Tq = config.block_size, config.query_tile
    L, T = cdiv(Nk, C), cdiv(Nq, Tq)
    dev = q.device
    t = torch.arange(T, device=dev)
    n_sink, lo, hi = forced_ranges(t, Nq, Nk, causal_offset, C, Tq, config.sink_blocks,
                                   config.local_blocks)
    leaf = torch.arange(L, device=dev)[None, :]
    last = torch.clamp((t + 1) * Tq, max=Nq) - 1 + causal_offset  # the tile's last position
    forced = (leaf < n_sink) | ((leaf >= lo[:, None]) & (leaf <= hi[:, None]))
    cand = (leaf * C <= last[:, None]) & ~forced
    W = max(16, triton.next_power_of_2(max(1, int(cand.sum(-1).max()))))
    M = block_width(Nk, C, config.top_k, config.sink_blocks, config.local_blocks, Tq)

    def per_head(x: torch.Tensor) -> torch.Tensor:
        return x.expand(B, Hkv, *x.shape).contiguous()

    short = per_head(_ascending(cand, W))
    fidx = per_head(_ascending(forced, M))
    fcnt = per_head(forced.sum(-1).to(torch.int32))
    idx = torch.empty(B, Hkv, T, M, dtype=torch.int32, device=dev)
    counts = torch.empty(B, Hkv, T, dtype=torch.int32, device=dev)
    lcnt = torch.zeros(B * Hkv * L, dtype=torch.float32, device=dev)  # no non-finite leaves
    # The package's rescoring launch, with every visible leaf as the shortlist.
    meta = dict(TQ=Tq, W=W, TW=16, C=C, BD=max(16, triton.next_power_of_2(D)),
                TOPK=config.top_k, MP=max(16, triton.next_power_of_2(M)))
    triton_select._rescore(q, k, q, lcnt, short, fidx, fcnt, idx, counts, None, None, True,
                           causal_offset, float(scale), L, T, M, meta, None)
    return idx, counts


def flat_exact_kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                scale: float, config: PisaConfig) -> torch.Tensor:
    """Causal attention over :func:`flat_exact_select`'s blocks (queries at the last ``Nq``
    positions, as ``eval_llm.flat_exact_attention``): ``[B, Hq, Nq, Dv]`` in q's dtype."""
    from pisa_compile.kernels import dispatch

    off = k.shape[2] - q.shape[2]
    idx, counts = flat_exact_select(q, k, scale, config, off)
    out, _ = dispatch.attention_forward(q, k, v, None, True, float(scale), idx, counts,
                                        dispatch.TRITON, block_size=config.block_size,
                                        query_tile=config.query_tile, causal_offset=off)
    return out


def _top_votes(lse, cand, tile_of, nt, n_keep):
    """The tile vote (the sum over a tile's rows of each row's softmax over its candidate
    leaves) and its ``n_keep`` best candidates: bool ``[B, Hkv, nt, L]``.

    ``lse``: ``[B, Hkv, G, n, L]`` per-row leaf scores; ``cand``: bool ``[B, Hkv, nt, L]``;
    ``tile_of``: int ``[n]``, the tile of each query."""
    B, Hkv, _, _, L = lse.shape
    x = lse.masked_fill(~cand[:, :, tile_of].unsqueeze(2), float("-inf"))
    z = torch.logsumexp(x, -1, keepdim=True)
    share = torch.where(torch.isfinite(z), torch.exp(x - z), 0.0)
    votes = torch.zeros(B, Hkv, nt, L, device=lse.device).index_add_(2, tile_of, share.sum(2))
    votes = votes.masked_fill(~cand, -1.0)
    top = torch.topk(votes, min(n_keep, L), -1).indices
    return torch.zeros_like(votes, dtype=torch.bool).scatter_(-1, top, True) & cand


def _sub_block_lse(qc, kf, scale, qpos, C, S, bound):
    """Rough per-row leaf scores from ``S``-key sub-block summaries: the LSE over a leaf's
    sub-blocks of ``scale q.mu_s + log n_s`` (pooled means; ``n_s`` keys, ``S`` but in the
    last) or, with ``bound``, of Quest's upper bound ``scale sum_d max(q_d min_d, q_d max_d)
    + log n_s``. Sub-blocks starting past a row's position are left out. Returns
    ``[B, Hkv, G, n, L]`` (fp32)."""
    B, Hkv, G, n, D = qc.shape
    N = kf.shape[2]
    L = -(-N // C)
    kp = torch.nn.functional.pad(kf, (0, 0, 0, L * C - N)).view(B, Hkv, L * C // S, S, D)
    cnt = torch.clamp(N - torch.arange(L * C // S, device=kf.device) * S, 0, S)
    if bound:
        big = torch.finfo(kf.dtype).max
        valid = (torch.arange(L * C, device=kf.device) < N).view(L * C // S, S, 1)
        hi = kp.masked_fill(~valid, -big).amax(3)
        lo = kp.masked_fill(~valid, big).amin(3)
        # sum_d max(q_d hi_d, q_d lo_d) = q+ . hi + q- . lo: two matmuls, no [.., D] product
        s = (torch.einsum("bhgnd,bhsd->bhgns", qc.clamp(min=0), hi)
             + torch.einsum("bhgnd,bhsd->bhgns", qc.clamp(max=0), lo))
    else:
        mu = kp.sum(3) / torch.clamp(cnt, min=1)[:, None]
        s = torch.einsum("bhgnd,bhsd->bhgns", qc, mu)
    s = s * scale + torch.log(cnt.float())
    start = torch.arange(L * C // S, device=kf.device) * S
    s = s.masked_fill(start[None, :] > qpos[:, None], float("-inf"))
    return torch.logsumexp(s.view(B, Hkv, G, n, L, C // S), -1)


def _mean_query_shortlist(qc, kf, scale, cand, last, Tq, C, M):
    """The ``M`` candidates of best vote by each head's tile-mean query: bool
    ``[B, Hkv, nt, L]`` (a subset of ``cand``).

    ``qc``: fp32 ``[B, Hkv, G, n, D]``, the chunk's queries (tiles of ``Tq`` from its start);
    ``kf``: fp32 ``[B, Hkv, N, D]``; ``cand``: bool ``[nt, L]`` candidate leaves per tile;
    ``last``: int ``[nt]``, each tile's last query position (keys past it are unseen);
    ``C``: keys per leaf."""
    B, Hkv, G, n, D = qc.shape
    nt, L = cand.shape
    qp = torch.nn.functional.pad(qc, (0, 0, 0, nt * Tq - n))
    count = torch.clamp(n - torch.arange(nt, device=qc.device) * Tq, max=Tq)
    qm = qp.view(B, Hkv, G, nt, Tq, D).sum(4) / count[:, None]  # [B, Hkv, G, nt, D]
    s = torch.einsum("bhgtd,bhkd->bhgtk", qm, kf) * scale
    N = kf.shape[2]
    s = s.masked_fill(torch.arange(N, device=qc.device)[None, :] > last[:, None], float("-inf"))
    s = torch.nn.functional.pad(s, (0, L * C - N), value=float("-inf"))
    lse = torch.logsumexp(s.view(B, Hkv, G, nt, L, C), -1).masked_fill(~cand, float("-inf"))
    z = torch.logsumexp(lse, -1, keepdim=True)
    votes = torch.where(torch.isfinite(z), torch.exp(lse - z), 0.0).sum(2)  # [B, Hkv, nt, L]
    votes = votes.masked_fill(~cand, -1.0)
    top = torch.topk(votes, min(M, L), -1).indices
    return torch.zeros_like(votes, dtype=torch.bool).scatter_(-1, top, True) & cand


def use_attention(model, name: str, config: Optional[PisaConfig],
                  ceiling: Optional[dict] = None) -> None:
    """Switch ``model`` to dense SDPA (``config`` None), to PISA with ``config``, or, with
    ``ceiling`` (the keyword arguments of :func:`flat_exact_attention`, ``{}`` for none), to
    that oracle with ``config``'s budget."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if config is None:
        model.set_attn_implementation("sdpa")
        return
    key = f"pisa_eval_{name}"
    if ceiling is not None:
        def fn(module, query, key_, value, attention_mask, scaling=None, **kwargs):
            _refuse_extras(kwargs)
            if attention_mask is not None:
                raise ValueError("the ceiling takes unpadded causal prompts only")
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            opts = dict(ceiling)
            if opts.pop("kernel", False):
                out = flat_exact_kernel_attention(query, key_, value, scale, config)
            else:
                out = flat_exact_attention(query, key_, value, scale, config, **opts)
            return out.transpose(1, 2).contiguous(), None
        AttentionInterface.register(key, fn)
    else:
        AttentionInterface.register(key, attention_function(config))
    AttentionMaskInterface.register(key, sdpa_mask)
    model.set_attn_implementation(key)
    if model.config._attn_implementation != key:
        raise RuntimeError(f"transformers did not switch the model to {key!r}")


@torch.no_grad()
def _retrieved(model, case: Case, device, cache: Optional[Callable] = None
               ) -> tuple[bool, float, int]:
    """Whether greedy decoding after the prompt gives every answer token, as ``generate()``
    would: the prompt (the case without its answer) is prefilled, then each answer token is
    fed back through the KV cache (one query per step). Teacher forcing the answer inside the
    prefill would let the answer's own queries vote in the last query tile's selection.
    Also returns the prefill's wall time (ms), and the first answer token predicted wrong
    (-1: none; 0 is the prefill's own prediction, later ones decode steps, each fed the true
    answer so far). ``cache``: called with the case's length, returns the
    ``past_key_values`` the prefill starts from (default: the model's own cache)."""
    ids = case.input_ids.to(device)[None]
    prompt, answer = ids[:, :-case.n_answer], ids[0, -case.n_answer:]
    kw = {} if cache is None else {"past_key_values": cache(ids.shape[1])}
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model(prompt, logits_to_keep=1, use_cache=True, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    preds = [out.logits[0, -1].argmax()]
    for tok in answer[:-1]:
        out = model(tok.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
        preds.append(out.logits[0, -1].argmax())
    right = torch.stack(preds) == answer
    miss = int((~right).nonzero()[0, 0]) if not bool(right.all()) else -1
    return miss < 0, ms, miss


@torch.no_grad()
def _tail_loss(model, ids: torch.Tensor, device) -> float:
    """Mean next-token NLL (nats) over the last quarter of ``ids``."""
    ids = ids.to(device)[None]
    n = ids.shape[1]
    keep = n // 4
    logits = model(ids, logits_to_keep=keep + 1).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, n - keep:]))


def evaluate(model, tokenizer, lengths: Sequence[int], configs: dict, *, repeats: int = 3,
             loss_windows_per_length: int = 4, bos: Optional[int] = None,
             ceilings: Optional[dict] = None, ceiling_lengths: Optional[Sequence[int]] = None,
             progress: Callable[[str], None] = lambda s: None,
             checkpoint: Callable[[dict], None] = lambda r: None,
             pyramid_decode: Sequence[str] = ()) -> dict:
    """Retrieval and loss of ``model`` under dense SDPA and each PISA option set.

    Args:
        model: a transformers causal LM (it is switched between attention implementations).
        tokenizer: its tokenizer.
        lengths: sequence lengths N (tokens).
        configs: name -> :class:`PisaConfig`; dense SDPA is always run, as ``"dense"``.
        ceilings: name -> ``(PisaConfig, oracle keyword arguments)`` run by
            :func:`flat_exact_attention`, at ``ceiling_lengths`` only (default: every length;
            the oracle is quadratic).
        progress: called with a line per (length, option set).
        checkpoint: called with the partial report after each (length, option set).
        repeats: cases per (task, depth); see :func:`needle_cases`.
        loss_windows_per_length: held-out windows per length for the loss.
        pyramid_decode: names among ``configs`` run once more, as ``"<name>+pyramid"``, with
            each case prefilled into a :class:`~pisa_compile.hf_cache.PisaCache` of that
            config (``sparse_from=0``): the decode steps then select from the cache's
            persistent pyramid (``generate(past_key_values=PisaCache(...))``; Triton only:
            elsewhere they stay dense). Retrieval only (the loss is the config's own), and
            ``sparse_decode_steps`` counts the steps the pyramid served.

    Returns:
        ``{"lengths": [...], "results": {config: {str(N): {"retrieval", "cases", "by_task",
        "loss", "loss_windows", "loss_vs_dense", "prefill_ms", "hits", "first_miss"}}}}``;
        ``prefill_ms`` is the median prefill time over the cases (ms), ``loss_vs_dense`` a
        relative change,
        ``hits`` the per-case outcomes (1/0, in case order), so runs can be paired case by
        case, and ``first_miss`` per case the first answer token predicted wrong (-1: none;
        0: by the prefill, later: by a decode step).
    """
    device = next(model.parameters()).device
    ceilings = ceilings or {}
    unknown = [c for c in pyramid_decode if c not in configs]
    if unknown:
        raise ValueError(f"pyramid_decode: {unknown} are not among configs {list(configs)}")
    runs = {"dense": None, **configs, **{c: cfg for c, (cfg, _) in ceilings.items()},
            **{f"{c}+pyramid": configs[c] for c in pyramid_decode}}
    results: dict = {name: {} for name in runs}
    report = {"lengths": list(lengths), "results": results}
    for n in lengths:
        cases = needle_cases(tokenizer, n, repeats=repeats, bos=bos)
        windows = loss_windows(tokenizer, n, loss_windows_per_length, bos=bos)
        for name, cfg in runs.items():
            if name in ceilings and ceiling_lengths is not None and n not in ceiling_lengths:
                continue
            pyramid = name.endswith("+pyramid")
            if pyramid and not cases:
                continue  # retrieval only
            use_attention(model, name, cfg,
                          ceiling=ceilings[name][1] if name in ceilings else None)
            cache = None
            if pyramid:
                from pisa_compile.hf_cache import PisaCache
                cache = functools.partial(PisaCache, config=cfg, sparse_from=0)
            # warm-up: kernels compile once (with no cases, the first loss window is it)
            if cases:
                _retrieved(model, cases[0], device, cache)
            else:
                _tail_loss(model, windows[0], device)
            steps0 = counters["pisa"]["sparse_decode"]
            oks, times, by_task, misses = [], [], {}, []
            for case in cases:
                ok, ms, miss = _retrieved(model, case, device, cache)
                oks.append(ok)
                misses.append(miss)
                times.append(ms)
                by_task.setdefault(case.task, []).append(ok)
            losses = [] if pyramid else [_tail_loss(model, w, device) for w in windows]
            # repeats=0: loss only (retrieval and prefill time None)
            row = {"retrieval": sum(oks) / len(oks) if oks else None, "cases": len(oks),
                   "by_task": {t: sum(v) / len(v) for t, v in by_task.items()},
                   "loss": sum(losses) / len(losses) if losses else None,
                   "loss_windows": len(losses),
                   "prefill_ms": sorted(times)[len(times) // 2] if times else None,
                   "hits": [int(o) for o in oks], "first_miss": misses}
            if pyramid:
                row["sparse_decode_steps"] = counters["pisa"]["sparse_decode"] - steps0
            results[name][str(n)] = row
            row["loss_vs_dense"] = (None if row["loss"] is None else
                                    row["loss"] / results["dense"][str(n)]["loss"] - 1.0)
            hits = f"retrieval {row['retrieval']:.3f} ({len(oks)} cases), " if oks else ""
            ms = f", prefill {row['prefill_ms']:.1f} ms" if times else ""
            loss = ("" if row["loss"] is None else
                    f"loss {row['loss']:.4f} ({row['loss_vs_dense']:+.2%})")
            steps = (f", {row['sparse_decode_steps']} sparse decode steps" if pyramid else "")
            progress(f"N={n} {name}: {hits}{loss}{ms}{steps}")
            checkpoint(report)
    return report


def load_gguf(path: str, device: str = "cuda", dtype=torch.bfloat16):
    """The model and tokenizer of a GGUF file (transformers de-quantizes it; needs ``gguf``)."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    return model.to(device).eval(), tok


def plot(report: dict, path: str) -> None:
    """Retrieval against length, one line per option set (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in report["results"].items():
        xs = [int(n) for n in rows]
        ax.plot(xs, [rows[n]["retrieval"] for n in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle retrieval")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="path of the model's .gguf file")
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384, 30000])
    ap.add_argument("--repeats", type=int, default=3,
                    help="cases per (task, depth); 0: the loss only")
    ap.add_argument("--loss-windows", type=int, default=4)
    ap.add_argument("--configs", nargs="*", default=list(CANDIDATES),
                    help=f"option sets among {list(CANDIDATES)}")
    ap.add_argument("--ceilings", nargs="*", default=list(CEILINGS),
                    help=f"block-level ceilings among {list(CEILINGS)}")
    ap.add_argument("--ceiling-lengths", type=int, nargs="*",
                    help="lengths the ceilings run at (default: all)")
    ap.add_argument("--pyramid-decode", nargs="*", default=[],
                    help="configs (among --configs) also run with a PisaCache: decode steps "
                         "select from its persistent pyramid")
    ap.add_argument("--json", help="written after every row, so a cut-off run keeps its rows")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    unknown = [c for c in args.configs if c not in CANDIDATES]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; expected some of {list(CANDIDATES)}")
    unknown = [c for c in args.pyramid_decode if c not in args.configs]
    if unknown:
        ap.error(f"--pyramid-decode: {unknown} are not among --configs {args.configs}")
    unknown = [c for c in args.ceilings if c not in CEILINGS]
    if unknown:
        ap.error(f"--ceilings: unknown {unknown}; expected some of {list(CEILINGS)}")
    model, tok = load_gguf(args.gguf)
    configs = {c: candidate_config(c) for c in args.configs}
    ceilings = {}
    for c in args.ceilings:
        opts = dict(CEILINGS[c])
        oracle = {key: opts.pop(key) for key in ORACLE_KEYS if key in opts}
        ceilings[c] = (PisaConfig.preset("fast", **opts), oracle)
    meta = {"model": args.gguf.rsplit("/", 1)[-1], "repeats": args.repeats,
            "retrieval_method": "prefill the prompt, then the answer token by token through "
                                "the KV cache (greedy generate()'s outcome)",
            "options": {c: CANDIDATES[c] for c in args.configs},
            "ceilings": {c: CEILINGS[c] for c in args.ceilings},
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__}

    def save(report):
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**meta, **report}, f, indent=1)

    report = evaluate(model, tok, args.lengths, configs, ceilings=ceilings, repeats=args.repeats,
                      loss_windows_per_length=args.loss_windows,
                      ceiling_lengths=args.ceiling_lengths, pyramid_decode=args.pyramid_decode,
                      progress=lambda s: print(s, flush=True), checkpoint=save)
    save(report)
    if args.png:
        plot(report, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
