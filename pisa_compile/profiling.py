"""Profiling compiled graphs: where the time goes, PISA against Inductor dense.

:func:`profile` compiles a model twice per sequence length (``backend="pisa"`` and Inductor
dense, the baseline), warms each up, times it, and records one ``torch.profiler`` trace per
(backend, length) through ``torch.profiler.tensorboard_trace_handler``. It then tabulates the
PISA stages (the ``record_function`` ranges of :data:`pisa_compile.kernels.runtime.STAGES`)
against the rest of the step, and writes one run folder::

    profiles/<run-name>/
        pisa_L1024.<ts>.pt.trace.json.gz   traces (TensorBoard + torch-tb-profiler, Perfetto)
        dense_L1024.<ts>.pt.trace.json.gz
        summary.json                       every number in the table, per backend and length
        profile.png                        step time and peak memory against sequence length
        table.txt                          the per-stage table, as printed
        rewrite_report.txt                 the rewrite report (as pisa_compile.explain prints it)
        graphs/L1024/graph0.before.py      each Dynamo graph before the rewrite ...
        graphs/L1024/graph0.after.py       ... and after it (readable FX code)

The folder is built under a temporary name next to its destination and renamed into place
at the end, so a failed or interrupted run leaves nothing half-written behind.

``python -m pisa_compile profile`` (:mod:`pisa_compile.profiling_cli`) drives this for the
demo models.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from . import tables
from .kernels.runtime import NESTED_IN, STAGES

__all__ = ["profile", "ProfileResult", "ProfileError", "parse_lengths", "SDPA_ROW", "REST_ROW"]

# Table rows besides the PISA stages.
SDPA_ROW = "attention (dense SDPA)"   # aten SDPA calls outside any PISA range
REST_ROW = "rest of model"            # the profiled step minus the rows above
SPREAD_WARN = 0.25                    # timed steps ranging wider than this share of the median
BACKENDS = ("pisa", "dense")
_SDPA_MARKERS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
EXAMPLE = "python -m pisa_compile profile --lengths 1024,2048,4096 --run-name llama-cpu"
OPTIONS_EXAMPLE = ("python -m pisa_compile profile --options "
                   "'{\"min_seq_len\": 0, \"block_size\": 64, \"top_k\": 8}'")


class ProfileError(ValueError):
    """Bad input to :func:`profile`; ``flag`` is the CLI flag it corresponds to.

    Attributes:
        flag: the ``python -m pisa_compile profile`` flag to name in a usage error
            (``"--lengths"``, ``"--model"``, ``"--options"``, ``"--run-name"``, ...).
        example: a command line that works, for the usage message.
    """

    def __init__(self, flag: str, message: str, example: str = EXAMPLE):
        super().__init__(f"{flag}: {message}")
        self.flag, self.message, self.example = flag, message, example


@dataclass
class ProfileResult:
    """What :func:`profile` produced.

    Attributes:
        run_dir: the run folder (``<out_dir>/<run_name>``), complete.
        summary: the contents of ``summary.json`` (see :func:`profile` for the keys).
        table: the per-stage table as printed.
    """

    run_dir: Path
    summary: dict
    table: str

    @property
    def traces(self) -> list[Path]:
        """The trace files of the run (``*.pt.trace.json`` or ``*.pt.trace.json.gz``)."""
        return sorted(p for p in self.run_dir.iterdir() if ".pt.trace.json" in p.name)


# -- inputs and lengths ------------------------------------------------------------------------

def parse_lengths(lengths: Union[str, Iterable[Any], None]) -> list[int]:
    """Sequence lengths as a sorted list of distinct positive ints.

    Args:
        lengths: ``"1024,2048"`` or an iterable of ints.

    Raises:
        ProfileError(flag="--lengths"): an entry is not a positive integer, or none given.
    """
    if lengths is None:
        raise ProfileError("--lengths", "no sequence lengths given")
    items = lengths.split(",") if isinstance(lengths, str) else list(lengths)
    out = []
    for item in items:
        value = item.strip() if isinstance(item, str) else item
        if isinstance(value, str) and re.fullmatch(r"[0-9]+", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ProfileError("--lengths", f"expected positive integers separated by commas, "
                                            f"got {item!r}")
        out.append(value)
    if not out:
        raise ProfileError("--lengths", "no sequence lengths given")
    return sorted(set(out))


def _as_call(inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from a tuple/list (args), a dict (kwargs) or a single tensor."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _default_length(inputs: Any) -> int:
    """Label for fixed inputs: dim 1 of the first tensor of rank >= 2 (``[B, N, ...]``), else 0."""
    args, kwargs = _as_call(inputs)
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[1])
    return 0


def _device_of(model: Any, args: tuple, kwargs: dict) -> torch.device:
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.device
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _first_float(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    for v in values:
        t = _first_float(v)
        if t is not None:
            return t
    return None


# -- measurement -------------------------------------------------------------------------------

def _make_step(fn: Callable, args: tuple, kwargs: dict, train: bool, model: Any,
               cuda: bool) -> Callable[[], Any]:
    """One step: forward (under no_grad), or with ``train`` forward + ``mean().backward()``."""

    def step():
        if train:
            if isinstance(model, torch.nn.Module):
                model.zero_grad(set_to_none=True)  # no growing .grad buffers across steps
            out = fn(*args, **kwargs)
            loss = _first_float(out)
            if loss is None:
                raise TypeError("train=True needs a floating-point tensor in the model output")
            loss.float().mean().backward()
        else:
            with torch.no_grad():
                out = fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()  # the step ends when the GPU is done
        return out

    return step


def _timed(step: Callable[[], Any], repeats: int, cuda: bool) -> tuple[list[float], Optional[float]]:
    """Run the warm ``step`` ``repeats`` times: wall seconds of each run, and on CUDA the peak
    extra MiB (``torch.cuda.max_memory_allocated`` over what was allocated before the run;
    ``None`` on the CPU, where :func:`_peak_from_trace` measures it instead)."""
    times, peaks = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        if cuda:
            peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
    return times, (max(peaks) if peaks else None)


def _peak_from_trace(path: Path, device_type: int = 0) -> Optional[float]:
    """Peak extra tensor memory (MiB) of any profiled step, from a trace's ``[memory]`` events.

    Each event carries the allocator's ``Total Allocated`` bytes after it; a step's peak is the
    largest value inside its ``ProfilerStep`` range minus the value just before the range.
    ``device_type`` 0 is the CPU allocator (1 is CUDA). ``None`` if the trace has no such
    events. (Linux's resident high-water mark is useless here: after warm-up the allocator
    reuses pages it already holds, so RSS does not move.)
    """
    import gzip as _gzip

    opener = _gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                 if isinstance(e, dict) and e.get("name") == "[memory]"
                 and e.get("args", {}).get("Device Type") == device_type
                 and "Total Allocated" in e.get("args", {}))
    steps = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if isinstance(e, dict)
             and str(e.get("name", "")).startswith("ProfilerStep") and e.get("ph") == "X"]
    if not mem or not steps:
        return None
    peak = 0.0
    for t0, t1 in steps:
        before = [a for ts, a in mem if ts < t0]
        inside = [a for ts, a in mem if t0 <= ts <= t1]
        if inside:
            peak = max(peak, max(inside) - (before[-1] if before else 0))
    return peak / 2**20


def _is_sdpa(name: str) -> bool:
    return name.startswith("aten::") and any(m in name for m in _SDPA_MARKERS)


def _is_pisa(name: str) -> bool:
    return name in STAGES or name.startswith("pisa::")


def _has_ancestor(e, pred) -> bool:
    p = e.cpu_parent
    while p is not None:
        if pred(p.name):
            return True
        p = p.cpu_parent
    return False


def stage_times(events: Sequence[Any], steps: int, cuda: bool) -> tuple[float, dict]:
    """Per-step time of each stage from a profiler's events.

    Args:
        events: ``prof.events()`` of one profiling cycle (``FunctionEvent`` s).
        steps: the number of active steps in the cycle (times are averaged over them).
        cuda: take a PISA stage's time on the GPU: the span of its range's GPU-side
            annotation (Triton launches go through the driver API, so the CPU range's
            ``device_time_total`` misses them), or, without annotations, the CPU range's
            ``device_time_total``; dense SDPA rows use ``device_time_total``. Else the wall
            time of the CPU ranges.

    Returns:
        ``(step_ms, {row: {"ms": float, "calls": float, "share": float}})``, ``step_ms`` from
        the ``ProfilerStep`` ranges; rows are the PISA stages that occurred, :data:`SDPA_ROW`
        (outermost aten SDPA calls outside PISA ranges), then :data:`REST_ROW` (the step minus
        the other rows, never negative). Rows are exclusive: nested ranges of the same stage
        count once, and a stage inside another (``NESTED_IN``: the pyramid inside the
        selection) is taken out of the enclosing row, so the rows sum to the step.
    """
    step_us = 0.0
    acc: dict[str, list[float]] = {}
    gpu: dict[str, list[float]] = {}
    for e in events:
        name = e.name
        if getattr(e, "device_type", None) not in (None, torch.autograd.DeviceType.CPU):
            if cuda and name in STAGES:  # the GPU-side annotation of a PISA range
                slot = gpu.setdefault(name, [0.0, 0.0])
                slot[0] += e.time_range.elapsed_us()
                slot[1] += 1
            continue
        if name.startswith("ProfilerStep"):
            step_us += e.time_range.elapsed_us()
            continue
        if name in STAGES:
            if _has_ancestor(e, lambda n, name=name: n == name):
                continue
            row = name
        elif _is_sdpa(name):
            if _has_ancestor(e, lambda n: _is_pisa(n) or _is_sdpa(n)):
                continue
            row = SDPA_ROW
        else:
            continue
        us = (getattr(e, "device_time_total", 0.0) or 0.0) if cuda else e.time_range.elapsed_us()
        slot = acc.setdefault(row, [0.0, 0.0])
        slot[0] += us
        slot[1] += 1
    for name, (us, calls) in gpu.items():  # annotations replace the CPU ranges' kernel sums
        acc[name] = [us, acc.get(name, [0.0, calls])[1]]
    for inner, outer in NESTED_IN.items():
        if inner in acc and outer in acc:
            acc[outer][0] = max(acc[outer][0] - acc[inner][0], 0.0)
    n = max(steps, 1)
    step_ms = step_us / n / 1e3
    rows = {r: {"ms": acc[r][0] / n / 1e3, "calls": acc[r][1] / n}
            for r in (*STAGES, SDPA_ROW) if r in acc}
    rows[REST_ROW] = {"ms": max(step_ms - sum(v["ms"] for v in rows.values()), 0.0), "calls": 0.0}
    for v in rows.values():
        v["share"] = v["ms"] / step_ms if step_ms > 0 else 0.0
    return step_ms, rows


def _profiled(step: Callable[[], Any], steps: int, trace_dir: Path, worker: str, cuda: bool,
              gzip: bool) -> tuple[float, dict, str, Optional[float]]:
    """Record ``steps`` steps (after one profiler warm-up step) into ``trace_dir``.

    Returns ``(step_ms, rows, trace_file_name, peak_mib)``; see :func:`stage_times` and
    :func:`_peak_from_trace`.
    """
    from torch.profiler import ProfilerActivity, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    handler = tensorboard_trace_handler(str(trace_dir), worker_name=worker, use_gzip=gzip)
    got: dict = {}

    def on_ready(prof):
        before = set(os.listdir(trace_dir))
        handler(prof)
        got["files"] = sorted(set(os.listdir(trace_dir)) - before)
        # Read the events here: the profiler clears them at the end of its cycle.
        got["rows"] = stage_times(list(prof.events()), steps, cuda)
        # On CUDA the timed runs' max_memory_allocated is used instead.
        got["peak"] = (_peak_from_trace(trace_dir / got["files"][0])
                       if got["files"] and not cuda else None)

    with torch.profiler.profile(activities=activities,
                                schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                                on_trace_ready=on_ready, record_shapes=True,
                                profile_memory=True) as prof:
        for _ in range(steps + 1):
            step()
            prof.step()
    if "rows" not in got:  # pragma: no cover - the schedule above always completes
        raise RuntimeError("the profiler recorded no cycle")
    step_ms, rows = got["rows"]
    return step_ms, rows, (got["files"][0] if got["files"] else ""), got["peak"]


# -- graphs: before and after the rewrite ------------------------------------------------------

@dataclass
class _Captured:
    """What the capturing backend saw at one length: graph code and the rewrite's sites."""

    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    sites: list = field(default_factory=list)


