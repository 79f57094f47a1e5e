"""Run records: one :class:`EpochRecord` per epoch (CSV log), :class:`TrainMetrics` (``metrics.json``) and
a PNG of the loss and accuracy curves (matplotlib's Agg canvas: no display needed)."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

LOG_FILE = "log.csv"
METRICS_FILE = "metrics.json"
PLOT_FILE = "curves.png"


@dataclass(frozen=True)
class EpochRecord:
    """What one epoch produced; ``val_*`` are None without a validation split, ``*_ema`` without EMA."""

    epoch: int
    lr: float
    train_loss: float
    train_accuracy: float
    val_loss: float | None
    val_accuracy: float | None
    val_accuracy_ema: float | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpochRecord:
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


@dataclass(frozen=True)
class TrainMetrics:
    """The summary in ``metrics.json``; ``weights`` says whether the saved model is the EMA or the raw one."""

    model: str
    data: str
    test_accuracy: float
    test_loss: float
    val_accuracy: float | None
    epochs: int
    steps: int
    wall_time_s: float
    weights: str
    device: str
    amp: str
    parameters: int
    stopped_early: str | None = None
    history: tuple[EpochRecord, ...] = field(default_factory=tuple)
    processes: int = 1  # data-parallel processes (torchrun's world size)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "history": [r.to_dict() for r in self.history]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainMetrics:
        return cls(**{**data, "history": tuple(EpochRecord.from_dict(r) for r in data.get("history", ()))})


def _csv_value(v: Any) -> Any:
    return "" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)


def write_log(path: Path, history: tuple[EpochRecord, ...] | list[EpochRecord]) -> None:
    """Rewrite the whole CSV (cheap: one row per epoch) so a resumed run never duplicates rows."""
    names = [f.name for f in fields(EpochRecord)]
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        for record in history:
            writer.writerow([_csv_value(getattr(record, n)) for n in names])


def read_log(path: Path) -> list[EpochRecord]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    ints = {"epoch"}
    return [
        EpochRecord.from_dict({k: (None if v == "" else int(v) if k in ints else float(v)) for k, v in row.items()})
        for row in rows
    ]


def write_metrics(path: Path, metrics: TrainMetrics) -> None:
    path.write_text(json.dumps(metrics.to_dict(), indent=2) + "\n")


def plot_curves(path: Path, history: tuple[EpochRecord, ...] | list[EpochRecord], title: str) -> None:
    """Loss (left) and accuracy (right) per epoch for the training and validation splits."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg and leaves the user's backend alone

    epochs = [r.epoch for r in history]
    fig = Figure(figsize=(10, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot(epochs, [r.train_loss for r in history], "o-", label="train")
    ax_acc.plot(epochs, [r.train_accuracy for r in history], "o-", label="train")
    if any(r.val_loss is not None for r in history):
        ax_loss.plot(epochs, [r.val_loss for r in history], "s-", label="validation")
        ax_acc.plot(epochs, [r.val_accuracy for r in history], "s-", label="validation")
    if any(r.val_accuracy_ema is not None for r in history):
        ax_acc.plot(epochs, [r.val_accuracy_ema for r in history], "^--", label="validation (EMA)")
    for ax, label in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
