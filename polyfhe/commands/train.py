"""``polyfhe train``: train a zoo model on local data and write checkpoint, metrics, CSV log and curves.

Exit codes: 0 trained; 1 training diverged (NaN loss; the last good checkpoint is kept); 2 bad input
(unknown model or option, missing data set, unreadable or mismatched checkpoint).

Data-parallel: ``--nproc N`` starts N processes on this machine through torch.distributed.run (torchrun), one per
GPU on CUDA, gloo on CPU; ``--batch-size`` is the global batch. For several machines run torchrun yourself:
``torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m polyfhe train ...``
(docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # polyfhe.training imports torch: only the run imports it, never the parser
    from rich.console import Console
    from rich.table import Table

EXIT_OK, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2

# What the parser shows, without importing polyfhe.training (it imports torch, seconds for every --help):
# TrainConfig's defaults and the names of its optimizers, amp modes and augmentations, sorted.
# tests/commands/test_cli_startup.py holds them equal to polyfhe.training's.
OPTIMIZER_NAMES = ("adamw", "lamb", "sgd")
AMP_MODES = ("auto", "bf16", "off")
AUGMENTATION_NAMES = ("flip", "flip-shift", "none", "shift")
_DEFAULTS: dict[str, Any] = {
    "batch_size": 128, "eval_batch_size": 512, "lr": 1e-3, "min_lr": 1e-6, "weight_decay": 0.05,
    "warmup_epochs": 1.0, "label_smoothing": 0.1, "mixup": 0.0, "cutmix": 0.0, "mix_prob": 1.0, "ema_decay": 0.0,
    "drop_path": 0.0, "drop_rate": 0.0, "rampout": 0, "grad_clip": 1.0, "seed": 0, "val_fraction": 0.1,
    "train_subset": None, "time_budget_s": None, "resume": None,
}

# (flag, TrainConfig field, type, help); unset flags keep TrainConfig's defaults.
_OPTIONS: tuple[tuple[str, str, type, str], ...] = (
    ("--batch-size", "batch_size", int, "training batch size"),
    ("--eval-batch-size", "eval_batch_size", int, "batch size for validation and test"),
    ("--lr", "lr", float, "peak learning rate (after warmup)"),
    ("--min-lr", "min_lr", float, "learning rate at the end of the cosine decay"),
    ("--weight-decay", "weight_decay", float, "decoupled weight decay on matrices and kernels"),
    ("--warmup-epochs", "warmup_epochs", float, "linear warmup length in epochs (fractions allowed)"),
    ("--label-smoothing", "label_smoothing", float, "label smoothing"),
    ("--mixup", "mixup", float, "mixup Beta alpha (0 = off)"),
    ("--cutmix", "cutmix", float, "cutmix Beta alpha (0 = off)"),
    ("--mix-prob", "mix_prob", float, "probability to mix a batch when mixup/cutmix is on"),
    ("--ema-decay", "ema_decay", float, "EMA decay of weights and buffers (0 = off)"),
    ("--drop-path", "drop_path", float, "stochastic depth rate of the last block"),
    ("--drop-rate", "drop_rate", float, "PolyNeXt head dropout, reached after --rampout epochs"),
    ("--rampout", "rampout", int, "epochs over which head dropout ramps up (0 = constant)"),
    ("--grad-clip", "grad_clip", float, "max gradient norm (0 = off)"),
    ("--seed", "seed", int, "random seed (splits, init, shuffling, augmentation)"),
    ("--val-fraction", "val_fraction", float, "share of training images held out for validation"),
    ("--train-subset", "train_subset", int, "use only this many training images"),
    ("--time-budget", "time_budget_s", float, "stop after this many seconds of training"),
    ("--resume", "resume", str, "continue from a previous --out folder (or its last/)"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a zoo model on local data (checkpoint, metrics, curves)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="registry name, e.g. monet_lr_bn (see polyfhe models)")
    p.add_argument("--data", required=True,
                   help="digits, fashion-mnist, mnist, cifar10, imagefolder, npz, or a path (IDX folder, CIFAR-10 "
                        "python folder, ImageFolder tree, .npz with x/y)")
    p.add_argument("--data-root", type=Path, default=None, help="folder or file for a named --data source")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default=None, help="default adamw")
    p.add_argument("--amp", choices=AMP_MODES, default=None, help="bf16 autocast: auto = on CUDA only")
    p.add_argument("--augment", choices=["auto", *AUGMENTATION_NAMES], default=None,
                   help="batch augmentation (auto: picked per data set)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (CUDA only)")
    p.add_argument("--no-normalize", action="store_true", help="feed images in [0, 1] without mean/std")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="train data-parallel in N processes on this machine (torchrun; one per GPU on CUDA)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra model option, VALUE as JSON (e.g. --model-arg 'dims=[32]'); repeatable")
    for flag, name, kind, text in _OPTIONS:
        p.add_argument(flag, dest=name, type=kind, default=None, help=f"{text} (default {_DEFAULTS[name]})")
    p.set_defaults(func=run)


def parse_model_args(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--model-arg expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # a bare word: keep it as a string
    return out


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`TrainConfig` fields the user set on the command line."""
    options = {name: getattr(args, name) for _, name, _, _ in _OPTIONS if getattr(args, name) is not None}
    for name in ("optimizer", "amp", "augment"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.compile:
        options["compile"] = True
    if args.no_normalize:
        options["normalize"] = False
    if args.no_progress:
        options["progress"] = False
    if args.model_arg:
        options["model_kwargs"] = parse_model_args(args.model_arg)
    return options


def _summary(result) -> Table:
    from rich.table import Table

    m = result.metrics
    table = Table(title=f"{m.model} on {m.data}", show_header=False)
    for key, value in (
        ("test accuracy", f"{m.test_accuracy:.2%}"),
        ("validation accuracy", "-" if m.val_accuracy is None else f"{m.val_accuracy:.2%}"),
        ("epochs / steps", f"{m.epochs} / {m.steps}"),
        ("weights", m.weights), ("device / amp", f"{m.device} / {m.amp}"),
        ("parameters", f"{m.parameters:,}"), ("wall time", f"{m.wall_time_s:.1f} s"),
        ("stopped early", m.stopped_early or "no"), ("output", str(result.out_dir)),
    ):
        table.add_row(key, value)
    return table


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``polyfhe train`` command line each torchrun worker runs: this one without ``--nproc``."""
    argv = ["-v"] * getattr(args, "verbose", 0) + [
        "train", "--model", args.model, "--data", str(args.data), "--epochs", str(args.epochs), "--out", str(args.out),
        "--device", args.device]
    if args.data_root is not None:
        argv += ["--data-root", str(args.data_root)]
    for name in ("optimizer", "amp", "augment", "threads"):
        if getattr(args, name) is not None:
            argv += [f"--{name}", str(getattr(args, name))]
    for flag, attr in (("--compile", "compile"), ("--no-normalize", "no_normalize"), ("--no-progress", "no_progress")):
        if getattr(args, attr):
            argv.append(flag)
    for item in args.model_arg:
        argv += ["--model-arg", item]
    for flag, name, _, _ in _OPTIONS:
        if getattr(args, name) is not None:
            argv += [flag, str(getattr(args, name))]
    return argv


def launch_command(args: argparse.Namespace) -> list[str]:
    """torch.distributed.run on this machine alone (``--standalone`` picks a free port), N copies of the run."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(args.nproc), "-m", "polyfhe", *worker_argv(args)]


def _check_before_launch(args: argparse.Namespace) -> None:
    """Refuse what every worker would refuse, before N of them start."""
    from polyfhe.models.registry import model_entry
    from polyfhe.training.config import TrainConfig

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    model_entry(args.model)
    cfg = TrainConfig.from_dict({"model": args.model, "data": str(args.data), "epochs": args.epochs,
                                 "out_dir": str(args.out), "device": args.device, **options_from_args(args)})
    if cfg.batch_size % args.nproc:
        raise ValueError(f"--batch-size {cfg.batch_size} is the global batch and must split evenly over "
                         f"{args.nproc} processes; use a multiple of {args.nproc}")
    if cfg.device.startswith("cuda:"):
        raise ValueError(f"--device {cfg.device} names one GPU; with --nproc use --device cuda (one GPU per process)")


def launch(args: argparse.Namespace, err: Console) -> int:
    from rich.markup import escape

    try:
        _check_before_launch(args)
    except (KeyError, ValueError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        err.print(f"[red]error[/]: {escape(str(message))}", soft_wrap=True)
        return EXIT_BAD_INPUT
    command = launch_command(args)
    # torchrun would set OMP_NUM_THREADS=1 with a warning; say it here instead, and keep a value the user set
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(args.threads or 1))}
    # torchrun answers 1 for any failed worker (a diverged run too); the workers' own messages say what failed
    return subprocess.run(command, env=env, check=False).returncode


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.markup import escape

    from polyfhe.training import TrainingDiverged, train
    from polyfhe.training.checkpoint import CheckpointError

    console = Console(stderr=False)
    err = Console(stderr=True)
    if args.nproc is not None:
        return launch(args, err)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = train(args.model, args.data, args.epochs, args.out, device=args.device,
                       data_root=args.data_root, **options_from_args(args))
    except TrainingDiverged as exc:
        err.print(f"[red]training diverged[/]: {escape(str(exc))}", soft_wrap=True)
        return EXIT_DIVERGED
    except (KeyError, ValueError, FileNotFoundError, CheckpointError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        err.print(f"[red]error[/]: {escape(str(message))}", soft_wrap=True)
        return EXIT_BAD_INPUT
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one summary: rank 0's
        console.print(_summary(result))
    return EXIT_OK
