"""A small Llama-style byte-level code model, trained with dense and with PISA attention.

``python -m experiments.code_model`` (GPU) trains the same model twice, with identical
seeds, data and steps: ``torch.compile(model)`` (Inductor, dense SDPA) and
``torch.compile(model, backend="pisa")`` (the PISA training kernels). It then measures, for
each: held-out bits per byte, a planted-retrieval test at 4K..32K, and training throughput,
and writes ``code_model.json`` plus the PISA checkpoint.

Data: the Python sources of the installed standard library and site-packages as bytes,
split into train and held-out *by file* (a hash of the path). Retrieval: a line
``name = "123456"`` planted at a depth of the context and the same line again at
its end; a hit is all six digits predicted (argmax, teacher-forced: the same as greedy
decoding). Training windows carry such pairs too, so both runs learn the same task.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

CHECKPOINT = Path(__file__).with_name("data") / "code_model_pisa.pt"


# -- the model ---------------------------------------------------------------------------------

@dataclass
class CodeModelConfig:
    """Llama-style decoder over bytes (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings)."""

    vocab_size: int = 256
    dim: int = 384
    n_layers: int = 6
    n_heads: int = 6
    n_kv_heads: int = 2
    ffn_dim: int = 1024
    rope_theta: float = 500000.0


class _Attention(nn.Module):
    def __init__(self, cfg: CodeModelConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, cfg: CodeModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = _Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class CodeModel(nn.Module):
    """``forward(ids [B, N] int64) -> logits [B, N, 256]`` (float32 under autocast)."""

    def __init__(self, cfg: Optional[CodeModelConfig] = None):
        super().__init__()
        self.cfg = cfg = cfg or CodeModelConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        hd = cfg.dim // cfg.n_heads
        # A buffer, not traced arithmetic on cfg.rope_theta: under dynamic=True Dynamo makes
        # that float a symbol and compiles the graph twice.
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (
            torch.arange(0, hd, 2, dtype=torch.float32) / hd), persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        n = ids.shape[1]
        inv = self.inv_freq
        ang = torch.arange(n, device=ids.device, dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = ang.cos(), ang.sin()
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x) @ self.embed.weight.t()


def load_checkpoint(path: Path = CHECKPOINT, device: str = "cpu") -> CodeModel:
    """The trained PISA code model shipped with the package (bf16 weights, float32 model).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
    """
    if not Path(path).exists():
        raise FileNotFoundError(f"no code-model checkpoint at {path} (train one with "
                                "`python -m experiments.code_model`)")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = CodeModel(CodeModelConfig(**blob["config"]))
    model.load_state_dict({k: v.float() for k, v in blob["state_dict"].items()})
    # The PISA options it was trained with: compile it with these (the demo does). Saved as
    # changes to the defaults of their day, the "fast" preset, unless they name a preset.
    model.pisa_options = {"preset": "fast", **dict(blob.get("pisa_options", {}))}
    return model.to(device).eval()


# -- data ----------------------------------------------------------------------------------------

def python_sources() -> list[Path]:
    """``*.py`` files of the standard library and site-packages, sorted."""
    roots = {Path(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")}
    files = set()
    for root in roots:
        if root.is_dir():
            files.update(p for p in root.rglob("*.py") if p.is_file())
    return sorted(files)


def held_out(path: Path, fraction: float = 0.05) -> bool:
    """Whether a file belongs to the held-out split (a stable hash of its path)."""
    return zlib.crc32(str(path).encode()) % 1000 < fraction * 1000


def load_bytes(split: str, max_bytes: int) -> Tensor:
    """Concatenated source bytes of one split (``"train"`` or ``"heldout"``), uint8."""
    buf = bytearray()
    for p in python_sources():
        if held_out(p) != (split == "heldout"):
            continue
        try:
            buf += p.read_bytes() + b"\n\n"
        except OSError:
            continue
        if len(buf) >= max_bytes:
            break
    if not buf:
        raise FileNotFoundError(f"no Python sources found for the {split!r} split")
    return torch.frombuffer(buf[:max_bytes], dtype=torch.uint8)  # a bytearray: writable


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _pair(rng: random.Random) -> tuple[bytes, bytes]:
    name = "key_" + "".join(rng.choice(_LETTERS) for _ in range(6))
    value = "".join(rng.choice("0123456789") for _ in range(6))
    return name.encode(), value.encode()


def plant(window: Tensor, rng: random.Random, depth: float, query_at_end: bool = True,
          distance: Optional[int] = None) -> tuple[Tensor, int, int]:
    """Overwrite ``\\nNAME = "VALUE"\\n`` at ``depth`` of ``window`` and the same line again at
    its end (or at a random later place): the model must recall VALUE there. Returns the
    window, the index of the first VALUE byte of the repeat (the planted bytes end 8 later)
    and the index of the definition's first byte. ``distance``: bytes from the
    end of the definition to the repeat (with ``query_at_end=False``; default: random)."""
    name, value = _pair(rng)
    define = b"\n" + name + b' = "' + value + b'"\n'
    query_head = b"\n" + name + b' = "'  # the definition's own prefix: recall it
    query = query_head + value + b'"\n'
    n = window.numel()
    at = min(int(depth * n), n - len(define) - len(query) - 1)
    if query_at_end:
        q_at = n - len(query)
    elif distance is not None:
        q_at = min(at + len(define) + distance, n - len(query))
    else:
        q_at = rng.randrange(at + len(define), n - len(query) + 1)
    w = window.clone()
    w[at:at + len(define)] = torch.tensor(list(define), dtype=w.dtype)
    w[q_at:q_at + len(query)] = torch.tensor(list(query), dtype=w.dtype)
    return w, q_at + len(query_head), at


def train_batch(data: Tensor, batch: int, length: int, rng: random.Random,
                pairs: Optional[tuple[int, int]] = None) -> tuple[Tensor, Tensor]:
    """``batch`` random windows of ``length + 1`` bytes with planted pairs, and a bool mask
    ``[batch, length]`` of the targets that are planted values.

    Each window gets ``pairs`` (a range; default 1 to ``length / 2048``) non-overlapping
    pairs; the distance from a definition to its repeat is log-uniform from 16 bytes to the
    window, so short-range recall is learned first and stretched to long range.
    """
    lo, hi = pairs or (1, max(1, length // 2048))
    rows, marks = [], []
    for _ in range(batch):
        s = rng.randrange(0, data.numel() - length - 2)
        w = data[s:s + length + 1].long()
        mark = torch.zeros(length, dtype=torch.bool)
        taken: list[tuple[int, int]] = []
        for _ in range(rng.randint(lo, hi)):
            for _try in range(8):  # rejection: planted lines must not overwrite each other
                dist = int(math.exp(rng.uniform(math.log(16), math.log(length))))
                w2, v_at, start = plant(w, rng, rng.uniform(0.0, 0.95), query_at_end=False,
                                        distance=dist)
                span = (start, v_at + 8)
                if all(span[1] < a or span[0] > b for a, b in taken):
                    w = w2
                    taken.append(span)
                    mark[v_at - 1:v_at + 5] = True  # logits at t predict byte t + 1
                    break
        rows.append(w)
        marks.append(mark)
    return torch.stack(rows), torch.stack(marks)


# -- train and evaluate ------------------------------------------------------------------------

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # retrieval: where the definition is planted


def compile_model(model: nn.Module, attention: str, dynamic: Optional[bool] = False,
                  options: Optional[dict] = None, mode: Optional[str] = None) -> nn.Module:
    """``torch.compile(model, mode=mode)`` with ``attention="dense"`` (Inductor) or ``"pisa"``
    (``backend="pisa"`` with ``options``), after a Dynamo reset. ``mode="reduce-overhead"``
    runs both under CUDA graphs."""
    # Every call compiles the same forward code object, and Dynamo's per-code cache stops at
    # its recompile limit (8 entries) and then runs the model eagerly, dense, without a word.
    # The reset drops every compiled graph of the process: this module compiles one at a time.
    torch._dynamo.reset()
    if attention == "pisa":
        from pisa_compile.backend import pisa_backend  # the object: works without the installed entry point
        if mode is not None:  # torch.compile takes mode or options, not both
            from torch._inductor import list_mode_options
            options = {**list_mode_options(mode), **(options or {})}
        return torch.compile(model, backend=pisa_backend, dynamic=dynamic, options=options)
    return torch.compile(model, dynamic=dynamic, mode=mode)


def pisa_shortfall(before: dict, n_layers: int) -> tuple[int, Optional[str]]:
    """Attention sites rewritten since the ``counters["pisa"]`` snapshot ``before``, and why
    that is not a whole PISA model (fewer than ``n_layers`` sites, or any left dense), else
    ``None``. Dynamo may trace a graph twice (``dynamic=True`` restarts), so counts of at least
    ``n_layers`` pass."""
    from torch._dynamo.utils import counters
    rewritten = counters["pisa"]["rewritten"] - before.get("rewritten", 0)
    left = counters["pisa"]["left_dense"] - before.get("left_dense", 0)
    if rewritten < n_layers or left:
        return rewritten, (f"backend='pisa' rewrote {rewritten} attention sites and left {left} "
                           f"dense ({n_layers} layers)")
    return rewritten, None


def check_dense_warmup(dense_warmup_steps: int, steps: Optional[int]) -> None:
    """Raises ``ValueError`` unless ``dense_warmup_steps >= 0`` and, with ``steps`` given,
    leaves the PISA run at least one PISA step."""
    if dense_warmup_steps < 0:
        raise ValueError(f"dense_warmup_steps must be >= 0, got {dense_warmup_steps}")
    if steps is not None and dense_warmup_steps >= max(steps, 1):
        raise ValueError(f"dense_warmup_steps ({dense_warmup_steps}) must be below steps "
                         f"({steps}): the PISA run would take no PISA step")


def train(attention: str, data: Tensor, steps: Optional[int], time_budget: Optional[float],
          length: int, batch: int, lr: float, seed: int, device: str,
          log=print, model_config: Optional[CodeModelConfig] = None,
          options: Optional[dict] = None, mode: Optional[str] = None,
          dense_warmup_steps: int = 0) -> tuple[CodeModel, dict]:
    """Train one model; stop after ``steps`` steps, or when ``time_budget`` seconds of
    training (after compiling) have passed. AdamW, linear warm-up then a constant rate (so
    the schedule does not depend on the number of steps); loss: next-byte cross-entropy plus
    the mean cross-entropy of the planted values. Returns the model and its record.

    ``attention``: ``"dense"`` (Inductor) or ``"pisa"`` (``backend="pisa"``, ``options``).
    ``mode``: the ``torch.compile`` mode of both (e.g. ``"reduce-overhead"``: CUDA graphs).
    ``dense_warmup_steps``: optimizer steps that a ``"pisa"`` run first takes with dense
    attention before it recompiles with PISA (ignored for ``"dense"``). ``steps`` counts them;
    the throughput leaves out each compile's first three steps.

    Raises:
        ValueError: ``dense_warmup_steps`` is negative, or not below ``steps``.
        RuntimeError: ``"pisa"`` did not rewrite every layer (checked at its first PISA step),
            or ``time_budget`` ended the run inside its dense warm-up.
    """
    check_dense_warmup(dense_warmup_steps, steps if attention == "pisa" else None)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = CodeModel(model_config).to(device)
    first_pisa = dense_warmup_steps if attention == "pisa" else -1
    compiled = compile_model(model, "dense" if first_pisa > 0 else attention, options=options,
                             mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device == "cuda")
    warmup = 50
    losses, value_losses, t_start, timed_tokens, t_timed = [], [], None, 0, 0.0
    step_s = []
    from torch._dynamo.utils import counters
    before = dict(counters["pisa"])
    rewritten = 0
    step = 0
    last_compile = 0
    while True:
        if steps is not None and step >= steps:
            break
        if time_budget is not None and t_start is not None and \
                time.perf_counter() - t_start > time_budget:
            break
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup)
        if step == first_pisa and step > 0:
            before = dict(counters["pisa"])
            compiled = compile_model(model, "pisa", options=options, mode=mode)
            last_compile = step
        x, mark = train_batch(data, batch, length, rng)
        x, mark = x.to(device), mark.to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = compiled(x[:, :-1])
        # Next-byte loss plus the mean loss on the planted values: they are a few bytes in
        # 32K, and without the second term the retrieval task gets almost no gradient.
        per = F.cross_entropy(logits.float().reshape(-1, 256), x[:, 1:].reshape(-1),
                              reduction="none")
        value_loss = per[mark.reshape(-1)].mean()
        loss = per.mean() + value_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if step == 2:
            t_start = time.perf_counter()  # compile and warm-up are over
        if step >= 3 and step - last_compile >= 3:
            timed_tokens += batch * length
            t_timed += dt
            step_s.append(dt)
        elif t_start is not None:
            t_start += dt  # a recompile's first steps are not training time
        if step == max(0, first_pisa):
            rewritten, why = pisa_shortfall(before, model.cfg.n_layers)
            # Checked at once: a PISA run with a site left dense would waste its budget and
            # poison the comparison.
            if attention == "pisa" and why:
                raise RuntimeError(f"{why}: the run would not be a PISA run")
        losses.append(loss.item())
        value_losses.append(value_loss.item())
        if step % 50 == 0:
            log(f"{attention}: step {step} loss {loss.item():.4f} ({dt * 1e3:.0f} ms)")
        step += 1
    if attention == "pisa" and step <= first_pisa:
        raise RuntimeError(f"the PISA run ended at step {step}, inside its dense warm-up of "
                           f"{first_pisa} steps: it took no PISA step")
    record = dict(attention=attention, steps=step, pisa_sites_rewritten=rewritten,
                  mode=mode, dense_warmup_steps=max(0, first_pisa),
                  length=length, batch=batch, lr=lr,
                  seed=seed, final_loss=sum(losses[-20:]) / max(1, len(losses[-20:])),
                  tokens_per_s=timed_tokens / t_timed if t_timed else None,
                  step_ms_median=sorted(step_s)[len(step_s) // 2] * 1e3 if step_s else None,
                  final_value_loss=sum(value_losses[-20:]) / max(1, len(value_losses[-20:])),
                  loss_curve=losses[::10], value_loss_curve=value_losses[::10])
    return model, record


@torch.no_grad()
def bits_per_byte(model: nn.Module, data: Tensor, length: int, n_windows: int,
                  device: str) -> float:
    """Mean next-byte cross-entropy in bits over ``n_windows`` evenly spaced windows."""
    total, count = 0.0, 0
    stride = (data.numel() - length - 1) // n_windows
    for i in range(n_windows):
        w = data[i * stride:i * stride + length + 1].long().to(device)[None]
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(w[:, :-1])
        total += F.cross_entropy(logits.float()[0], w[0, 1:], reduction="sum").item()
        count += length
    return total / count / math.log(2)


@torch.no_grad()
def retrieval(model: nn.Module, data: Tensor, lengths: list[int], depths: list[float],
              per_cell: int, device: str, seed: int = 1234) -> dict:
    """Exact-match accuracy of the planted value, per context length and depth."""
    rng = random.Random(seed)
    out = {}
    for n in lengths:
        for d in depths:
            hits = 0
            for _ in range(per_cell):
                s = rng.randrange(0, data.numel() - n - 1)
                w, v_at, _ = plant(data[s:s + n].long(), rng, d)
                w = w.to(device)[None]
                with torch.autocast(device_type=device, dtype=torch.bfloat16,
                                    enabled=device == "cuda"):
                    logits = model(w)
                pred = logits[0, v_at - 1:v_at + 5].argmax(-1)
                hits += int(torch.equal(pred, w[0, v_at:v_at + 6]))
            out[f"{n / 1024:g}K@{d:.1f}"] = hits / per_cell
    return out


def evaluate(model: CodeModel, attention: str, held: Tensor, length: int, n_windows: int,
             lengths: list[int], per_cell: int, device: str,
             options: Optional[dict] = None) -> dict:
    """Compile ``model`` for evaluation (``dynamic=True``) with ``attention``; then
    :func:`bits_per_byte` over ``n_windows`` windows of ``length`` bytes of ``held`` and
    :func:`retrieval` at ``lengths`` x :data:`DEPTHS`, ``per_cell`` each.

    Returns ``{"bits_per_byte": float, "retrieval": {cell: accuracy}, "eval_wall_s": {...}}``.

    Raises:
        RuntimeError: ``attention="pisa"`` did not rewrite every layer (the numbers would be
            dense ones).
    """
    from torch._dynamo.utils import counters
    before = dict(counters["pisa"])
    t0 = time.perf_counter()
    m = compile_model(model, attention, dynamic=True,
                      options=options if attention == "pisa" else None)
    bpb = bits_per_byte(m, held, length, n_windows, device)
    if attention == "pisa":
        _, why = pisa_shortfall(before, model.cfg.n_layers)
        if why:
            raise RuntimeError(f"{why}: this evaluation would be dense")
    t1 = time.perf_counter()
    ret = retrieval(m, held, lengths, list(DEPTHS), per_cell, device)
    t2 = time.perf_counter()
    return dict(bits_per_byte=bpb, retrieval=ret,
                eval_wall_s={"bits_per_byte (incl. compile)": t1 - t0, "retrieval": t2 - t1})


def save_checkpoint(model: CodeModel, path: Path, pisa_options: Optional[dict] = None) -> None:
    """bf16 weights, the config and the PISA options of training (about 19 MB by default)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"config": asdict(model.cfg), "pisa_options": dict(pisa_options or {}),
                "state_dict": {k: v.detach().to(torch.bfloat16).cpu()
                               for k, v in model.state_dict().items()}}, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.code_model",
        description="Train the byte-level code model with dense and with PISA attention "
                    "(same seed, data, steps) and compare bits/byte, retrieval, throughput.")
    ap.add_argument("--length", type=int, default=16384, help="training context (bytes)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps of each run (default: as many as --time-budget "
                         "allows the first run, then the same number for the second)")
    ap.add_argument("--time-budget", type=float, default=150.0,
                    help="seconds of training for the first run when --steps is not given")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", default="pisa,dense",
                    help="runs, in order, comma-separated: dense, pisa")
    ap.add_argument("--eval-lengths", default="4096,8192,16384,32768")
    ap.add_argument("--per-cell", type=int, default=20, help="retrieval examples per cell")
    ap.add_argument("--bpb-windows", type=int, default=32,
                    help="held-out windows of --length bytes for bits per byte")
    ap.add_argument("--train-bytes", type=int, default=64 << 20)
    ap.add_argument("--out", default="code_model.json")
    ap.add_argument("--checkpoint", default=None, help="where to save the PISA model")
    ap.add_argument("--options", default='{"preset": "fast"}',
                    help='PISA options (JSON) for training and evaluating with PISA, e.g. '
                         '\'{"preset": "fast", "local_blocks": 8}\'')
    ap.add_argument("--mode", default=None,
                    help="torch.compile mode of both runs, e.g. reduce-overhead (CUDA graphs)")
    ap.add_argument("--dense-warmup-steps", type=int, default=0,
                    help="the PISA run's first steps use dense attention (counted in --steps)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    try:
        check_dense_warmup(args.dense_warmup_steps,
                           args.steps if args.dense_warmup_steps else None)
    except ValueError as e:
        ap.error(f"--dense-warmup-steps: {e}")
    if args.dense_warmup_steps and "pisa" not in args.attention:
        ap.error("--dense-warmup-steps applies to the pisa run; --attention has none")
    from pisa_compile.config import split_options
    try:
        split_options(None, args.mode)  # the backend's own check of a mode
    except ValueError as e:
        ap.error(f"--mode: {e}")
    runs = [a.strip() for a in args.attention.split(",") if a.strip()]
    if not runs or any(a not in ("dense", "pisa") for a in runs):
        ap.error(f"--attention: expected a comma-separated list of dense, pisa; got "
                 f"{args.attention!r} (example: --attention dense,pisa)")
    try:
        options = json.loads(args.options)
        if not isinstance(options, dict):
            raise TypeError(f"a JSON {type(options).__name__}, not an object")
        split_options(options)  # unknown keys are errors here, not after the first run
    except (ValueError, TypeError) as e:
        ap.error(f"--options: expected a JSON object of PISA options like "
                 f"'{{\"local_blocks\": 8}}'; got {args.options!r} ({e})")
    try:
        lengths = [int(x) for x in args.eval_lengths.split(",")]
    except ValueError:
        ap.error(f"--eval-lengths: expected integers like 4096,8192; got {args.eval_lengths!r}")
    train_data = load_bytes("train", args.train_bytes)
    held = load_bytes("heldout", max(max(lengths) * 8, args.bpb_windows * args.length) + 1)
    print(f"data: {train_data.numel() / 2**20:.1f} MiB train, {held.numel() / 2**20:.1f} MiB "
          f"held out", flush=True)
    result = dict(config=asdict(CodeModelConfig()), args=vars(args), runs={},
                  torch=torch.__version__,
                  device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    steps = args.steps
    for attention in runs:
        t0 = time.perf_counter()
        model, rec = train(attention, train_data, steps, None if steps else args.time_budget,
                           args.length, args.batch, args.lr, args.seed, args.device,
                           log=lambda m: print(m, flush=True),
                           options=options if attention == "pisa" else None, mode=args.mode,
                           dense_warmup_steps=args.dense_warmup_steps)
        rec["train_wall_s"] = time.perf_counter() - t0
        steps = rec["steps"]
        model.eval()
        rec["n_params"] = sum(p.numel() for p in model.parameters())
        result["runs"][attention] = rec
        # Written before the evaluations, so a slow or failed evaluation loses nothing.
        if attention == "pisa" and args.checkpoint:
            save_checkpoint(model, Path(args.checkpoint), options)
        Path(args.out).write_text(json.dumps(result, indent=1))
        for eval_attention in (attention, "pisa" if attention == "dense" else "dense"):
            r = evaluate(model, eval_attention, held, args.length, args.bpb_windows, lengths,
                         args.per_cell, args.device, options)
            tag = "" if eval_attention == attention else f"_{eval_attention}_attention"
            for key, value in r.items():
                rec[key + tag] = value
            wall = r["eval_wall_s"]
            print(f"{attention} (eval {eval_attention}): bpb {r['bits_per_byte']:.4f} "
                  f"({wall['bits_per_byte (incl. compile)']:.0f} s), retrieval "
                  f"{r['retrieval']} ({wall['retrieval']:.0f} s)", flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
