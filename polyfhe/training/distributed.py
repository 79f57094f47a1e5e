"""Data-parallel training under ``torchrun``: the process group, rank-0 duties, and batch statistics over all ranks.

``torchrun --nproc-per-node N -m polyfhe train ...`` (or ``polyfhe train --nproc N``) starts N copies of the same
run. :func:`setup` reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), opens the process group
(gloo on CPU, nccl on CUDA, one GPU per local rank) and returns a :class:`DistContext`; without them it returns the
single-process context and nothing changes.

``--batch-size`` stays the *global* batch: every rank draws the same shuffled order and augmentation (one seed),
takes its contiguous share of each global batch, and DistributedDataParallel averages the gradients. Batch
statistics are summed over all ranks inside the forward pass (:func:`sync_batch_norms`), so N processes compute what
one process computes on the whole batch, up to float rounding (tested in ``tests/training/test_distributed.py``).

torch's ``SyncBatchNorm`` is not used: it runs on CUDA only, and the models' BatchNorms are not all ``BatchNorm2d``.
MONet's ``TokenBatchNorm`` normalises channels-last tensors, PolyNeXt's ``ChannelBatchNorm`` takes per-position
statistics over (batch, channel), and ``RunningRowSumNorm`` averages attention row sums over the batch. Each gets a
subclass here that all-reduces its sums (one autograd-aware all-reduce per layer and step, another in the backward
pass) and keeps the state_dict keys of the original, so checkpoints are the same files as a single-process run's.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from polyfhe.models.layers.norms import ChannelBatchNorm, RunningRowSumNorm
from polyfhe.models.layers.token_norms import TokenBatchNorm

log = logging.getLogger(__name__)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in a run: ``backend`` is None when it runs alone (no process group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    owns_group: bool = False  # opened by :func:`setup`, so :func:`teardown` closes it

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> slice:
        """This rank's contiguous part of ``n`` items (sizes differ by at most one)."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        """Sum ``t`` over all ranks, in place (no gradient); a no-op alone."""
        if self.enabled:
            dist.all_reduce(t)
        return t

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a picklable object); ``value`` itself alone."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


SINGLE = DistContext()


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARS)


def _device_for(name: str, local_rank: int, world_size: int) -> torch.device:
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if name.startswith("cuda:") and world_size > 1:
        raise ValueError(f"device {name!r} names one GPU, but {world_size} processes run: use --device cuda "
                         "(each process takes the GPU of its local rank) or --device cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available (torch {torch.__version__}); "
                         "use --device cpu or install a CUDA build of torch")
    index = torch.device(name).index if name.startswith("cuda:") else local_rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"local rank {local_rank} needs GPU {index}, but this node has {torch.cuda.device_count()}; "
                         "start at most one process per GPU (--nproc-per-node)")
    return torch.device("cuda", index)


def setup(device: str) -> tuple[DistContext, torch.device | None]:
    """The context of this process and, when distributed, its device (None: the caller resolves ``device``).

    Joins a process group opened by the caller, opens one when torchrun started this process (also for a single
    process: ``--nproc-per-node 1`` exercises the same path), else runs alone.
    """
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        backend = dist.get_backend()
        resolved = _device_for("cpu" if backend == "gloo" and device == "auto" else device, local, world)
        return DistContext(rank, world, local, backend, owns_group=False), resolved
    if not launched_by_torchrun():
        return SINGLE, None
    rank, world, local = (int(os.environ[name]) for name in TORCHRUN_VARS)
    resolved = _device_for(device, local, world)
    backend = "nccl" if resolved.type == "cuda" else "gloo"
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    dist.init_process_group(backend, device_id=resolved if resolved.type == "cuda" else None)
    ctx = DistContext(rank, world, local, backend, owns_group=True)
    if ctx.is_main:
        log.info("distributed training: %d processes, backend %s, this node's local rank %d on %s",
                 world, backend, local, resolved)
    return ctx, resolved


def teardown(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ synchronised statistics
class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) with a gradient: the backward pass sums the ranks' gradients, as the chain rule through
    statistics shared by all ranks asks. (torch's own differentiable all-reduce is deprecated in favour of a
    private module.)"""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        out = t.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        out = grad.contiguous().clone()
        dist.all_reduce(out)
        return out


def _global_sum(t: Tensor) -> Tensor:
    return _SumOverRanks.apply(t)


def _mean_and_var(x: Tensor, dims: tuple[int, ...], keep: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Mean and biased variance over ``dims`` *and all ranks*, from one all-reduce of the sums and the count;
    also the count (how many values each statistic covers over all ranks)."""
    local = 1
    for d in dims:
        local *= x.shape[d]
    s1 = x.sum(dims, keepdim=keep, dtype=torch.float32)
    s2 = (x * x).sum(dims, keepdim=keep, dtype=torch.float32)
    packed = _global_sum(torch.cat([s1.flatten(), s2.flatten(), s1.new_full((1,), float(local))]))
    k = s1.numel()
    n = packed[-1]
    mean = (packed[:k] / n).view(s1.shape)
    var = (packed[k:2 * k].view(s1.shape) / n - mean * mean).clamp_min(0.0)
    return mean, var, n.detach()  # a tensor: reading it on the host would wait for the GPU


