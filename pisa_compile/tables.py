"""Plain-text tables, the one format of every table this package prints."""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence], title: Optional[str] = None) -> str:
    """Left-aligned columns two spaces apart, the header underlined with dashes; ``title`` on
    its own line above. Cells are converted with ``str``. Returns the text, newline-terminated."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(([title, ""] if title else []) + lines) + "\n"
