"""``polyfhe.train``: data -> splits -> registry model -> :func:`~polyfhe.training.loop.fit` -> files on disk.

``out_dir`` receives the checkpoint (``model.safetensors`` + ``config.json``), ``metrics.json``, ``log.csv``,
``curves.png`` and ``last/`` (the resumable state of the latest epoch). Under torchrun every process calls
``train`` and returns the same result; rank 0 alone writes the files (see :mod:`polyfhe.training.distributed`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyfhe.data.sources import ImageDataset, open_dataset
from polyfhe.models.registry import create_model, model_entry
from polyfhe.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_checkpoint_info,
    save_checkpoint,
)
from polyfhe.training.config import TrainConfig
from polyfhe.training.data import Normalization, Splits, make_splits
from polyfhe.training.distributed import DistContext, setup, teardown
from polyfhe.training.loop import LAST_DIR, evaluate, fit
from polyfhe.training.metrics import (
    LOG_FILE,
    METRICS_FILE,
    PLOT_FILE,
    TrainMetrics,
    plot_curves,
    write_log,
    write_metrics,
)
from polyfhe.zoo import count_parameters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    """A finished run: where its files are, its metrics, and the trained model (eval mode, on CPU)."""

    out_dir: Path
    metrics: TrainMetrics
    normalization: Normalization
    classes: tuple[str, ...]
    config: TrainConfig
    model: nn.Module = field(repr=False, compare=False)

    @property
    def checkpoint(self) -> Path:
        return self.out_dir

    def to_dict(self) -> dict[str, Any]:
        """Everything but the model (which lives in the checkpoint files)."""
        return {
            "out_dir": str(self.out_dir), "metrics": self.metrics.to_dict(),
            "normalization": self.normalization.to_dict(), "classes": list(self.classes),
            "config": self.config.to_dict(),
        }

    @classmethod
    def load(cls, out_dir: str | Path) -> TrainResult:
        """Reopen a finished run from its folder (model from the checkpoint, the rest from the JSON files)."""
        out_dir = Path(out_dir)
        model, info = load_checkpoint(out_dir)
        metrics_path = out_dir / METRICS_FILE
        if not metrics_path.is_file():
            raise FileNotFoundError(f"{metrics_path} is missing; is {out_dir} the out_dir of a finished polyfhe train?")
        metrics = TrainMetrics.from_dict(json.loads(metrics_path.read_text()))
        return cls(out_dir, metrics, Normalization.from_dict(info.extra["normalization"]),
                   tuple(info.extra.get("classes", ())), TrainConfig.from_dict(info.extra["train_config"]),
                   model.eval())


def model_kwargs_for(cfg: TrainConfig, splits: Splits) -> dict[str, Any]:
    """Registry overrides that fit the model to the data, plus the recipe's regularisers; ``cfg.model_kwargs`` win."""
    c, h, w = splits.input_shape
    kwargs: dict[str, Any] = {"num_classes": splits.num_classes, "img_size": h if h == w else [h, w], "in_chans": c}
    if cfg.drop_path:
        kwargs["drop_path_rate"] = cfg.drop_path
    if cfg.drop_rate:
        kwargs["drop_rate"] = cfg.drop_rate
        kwargs["rampout"] = cfg.rampout
    return {**kwargs, **cfg.model_kwargs}


