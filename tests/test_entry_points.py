"""Every script the READMEs name runs as ``python -m <module>``: it has a ``__main__`` guard
that calls its ``main`` (``--help`` exits 0 and prints its usage)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["experiments.selection_study", "experiments.code_model",
                                    "pisa_compile"])
def test_module_runs_as_script(module):
    res = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout


def test_version_flag_prints_the_package_version():
    from pisa_compile._version import __version__
    res = subprocess.run([sys.executable, "-m", "pisa_compile", "--version"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == f"pisa_compile {__version__}"


@pytest.mark.parametrize("path", sorted((ROOT / "experiments").glob("*.py"))
                         + sorted((ROOT / "benchmarks").glob("*.py")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scripts_have_a_main_guard(path):
    if path.name.startswith("_"):  # __init__ and private helpers: not scripts
        return
    assert 'if __name__ == "__main__":' in path.read_text()
