"""``polyfhe demo``: the main job. It grows with the pipeline; today: data -> zoo -> forward pass -> zoo table.

Later stages (train -> calibrate -> fold -> check -> export -> encrypted inference) plug in here as they land.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from rich.console import Console

from polyfhe.commands.models import render_table
from polyfhe.data.sources import load_default_dataset
from polyfhe.models.registry import create_model
from polyfhe.zoo import count_parameters, zoo_rows

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run the main job end to end on local data")
    p.add_argument("--model", default="monet_lr_bn", help="zoo model to build for the data (default monet_lr_bn)")
    p.add_argument("--samples", type=int, default=256, help="test images pushed through the model")
    p.add_argument("--skip-zoo", action="store_true", help="do not print the full zoo table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = Console(width=200)
    data = load_default_dataset()
    c, h, w = data.input_shape
    console.print(f"[bold]data[/]: {data.name}, train {len(data.x_train)}, test {len(data.x_test)}, "
                  f"input {c}x{h}x{w}, {data.num_classes} classes")
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=data.num_classes, img_size=h, in_chans=c).eval()
    x = torch.from_numpy(data.x_test[: args.samples])
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(x)
    elapsed = time.perf_counter() - start
    console.print(f"[bold]model[/]: {args.model}, {count_parameters(model):,} parameters, "
                  f"forward of {len(x)} images -> logits {tuple(logits.shape)} in {elapsed * 1e3:.1f} ms "
                  "(untrained: training lands with the training issue)")
    if not args.skip_zoo:
        console.print(render_table(zoo_rows(with_analyzer=True)))
    return 0
