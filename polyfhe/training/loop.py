"""The training loop: epochs of augmented, mixed, autocast steps; validation; resumable ``last/`` checkpoints.

GPU and CPU share one code path: autocast takes its ``device_type`` from the device, so the bf16 path runs
(slowly) on CPU in tests too. ``torch.compile`` is refused on CPU with a clear error rather than silently
ignored (inductor needs a C++ toolchain there and takes minutes on small machines). On CUDA a step never
waits for the GPU: batches are indexed on the device, and the losses are read back every
:data:`LOSS_READ_EVERY` steps, not after each (the small FHE recipes are launch-bound, and a read per step
idles the GPU while the next step is queued).

Under torchrun the same loop runs in every process (:mod:`polyfhe.training.distributed`): each takes its share of
every global batch, DistributedDataParallel averages the gradients, losses and accuracies are summed over the
ranks, and rank 0 alone keeps the EMA, writes ``last/`` and reports progress.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from polyfhe.training.checkpoint import load_checkpoint, save_checkpoint
from polyfhe.training.config import TrainConfig
from polyfhe.training.data import (
    AUGMENTATIONS,
    Normalization,
    Splits,
    batch_indices,
    resolve_augment,
    steps_per_epoch,
    to_device,
)
from polyfhe.training.distributed import SINGLE, DistContext, restore_batch_norms, sync_batch_norms
from polyfhe.training.metrics import EpochRecord
from polyfhe.training.recipe import (
    ModelEma,
    build_optimizer,
    cosine_lr,
    mix_batch,
    set_lr,
    smooth_one_hot,
    soft_cross_entropy,
)

log = logging.getLogger(__name__)

LAST_DIR = "last"
STATE_FILE = "train_state.pt"
LOSS_READ_EVERY = 50  # CUDA steps between host reads of the loss (one GPU sync each); CPU reads every step
DIVERGED_HINT = ("lower --lr, keep --grad-clip on (e.g. 1.0), lengthen --warmup-epochs or try --amp off; "
                 "polynomial networks grow fast in degree, so large inputs or steps overflow")


class TrainingDiverged(RuntimeError):
    """The loss (or the weights) stopped being finite; names the step and the last good checkpoint."""

    def __init__(self, message: str, step: int, epoch: int) -> None:
        super().__init__(message)
        self.step = step
        self.epoch = epoch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available (torch {torch.__version__}); "
                         "use --device cpu or install a CUDA build of torch")
    return device


def resolve_amp(mode: str, device: torch.device) -> bool:
    """Whether to run bf16 autocast: ``auto`` means on CUDA only."""
    return mode == "bf16" or (mode == "auto" and device.type == "cuda")


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def maybe_compile(model: nn.Module, enabled: bool, device: torch.device) -> nn.Module:
    if not enabled:
        return model
    if device.type != "cuda":
        raise ValueError(f"compile=True needs a CUDA device, got {device}; drop --compile on CPU")
    return torch.compile(model)


def loss_read_interval(device: torch.device) -> int:
    """Steps between host reads of the loss: a read waits for the device, which only an accelerator makes costly."""
    return 1 if device.type == "cpu" else LOSS_READ_EVERY


class PendingLosses:
    """Per-step losses left on the device until :meth:`drain` reads them all back at once (one sync)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._steps: list[tuple[int, Tensor, int, float, int]] = []  # step (from 1), loss, batch size, lr, local

    def add(self, step: int, loss: Tensor, size: int, lr: float, local: int | None = None) -> None:
        """``size``: the (global) batch; ``local``: how many of its images ``loss`` averages (default all)."""
        self._steps.append((step, loss.detach(), size, lr, size if local is None else local))

    @property
    def due(self) -> bool:
        return len(self._steps) >= self.every

    def drain(self, ctx: DistContext = SINGLE) -> list[tuple[int, float, int, float]]:
        """``(step, loss, batch size, lr)`` of every pending step, oldest first; the loss of the global batch."""
        return self.drain_with_flag(ctx, False)[0]

    def drain_with_flag(self, ctx: DistContext, flag: bool) -> tuple[list[tuple[int, float, int, float]], bool]:
        """:meth:`drain`, and whether ``flag`` is set on any rank: one all-reduce carries both (every rank has
        the same pending steps, so all of them join it)."""
        if not self._steps:
            return [], flag
        losses = torch.stack([loss for _, loss, _, _, _ in self._steps]).float()
        if ctx.enabled:  # sum of loss x local images over the ranks, divided by the global batch
            local = torch.tensor([n for *_, n in self._steps], dtype=torch.float32, device=losses.device)
            packed = ctx.all_reduce_sum(torch.cat([losses * local, losses.new_full((1,), float(flag))]))
            sizes = torch.tensor([size for _, _, size, _, _ in self._steps], dtype=torch.float32,
                                 device=losses.device)
            losses, flag = packed[:-1] / sizes, bool(packed[-1] > 0)
        values = losses.tolist()
        drained = [(step, value, size, lr) for (step, _, size, lr, _), value in zip(self._steps, values, strict=True)]
        self._steps.clear()
        return drained, flag


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, norm: Normalization, *, device: torch.device,
             batch_size: int, amp: bool, ctx: DistContext = SINGLE) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` in eval mode (restores the previous mode); distributed, each
    rank evaluates its share of ``x`` and the sums are reduced, so every rank returns the numbers of all of ``x``."""
    if len(x) == 0:
        return math.nan, math.nan
    total = len(x)
    if ctx.enabled:
        part = ctx.shard(total)
        x, y = x[part], y[part]
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    mean, std = norm.tensors(device)
    for idx in batch_indices(len(x), batch_size, None, drop_last=False):
        xb, yb = (x[idx].to(device) - mean) / std, y[idx].to(device)
        with autocast(device, amp):
            logits = model(xb).float()
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    model.train(was_training)
    if ctx.enabled:
        sums = ctx.all_reduce_sum(torch.tensor([loss_sum, float(correct)], dtype=torch.float64, device=device))
        loss_sum, correct = float(sums[0]), int(sums[1])
    return loss_sum / total, correct / total


@dataclass
class RunState:
    """Mutable progress of a run; saved beside ``last/`` so ``resume`` continues where it stopped."""

    epoch: int = 0  # completed epochs
    step: int = 0
    elapsed_s: float = 0.0
    history: list[EpochRecord] = field(default_factory=list)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_last(out_dir: Path, model: nn.Module, cfg: TrainConfig, model_kwargs: dict, state: RunState,
              optimizer: torch.optim.Optimizer, ema: ModelEma | None, gen: torch.Generator,
              rng: np.random.Generator, norm: Normalization) -> Path:
    last = save_checkpoint(model, out_dir / LAST_DIR, model_name=cfg.model, model_kwargs=model_kwargs,
                           epoch=state.epoch, extra={"normalization": norm.to_dict(), "train_config": cfg.to_dict()})
    _atomic_torch_save({
        "step": state.step, "epoch": state.epoch, "elapsed_s": state.elapsed_s,
        "history": [r.to_dict() for r in state.history],
        "optimizer": optimizer.state_dict(), "ema": ema.state_dict() if ema else None,
        "generator": gen.get_state(), "numpy_rng": rng.bit_generator.state,
    }, last / STATE_FILE)
    return last


def load_last(resume: str | Path, cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
              ema: ModelEma | None, gen: torch.Generator, rng: np.random.Generator) -> RunState:
    """Restore weights, optimizer, EMA and random streams from ``resume`` (an out_dir or its ``last/``)."""
    root = Path(resume).expanduser()
    root = root / LAST_DIR if (root / LAST_DIR).is_dir() else root
    loaded, _ = load_checkpoint(root, expect_model=cfg.model)
    model.load_state_dict(loaded.state_dict())
    state_file = root / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"cannot resume: {state_file} is missing (written at each epoch end by polyfhe train)")
    saved = torch.load(state_file, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(saved["optimizer"])
    if ema is not None and saved.get("ema"):
        ema.load_state_dict(saved["ema"])
    gen.set_state(saved["generator"])
    rng.bit_generator.state = saved["numpy_rng"]
    log.info("resumed %s from %s after epoch %d (step %d)", cfg.model, root, saved["epoch"], saved["step"])
    return RunState(saved["epoch"], saved["step"], saved["elapsed_s"],
                    [EpochRecord.from_dict(r) for r in saved["history"]])


def _all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values() if t.is_floating_point())


def _diverged(what: str, step: int, state: RunState, out_dir: Path, lr: float) -> TrainingDiverged:
    """``step`` counts optimizer steps from 1, as the progress bar does."""
    last = out_dir / LAST_DIR
    kept = (f"the last good checkpoint is {last} (epoch {state.epoch})" if (last / STATE_FILE).is_file()
            else "no checkpoint was written yet")
    return TrainingDiverged(f"{what} at step {step} (epoch {state.epoch + 1}, lr {lr:.2e}); {kept}. "
                            f"Hint: {DIVERGED_HINT}", step, state.epoch + 1)


def _read_losses(drained: list[tuple[int, float, int, float]], bar: tqdm, state: RunState, out_dir: Path) -> float:
    """Sum of loss x batch size over drained steps; the first non-finite loss stops the run, naming its step."""
    total = 0.0
    for step, value, size, lr in drained:
        if not math.isfinite(value):
            bar.close()
            raise _diverged(f"loss became {value}", step, state, out_dir, lr)
        total += value * size
        bar.set_postfix(loss=f"{value:.3f}", lr=f"{lr:.1e}", refresh=False)
    return total


def epochs_within_budget(planned: int, done: int, seconds_per_epoch: float, seconds_left: float) -> int:
    """How many epochs (at least ``done``, at most ``planned``) fit when each takes ``seconds_per_epoch``."""
    if seconds_per_epoch <= 0:
        return planned
    return max(done, min(planned, done + math.floor(max(seconds_left, 0.0) / seconds_per_epoch)))


def epoch_summary(record: EpochRecord, planned: int) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    ema = f" (EMA {fmt(record.val_accuracy_ema)})" if record.val_accuracy_ema is not None else ""
    return (f"epoch {record.epoch}/{planned}: train loss {record.train_loss:.4f} acc {record.train_accuracy:.4f} | "
            f"val loss {fmt(record.val_loss)} acc {fmt(record.val_accuracy)}{ema} | lr {record.lr:.2e} | "
            f"{record.seconds:.1f} s")


@dataclass(frozen=True)
class FitOutcome:
    """What :func:`fit` hands to the API: the chosen model, which weights it holds, and the run's progress."""

    model: nn.Module
    weights: str  # "raw" or "ema"
    state: RunState
    device: torch.device
    amp: bool
    stopped_early: str | None


def _wrap_ddp(model: nn.Module, ctx: DistContext, device: torch.device) -> nn.Module:
    """DistributedDataParallel over ``model``; buffers are not broadcast each step, since the synchronised
    BatchNorms keep their running statistics equal on every rank."""
    device_ids = [device.index] if device.type == "cuda" else None
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:  # torch >= 2.12
        return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def _share_rank0_weights(model: nn.Module, ema: ModelEma | None, ctx: DistContext) -> nn.Module:
    """The EMA weights (kept by rank 0 only) on every rank, in ``model``'s place on the others."""
    chosen = ema.module if ctx.is_main and ema is not None else model
    if ctx.enabled:
        import torch.distributed as dist

        for tensor in chosen.state_dict().values():
            dist.broadcast(tensor, src=0)
    return chosen


def fit(cfg: TrainConfig, splits: Splits, model: nn.Module, model_kwargs: dict, out_dir: Path, *,
        ctx: DistContext = SINGLE, device: torch.device | None = None) -> FitOutcome:
    """Train ``model`` on ``splits`` as ``cfg`` says; writes ``out_dir/last/`` after every epoch (rank 0).

    ``ctx`` and ``device`` come from :func:`polyfhe.training.distributed.setup` under torchrun; ``cfg.batch_size``
    is then the global batch, split over the ranks.
    """
    start = time.perf_counter()
    device = device or resolve_device(cfg.device)
    amp = resolve_amp(cfg.amp, device)
    if ctx.enabled and cfg.batch_size % ctx.world_size:
        raise ValueError(f"batch_size {cfg.batch_size} is the global batch and must split evenly over "
                         f"{ctx.world_size} processes; use a multiple of {ctx.world_size}")
    torch.manual_seed(cfg.seed)
    model.to(device)
    # rank 0 alone keeps the EMA: a copy of the plain model, made before the BatchNorms are synchronised
    ema = ModelEma(model, cfg.ema_decay) if cfg.ema_decay > 0 and ctx.is_main else None
    swaps = sync_batch_norms(model) if ctx.enabled else []
    optimizer = build_optimizer(cfg.optimizer, model, cfg.lr, cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)  # the same on every rank: one batch order, one augmentation
    rng = np.random.default_rng(cfg.seed)
    state = load_last(cfg.resume, cfg, model, optimizer, ema, gen, rng) if cfg.resume else RunState()
    prior_elapsed = state.elapsed_s
    train_model = maybe_compile(_wrap_ddp(model, ctx, device) if ctx.enabled else model, cfg.compile, device)
    if ctx.rank:
        torch.manual_seed(cfg.seed + ctx.rank)  # dropout and drop-path masks differ between ranks

    norm, n_classes = splits.normalization, splits.num_classes
    mean, std = norm.tensors(device)  # once: building them per step would sync the GPU every step
    augment = AUGMENTATIONS[resolve_augment(cfg.augment, splits.name)]
    x_train, y_train = splits.x_train.to(device), splits.y_train.to(device)
    spe = steps_per_epoch(len(x_train), cfg.batch_size)
    total_steps = spe * cfg.epochs
    warmup = min(round(cfg.warmup_epochs * spe), total_steps // 2)
    stopped: str | None = None  # a hard stop inside an epoch
    shortened: str | None = None  # fewer epochs planned to fit the time budget
    lr = cosine_lr(state.step, total_steps, warmup, cfg.lr, cfg.min_lr)
    if ctx.is_main:
        log.info("training %s on %s: %d train / %d val images, %d steps/epoch, device %s, bf16 %s%s",
                 cfg.model, splits.name, len(x_train), len(splits.x_val), spe, device, amp,
                 f", {ctx.world_size} processes ({ctx.backend})" if ctx.enabled else "")
    pending = PendingLosses(loss_read_interval(device))
    show = cfg.progress and ctx.is_main

    planned = cfg.epochs
    while state.epoch < planned:
        epoch = state.epoch
        epoch_start = time.perf_counter()
        if hasattr(model, "set_epoch"):
            model.set_epoch(epoch)  # PolyNeXt's head dropout ramps up over `rampout` epochs
        model.train()
        loss_sum, seen = 0.0, 0
        correct = torch.zeros((), dtype=torch.long, device=device)  # summed on the device: no extra sync per step
        # disable=None: tqdm stays quiet when stderr is not a terminal (logs, CI), shows the bar when it is
        bar = tqdm(total=spe, desc=f"epoch {epoch + 1}/{planned}", disable=None if show else True, leave=False)
        for idx in batch_indices(len(x_train), cfg.batch_size, gen, drop_last=True):
            lr = cosine_lr(state.step, total_steps, warmup, cfg.lr, cfg.min_lr)
            set_lr(optimizer, lr)
            idx = to_device(idx, device)
            # augmentation and mixing see the whole global batch (mixup pairs image i with image B-1-i), so
            # every rank draws the same random numbers; each then keeps its own share
            xb, yb = augment(x_train[idx], gen), y_train[idx]
            xb, targets = mix_batch(xb, smooth_one_hot(yb, n_classes, cfg.label_smoothing),
                                    mixup=cfg.mixup, cutmix=cfg.cutmix, prob=cfg.mix_prob, rng=rng)
            if ctx.enabled:
                part = ctx.shard(len(idx))
                xb, yb, targets = xb[part], yb[part], targets[part]
            with autocast(device, amp):
                logits = train_model((xb - mean) / std)
            loss = soft_cross_entropy(logits, targets)
            pending.add(state.step + 1, loss, len(idx), lr, local=len(yb))
            over = cfg.time_budget_s is not None and time.perf_counter() - start > cfg.time_budget_s
            if pending.due:
                drained, over = pending.drain_with_flag(ctx, over)  # ranks stop together: any over budget stops all
                loss_sum += _read_losses(drained, bar, state, out_dir)
            elif ctx.enabled:
                over = False  # decided where every rank joins the reduction of the losses
            optimizer.zero_grad(set_to_none=True)
            # DDP averages the ranks' gradients; a share smaller than the others' (only when the data holds fewer
            # images than one batch) is weighted by its size, so the step is that of the whole batch's mean loss
            scale = len(yb) * ctx.world_size / len(idx) if ctx.enabled else 1.0
            (loss * scale if scale != 1.0 else loss).backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            if ema is not None:
                ema.update(model)
            state.step += 1
            correct += (logits.detach().argmax(1) == yb).sum()  # against the unmixed labels
            seen += len(idx)
            bar.update(1)
            if over:
                stopped = f"time budget of {cfg.time_budget_s:g} s reached at step {state.step}"
                break
        loss_sum += _read_losses(pending.drain(ctx), bar, state, out_dir)
        bar.close()
        ctx.all_reduce_sum(correct)
        if not _all_finite(model):
            raise _diverged("weights became non-finite", state.step, state, out_dir, lr)
        eval_args = {"device": device, "batch_size": cfg.eval_batch_size, "amp": amp}
        val_loss, val_acc = evaluate(model, splits.x_val, splits.y_val, norm, **eval_args, ctx=ctx)
        val_acc_ema = evaluate(ema.module, splits.x_val, splits.y_val, norm, **eval_args)[1] if ema else math.nan
        if ctx.enabled and cfg.ema_decay > 0:
            val_acc_ema = ctx.broadcast(val_acc_ema)
        has_ema = ema is not None or (ctx.enabled and cfg.ema_decay > 0)
        state.epoch = epoch + 1
        has_val = len(splits.x_val) > 0
        if has_val and not math.isfinite(val_loss) and ctx.is_main:
            log.warning("epoch %d: validation loss is %s in eval mode (running statistics); deep BN polynomial "
                        "nets blow up until their statistics settle, more epochs or a lower lr usually help",
                        state.epoch, val_loss)
        record = EpochRecord(
            state.epoch, lr, loss_sum / max(seen, 1), int(correct) / max(seen, 1),
            val_loss if has_val else None, val_acc if has_val else None,
            val_acc_ema if has_val and has_ema else None, time.perf_counter() - epoch_start,
        )
        state.history.append(record)
        state.elapsed_s = prior_elapsed + time.perf_counter() - start
        if ctx.is_main:
            save_last(out_dir, model, cfg, model_kwargs, state, optimizer, ema, gen, rng, norm)
            summary = epoch_summary(record, planned)
            log.info("%s", summary)
            if show:
                tqdm.write(summary)  # one persistent line per epoch under the (transient) progress bars
        if stopped:
            if ctx.is_main:
                log.warning("stopping early: %s", stopped)
            break
        if cfg.time_budget_s is not None:
            elapsed = time.perf_counter() - start
            fitted = ctx.broadcast(epochs_within_budget(planned, state.epoch, record.seconds,
                                                        cfg.time_budget_s - elapsed))  # rank 0's clock decides
            if fitted < planned:
                planned, total_steps = fitted, spe * fitted  # the cosine schedule now ends at the new last epoch
                shortened = f"time budget of {cfg.time_budget_s:g} s: {planned} of {cfg.epochs} epochs"
                if ctx.is_main:
                    log.warning("%s (schedule shortened after epoch %d)", shortened, state.epoch)

    del train_model
    restore_batch_norms(swaps)
    chosen, weights = model, "raw"
    if cfg.ema_decay > 0:
        last = state.history[-1] if state.history else None
        raw_acc = last.val_accuracy if last else None
        ema_acc = last.val_accuracy_ema if last else None
        if raw_acc is None or ema_acc is None or ema_acc >= raw_acc:  # the same numbers on every rank
            chosen, weights = _share_rank0_weights(model, ema, ctx), "ema"
    chosen.eval()
    state.elapsed_s = prior_elapsed + time.perf_counter() - start
    return FitOutcome(chosen, weights, state, device, amp, stopped or shortened)