def _capturing_pisa_backend(options: Mapping[str, Any], captured: _Captured) -> Callable:
    """A backend that records each Dynamo graph before and after the PISA rewrite, then
    compiles it with :func:`pisa_compile.backend.pisa_backend` (what ``backend="pisa"``
    resolves to) exactly as ``torch.compile(model, backend="pisa", options=options)`` would.

    The "after" graph comes from running the public rewrite pass
    (:func:`pisa_compile.lowering.rewrite_graph`) on a copy, so the real compile is untouched.
    """
    from .backend import pisa_backend
    from .config import split_options
    from .lowering import rewrite_graph
    from .lowering.rewrite import copy_graph

    config, _ = split_options(options)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        index = len(captured.before)
        captured.before.append(gm.print_readable(print_output=False))
        try:
            copy_gm = torch.fx.GraphModule(gm, copy_graph(gm.graph))
            sites = rewrite_graph(copy_gm, config)
            for s in sites:
                s.graph = index
            captured.sites.extend(sites)
            captured.after.append(copy_gm.print_readable(print_output=False))
        except Exception as err:  # the real backend falls back and warns; show why here
            captured.after.append(f"# the rewrite pass failed on this graph: "
                                  f"{type(err).__name__}: {err}\n")
        return pisa_backend(gm, example_inputs, options=options)

    return backend


