"""``TrainConfig``: every knob of one training run, validated up front and stored in the checkpoint.

Defaults follow the papers' recipe (spec 2.7: AdamW, lr 1e-3, wd 0.05, cosine schedule with warmup, label
smoothing 0.1) scaled to small data; EMA, mixup/cutmix, drop path and head dropout are opt-in because they
only pay off on long runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from polyfhe.training.data import AUGMENTATIONS
from polyfhe.training.recipe import OPTIMIZERS

AMP_MODES = ("auto", "bf16", "off")  # auto: bf16 autocast on CUDA, float32 on CPU


@dataclass(frozen=True)
class TrainConfig:
    """One training run; ``data`` is a source name or a path (see ``polyfhe.data.open_dataset``)."""

    model: str
    data: str
    epochs: int
    out_dir: str
    device: str = "auto"
    batch_size: int = 128
    eval_batch_size: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.05
    optimizer: str = "adamw"
    warmup_epochs: float = 1.0
    min_lr: float = 1e-6
    label_smoothing: float = 0.1
    mixup: float = 0.0  # Beta(alpha, alpha) for mixup; 0 = off
    cutmix: float = 0.0  # Beta(alpha, alpha) for cutmix; 0 = off (both on: one of the two per batch)
    mix_prob: float = 1.0
    ema_decay: float = 0.0  # 0 = off; e.g. 0.999 for short runs, 0.9999 for ImageNet-length runs
    drop_path: float = 0.0  # stochastic depth, linearly increasing over blocks
    drop_rate: float = 0.0  # PolyNeXt head dropout, reached after `rampout` epochs
    rampout: int = 0
    grad_clip: float = 1.0  # max global gradient norm; 0 = off
    amp: str = "auto"
    compile: bool = False  # torch.compile; CUDA only (see docs/training.md)
    seed: int = 0
    val_fraction: float = 0.1
    augment: str = "auto"  # "auto" picks per data set (see polyfhe.training.data.DEFAULT_AUGMENT)
    normalize: bool = True  # per-channel mean/std from the training split, recorded in the checkpoint
    train_subset: int | None = None  # use only this many training images (quick runs)
    time_budget_s: float | None = None  # stop after the epoch step that crosses this wall time
    resume: str | None = None  # a previous out_dir (or its last/ folder) to continue from
    progress: bool = True
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = (
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1 and self.eval_batch_size >= 1, "batch sizes must be >= 1"),
            (self.lr > 0 and self.min_lr >= 0, f"lr must be > 0 and min_lr >= 0, got {self.lr}, {self.min_lr}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (self.optimizer in OPTIMIZERS, f"optimizer {self.optimizer!r} unknown; accepted: {sorted(OPTIMIZERS)}"),
            (self.amp in AMP_MODES, f"amp {self.amp!r} unknown; accepted: {list(AMP_MODES)}"),
            (self.augment == "auto" or self.augment in AUGMENTATIONS,
             f"augment {self.augment!r} unknown; accepted: auto, {', '.join(sorted(AUGMENTATIONS))}"),
            (0 <= self.label_smoothing < 1, f"label_smoothing must be in [0, 1), got {self.label_smoothing}"),
            (self.mixup >= 0 and self.cutmix >= 0 and 0 <= self.mix_prob <= 1, "mixup/cutmix >= 0, mix_prob in [0, 1]"),
            (0 <= self.ema_decay < 1, f"ema_decay must be in [0, 1), got {self.ema_decay}"),
            (0 <= self.drop_path < 1 and 0 <= self.drop_rate < 1, "drop_path and drop_rate must be in [0, 1)"),
            (self.rampout >= 0 and self.warmup_epochs >= 0, "rampout and warmup_epochs must be >= 0"),
            (self.grad_clip >= 0, f"grad_clip must be >= 0 (0 = off), got {self.grad_clip}"),
            (0 <= self.val_fraction <= 0.5, f"val_fraction must be in [0, 0.5], got {self.val_fraction}"),
            (self.train_subset is None or self.train_subset >= 1, "train_subset must be >= 1 when given"),
            (self.time_budget_s is None or self.time_budget_s > 0, "time_budget_s must be > 0 when given"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device {self.device!r} unknown; accepted: auto, cpu, cuda, cuda:N"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown training options {sorted(unknown)}; accepted: {sorted(known)}")
        return cls(**data)
