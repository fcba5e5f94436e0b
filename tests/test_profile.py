"""``pisa_compile.profile`` and ``python -m pisa_compile profile`` (CPU, reference path).

A one-layer causal-attention model at 128/256 tokens, with options that make PISA sparse
(block 16, top_k 2, min_seq_len 0), so the pisa.* stage ranges are really recorded.
Everything is written under pytest's tmp_path, never into the repository's profiles/.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from pisa_compile import profiling_cli
from pisa_compile.profiling import (REST_ROW, SDPA_ROW, ProfileError, stage_table,
                                    parse_lengths, profile, stage_times)

OPTIONS = {"min_seq_len": 0, "block_size": 16, "top_k": 2}
FAST = dict(warmup=1, repeats=2, profile_steps=1, progress=False)
REPO = Path(__file__).resolve().parents[1]

# A user's model file, as `--model FILE.py:FUNC` takes it: FUNC() -> (model, make_inputs).
MODEL_SRC = '''
import torch
import torch.nn.functional as F
from torch import nn


class TinyCausalLM(nn.Module):
    """Embedding, one causal SDPA layer (2 heads of 16), LM head over 64 tokens."""

    def __init__(self, vocab=64, d=32, heads=2, fail_at=None):
        super().__init__()
        self.heads, self.fail_at = heads, fail_at
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        if self.fail_at is not None and ids.shape[1] >= self.fail_at:
            raise ValueError(f"TinyCausalLM cannot take {ids.shape[1]} tokens")
        x = self.emb(ids)
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.out(y.transpose(1, 2).reshape(B, N, D)))


def make_inputs(length):
    g = torch.Generator().manual_seed(length)
    return (torch.randint(0, 64, (1, length), generator=g),)


def build():
    torch.manual_seed(0)
    return TinyCausalLM().eval(), make_inputs


def build_failing():
    torch.manual_seed(0)
    return TinyCausalLM(fail_at=256).eval(), make_inputs
'''


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("usermodel") / "tiny_model.py"
    path.write_text(MODEL_SRC)
    return path


@pytest.fixture(scope="module")
def tiny(model_file):
    spec = importlib.util.spec_from_file_location("tiny_model", model_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """One inference profile at 128 and 256 tokens."""
    model, make_inputs = tiny.build()
    out = tmp_path_factory.mktemp("profiles")
    return profile(model, make_inputs, lengths=[256, 128], options=OPTIONS, out_dir=out,
                   run_name="tiny", model_name="tiny causal LM", **FAST)


@pytest.fixture(scope="module")
def train_run(tiny, tmp_path_factory):
    """A forward + backward profile at 128 tokens (records pisa.attention_bwd)."""
    model, make_inputs = tiny.build()
    out = tmp_path_factory.mktemp("profiles_train")
    return profile(model, make_inputs, lengths="128", options=OPTIONS, out_dir=out,
                   run_name="tiny-train", train=True, **FAST)


def _load_trace(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _names(trace: dict) -> set:
    return {e.get("name") for e in trace["traceEvents"] if isinstance(e, dict)}


# -- traces ------------------------------------------------------------------------------------

def test_traces_are_chrome_traces_with_pisa_stage_ranges(run):
    traces = run.traces
    assert sorted(p.name.split(".")[0] for p in traces) == [
        "dense_L128", "dense_L256", "pisa_L128", "pisa_L256"]
    for path in traces:
        assert path.name.endswith(".pt.trace.json.gz")
        trace = _load_trace(path)
        events = trace["traceEvents"]
        assert isinstance(events, list) and events
        assert all("ph" in e for e in events if isinstance(e, dict))
        complete = [e for e in events if e.get("ph") == "X"]
        assert complete and all(e["dur"] >= 0 and "ts" in e for e in complete)
        names = _names(trace)
        if path.name.startswith("pisa"):
            assert {"pisa.select", "pisa.attention_fwd"} <= names
            assert "pisa::attention" in names
        else:
            assert not any(str(n).startswith("pisa") for n in names)
            assert any(str(n).startswith("aten::") and "scaled_dot_product" in str(n)
                       for n in names)
        # Readable kernel names: Inductor's C++ kernels get ranges of their own.
        assert any("cpp_fused" in str(n) for n in names)


def test_training_profile_records_backward_stage(train_run):
    pisa = [p for p in train_run.traces if p.name.startswith("pisa")]
    assert len(pisa) == 1
    assert {"pisa.select", "pisa.attention_fwd", "pisa.attention_bwd"} <= _names(
        _load_trace(pisa[0]))
    stages = next(r for r in train_run.summary["results"] if r["backend"] == "pisa")["stages"]
    assert stages["pisa.attention_bwd"]["ms"] > 0
    assert train_run.summary["train"] is True


# -- summary.json, table, plot -------------------------------------------------------------------

def test_summary_json(run):
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary == json.loads(json.dumps(run.summary, default=str))
    assert {"schema", "run_name", "created", "device", "torch", "pisa_compile", "model",
            "options", "train", "lengths", "settings", "results", "rewrite", "files"} <= set(summary)
    assert summary["lengths"] == [128, 256] and summary["device"] == "cpu"
    assert summary["options"] == OPTIONS and summary["run_name"] == "tiny"
    assert {(r["length"], r["backend"]) for r in summary["results"]} == {
        (L, b) for L in (128, 256) for b in ("pisa", "dense")}
    for r in summary["results"]:
        assert {"length", "backend", "step_ms", "step_ms_all", "profiled_step_ms", "peak_mib",
                "stages", "trace"} <= set(r)
        assert (run.run_dir / r["trace"]).is_file()
        assert len(r["step_ms_all"]) == 2
        for t in [r["step_ms"], r["profiled_step_ms"], *r["step_ms_all"]]:
            assert math.isfinite(t) and t >= 0
        # CPU: the allocator's peak during the profiled step, from the trace's memory events.
        assert r["peak_mib"] > 0 and "profiler memory" in r["peak_source"]
        assert REST_ROW in r["stages"]
        for row in r["stages"].values():
            assert row["ms"] >= 0 and 0 <= row["share"] <= 1 + 1e-9
        shares = sum(v["share"] for v in r["stages"].values())
        assert shares == pytest.approx(1.0, abs=1e-6) or shares > 1  # rest clamps at 0
        if r["backend"] == "pisa":
            assert r["stages"]["pisa.select"]["ms"] > 0
            assert r["stages"]["pisa.attention_fwd"]["calls"] == 1
        else:
            assert SDPA_ROW in r["stages"] and not any(k.startswith("pisa") for k in r["stages"])
    assert [(w["length"], w["rewritten"], w["left_dense"]) for w in summary["rewrite"]] == [
        (128, 1, 0), (256, 1, 0)]
    assert summary["rewrite"][0]["sites"][0]["mask"] == "causal"


def test_table(run):
    table = (run.run_dir / "table.txt").read_text()
    assert table == run.table == stage_table(run.summary)
    for word in ("PISA ms", "dense ms", "pisa.select", "pisa.attention_fwd", SDPA_ROW, REST_ROW,
                 "step (profiled)", "step (timed, median)", "peak extra MiB", "128", "256"):
        assert word in table


def test_plot_is_a_png(run):
    path = run.run_dir / "profile.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image
    with Image.open(path) as im:
        im.verify()
    import matplotlib.image
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_rewrite_report_and_graphs(run):
    report = (run.run_dir / "rewrite_report.txt").read_text()
    assert "== sequence length 128 ==" in report and "1 rewritten, 0 left dense" in report
    for length in (128, 256):
        before = (run.run_dir / f"graphs/L{length}/graph0.before.py").read_text()
        after = (run.run_dir / f"graphs/L{length}/graph0.after.py").read_text()
        sdpa_call = "= torch._C._nn.scaled_dot_product_attention("
        assert sdpa_call in before and "pisa_attention" not in before
        assert "= pisa_compile_ops_pisa_attention(" in after and sdpa_call not in after
        assert f"f32[1, 2, {length}, 16]" in before  # readable code, with shapes
    assert sorted(run.summary["files"]["graphs"]) == sorted(
        str(p.relative_to(run.run_dir)) for p in (run.run_dir / "graphs").rglob("*.py"))


def test_nothing_but_the_run_folder(run):
    assert [p.name for p in run.run_dir.parent.iterdir()] == ["tiny"]


def test_stage_times_counts_nested_ranges_once():
    from torch.profiler import record_function

    with torch.profiler.profile() as prof:
        with record_function("ProfilerStep#1"):
            with record_function("pisa.select"):
                with record_function("pisa.select"):
                    time.sleep(0.002)
            with record_function("pisa::attention"):
                torch.nn.functional.scaled_dot_product_attention(*torch.randn(3, 1, 1, 8, 4))
            torch.nn.functional.scaled_dot_product_attention(*torch.randn(3, 1, 1, 8, 4))
    step_ms, rows = stage_times(list(prof.events()), steps=1, cuda=False)
    assert rows["pisa.select"]["calls"] == 1 and rows["pisa.select"]["ms"] >= 2
    assert rows[SDPA_ROW]["calls"] == 1  # the one inside pisa::attention is PISA's
    assert step_ms >= rows["pisa.select"]["ms"] + rows[SDPA_ROW]["ms"]
    assert sum(r["ms"] for r in rows.values()) == pytest.approx(step_ms)


def test_stage_times_on_cuda_uses_gpu_annotations_and_exclusive_rows():
    """Triton kernels are launched through the driver API, so a CPU range's device time
    misses them: on CUDA a PISA stage is timed by its GPU-side annotation, and the pyramid
    (inside the selection) is taken out of the selection's row."""
    from types import SimpleNamespace as NS

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, us, device=cpu, parent=None, device_us=0.0):
        return NS(name=name, device_type=device, cpu_parent=parent,
                  device_time_total=device_us, time_range=NS(elapsed_us=lambda: us))
    step = ev("ProfilerStep#1", 10_000)
    sel = ev("pisa.select", 900, parent=step, device_us=12.0)
    events = [step, sel, ev("pisa.pyramid", 300, parent=sel, device_us=0.0),
              ev("pisa.select", 4_000, device=cuda), ev("pisa.pyramid", 1_000, device=cuda),
              ev("aten::_scaled_dot_product_flash_attention", 50, parent=step,
                 device_us=2_000)]
    step_ms, rows = stage_times(events, steps=1, cuda=True)
    assert step_ms == pytest.approx(10.0)
    assert rows["pisa.select"]["ms"] == pytest.approx(3.0)   # 4 ms span minus the pyramid
    assert rows["pisa.pyramid"]["ms"] == pytest.approx(1.0)
    assert rows[SDPA_ROW]["ms"] == pytest.approx(2.0)
    assert rows["pisa.select"]["calls"] == 1
    assert sum(r["ms"] for r in rows.values()) == pytest.approx(step_ms)


