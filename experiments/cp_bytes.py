"""Bytes that context-parallel PISA moves per rank, against ring attention, on real queries
and keys (issue #17).

For each layer of the trained code model (``experiments/code_model.py``; 6 query and 2 KV
heads of 64) on held-out Python source, single-process PISA selects with the context-parallel
options; each rank of a zig-zag layout over ``W`` ranks then receives the chosen blocks that
others own (per batch row and KV head, the union over its tiles) and the other ranks' leaf
sums. ``tests/test_context_parallel.py`` checks that ``context_parallel_attention`` receives
exactly these bytes. Ring attention receives the ``W - 1`` other shards of K and V.

    python -m experiments.cp_bytes --lengths 16384 32768 65536 --worlds 2 4 8 \\
        --out profiles/cp_bytes.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Optional

import torch

from pisa_compile.context_parallel import CP_CONFIG
from pisa_compile.ops import select_blocks


def received_leaves(block_indices: torch.Tensor, n_leaves: int, world: int) -> list[int]:
    """Per rank, the (batch row, KV head, leaf) blocks its tiles chose that another rank owns.

    Args:
        block_indices: int32 ``[B, Hkv, T, M]`` of a causal selection over the whole
            sequence (-1 padded); ``T`` and ``n_leaves`` multiples of ``2 * world``.
    """
    B, H, T, _ = block_indices.shape
    tiles, leaves = T // (2 * world), n_leaves // (2 * world)
    chunk = torch.arange(n_leaves) // leaves
    owner = torch.where(chunk < world, chunk, 2 * world - 1 - chunk)
    out = []
    for r in range(world):
        need = torch.zeros(B, H, n_leaves + 1, dtype=torch.bool)
        for c in (r, 2 * world - 1 - r):
            bi = block_indices[:, :, c * tiles:(c + 1) * tiles]
            need.scatter_(2, torch.where(bi < 0, n_leaves, bi).long().flatten(2), True)
        out.append(int((need[..., :n_leaves] & (owner != r)).sum()))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--layers", type=int, nargs="*", default=None,
                   help="layer indices (default: every layer)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    from .selection_study import code_model_qk

    config = CP_CONFIG
    C, value_bytes = config.block_size, 2  # bf16 K and V
    rows = []
    for n in a.lengths:
        layers = code_model_qk(n)
        for li, (q, k) in enumerate(layers):
            if a.layers is not None and li not in a.layers:
                continue
            bi, _ = select_blocks(q, k, is_causal=True, enable_gqa=True, config=config)
            B, Hkv, _, D = k.shape
            L = n // C
            for w in a.worlds:
                per_rank = received_leaves(bi, L, w)
                block = [x * C * 2 * D * value_bytes for x in per_rank]  # K and V
                summary = (w - 1) * (L // w) * B * Hkv * D * 4  # fp32 leaf sums
                ring = 2 * (w - 1) * (n // w) * B * Hkv * D * value_bytes
                rows.append(dict(length=n, layer=li, world=w, ring_bytes=ring,
                                 summary_bytes=summary, block_bytes_max=max(block),
                                 block_bytes_mean=sum(block) / w,
                                 ratio_max=(max(block) + summary) / ring))
                print(f"N={n} layer {li} W={w}: PISA max {max(block) + summary:,} B per rank "
                      f"({rows[-1]['ratio_max']:.1%} of ring's {ring:,})", flush=True)
    if a.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        a.out.write_text(json.dumps(dict(
            command="python -m experiments." + Path(__file__).stem + " " + " ".join(argv or []),
            commit=commit, model="experiments/data/code_model_pisa.pt (6 q / 2 KV heads of 64)",
            config={f: getattr(config, f) for f in ("block_size", "top_k", "query_tile",
                                                    "sink_blocks", "local_blocks", "branching",
                                                    "beam", "leaf_scoring")},
            note="bytes per rank per attention call; K and V in bf16, leaf sums in fp32",
            rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
