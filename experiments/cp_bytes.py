"""Bytes that context-parallel PISA moves per rank, against ring attention, on real queries
and keys (issue #17).

For each layer of the trained code model (``experiments/code_model.py``; 6 query and 2 KV
heads of 64) on held-out Python source, single-process PISA selects with the context-parallel
options; each rank of a zig-zag layout over ``W`` ranks then receives the chosen blocks that
others own (per batch row and KV head, the union over its tiles) and the other ranks' leaf
sums. ``tests/test_context_parallel.py`` checks that ``context_parallel_attention`` receives
exactly these bytes. Ring attention receives the ``W - 1`` other shards of K and V.

``--budgets F ...`` asks what ``context_parallel_attention(fetch_budget=F)`` costs (the
cap, :func:`~pisa_compile.context_parallel.cap_fetch`): each rank fetches at most the ``F``
fraction of the remote leaves (per batch row and KV head) that most of its tiles chose
(plus the forced ones: sinks, and the local leaves before each chunk), and its tiles drop
the other remote blocks they chose. The attention mass the rows keep (``metrics``, against
dense attention) is reported beside the unconstrained selection's.

    python -m experiments.cp_bytes --lengths 16384 32768 65536 --worlds 2 4 8 \\
        --out profiles/cp_bytes.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

from pisa_compile import PisaConfig
from pisa_compile.context_parallel import CP_CONFIG, cap_fetch
from pisa_compile.ops import select_blocks


def budgeted(block_indices: torch.Tensor, block_counts: torch.Tensor, n_leaves: int,
             world: int, budget: float, config) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The selection with each rank's fetch capped by
    :func:`pisa_compile.context_parallel.cap_fetch` (what ``context_parallel_attention``'s
    ``fetch_budget`` runs): the whole sequence's new ``block_indices`` and ``block_counts``,
    and per rank the remote leaves fetched (summed over batch rows and KV heads; with
    ``budget=1``, every remote block its tiles chose that their queries can see)."""
    T = block_indices.shape[2]
    tiles, leaves = T // (2 * world), n_leaves // (2 * world)
    bi, bc, fetched = block_indices.clone(), block_counts.clone(), []
    for r in range(world):
        rows = [slice(c * tiles, (c + 1) * tiles) for c in (r, 2 * world - 1 - r)]
        capped, n = cap_fetch([(block_indices[:, :, s], block_counts[:, :, s]) for s in rows],
                              world=world, rank=r, chunk_leaves=leaves, config=config,
                              fetch_budget=budget)
        for s, (i, c) in zip(rows, capped):
            bi[:, :, s], bc[:, :, s] = i, c
        fetched.append(int(n))
    return bi, bc, fetched


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--layers", type=int, nargs="*", default=None,
                   help="layer indices (default: every layer)")
    p.add_argument("--budgets", type=float, nargs="*", default=[],
                   help="fetch caps (context_parallel_attention's fetch_budget): fractions "
                        "of ring attention's K/V bytes")
    p.add_argument("--compare", action="store_true",
                   help="also the attention mass of single-process selections that need keys "
                        "(the defaults: exact leaves, 16-key box bounds) or per-leaf boxes")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    from pisa_compile.metrics import block_mass, selection_recall
    from .selection_study import code_model_qk

    config = CP_CONFIG
    C, value_bytes = config.block_size, 2  # bf16 K and V
    rows = []
    for n in a.lengths:
        layers = code_model_qk(n)
        for li, (q, k) in enumerate(layers):
            if a.layers is not None and li not in a.layers:
                continue
            bi, bc = select_blocks(q, k, is_causal=True, enable_gqa=True, config=config)
            B, Hkv, _, D = k.shape
            L = n // C
            oracle = None
            if a.budgets or a.compare:  # one dense oracle per layer for every selection
                oracle = block_mass(q, k, None, True, q.shape[-1] ** -0.5, config)
            if a.compare:
                for name, other in (("default", PisaConfig(min_seq_len=0)),
                                    ("pooled+leaf boxes", config.replace(bound_block=C))):
                    m = selection_recall(q, k, other, is_causal=True, mass=oracle).mass_ratio
                    rows.append(dict(length=n, layer=li, config=name, mass_ratio=m))
                    print(f"N={n} layer {li}: {name} mass {m:.4f}", flush=True)
            mass = None
            if a.budgets or a.compare:
                mass = selection_recall(q, k, config, is_causal=True, block_indices=bi,
                                        block_counts=bc, mass=oracle).mass_ratio
            for w in a.worlds:
                # Budget 1 caps nothing: per rank, the remote blocks its queries' tiles chose.
                per_rank = budgeted(bi, bc, L, w, 1.0, config)[2]
                block = [x * C * 2 * D * value_bytes for x in per_rank]  # K and V
                summary = (w - 1) * (L // w) * B * Hkv * D * 4  # fp32 leaf sums
                ring = 2 * (w - 1) * (n // w) * B * Hkv * D * value_bytes
                rows.append(dict(length=n, layer=li, world=w, ring_bytes=ring,
                                 summary_bytes=summary, block_bytes_max=max(block),
                                 block_bytes_mean=sum(block) / w,
                                 ratio_max=(max(block) + summary) / ring))
                print(f"N={n} layer {li} W={w}: PISA max {max(block) + summary:,} B per rank "
                      f"({rows[-1]['ratio_max']:.1%} of ring's {ring:,})"
                      + (f", mass {mass:.4f}" if mass is not None else ""), flush=True)
                rows[-1]["mass_ratio"] = mass
                for f in a.budgets:
                    capped, counts, fetched = budgeted(bi, bc, L, w, f, config)
                    m = selection_recall(q, k, config, is_causal=True, block_indices=capped,
                                         block_counts=counts, mass=oracle).mass_ratio
                    fb = max(fetched) * C * 2 * D * value_bytes + summary
                    rows.append(dict(length=n, layer=li, world=w, budget=f, ring_bytes=ring,
                                     bytes_max=fb, ratio_max=fb / ring, mass_ratio=m))
                    print(f"    budget {f:.0%}: {fb / ring:.1%} of ring, mass {m:.4f}",
                          flush=True)
    if a.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        a.out.write_text(json.dumps(dict(
            command=" ".join(["python -m experiments." + Path(__file__).stem,
                              *(sys.argv[1:] if argv is None else argv)]),
            commit=commit, model="experiments/data/code_model_pisa.pt (6 q / 2 KV heads of 64)",
            config={f: getattr(config, f) for f in ("block_size", "top_k", "query_tile",
                                                    "sink_blocks", "local_blocks", "branching",
                                                    "beam", "leaf_scoring")},
            note="bytes per rank per attention call; K and V in bf16, leaf sums in fp32",
            rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
