"""Real inputs without a network: Python standard-library text, and a tiny Llama.

Shared by ``python -m pisa_compile profile`` (its default model), the demo and the
experiments. Nothing here is needed by the compiler itself.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import torch

__all__ = ["stdlib_files", "stdlib_docstrings", "stdlib_bytes", "tiny_llama"]


def stdlib_files() -> list[Path]:
    """The standard library's top-level public ``*.py`` files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))


def stdlib_docstrings(n: int = 50, min_chars: int = 300) -> list[str]:
    """Module docstrings of the standard library, whitespace collapsed, sorted by module name:
    the first ``n`` that have at least ``min_chars`` characters (long enough for several key
    blocks)."""
    docs = []
    for path in stdlib_files():
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and len(doc) >= min_chars:
            docs.append(" ".join(doc.split()))
        if len(docs) == n:
            break
    return docs


def stdlib_bytes(n: int = 8192) -> torch.Tensor:
    """The first ``n`` bytes of the concatenated standard-library sources: int64 ``[n]``."""
    buf = bytearray()
    for path in stdlib_files():
        buf += path.read_bytes()
        if len(buf) >= n:
            break
    return torch.tensor(list(buf[:n]), dtype=torch.long)


def tiny_llama(max_positions: int = 8192, num_layers: int = 4):
    """A small random-init ``transformers.LlamaForCausalLM`` over bytes (vocabulary 256):
    ``num_layers`` layers, hidden 256, GQA with 8 query and 2 KV heads of 32, SDPA attention,
    eval mode. Seeded (``torch.manual_seed(0)``), so every call builds the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=num_layers, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=max_positions, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()
