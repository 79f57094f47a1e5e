"""``polyfhe demo``: the main job. It grows with the pipeline; today it runs, on local data:

data -> zoo model -> BatchNorm running statistics from training images -> fold -> checked ONNX export ->
degree analysis -> the zoo table with the analyzer's numbers. Training, calibration of value ranges and
encrypted inference plug in here as they land.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from polyfhe.commands.models import render_table
from polyfhe.data.sources import ImageDataset, load_default_dataset
from polyfhe.export.onnx import export_onnx
from polyfhe.models.registry import create_model
from polyfhe.zoo import count_parameters, zoo_rows

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run the main job end to end on local data")
    p.add_argument("--model", default="monet_lr_bn", help="BN zoo model to build for the data (default monet_lr_bn)")
    p.add_argument("--samples", type=int, default=512, help="test images pushed through the folded model")
    p.add_argument("--out", type=Path, default=None, help="folder for the exported .onnx (default: a temp dir)")
    p.add_argument("--skip-zoo", action="store_true", help="do not print the full zoo table")
    p.set_defaults(func=run)


def _running_statistics(model: torch.nn.Module, data: ImageDataset, batches: int = 20, batch: int = 128) -> None:
    """Fill BatchNorm running statistics from training images (full calibration lands with training)."""
    rng = np.random.default_rng(0)
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            idx = rng.choice(len(data.x_train), size=batch, replace=False)
            model(torch.from_numpy(data.x_train[idx]))
    model.eval()


def run(args: argparse.Namespace) -> int:
    console = Console(width=200)
    data = load_default_dataset()
    c, h, w = data.input_shape
    console.print(f"[bold]data[/]: {data.name}, train {len(data.x_train)}, test {len(data.x_test)}, "
                  f"input {c}x{h}x{w}, {data.num_classes} classes")
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=data.num_classes, img_size=h, in_chans=c)
    _running_statistics(model, data)
    console.print(f"[bold]model[/]: {args.model}, {count_parameters(model):,} parameters "
                  "(untrained: training lands with the training issue)")
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="polyfhe-demo-"))
    start = time.perf_counter()
    result = export_onnx(model, out_dir / f"{args.model}.onnx")
    report = result.analysis
    console.print(f"[bold]fold + ONNX export[/]: {result.path} in {time.perf_counter() - start:.1f} s, "
                  f"onnxruntime vs torch max relative error {result.max_rel_error:.1e}")
    console.print(f"[bold]degree check[/]: polynomial={report.polynomial}, degree {report.degree}, "
                  f"ct x ct depth {report.mult_depth}, CKKS levels {report.levels}")
    x = torch.from_numpy(data.x_test[: args.samples])
    with torch.no_grad():
        agree = (model(x).argmax(1) == torch.from_numpy(data.y_test[: args.samples])).float().mean()
    console.print(f"[bold]accuracy[/] of the untrained model on {len(x)} test images: {agree:.1%} (chance level)")
    if not args.skip_zoo:
        console.print(render_table(zoo_rows(with_analyzer=True)))
    return 0