# -- the CLI -----------------------------------------------------------------------------------

def _cli(args, capsys):
    with pytest.raises(SystemExit) as exc:
        profiling_cli.main(args)
    return exc.value.code, capsys.readouterr().err


def test_cli_user_model_end_to_end(model_file, tmp_path, capsys):
    out = tmp_path / "profiles"
    rc = profiling_cli.main(["--model", f"{model_file}:build", "--lengths", "128",
                             "--options", json.dumps(OPTIONS), "--out-dir", str(out),
                             "--run-name", "cli", "--warmup", "0", "--repeats", "1",
                             "--profile-steps", "1", "--no-gzip", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "pisa.select" in printed and "Wrote" in printed and "tensorboard --logdir" in printed
    run_dir = out / "cli"
    traces = sorted(run_dir.glob("*.pt.trace.json"))
    assert [p.name.split(".")[0] for p in traces] == ["dense_L128", "pisa_L128"]
    assert "pisa.attention_fwd" in _names(_load_trace(traces[1]))
    assert {"summary.json", "profile.png", "table.txt", "rewrite_report.txt", "graphs"} <= {
        p.name for p in run_dir.iterdir()}
    # The same name again is a usage error, and the existing run is left alone.
    code, err = _cli(["--model", f"{model_file}:build", "--lengths", "128",
                      "--out-dir", str(out), "--run-name", "cli"], capsys)
    assert code == 2 and "--run-name" in err and "already exists" in err
    assert (run_dir / "summary.json").is_file()


@pytest.mark.parametrize("lengths", ["0", "-5", "abc", "1.5", "", "128,,256", "128;256"])
def test_cli_bad_lengths(lengths, tmp_path, capsys):
    code, err = _cli(["--lengths", lengths, "--out-dir", str(tmp_path / "p")], capsys)
    assert code == 2
    assert "argument --lengths" in err and "positive integers" in err
    assert "example: python -m pisa_compile profile" in err and "usage:" in err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("argv, flag, words", [
    (["--bogus"], "--bogus", "unrecognized arguments"),
    (["--lengths"], "--lengths", "expected one argument"),
    (["--repeats", "0"], "--repeats", "integer >= 1"),
    (["--warmup", "x"], "--warmup", "integer >= 0"),
    (["--device", "tpu"], "--device", "invalid choice"),
    (["--options", "{not json"], "--options", "not valid JSON"),
    (["--options", "[1, 2]"], "--options", "JSON object"),
    (["--options", '{"top_k": 0}'], "--options", "PisaConfig.top_k"),
    (["--options", '{"nope": 1}'], "--options", "Valid keys"),
    (["--model", "minilm", "--lengths", "1024"], "--lengths", "at most 512"),
    (["--model", "nowhere.py:build"], "--model", "no such file"),
    (["--model", "nonsense"], "--model", "FILE.py:FUNC"),
    (["--model", "{model_file}:build"], "--lengths", "required with --model"),
    (["--model", "{model_file}:nope", "--lengths", "8"], "--model", "could not build"),
    (["--run-name", "../escape", "--model", "{model_file}:build", "--lengths", "8"],
     "--run-name", "letters, digits"),
])
def test_cli_usage_errors(argv, flag, words, model_file, tmp_path, capsys):
    argv = [a.replace("{model_file}", str(model_file)) for a in argv]
    code, err = _cli(argv + ["--out-dir", str(tmp_path / "p")], capsys)
    assert code == 2
    assert flag in err and words in err, err
    assert "example: python -m pisa_compile profile" in err
    assert not (tmp_path / "p").exists()


def test_cli_model_that_fails_leaves_nothing(model_file, tmp_path, capsys):
    """The model runs at 128 tokens and raises at 256: the 128 traces were already written
    (in the temporary folder), and must be gone after the usage error."""
    out = tmp_path / "p"
    code, err = _cli(["--model", f"{model_file}:build_failing", "--lengths", "128,256",
                      "--options", json.dumps(OPTIONS), "--out-dir", str(out),
                      "--warmup", "0", "--repeats", "1", "--profile-steps", "1",
                      "--no-progress"], capsys)
    assert code == 2
    assert "argument --model" in err and "fails to run" in err and "256 tokens" in err
    assert "example:" in err
    assert not out.exists()


def test_module_entry_point_usage_error(tmp_path):
    """``python -m pisa_compile profile`` parses its own flags (exit status 2 on bad ones)."""
    proc = subprocess.run([sys.executable, "-m", "pisa_compile", "profile", "--bogus", "1"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "--bogus" in proc.stderr and "example:" in proc.stderr
    assert not (tmp_path / "profiles").exists()


# -- the API's errors --------------------------------------------------------------------------

def test_parse_lengths():
    assert parse_lengths("2048, 1024,1024") == [1024, 2048]
    assert parse_lengths([4, 2]) == [2, 4]
    for bad in ("0", "x", "", [1.5], [True], [-1], None):
        with pytest.raises(ProfileError) as exc:
            parse_lengths(bad)
        assert exc.value.flag == "--lengths"


def test_api_bad_inputs_write_nothing(tiny, tmp_path):
    model, make_inputs = tiny.build()
    out = tmp_path / "p"
    cases = [(dict(lengths="0"), "--lengths"), (dict(lengths=None), "--lengths"),
             (dict(lengths=[128], options={"nope": 1}), "--options"),
             (dict(lengths=[128], repeats=0), "--repeats"),
             (dict(lengths=[128], run_name="a/b"), "--run-name")]
    for kwargs, flag in cases:
        with pytest.raises(ProfileError) as exc:
            profile(model, make_inputs, out_dir=out, **kwargs)
        assert exc.value.flag == flag
    assert not out.exists()


def test_api_model_that_fails(tiny, tmp_path):
    model, make_inputs = tiny.build_failing()
    out = tmp_path / "p"
    with pytest.raises(ProfileError) as exc:
        profile(model, make_inputs(256), options=OPTIONS, out_dir=out, **FAST)
    assert exc.value.flag == "--model"
    assert isinstance(exc.value.__cause__, ValueError)
    assert not out.exists()


# -- a real viewer: TensorBoard with torch-tb-profiler ------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base: str, route: str, **params) -> bytes:
    url = f"{base}/data/plugin/pytorch_profiler/{route}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as resp:
        data = resp.read()
        if resp.headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
    return data


def test_tensorboard_lists_run_and_pisa_stages(run, tmp_path):
    for module in ("tensorboard", "torch_tb_profiler"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install tensorboard torch-tb-profiler)")
    port = _free_port()
    log = tmp_path / "tensorboard.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(run.run_dir.parent),
             "--host", "127.0.0.1", "--port", str(port), "--load_fast=false"],
            stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    base = f"http://127.0.0.1:{port}"
    try:
        runs, deadline = None, time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.skip(f"TensorBoard could not start (exit {proc.returncode}): "
                            f"{log.read_text()[-800:]}")
            try:
                runs = json.loads(_get(base, "runs"))
                if "tiny" in runs["runs"] and not runs["loading"]:
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        else:
            pytest.skip(f"TensorBoard did not serve the profiler plugin within 90 s: {runs}; "
                        f"{log.read_text()[-800:]}")
        assert "tiny" in runs["runs"]
        workers = json.loads(_get(base, "workers", run="tiny", view="Overview"))
        assert {"pisa_L128", "pisa_L256", "dense_L128", "dense_L256"} <= set(workers)
        span = json.loads(_get(base, "spans", run="tiny", worker="pisa_L128"))[0]
        trace = json.loads(_get(base, "trace", run="tiny", worker="pisa_L128", span=span))
        assert {"pisa.select", "pisa.attention_fwd"} <= _names(trace)
        ops = json.loads(_get(base, "operation/table", run="tiny", worker="pisa_L128",
                              span=span, group_by="Operation"))
        assert "pisa::attention" in {row["name"] for row in ops["data"]}
        dense_span = json.loads(_get(base, "spans", run="tiny", worker="dense_L128"))[0]
        dense = json.loads(_get(base, "trace", run="tiny", worker="dense_L128", span=dense_span))
        assert "pisa.select" not in _names(dense)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_table_says_why_no_pisa_stage_ran(tiny, tmp_path):
    """Below min_seq_len the SDPA sites stay in the graph: the table says so instead of
    silently showing no PISA stage; the run's timing spread is recorded."""
    model, make_inputs = tiny.build()
    res = profile(model, make_inputs, lengths=[64], options={"min_seq_len": 128},
                  out_dir=tmp_path, run_name="below", **FAST)
    assert ("no PISA stage ran: no attention site was rewritten: Nk=64 < min_seq_len=128"
            in res.table), res.table
    assert all(r["spread"] >= 0 for r in res.summary["results"])
    # A PISA stage in the pisa run (never in the dense run's) clears the line.
    assert "no PISA stage ran" not in stage_table({**res.summary, "results": [
        {**r, "stages": {**r["stages"], "pisa.select": {"ms": 1.0, "share": 0.1, "calls": 1}}}
        if r["backend"] == "pisa" else r for r in res.summary["results"]]})


def test_api_prints_nothing(run, capsys, tiny, tmp_path):
    model, make_inputs = tiny.build()
    profile(model, make_inputs, lengths=[64], options=OPTIONS, out_dir=tmp_path,
            run_name="quiet", **FAST)
    assert capsys.readouterr().out == ""
