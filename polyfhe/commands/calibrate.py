"""``polyfhe calibrate CHECKPOINT_DIR --data SOURCE``: recompute running statistics, record value ranges.

Loads the checkpoint, recalibrates every BN-like layer on a random subset of the source's training images
(``load_dataset`` gives [0, 1]; the checkpoint's ``normalization``, recorded by ``polyfhe train``, is applied
when present), writes the updated weights back and ``calibration.json`` beside them, and prints a short table.
``--keep-stats`` keeps the statistics from training and only records the value ranges.
Exit codes: 0 done; 2 bad input (checkpoint, data source, or data that does not fit the model).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from polyfhe.commands.arguments import positive_int

__all__ = ["add_parser", "run"]

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_BAD_INPUT = 2


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate", help="recompute running statistics of a checkpoint and record value ranges for CKKS",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT_DIR",
                   help="folder with model.safetensors and config.json")
    p.add_argument("--data", required=True, metavar="SOURCE",
                   help="dataset source, e.g. fashion-mnist or digits")
    p.add_argument("--samples", type=positive_int, default=2048, metavar="N",
                   help="training images to calibrate on, a random subset (default 2048)")
    p.add_argument("--batch-size", type=positive_int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the random subset")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--no-ranges", action="store_true",
                      help="only recompute running statistics (skip the ONNX export and range profiling)")
    what.add_argument("--keep-stats", action="store_true",
                      help="keep the running statistics from training; only profile value ranges")
    p.set_defaults(func=run)




def run(args: argparse.Namespace) -> int:
    from polyfhe.calibration import CalibrationError, calibrate, sample_images
    from polyfhe.data.sources import load_dataset
    from polyfhe.exporters.onnx import ExportError
    from polyfhe.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from polyfhe.training.data import Normalization

    try:
        model, info = load_checkpoint(args.checkpoint)
        dataset = load_dataset(args.data)
        x = sample_images(dataset.x_train, args.samples, args.seed)
        normalization = info.extra.get("normalization")
        if normalization is not None:
            x = Normalization.from_dict(normalization).apply_numpy(x)
        result = calibrate(model, x, batch_size=args.batch_size, onnx_ranges=not args.no_ranges,
                           recompute_stats=not args.keep_stats)
    except (CheckpointError, CalibrationError, ExportError, FileNotFoundError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    record = {"data": args.data, "num_samples": result.num_samples, "seed": args.seed,
              "normalized": normalization is not None, "ranges": not args.no_ranges,
              "running_stats": "kept" if args.keep_stats else "recomputed"}
    extra = {**info.extra, "calibration": record}
    save_checkpoint(model, args.checkpoint, model_name=info.model_name, model_kwargs=info.model_kwargs,
                    epoch=info.epoch, extra=extra)
    path = result.save(args.checkpoint)
    _render(result, path)
    return EXIT_OK


def _render(result: Any, path: Path) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    stats = result.stats_summary
    layers = len(stats.get("layers", []))
    what = (f"recalibrated {layers} running-statistics layers" if stats.get("num_samples")
            else f"kept the trained statistics of {layers} layers")
    console.print(f"[bold]{escape(result.model_name)}[/bold]: {what}, {result.num_samples} samples; "
                  f"wrote {escape(str(path))}")
    table = Table(title="value ranges (largest |value| first)")
    for col in ("value", "shape", "min", "max", "p0.1", "p99.9", "abs max"):
        table.add_column(col, justify="left" if col in ("value", "shape") else "right")
    shown = sorted(result.node_ranges.values(), key=lambda r: -r.abs_max)[:8] or [result.input_range]
    for r in shown:
        table.add_row(escape(r.name), "x".join(map(str, r.shape)), *(f"{v:.4g}" for v in
                      (r.min, r.max, r.p001, r.p999, r.abs_max)))
    console.print(table)
    if result.node_ranges:
        console.print(f"{len(result.node_ranges)} values profiled; largest |value| {result.max_abs:.4g}")
