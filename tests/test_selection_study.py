"""The selection study (``python -m pisa_compile eval-selection``) on small inputs."""

import json

import pytest
import torch

from pisa_compile import PisaConfig
from pisa_compile.selection_study import main, run_study, variants


def test_variants_share_top_k_and_flat_means_one_pool():
    base = PisaConfig(block_size=16, min_seq_len=0)
    vs = variants(4, 40, base)
    assert vs["flat pooled"].effective_beam >= 40 and vs["pyramid beam=k"].effective_beam == 4
    assert vs["flat exact (ceiling)"].leaf_scoring == "exact"
    assert {v.top_k for n, v in vs.items() if "2k blocks" not in n} == {4}


def test_study_reports_bounded_figures():
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 2, 128, 16, generator=g), torch.randn(1, 2, 128, 16, generator=g))]
    res = run_study(layers, PisaConfig(block_size=8, top_k=2, query_tile=16, min_seq_len=0), 2,
                    is_causal=True, progress=False)
    assert len(res) == len(variants(2, 16, PisaConfig()))
    for r in res.values():
        assert 0.0 <= r["recall"] <= 1.0 and 0.0 <= r["mass_ratio"] <= 1.0 + 1e-6
        assert r["select_s"] >= 0
    # Attending 2k blocks keeps at least the mass that k blocks of the same walk keep.
    assert res["pyramid pooled, 2k blocks (FLOPs of exact)"]["mass_ratio"] >= \
        res["pyramid beam=2k"]["mass_ratio"] - 1e-6


def test_cli_rejects_bad_top_k(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--top-k", "0"])
    assert e.value.code == 2 and "--top-k" in capsys.readouterr().err
