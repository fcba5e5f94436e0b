"""Plot ``bench_pisa.py --json`` results: forward time against N (log-log), one line per method.

    python -m benchmarks.plot_bench profiles/bench_pisa.json profiles/bench_pisa.png
"""

from __future__ import annotations

import json
import re
import sys

SERIES = {  # label -> key prefix in median_ms ("<prefix> N=<n>K")
    "PISA forward (selection + attention)": "pisa fwd",
    "PISA selection only": "pisa_select fwd",
    "PISA attention only (its selection)": "pisa_attention fwd",
    "FlexAttention, same selection": "flex fwd",
    "SDPA default (GQA)": "sdpa_default fwd",
    "SDPA FLASH (K/V expanded)": "sdpa_flash fwd",
    "flat per-token block scoring": "flat_select fwd",
}


def plot(json_path: str, png_path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(json_path))
    ms = data["median_ms"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, prefix in SERIES.items():
        pts = sorted((int(m.group(1)) * 1024, t) for key, t in ms.items()
                     if (m := re.fullmatch(re.escape(prefix) + r" N=(\d+)K", key)))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N (tokens)")
    ax.set_ylabel("median time (ms)")
    ax.set_title(f"{data['device']}, {data['setting'].split(';')[0]}\n"
                 f"torch {data['torch']}, triton {data.get('triton')}, commit {data.get('commit')}",
                 fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])
