"""``python -m pisa_compile profile ...``: the package's command line
(``python -m pisa_compile --version`` prints the version).

The demo (``make demo``) and the studies live outside the package, in ``experiments/``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from ._version import __version__


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # A subcommand with flags of its own parses the rest of the command line itself.
    if argv[:1] == ["profile"]:
        from .profiling_cli import main as profile_main
        return profile_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m pisa_compile",
        description="PISA sparse attention for torch.compile (backend='pisa').",
        epilog="The demo is `make demo`; the studies are in experiments/ (see its README).")
    parser.add_argument("--version", action="version", version=f"pisa_compile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("profile", add_help=False,
                   help="profile PISA against Inductor dense per stage: tables, summary.json, "
                        "plots, TensorBoard/Perfetto traces (see `profile --help`)")
    parser.parse_args(argv)
    return 2  # not reached: "profile" returned above, anything else is a usage error


if __name__ == "__main__":
    sys.exit(main())