# -- output -----------------------------------------------------------------------------------

def _fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def stage_table(summary: dict) -> str:
    """The per-stage table of a ``summary.json`` dict, as text (PISA beside dense per length)."""
    stages = [s for s in (*STAGES, SDPA_ROW, REST_ROW)
              if any(s in r["stages"] for r in summary["results"])]
    by = {(r["length"], r["backend"]): r for r in summary["results"]}
    rows = []
    for length in summary["lengths"]:
        pair = [by.get((length, b)) for b in BACKENDS]
        for stage in stages:
            cells = []
            for r in pair:
                v = r["stages"].get(stage) if r else None
                cells += ["-", "-"] if v is None else [_fmt_ms(v["ms"]), f"{100 * v['share']:.1f}%"]
            rows.append([str(length), stage] + cells)
        rows.append([str(length), "step (profiled)"]
                    + sum(([_fmt_ms(r["profiled_step_ms"]), "100%"] if r else ["-", "-"]
                           for r in pair), []))
        rows.append([str(length), "step (timed, median)"]
                    + sum(([_fmt_ms(r["step_ms"]), _spread(r)] if r else ["-", ""]
                           for r in pair), []))
        rows.append([str(length), "peak extra MiB"]
                    + sum(([("n/a" if r is None or r["peak_mib"] is None
                             else f"{r['peak_mib']:.1f}"), ""] for r in pair), []))
        why = _no_pisa_stage(summary, length, pair[BACKENDS.index("pisa")])
        if why:
            rows.append([str(length), f"(no PISA stage ran: {why})", "", "", "", ""])
    unit = "GPU ms in range" if summary["device"].startswith("cuda") else "ms"
    title = (f"{summary['model']} on {summary['device']}: time per step by stage "
             f"({unit}, share of the profiled step), PISA vs Inductor dense"
             + (" (forward + backward)" if summary["train"] else " (forward)"))
    return tables.format_table(["length", "stage", "PISA ms", "share", "dense ms", "share"], rows,
                               title)


