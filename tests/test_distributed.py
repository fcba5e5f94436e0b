"""Data-parallel training under ``backend="pisa"`` (issue #17): two gloo processes on the CPU
run ``experiments.train_distributed`` under DDP and under FSDP2 (``torch.distributed.run``
in a subprocess), and their sites, losses and gradients are checked against one process
training the same global batch. The exact-regime options make PISA equal dense attention,
so the distributed run must match one process up to the reduction order of fp32 sums. With
``--kernel triton`` (the interpreter) the layer graphs' unproved mask is read at run time and
trained through PISA's kernels."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from experiments.train_distributed import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, SEQ_LEN, BATCH, LAYERS = 2, 64, 4, 2
# DDP's first bucket is 1 MiB and DDPOptimizer wants no bucket smaller; 1 MiB splits the
# 2-layer model (about 2.2 MB of fp32 weights per layer) into several graphs.
BUCKET_CAP_MB = 1
# Only the order of the fp32 sums differs (all-reduce, per-rank means); measured:
# 5e-7 on the losses (about 5.6) and 4e-9 on the gradients (up to 0.05), FSDP2, this CPU.
LOSS_TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = dict(atol=1e-6, rtol=1e-4)


def _torchrun(mode: str, tmp: Path, kernel: str = "auto") -> dict:
    out = tmp / f"{mode}_{kernel}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", "-m", "experiments.train_distributed", "--mode", mode,
           "--steps", str(STEPS),
           "--seq-len", str(SEQ_LEN), "--batch", str(BATCH), "--layers", str(LAYERS),
           "--bucket-cap-mb", str(BUCKET_CAP_MB), "--kernel", kernel, "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", **({"TRITON_INTERPRET": "1"} if kernel == "triton"
                                              else {}))
    # Its own session, so a timeout kills the workers too, not only the launcher.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    # Exit status 1 with a saved file is the example's own "a site was not rewritten":
    # the tests below say which; anything else is a crash.
    assert out.exists(), (f"torchrun {mode} failed (rc {proc.returncode}):\n"
                          f"{stdout[-3000:]}\n{stderr[-5000:]}")
    # The output on failure: the launcher's stdout and the workers' stderr (a worker that
    # crashes after saving shows only there).
    log = f"rc {proc.returncode}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-6000:]}"
    return dict(torch.load(out, weights_only=False), returncode=proc.returncode, log=log)


@pytest.fixture(scope="module")
def single():
    """One process, the whole global batch, the same compiled model."""
    return train("single", STEPS, SEQ_LEN, BATCH, LAYERS, log=lambda *_: None)


def test_one_process_equals_eager(single):
    """The reference itself: one compiled process in the exact regime equals the same
    training run eagerly (dense attention), losses and first-step gradients."""
    eager = train("single", STEPS, SEQ_LEN, BATCH, LAYERS, compiled=False, log=lambda *_: None)
    torch.testing.assert_close(torch.tensor(single["losses"]), torch.tensor(eager["losses"]),
                               **LOSS_TOL)
    for name, g in eager["grads"].items():
        torch.testing.assert_close(single["grads"][name], g, **GRAD_TOL,
                                   msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def run(request, tmp_path_factory):
    return request.param, _torchrun(request.param, tmp_path_factory.mktemp(request.param))


def test_every_attention_site_is_rewritten(run):
    """Every SDPA node of every graph the backend got, on each rank, became a rewritten site
    (a site cut across two graphs would leave a node without one). Under DDP the small
    buckets really split the graph; under FSDP2 each ``fully_shard`` layer is its own graph,
    compiled once and reused by both layers."""
    mode, res = run
    assert len(res["reports"]) == 2
    for rank, rep in enumerate(res["reports"]):
        assert rep["left_dense"] == 0, (rank, rep["sites"])
        assert rep["rewritten"] == rep["attention_nodes"], (rank, rep["per_call"])
        assert rep["backend_calls"] > 1, (rank, rep["per_call"])
        with_sites = [c for c in rep["per_call"] if c[1]]
        if mode == "ddp":  # one graph per bucket: both layers' sites, in different graphs
            assert rep["rewritten"] == LAYERS and len(with_sites) == LAYERS, rep["per_call"]
        else:  # the layer graph serves both layers
            assert rep["rewritten"] >= 1, rep["per_call"]
        assert all("sdpa+gqa" in s and ": rewritten" in s for s in rep["sites"]), rep["sites"]
    assert res["returncode"] == 0, res["log"]


def test_losses_and_gradients_equal_one_process(run, single):
    """Per-step global mean losses (two AdamW steps) and the full averaged gradients of the
    first step (FSDP2's shards gathered) equal one process on the same global batch."""
    mode, res = run
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(single["losses"]),
                               **LOSS_TOL)
    assert res["grads"].keys() == single["grads"].keys()
    for name, g in single["grads"].items():
        assert g.abs().max() > 0, name  # a zero gradient would make the comparison empty
        torch.testing.assert_close(res["grads"][name], g, **GRAD_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.xfail(strict=True, reason=(
    "the causal+padding mask is built in the model's first graph (before the DDP bucket "
    "split, or outside the fully_shard layer's graph), so the pass sees it as an input it "
    "cannot prove: the site reads the explicit mask at run time (one host sync per call, "
    "and in training a second forward in the backward)"))
def test_the_mask_is_proved_in_every_graph(run):
    """The structure the pass proves from transformers' masks in one graph
    (``bool->is_causal+padding``) survives the graph split."""
    _, res = run
    for rep in res["reports"]:
        assert all("mask=bool->is_causal" in s for s in rep["sites"]), rep["sites"]


def test_ddp_trains_through_masks_read_at_run_time(single, tmp_path):
    """The layer graphs' unproved mask, with PISA's kernels (``kernel="triton"``, the Triton
    interpreter here, as CUDA's ``"auto"`` would run them): each attention call reads the
    mask at run time and finds causal AND padding (PISA, not dense), its backward runs the
    forward again, and losses and gradients equal one process (the mask proved there)."""
    res = _torchrun("ddp", tmp_path, kernel="triton")
    assert res["returncode"] == 0, res["log"]
    calls = STEPS * LAYERS  # per rank: one attention call per layer and step
    for rank, rep in enumerate(res["reports"]):
        assert rep["runtime"].get("runtime_mask_unstructured", 0) == 0, (rank, rep["runtime"])
        # forward, and the backward's recomputation
        assert rep["runtime"]["runtime_mask_structured"] == 2 * calls, (rank, rep["runtime"])
        assert rep["runtime"]["runtime_mask_backward"] == calls, (rank, rep["runtime"])
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(single["losses"]),
                               **LOSS_TOL)
    for name, g in single["grads"].items():  # the interpreter's fp32 sums, not the reference's
        torch.testing.assert_close(res["grads"][name], g, atol=1e-5, rtol=1e-3,
                                   msg=lambda m: f"{name}: {m}")


def test_ddp_bench_smoke(tmp_path):
    """The 2-GPU DDP benchmark's CPU smoke run (gloo, 2 ranks, as a command): it times one
    process and DDP side by side, and every rank's graph pieces rewrite every site."""
    import json
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_ddp", "--nproc", "2", "--device", "cpu",
           "--tiny", "--seq-len", "128", "--steps", "1", "--json", str(out)]
    # One compile thread per rank: no worker pool to start on a loaded machine.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-5000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["single_step_ms"] > 0 and row["ddp_step_ms"] > 0 and row["scaling"] > 0
    layers = 2  # bench_generate's tiny model
    assert row["single_sites"]["rewritten"] == layers
    for sites in row["ddp_sites"]:
        assert sites["rewritten"] == layers and sites["left_dense"] == 0, sites
