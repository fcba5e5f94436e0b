"""``python -m pisa_compile <command>``; ``demo`` is the main job."""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Subcommands with flags of their own parse the rest of the command line themselves.
    if argv[:1] == ["profile"]:
        from .profiling_cli import main as profile_main
        return profile_main(argv[1:])
    if argv[:1] == ["eval-selection"]:
        from .selection_study import main as study_main
        return study_main(argv[1:])
    if argv[:1] == ["train-code-model"]:
        from .code_model import main as train_main
        return train_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m pisa_compile",
        description="PISA sparse attention for torch.compile (backend='pisa').")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="MiniLM embeddings and a Llama-architecture LM on real "
                                "standard-library text, dense against PISA (CPU, offline)")
    sub.add_parser("profile", add_help=False,
                   help="profile PISA against Inductor dense per stage: tables, summary.json, "
                        "plots, TensorBoard/Perfetto traces (see `profile --help`)")
    sub.add_parser("eval-selection", add_help=False,
                   help="selection recall@K and attention mass against the exact oracle, on "
                        "real MiniLM or code-model queries and keys (see `eval-selection "
                        "--help`)")
    sub.add_parser("train-code-model", add_help=False,
                   help="GPU: train the byte-level code model with dense and with PISA "
                        "attention and compare them (see `train-code-model --help`)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main
        return demo_main()
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