def _spread(result: dict) -> str:
    """``±x%``, half the range of the timed steps over their median, where it is wide."""
    spread = result.get("spread")
    return f"±{50 * spread:.0f}%" if spread is not None and spread > SPREAD_WARN else ""


def _no_pisa_stage(summary: dict, length: int, result: Optional[dict]) -> str:
    """Why the PISA run at ``length`` shows no PISA stage (the sites' notes), or ``""``."""
    if result is None or any(k.startswith("pisa.") for k in result["stages"]):
        return ""
    for entry in summary["rewrite"]:
        if entry["length"] == length:
            notes = {s.get("note", "") for s in entry["sites"] if s["decision"] == "rewritten"}
            if not entry["rewritten"]:
                reasons = sorted({s.get("reason", "") for s in entry["sites"]} - {""})
                return ("no attention site was rewritten"
                        + (f": {'; '.join(reasons)}" if reasons else "")
                        + " (see rewrite_report.txt)")
            if notes - {""}:
                return "; ".join(sorted(notes - {""}))
    return "the op ran no PISA kernel (see rewrite_report.txt)"


def plot(summary: dict, path: Path) -> None:
    """Write a PNG: step time (ms, timed median) and peak extra memory (MiB) against sequence
    length, PISA and Inductor dense; dashed, the part of the step spent in attention (PISA
    stages / dense SDPA), as its share of the profiled step times the timed step."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    lengths = summary["lengths"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"pisa": ("PISA", "tab:blue"), "dense": ("Inductor dense", "tab:orange")}
    for backend in BACKENDS:
        res = sorted((r for r in summary["results"] if r["backend"] == backend),
                     key=lambda r: r["length"])
        if not res:
            continue
        label, color = styles[backend]
        xs = [r["length"] for r in res]
        ax_t.plot(xs, [r["step_ms"] for r in res], "o-", color=color, label=f"{label}: step")
        # The profiler slows a step down, so scale the attention share of the profiled step
        # onto the timed step rather than plotting profiled milliseconds beside timed ones.
        attn = [r["step_ms"] * sum(v["share"] for k, v in r["stages"].items() if k != REST_ROW)
                for r in res]
        ax_t.plot(xs, attn, "s--", color=color, alpha=0.7,
                  label=f"{label}: in attention "
                        f"({'PISA stages + any SDPA' if backend == 'pisa' else 'SDPA'}; profiled share)")
        mem = [(r["length"], r["peak_mib"]) for r in res if r["peak_mib"] is not None]
        if mem:
            ax_m.plot([m[0] for m in mem], [m[1] for m in mem], "o-", color=color, label=label)
    times = [y for line in ax_t.get_lines() for y in line.get_ydata() if y > 0]
    if times and max(times) / min(times) > 30:  # PISA and dense can differ by orders
        ax_t.set_yscale("log")
    for ax, ylabel in ((ax_t, "time per step (ms)"), (ax_m, "peak extra memory (MiB)")):
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        if len(lengths) > 1 and min(lengths) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(lengths)
        ax.set_xticklabels([str(x) for x in lengths])
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{summary['model']} on {summary['device']}"
                 + (" (forward + backward)" if summary["train"] else " (forward)"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _default_run_name(model_name: str, device: torch.device) -> str:
    safe = re.sub(r"[^A-Za-z0-9._+-]+", "-", model_name).strip("-") or "model"
    return f"{safe}-{device.type}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


# -- the API ----------------------------------------------------------------------------------

@dataclass
class _Settings:
    """A profiling run's validated settings (see :func:`profile` for each)."""

    lengths: list
    make_inputs: Optional[Callable]
    inputs: Any
    device: torch.device
    model_name: str
    run_name: str
    final: Path
    pisa_options: dict
    dense_options: dict
    options: dict
    warmup: int
    repeats: int
    profile_steps: int
    train: bool
    gzip: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def call(self, length: int) -> tuple[tuple, dict]:
        return _as_call(self.make_inputs(length) if self.make_inputs else self.inputs)