def _build(cfg: TrainConfig, kwargs: dict[str, Any]) -> nn.Module:
    try:
        return create_model(cfg.model, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot build {cfg.model!r} for this data/recipe with {kwargs}: {exc}") from exc


def _dataset(data: str | Path | ImageDataset, data_root: str | Path | None) -> ImageDataset:
    if isinstance(data, ImageDataset):
        return data
    return open_dataset(data, root=data_root)


def train(
    model_name: str,
    data: str | Path | ImageDataset,
    epochs: int,
    out_dir: str | Path,
    device: str = "auto",
    *,
    data_root: str | Path | None = None,
    **options: Any,
) -> TrainResult:
    """Train a registry model on a data source (name, path or :class:`ImageDataset`) and write the run to ``out_dir``.

    ``options`` are :class:`TrainConfig` fields (``batch_size``, ``lr``, ``ema_decay``, ``resume``, ...).
    Started by torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set), it trains data-parallel over all processes;
    ``batch_size`` is then the global batch.
    """
    start = time.perf_counter()
    model_entry(model_name)  # unknown names fail before any data is read, listing the registry
    ds = _dataset(data, data_root)
    data_label = ds.name if isinstance(data, ImageDataset) else str(data)
    cfg = TrainConfig.from_dict({"model": model_name, "data": data_label, "epochs": epochs,
                                 "out_dir": str(out_dir), "device": device, **options})
    ctx, dist_device = setup(cfg.device)
    try:
        return _train(cfg, ds, Path(out_dir), start, ctx, dist_device)
    finally:
        teardown(ctx)


def _train(cfg: TrainConfig, ds: ImageDataset, out: Path, start: float, ctx: DistContext,
           dist_device: torch.device | None) -> TrainResult:
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
    splits = make_splits(ds, val_fraction=cfg.val_fraction, seed=cfg.seed, normalize=cfg.normalize,
                         train_subset=cfg.train_subset)
    if cfg.resume:
        # the architecture comes from the checkpoint, so a resumed run cannot silently change shape
        info = read_checkpoint_info(_resume_dir(cfg.resume))
        if info.model_name != cfg.model:
            raise CheckpointError(f"cannot resume: checkpoint {_resume_dir(cfg.resume)} holds architecture "
                                  f"{info.model_name!r}, but {cfg.model!r} was requested")
        kwargs = dict(info.model_kwargs)
    else:
        kwargs = model_kwargs_for(cfg, splits)
    torch.manual_seed(cfg.seed)  # the initial weights follow --seed (and are the same on every rank)
    model = _build(cfg, kwargs)
    outcome = fit(cfg, splits, model, kwargs, out, ctx=ctx, device=dist_device)

    # float32 even after bf16 training: the test accuracy is that of the model that gets exported (float32/CKKS)
    test_loss, test_acc = evaluate(outcome.model, splits.x_test, splits.y_test, splits.normalization,
                                   device=outcome.device, batch_size=cfg.eval_batch_size, amp=False, ctx=ctx)
    history = tuple(outcome.state.history)
    last = history[-1] if history else None
    val_acc = None if last is None else (last.val_accuracy_ema if outcome.weights == "ema" else last.val_accuracy)
    metrics = TrainMetrics(
        model=cfg.model, data=splits.name, test_accuracy=test_acc, test_loss=test_loss, val_accuracy=val_acc,
        epochs=outcome.state.epoch, steps=outcome.state.step, wall_time_s=outcome.state.elapsed_s,
        weights=outcome.weights, device=str(outcome.device), amp="bf16" if outcome.amp else "off",
        parameters=count_parameters(outcome.model), stopped_early=outcome.stopped_early, history=history,
        processes=ctx.world_size,
    )
    final = outcome.model.to("cpu").eval()
    if not ctx.is_main:
        ctx.barrier()  # returns once rank 0 has written the files
        return TrainResult(out, metrics, splits.normalization, splits.classes, cfg, final)
    save_checkpoint(final, out, model_name=cfg.model, model_kwargs=kwargs, epoch=outcome.state.epoch, extra={
        "normalization": splits.normalization.to_dict(), "classes": list(splits.classes), "data": splits.name,
        "weights": outcome.weights, "test_accuracy": test_acc, "val_accuracy": val_acc, "train_config": cfg.to_dict(),
    })
    write_metrics(out / METRICS_FILE, metrics)
    write_log(out / LOG_FILE, history)
    if history:
        plot_curves(out / PLOT_FILE, history, f"{cfg.model} on {splits.name}")
    ctx.barrier()
    log.info("trained %s: test accuracy %.4f (%s weights) in %.1f s (this call %.1f s); files in %s",
             cfg.model, test_acc, outcome.weights, metrics.wall_time_s, time.perf_counter() - start, out)
    return TrainResult(out, metrics, splits.normalization, splits.classes, cfg, final)


def _resume_dir(resume: str | Path) -> Path:
    root = Path(resume).expanduser()
    return root / LAST_DIR if (root / LAST_DIR).is_dir() else root
