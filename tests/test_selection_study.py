"""The selection study (``python -m experiments.selection_study``) on small inputs."""

import json

import pytest
import torch

from pisa_compile import PisaConfig
from experiments.selection_study import main, run_study, variants


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


def test_code_model_source_end_to_end(tmp_path):
    """``--source code-model``: real q/k of a (tiny, saved) code model, causal, per length."""
    from experiments import code_model as cm
    torch.manual_seed(0)
    ck = tmp_path / "tiny.pt"
    cm.save_checkpoint(cm.CodeModel(cm.CodeModelConfig(dim=64, n_layers=2, n_heads=4,
                                                       n_kv_heads=2, ffn_dim=128)), ck)
    from experiments.selection_study import code_model_qk
    layers = code_model_qk(192, ck, "cpu")
    assert len(layers) == 2 and layers[0][0].shape == (1, 4, 192, 16)
    assert layers[0][1].shape == (1, 2, 192, 16)
    # Layer 0's q/k recomputed by hand: the rotated projections of the normed embeddings.
    model = cm.load_checkpoint(ck)
    ids = cm.load_bytes("heldout", 192).long()[None]
    with torch.no_grad():
        x = model.layers[0].attn_norm(model.embed(ids))
        att = model.layers[0].attn
        ang = torch.arange(192, dtype=torch.float32)[:, None] * model.inv_freq[None, :]
        q = att.wq(x).view(1, 192, 4, 16).transpose(1, 2)
        k = att.wk(x).view(1, 192, 2, 16).transpose(1, 2)
        torch.testing.assert_close(layers[0][0], cm._rope(q, ang.cos(), ang.sin()))
        torch.testing.assert_close(layers[0][1], cm._rope(k, ang.cos(), ang.sin()))
    rc = main(["--source", "code-model", "--checkpoint", str(ck), "--lengths", "128,256",
               "--query-tiles", "16", "--block-size", "16", "--top-k", "2",
               "--device", "cpu", "--out", str(tmp_path)])
    body = json.loads((tmp_path / "selection_code_model.json").read_text())
    assert rc == 0 and set(body["results_by_length"]) == {"0.125K", "0.25K"}
    for res in body["results_by_length"].values():
        assert "pyramid beam=k, query_tile=16" in res and "pyramid beam=k, query_tile=1" not in res
        assert all(0.0 <= r["recall"] <= 1.0 for r in res.values())
        # The flat exact scan is the ceiling of the pooled pyramid at the same top_k.
        assert res["flat exact (ceiling)"]["mass_ratio"] >= \
            res["pyramid beam=k"]["mass_ratio"] - 1e-6
    assert (tmp_path / "selection_code_model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, flag", [(["--lengths", "4k"], "--lengths"),
                                        (["--query-tiles", "0"], "--query-tiles")])
def test_cli_rejects_bad_lists(args, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--source", "code-model"] + args)
    assert e.value.code == 2 and flag in capsys.readouterr().err
