"""The code-model study's pieces on the CPU: planting, a few training steps with each
attention (PISA in its sparse regime), evaluation, and the checkpoint round trip."""

from __future__ import annotations

import random

import pytest
import torch

from experiments import code_model as cm

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
TINY = cm.CodeModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
SPARSE = {"min_seq_len": 0, "block_size": 16, "query_tile": 16, "top_k": 2, "dense_tail": 0}


def test_plant_writes_definition_and_query():
    w = torch.full((400,), ord("x"), dtype=torch.long)
    out, v_at, start = cm.plant(w, random.Random(0), 0.3)
    assert start == 120
    text = bytes(out.tolist()).decode()
    value = text[v_at:v_at + 6]
    assert value.isdigit()
    name = text[text.index("\nkey_") + 1:].split(" ")[0]
    assert f'\n{name} = "{value}"\n' in text[:200]
    assert text.endswith(f'\n{name} = "{value}"\n') and v_at > 300
    assert out.numel() == 400


def test_sources_split_by_file():
    files = cm.python_sources()[:400]
    held = [p for p in files if cm.held_out(p)]
    assert files and 0 < len(held) < len(files)
    assert all(cm.held_out(p) == cm.held_out(p) for p in held)  # stable
    data = cm.load_bytes("heldout", 1 << 16)
    assert data.dtype == torch.uint8 and data.numel() == 1 << 16


@pytest.mark.parametrize("attention", ["dense", "pisa"])
def test_train_evaluate_and_checkpoint(attention, tmp_path):
    data = cm.load_bytes("train", 1 << 18)
    model, rec = cm.train(attention, data, steps=3, time_budget=None, length=128, batch=2,
                          lr=1e-3, seed=0, device="cpu", log=lambda m: None,
                          model_config=TINY, options=SPARSE)
    assert rec["steps"] == 3 and all(torch.isfinite(torch.tensor(rec["loss_curve"])))
    from torch._dynamo.utils import counters
    assert counters["pisa"]["rewritten"] == (TINY.n_layers if attention == "pisa" else 0)
    model.eval()
    bpb = cm.bits_per_byte(model, data, 128, 2, "cpu")
    assert 0 < bpb < 9  # untrained: about 8 bits per byte
    acc = cm.retrieval(model, data, [128], [0.5], 2, "cpu")
    assert set(acc) == {"0.125K@0.5"} and 0 <= acc["0.125K@0.5"] <= 1
    path = tmp_path / "m.pt"
    cm.save_checkpoint(model, path, SPARSE if attention == "pisa" else None)
    back = cm.load_checkpoint(path)
    # Saved options are changes to the "fast" preset (the defaults they were written for).
    assert back.pisa_options == {"preset": "fast", **(SPARSE if attention == "pisa" else {})}
    ids = torch.randint(0, 256, (1, 64))
    with torch.no_grad():  # the weights round to bf16; the RoPE buffer is rebuilt in fp32
        for prm in model.parameters():
            prm.copy_(prm.to(torch.bfloat16).float())
    torch.testing.assert_close(back(ids), model(ids), rtol=1e-4, atol=1e-4)


def test_dense_warmup_switches_to_pisa_after_its_steps():
    """``dense_warmup_steps``: the first steps are a dense run's (same seed: same losses), then
    every layer is rewritten to PISA, which changes the loss from there on."""
    from torch._dynamo.utils import counters
    data = cm.load_bytes("train", 1 << 18)
    kw = dict(time_budget=None, length=128, batch=2, lr=1e-3, seed=0, device="cpu",
              log=lambda m: None, model_config=TINY, options=SPARSE)
    _, dense = cm.train("dense", data, steps=4, **kw)
    counters.clear()
    _, warm = cm.train("pisa", data, steps=4, dense_warmup_steps=2, **kw)
    assert warm["steps"] == 4 and warm["dense_warmup_steps"] == 2
    assert warm["pisa_sites_rewritten"] == TINY.n_layers == counters["pisa"]["rewritten"]
    # loss_curve keeps every 10th step: step 0 only; compare the final losses too.
    assert warm["loss_curve"][0] == pytest.approx(dense["loss_curve"][0], rel=1e-5)
    assert warm["final_loss"] != pytest.approx(dense["final_loss"], rel=1e-6)