def _settings(model, inputs, lengths, options, out_dir, run_name, model_name, warmup, repeats,
              profile_steps, train, gzip, overwrite) -> _Settings:
    """Validate every argument of :func:`profile` before any work is done."""
    from .config import split_options

    for flag, value, lo in (("--warmup", warmup, 0), ("--repeats", repeats, 1),
                            ("--profile-steps", profile_steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ProfileError(flag, f"must be an integer >= {lo}, got {value!r}")
    make_inputs = inputs if callable(inputs) and not isinstance(inputs, torch.Tensor) else None
    if make_inputs is not None:
        lengths_ = parse_lengths(lengths)
    else:
        lengths_ = parse_lengths(lengths) if lengths is not None else [_default_length(inputs)]
        if len(lengths_) != 1:
            raise ProfileError("--lengths", "fixed inputs give one point: pass inputs as a "
                                            "function make_inputs(length) to profile several")
    try:
        _, patches = split_options(options)
    except (ValueError, TypeError) as err:
        raise ProfileError("--options", str(err), example=OPTIONS_EXAMPLE) from err
    options = dict(options or {})
    args, kwargs = _as_call(make_inputs(lengths_[0]) if make_inputs else inputs)
    device = _device_of(model, args, kwargs)
    model_name = model_name or type(model).__name__
    run_name = run_name or _default_run_name(model_name, device)
    if not _RUN_NAME.match(run_name):
        raise ProfileError("--run-name", f"use letters, digits and ._+- only, got {run_name!r}")
    final = Path(out_dir) / run_name
    if final.exists() and not overwrite:
        raise ProfileError("--run-name", f"{final} already exists; choose another name or "
                                         "pass --overwrite")
    # Readable kernel names in the traces: Inductor's C++ kernels get their own ranges
    # (graph_0_cpp_fused_...); its Triton kernels are named after the fused aten ops.
    names = ({"triton.unique_kernel_names": True} if device.type == "cuda"
             else {"cpp.enable_kernel_profile": True})
    return _Settings(lengths_, make_inputs, inputs, device, model_name, run_name, final,
                     {**names, **options}, {**names, **patches}, options, warmup, repeats,
                     profile_steps, bool(train), bool(gzip))


def _measure(model, backend: str, length: int, st: _Settings, tmp: Path) -> tuple[dict, _Captured]:
    """Compile ``model`` with ``backend`` (``"pisa"`` or ``"dense"``), warm up, time and
    profile it at ``length``: one entry of ``summary["results"]``, and the captured graphs."""
    args, kwargs = st.call(length)
    captured = _Captured()
    torch._dynamo.reset()
    if backend == "pisa":
        compiled = torch.compile(model, backend=_capturing_pisa_backend(st.pisa_options, captured))
    else:
        compiled = torch.compile(model, options=st.dense_options)
    step = _make_step(compiled, args, kwargs, st.train, model, st.cuda)
    try:
        step()  # compiles
    except Exception as err:
        _raise_if_model_fails(model, args, kwargs, st.train, st.cuda, length, err)
        raise
    for _ in range(st.warmup):
        step()
    times, peak = _timed(step, st.repeats, st.cuda)
    step_ms, rows, trace, traced_peak = _profiled(step, st.profile_steps, tmp,
                                                  f"{backend}_L{length}", st.cuda, st.gzip)
    times_ms = sorted(t * 1e3 for t in times)
    median = times_ms[len(times_ms) // 2]
    spread = (times_ms[-1] - times_ms[0]) / median if median > 0 else 0.0
    if spread > SPREAD_WARN:
        warnings.warn(f"profile: the {len(times_ms)} timed steps of {backend} at length {length} "
                      f"range over {100 * spread:.0f}% of their median ({times_ms[0]:.2f} to "
                      f"{times_ms[-1]:.2f} ms): the machine is busy or the steps differ; "
                      "raise repeats or warmup", RuntimeWarning, stacklevel=3)
    return {"length": length, "backend": backend,
            "step_ms": median, "step_ms_all": times_ms, "spread": spread,
            "profiled_step_ms": step_ms,
            "peak_mib": peak if st.cuda else traced_peak,
            "peak_source": ("torch.cuda.max_memory_allocated" if st.cuda
                            else "profiler memory events (CPU allocator)"),
            "stages": rows, "trace": trace}, captured


def _summary(st: _Settings, results: list, rewrite: list, graphs: list) -> dict:
    from ._version import __version__
    return {
        "schema": 1, "run_name": st.run_name,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": _device_name(st.device), "torch": torch.__version__,
        "pisa_compile": __version__, "model": st.model_name, "options": st.options,
        "train": st.train, "lengths": st.lengths,
        "settings": {"warmup": st.warmup, "repeats": st.repeats,
                     "profile_steps": st.profile_steps, "gzip": st.gzip},
        "results": results, "rewrite": rewrite,
        "files": {"summary": "summary.json", "plot": "profile.png", "table": "table.txt",
                  "report": "rewrite_report.txt", "graphs": graphs,
                  "traces": [r["trace"] for r in results]},
    }


class _RunFolder:
    """A temporary folder beside ``final``, renamed into place by :meth:`commit`; removed
    (and ``final``'s parent too, if this created it and it is empty) if never committed."""

    def __init__(self, final: Path):
        self.final, self.parent = final, final.parent
        self.created_parent = not self.parent.exists()
        self.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=self.parent))
        self.done = False

    def commit(self) -> None:
        os.chmod(self.tmp, 0o755)  # mkdtemp makes it 0700
        if self.final.exists():  # overwrite=True
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)
        self.done = True

    def __enter__(self) -> "_RunFolder":
        return self

    def __exit__(self, *exc) -> None:
        if self.done:
            return
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.created_parent:
            try:
                self.parent.rmdir()  # only if empty: never remove anything we did not create
            except OSError:
                pass


