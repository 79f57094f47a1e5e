"""Levels vs accuracy: train variants of the FHE recipes on Fashion-MNIST and tabulate depth against accuracy.

Every variant is trained with the same small self-contained recipe (AdamW, warm-up + cosine schedule, label
smoothing 0.1, random horizontal flips; ``--augment shift-flip`` adds +-2 px shifts), then folded and exported
through the checked ONNX exporter, whose analyzer gives degree, ct x ct depth and CKKS levels; the largest
encrypted tensor (values per image) comes from the shapes onnxruntime produces. Writes ``results.md``,
``results.json`` and ``levels_vs_accuracy.png`` to ``--out``.

    python bench/levels_vs_accuracy.py --epochs 25 --device cuda --out runs/levels_vs_accuracy
    python bench/levels_vs_accuracy.py --limit 2000 --epochs 1 --device cpu --out /tmp/lva   # CPU smoke

Images are used as ``load_dataset`` returns them ([0, 1], no mean/std normalisation).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import polyfhe
from polyfhe.calibration import profile_onnx_ranges
from polyfhe.data.sources import ImageDataset, load_dataset, load_fashion_mnist
from polyfhe.exporters.onnx import STRUCTURAL_CHECK_RTOL, export_onnx
from polyfhe.training.recipe import param_groups

log = logging.getLogger("levels_vs_accuracy")


@dataclass(frozen=True)
class Variant:
    """A registry model plus overrides; ``label`` is what the table and the plot show."""

    label: str
    model: str
    overrides: dict[str, Any] = field(default_factory=dict)


VARIANTS: dict[str, Variant] = {v.label: v for v in (
    Variant("monet_fhe_1blk", "monet_fhe_bn", {"depths": (1,)}),
    Variant("monet_fhe_bn", "monet_fhe_bn"),
    Variant("monet_fhe_3blk", "monet_fhe_bn", {"depths": (3,)}),
    Variant("monet_fhe_w64", "monet_fhe_bn", {"dims": (64,)}),
    Variant("cpolynext_fhe_1stk", "cpolynext_fhe_bn", {"stacks": 1}),
    Variant("cpolynext_fhe_bn", "cpolynext_fhe_bn"),
    Variant("cpolynext_fhe_3stk", "cpolynext_fhe_bn", {"stacks": 3}),
    Variant("cpolynext_fhe_narrow", "cpolynext_fhe_bn", {"exp_conv": 1.0, "exp_mlp": 2.0}),
)}


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 25
    batch_size: int = 256
    lr: float = 3e-3
    weight_decay: float = 0.05
    label_smoothing: float = 0.1
    warmup_epochs: float = 1.0
    clip_grad: float = 5.0
    augment: str = "flip"  # key of AUGMENTATIONS
    seed: int = 0


@dataclass(frozen=True)
class Row:
    variant: str
    model: str
    overrides: dict[str, Any]
    params: int
    degree: int | None
    mult_depth: int | None
    levels: int | None
    largest_tensor: int
    test_accuracy: float
    train_seconds: float
    epochs: int
    train_samples: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ training
def hflip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Horizontal flips of half the samples."""
    flip = torch.rand(x.shape[0], generator=generator, device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def shift_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random shifts of up to 2 pixels (zero fill) and horizontal flips, per sample."""
    b, _, h, w = x.shape
    padded = F.pad(x, (2, 2, 2, 2))
    dy = torch.randint(0, 5, (b,), generator=generator, device=x.device)
    dx = torch.randint(0, 5, (b,), generator=generator, device=x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]
    batch = torch.arange(b, device=x.device)[:, None, None]
    return hflip(padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2), generator)


AUGMENTATIONS = {"none": lambda x, generator: x, "flip": hflip, "shift-flip": shift_flip}


def _lr_lambda(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch_size):
        correct += int((model(x[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum())
    return correct / max(1, len(x))


def train(model: nn.Module, data: ImageDataset, cfg: TrainConfig, device: torch.device
          ) -> tuple[float, float]:
    """Train in place; returns (test accuracy, seconds). A diverged run (non-finite loss) scores 0."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    x_train = torch.as_tensor(data.x_train, device=device)
    y_train = torch.as_tensor(data.y_train, device=device)
    steps_per_epoch = math.ceil(len(x_train) / cfg.batch_size)
    total = cfg.epochs * steps_per_epoch
    model.to(device)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    warmup = int(cfg.warmup_epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total, warmup))
    start = time.perf_counter()
    for epoch in range(cfg.epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=gen, device=device)
        running = torch.zeros((), device=device)
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            xb = AUGMENTATIONS[cfg.augment](x_train[idx], gen)
            loss = F.cross_entropy(model(xb), y_train[idx], label_smoothing=cfg.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
            opt.step()
            sched.step()
            running += loss.detach()
        mean_loss = float(running) / steps_per_epoch
        if not math.isfinite(mean_loss):
            log.warning("training diverged in epoch %d", epoch)
            return 0.0, time.perf_counter() - start
        log.info("epoch %d/%d loss %.4f", epoch + 1, cfg.epochs, mean_loss)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    x_test, y_test = (torch.as_tensor(a, device=device) for a in (data.x_test, data.y_test))
    acc = accuracy(model, x_test, y_test)
    return acc, seconds


# ------------------------------------------------------------------------------------------------ analysis
def largest_tensor(path: Path, x: np.ndarray) -> int:
    """Largest per-image element count over the encrypted values, as onnxruntime produces them on ``x``."""
    return max(math.prod(r.shape) for r in profile_onnx_ranges(path, x).values())


def run_variant(variant: Variant, data: ImageDataset, cfg: TrainConfig, device: torch.device) -> Row:
    torch.manual_seed(cfg.seed)
    c, h, _ = data.input_shape
    model = polyfhe.create_model(
        variant.model, img_size=h, in_chans=c, num_classes=data.num_classes, **variant.overrides
    )
    params = sum(p.numel() for p in model.parameters())
    acc, seconds = train(model, data, cfg, device)
    model = model.cpu().eval()
    with tempfile.TemporaryDirectory(prefix="levels-") as tmp:
        path = Path(tmp) / "model.onnx"
        report = export_onnx(model, path, rtol=STRUCTURAL_CHECK_RTOL, allow_nonfinite=True).analysis
        biggest = largest_tensor(path, data.x_test[:2])
    row = Row(variant.label, variant.model, {k: list(v) if isinstance(v, tuple) else v
                                             for k, v in variant.overrides.items()},
              params, report.degree, report.mult_depth, report.levels, biggest, acc, seconds, cfg.epochs,
              len(data.x_train))
    log.info("%s: acc %.4f, levels %s, %.1f s", variant.label, acc, report.levels, seconds)
    return row


# ------------------------------------------------------------------------------------------------- output
def markdown_table(rows: list[Row]) -> str:
    lines = [
        ("| variant | params | degree | ct x ct depth | levels | largest tensor | test accuracy "
         "| train time (s) |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.params:,} | {r.degree} | {r.mult_depth} | {r.levels} | {r.largest_tensor:,} "
            f"| {100 * r.test_accuracy:.2f}% | {r.train_seconds:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    for family, marker in (("monet", "o"), ("cpolynext", "s")):
        pts = [r for r in rows if r.model.startswith(family)]
        if pts:
            ax.scatter([r.levels or 0 for r in pts], [100 * r.test_accuracy for r in pts], marker=marker,
                       label=family)
            for r in pts:
                ax.annotate(r.variant, (r.levels or 0, 100 * r.test_accuracy), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
    ax.axvline(11, color="grey", linestyle="--", linewidth=0.8, label="11 levels: N=16384, 30-bit scale")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(x=0.25, y=0.15)
    ax.set_xlabel("CKKS levels (folded, analyzer)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Fashion-MNIST: levels vs accuracy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def load_data(args: argparse.Namespace) -> ImageDataset:
    data = load_fashion_mnist(args.data_dir) if args.data_dir else load_dataset(args.dataset)
    if args.limit:
        rng = np.random.default_rng(0)
        train_idx = rng.permutation(len(data.x_train))[: args.limit]
        test_idx = rng.permutation(len(data.x_test))[: max(1, args.limit // 5)]
        data = ImageDataset(data.name, data.x_train[train_idx], data.y_train[train_idx],
                            data.x_test[test_idx], data.y_test[test_idx], data.classes)
    return data


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--limit", type=int, default=0,
                   help="train on this many samples (test on limit/5); 0: all")
    p.add_argument("--dataset", default="fashion-mnist", help="a polyfhe.data.sources name")
    p.add_argument("--data-dir", default=None,
                   help="folder with Fashion-MNIST IDX files (overrides --dataset)")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--augment", default=TrainConfig.augment, choices=list(AUGMENTATIONS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/levels_vs_accuracy"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    data = load_data(args)
    cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, augment=args.augment,
                      seed=args.seed)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    header = (f"{data.name} ({len(data.x_train)} train / {len(data.x_test)} test), {cfg.epochs} epochs, "
              f"device {device}, batch {cfg.batch_size}, lr {cfg.lr}\n\n")
    rows: list[Row] = []
    for name in args.variants:
        rows.append(run_variant(VARIANTS[name], data, cfg, device))
        write_results(rows, cfg, header, args.out)  # after every variant, so a cut-off run keeps what it did
    print(header + markdown_table(rows))  # a bench script prints its table (library code does not)
    return 0


def write_results(rows: list[Row], cfg: TrainConfig, header: str, out: Path) -> None:
    (out / "results.md").write_text(header + markdown_table(rows))
    (out / "results.json").write_text(json.dumps(
        {"train_config": asdict(cfg), "rows": [r.to_dict() for r in rows]}, indent=2) + "\n")
    plot(rows, out / "levels_vs_accuracy.png")


if __name__ == "__main__":
    raise SystemExit(main())