class SyncChannelBatchNorm(ChannelBatchNorm):
    """:class:`ChannelBatchNorm` whose per-position statistics cover the whole global batch."""

    def _statistics(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if not self.training:
            return super()._statistics(x)
        mu, var, _ = _mean_and_var(x, (0, 1), keep=True)
        with torch.no_grad():
            self.running_mean.mul_(1.0 - self.momentum).add_(self.momentum * mu.to(self.running_mean.dtype))
            self.running_var.mul_(1.0 - self.momentum).add_(self.momentum * var.to(self.running_var.dtype))
            self.num_batches_tracked.add_(1)
        return mu.to(x.dtype), var.to(x.dtype)


class SyncRunningRowSumNorm(RunningRowSumNorm):
    """:class:`RunningRowSumNorm` whose batch mean of attention row sums covers the whole global batch."""

    def _denominator(self, a_raw: Tensor) -> Tensor:
        if not self.training:
            return super()._denominator(a_raw)
        rows = a_raw.sum(dim=-1, keepdim=True).sum(dim=0, keepdim=True, dtype=torch.float32)
        count = a_raw.new_full((1,), a_raw.shape[0], dtype=torch.float32)
        packed = _global_sum(torch.cat([rows.flatten(), count]))
        denom = (packed[:-1] / packed[-1]).view(rows.shape)
        with torch.no_grad():
            self.running_denom.mul_(1.0 - self.momentum).add_(self.momentum * denom.to(self.running_denom.dtype))
            self.num_batches_tracked.add_(1)
        return denom.to(a_raw.dtype)


def _batch_norm_over_ranks(bn: nn.modules.batchnorm._BatchNorm, x: Tensor) -> Tensor:
    """Training-mode BatchNorm of ``x`` shaped ``(N, C, ...)`` with statistics over all ranks; torch's rules
    for the running statistics (unbiased variance, momentum None = cumulative average)."""
    dims = (0, *range(2, x.dim()))
    mean, var, n = _mean_and_var(x, dims, keep=False)
    if bn.track_running_stats and bn.running_mean is not None:
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
            unbiased = var * (n / (n - 1).clamp_min(1.0))
            bn.running_mean.mul_(1.0 - factor).add_(factor * mean.to(bn.running_mean.dtype))
            bn.running_var.mul_(1.0 - factor).add_(factor * unbiased.to(bn.running_var.dtype))
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = (x - mean.view(shape)) * torch.rsqrt(var + bn.eps).view(shape)
    if bn.affine:
        y = y * bn.weight.view(shape) + bn.bias.view(shape)
    return y.to(x.dtype)


class SyncTokenBatchNorm(TokenBatchNorm):
    """MONet's channels-last :class:`TokenBatchNorm` with statistics over all ranks."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return super().forward(x)
        if x.dim() < 2 or x.shape[-1] != self.num_features:
            raise ValueError(
                f"TokenBatchNorm({self.num_features}) expects (..., {self.num_features}), got {tuple(x.shape)}"
            )
        return _batch_norm_over_ranks(self, x.reshape(-1, x.shape[-1])).reshape(x.shape)


class _SyncBatchNormMixin:
    """Put before ``nn.BatchNorm1d/2d/3d`` in a subclass: training statistics over all ranks."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return super().forward(x)  # type: ignore[misc]
        self._check_input_dim(x)  # type: ignore[attr-defined]
        return _batch_norm_over_ranks(self, x)  # type: ignore[arg-type]


class SyncBatchNorm1d(_SyncBatchNormMixin, nn.BatchNorm1d):
    pass


class SyncBatchNorm2d(_SyncBatchNormMixin, nn.BatchNorm2d):
    pass


class SyncBatchNorm3d(_SyncBatchNormMixin, nn.BatchNorm3d):
    pass


# exact types only: a subclass with its own forward (as TokenBatchNorm has) needs its own entry
SYNC_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    ChannelBatchNorm: SyncChannelBatchNorm,
    RunningRowSumNorm: SyncRunningRowSumNorm,
    TokenBatchNorm: SyncTokenBatchNorm,
    nn.BatchNorm1d: SyncBatchNorm1d,
    nn.BatchNorm2d: SyncBatchNorm2d,
    nn.BatchNorm3d: SyncBatchNorm3d,
}

Swap = tuple[nn.Module, str, nn.Module]  # parent, attribute name, the original module


def _aliased(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """A ``cls`` instance sharing every parameter, buffer and attribute of ``module`` (the same dicts)."""
    twin = cls.__new__(cls)
    twin.__dict__ = module.__dict__.copy()
    return twin


def sync_batch_norms(model: nn.Module) -> list[Swap]:
    """Replace every BatchNorm-like layer of ``model`` by its synchronised twin (same tensors); returns what
    :func:`restore_batch_norms` needs to put the originals back. Layers with running statistics that no twin
    covers are named in a warning: their statistics would stay per rank."""
    swaps: list[Swap] = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            twin_cls = SYNC_CLASSES.get(type(child))
            if twin_cls is not None:
                setattr(parent, name, _aliased(child, twin_cls))
                swaps.append((parent, name, child))
            elif type(child) not in SYNC_CLASSES.values() and any(
                b.startswith("running_") for b, _ in child.named_buffers(recurse=False)
            ):
                log.warning("%s (%s) keeps running statistics that are not synchronised across processes",
                            f"{parent_name}.{name}".lstrip("."), type(child).__name__)
    return swaps


def restore_batch_norms(swaps: list[Swap]) -> None:
    """Put the original layers back (they hold the trained tensors: the twins shared them)."""
    for parent, name, original in reversed(swaps):
        setattr(parent, name, original)