def profile(model: Callable, inputs: Any, *, lengths: Union[str, Iterable[int], None] = None,
            options: Optional[Mapping[str, Any]] = None, out_dir: Union[str, Path] = "profiles",
            run_name: Optional[str] = None, model_name: Optional[str] = None,
            warmup: int = 2, repeats: int = 10, profile_steps: int = 2, train: bool = False,
            gzip: bool = True, overwrite: bool = False, progress: bool = True) -> ProfileResult:
    """Profile ``model`` compiled with ``backend="pisa"`` against Inductor dense.

    For each sequence length, and for each backend (Inductor dense first, then PISA): reset
    Dynamo, compile, warm up ``warmup`` steps, time ``repeats`` steps (median wall time, peak
    memory), then record ``profile_steps`` steps with ``torch.profiler`` (after one profiler
    warm-up step) into a trace. Nothing is printed (the CLI prints ``result.table``).

    Args:
        model: an ``nn.Module`` or a function; it is not modified.
        inputs: either ``make_inputs(length) -> inputs`` (called once per length), or fixed
            inputs (then there is one point, labelled by ``lengths[0]`` if given, else by dim 1
            of the first tensor of rank >= 2). Inputs are a tuple/list (positional), a dict
            (keyword) or a single tensor, already on the model's device.
        lengths: sequence lengths in tokens (``"1024,2048"`` or ints); required with
            ``make_inputs``.
        options: ``torch.compile(options=...)`` for the ``pisa`` backend: PisaConfig keys and
            Inductor config keys (validated as the backend does). Inductor keys also apply to
            the dense baseline.
        out_dir: parent of the run folder (default ``profiles``).
        run_name: the run folder's name (letters, digits, ``._+-``); default
            ``<model_name>-<device>-<YYYYmmdd-HHMMSS>``.
        model_name: a label for tables and plots (default: the model's class name).
        warmup: untimed steps after compiling (>= 0); the first call compiles in any case.
        repeats: timed steps (>= 1); the table shows their median, and ``±x%`` where their
            range exceeds 25% of it (a ``RuntimeWarning`` says so too).
        profile_steps: profiled steps per trace (>= 1); stage times are their mean.
        train: profile forward + backward (``mean()`` of the first floating-point output),
            so ``pisa.attention_bwd`` appears; default forward only, under ``no_grad``.
        gzip: write ``.pt.trace.json.gz`` (both viewers read it) rather than ``.pt.trace.json``.
        overwrite: replace an existing run folder of the same name.
        progress: show a tqdm bar (on stderr) over lengths and backends.

    Returns:
        A :class:`ProfileResult`: ``run_dir``, ``summary`` (as written to ``summary.json``) and
        ``table``. ``summary.json`` holds ``schema``, ``run_name``, ``created``, ``device``,
        ``torch``, ``pisa_compile``, ``model``, ``options``, ``train``, ``lengths``,
        ``settings`` (warmup, repeats, profile_steps), ``results`` (one per length and
        backend: ``length``, ``backend``, ``step_ms`` (timed median), ``step_ms_all``,
        ``profiled_step_ms``, ``peak_mib`` (peak extra MiB or null), ``stages`` ({row: {ms,
        share, calls}}, per step), ``trace`` (file name)), ``rewrite`` (``rewritten``,
        ``left_dense``, ``sites`` per length) and ``files``. Times are milliseconds per step.
        On CUDA a stage's ms is the GPU time of the kernels launched inside its range; on the
        CPU the wall time of the range.

    Raises:
        ProfileError: bad ``lengths`` (flag ``--lengths``), ``options`` (``--options``),
            ``run_name`` or an existing run folder (``--run-name``), counts (``--warmup``,
            ``--repeats``, ``--profile-steps``), or a model that fails to run eagerly on the
            inputs (``--model``; the model's exception is chained).
        Anything the compilers raise, for a model that runs eagerly but fails to compile.

    In every failure the run folder is not created (work happens in a temporary folder
    beside it that is removed).
    """
    from tqdm import tqdm
    from .lowering import Report

    st = _settings(model, inputs, lengths, options, out_dir, run_name, model_name, warmup,
                   repeats, profile_steps, train, gzip, overwrite)
    with _RunFolder(st.final) as folder:
        results, rewrite, graphs, reports = [], [], [], []
        with tqdm(total=2 * len(st.lengths), desc="profile", file=sys.stderr,
                  disable=not progress, unit="run") as bar:
            for length in st.lengths:
                for backend in ("dense", "pisa"):
                    bar.set_description(f"profile L={length} {backend}")
                    result, captured = _measure(model, backend, length, st, folder.tmp)
                    results.append(result)
                    if backend == "pisa":
                        graphs += _write_graphs(folder.tmp, length, captured)
                        report = Report(sites=captured.sites, graphs=len(captured.before))
                        reports.append(f"== sequence length {length} ==\n{report}\n")
                        rewrite.append({"length": length, "graphs": len(captured.before),
                                        "rewritten": len(report.rewritten),
                                        "left_dense": len(report.left_dense),
                                        "sites": [asdict(s) for s in captured.sites]})
                    bar.update(1)
        torch._dynamo.reset()
        summary = _summary(st, results, rewrite, graphs)
        table = stage_table(summary)
        (folder.tmp / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        (folder.tmp / "table.txt").write_text(table)
        (folder.tmp / "rewrite_report.txt").write_text("\n".join(reports))
        plot(summary, folder.tmp / "profile.png")
        folder.commit()
    return ProfileResult(run_dir=st.final, summary=summary, table=table)


def _raise_if_model_fails(model, args, kwargs, train, cuda, length, compile_error) -> None:
    """Turn "the model itself fails on these inputs" into a ProfileError; return otherwise
    (the compile failed on a model that runs: the caller re-raises that error)."""
    torch._dynamo.reset()
    try:
        _make_step(model, args, kwargs, train, model, cuda)()
    except Exception as err:
        raise ProfileError(
            "--model", f"the model fails to run on its inputs at sequence length {length}: "
                       f"{type(err).__name__}: {err}") from err


def _write_graphs(tmp: Path, length: int, captured: _Captured) -> list[str]:
    folder = tmp / "graphs" / f"L{length}"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for i, (before, after) in enumerate(zip(captured.before, captured.after)):
        for tag, code in (("before", before), ("after", after)):
            p = folder / f"graph{i}.{tag}.py"
            p.write_text(f"# Dynamo graph {i} at sequence length {length}, {tag} the PISA "
                         f"rewrite\n{code}")
            written.append(str(p.relative_to(tmp)))
    return written