def test_compile_mode_reaches_both_backends(monkeypatch):
    """``torch.compile`` takes mode or options, not both: for PISA the mode's Inductor options
    are merged under the PISA ones, which the backend validates and splits."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append(kw) or model)
    m = cm.CodeModel(TINY)
    cm.compile_model(m, "pisa", options={"top_k": 2}, mode="reduce-overhead")
    cm.compile_model(m, "dense", mode="reduce-overhead")
    assert calls[0]["options"] == {"triton.cudagraphs": True, "top_k": 2}
    assert "mode" not in calls[0] and calls[1]["mode"] == "reduce-overhead"
    from pisa_compile.config import split_options
    config, patches = split_options(calls[0]["options"])
    assert config.top_k == 2 and patches == {"triton.cudagraphs": True}


@pytest.mark.parametrize("warmup, steps", [(-1, 4), (4, 4), (9, 4)])
def test_dense_warmup_that_leaves_no_pisa_step_is_refused(warmup, steps):
    data = cm.load_bytes("train", 1 << 16)
    with pytest.raises(ValueError, match="dense_warmup_steps"):
        cm.train("pisa", data, steps=steps, time_budget=None, length=64, batch=1, lr=1e-3,
                 seed=0, device="cpu", log=lambda m: None, model_config=TINY,
                 dense_warmup_steps=warmup)


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no code-model checkpoint"):
        cm.load_checkpoint(tmp_path / "none.pt")


def test_cli_runs_and_writes_json(tmp_path):
    out = tmp_path / "r.json"
    ck = tmp_path / "ck.pt"
    rc = cm.main(["--device", "cpu", "--length", "128", "--steps", "2", "--eval-lengths", "128",
                  "--per-cell", "1", "--bpb-windows", "2", "--train-bytes", "200000",
                  "--attention", "pisa",
                  # 128 tokens: below the preset's min_seq_len the SDPA sites stay dense
                  "--options", '{"preset": "fast", "min_seq_len": 0}',
                  "--out", str(out), "--checkpoint", str(ck)])
    import json
    res = json.loads(out.read_text())
    rec = res["runs"]["pisa"]
    assert rc == 0 and rec["steps"] == 2 and ck.exists()
    assert rec["pisa_sites_rewritten"] == cm.CodeModelConfig().n_layers
    assert {"bits_per_byte", "retrieval", "bits_per_byte_dense_attention"} <= set(rec)


@pytest.mark.parametrize("args, flag", [(["--attention", "flash"], "--attention"),
                                        (["--eval-lengths", "4k"], "--eval-lengths"),
                                        (["--options", "{bad json"], "--options"),
                                        (["--options", '{"top_k": 0}'], "--options"),
                                        (["--options", "[1]"], "--options"),
                                        (["--options", '{"local_block": 8}'], "--options"),
                                        (["--mode", "fast"], "--mode"),
                                        (["--dense-warmup-steps", "-1"], "--dense-warmup-steps"),
                                        (["--dense-warmup-steps", "5", "--steps", "5"],
                                         "--dense-warmup-steps"),
                                        (["--dense-warmup-steps", "5", "--attention", "dense"],
                                         "--dense-warmup-steps")])
def test_cli_bad_flags_name_the_flag(args, flag, capsys):
    with pytest.raises(SystemExit):
        cm.main(args + ["--device", "cpu"])
    assert flag in capsys.readouterr().err


def test_training_fails_loudly_when_pisa_rewrites_nothing(monkeypatch):
    """A PISA run that silently trained dense would poison the comparison."""
    monkeypatch.setattr(cm, "compile_model", lambda model, attention, **kw: model)
    data = cm.load_bytes("train", 1 << 16)
    with pytest.raises(RuntimeError, match="rewrote 0 attention sites"):
        cm.train("pisa", data, steps=1, time_budget=None, length=64, batch=1, lr=1e-3, seed=0,
                 device="cpu", log=lambda m: None, model_config=TINY)


def test_shipped_checkpoint_loads_with_its_options():
    """The shipped weights are the recorded PISA run's, with the options it trained with."""
    import json
    from pathlib import Path
    record = json.loads((Path(__file__).parents[1] / "profiles" / "code_model.json").read_text())
    model = cm.load_checkpoint()
    assert model.cfg == cm.CodeModelConfig(**record["config"])
    assert sum(p.numel() for p in model.parameters()) == record["runs"]["pisa"]["n_params"]
    assert record["runs"]["pisa"]["options"] != {}
    assert model.pisa_options == {"preset": "fast", **record["runs"]["pisa"]["options"]}
    assert cm.CHECKPOINT.stat().st_size < 20 * 10**6
