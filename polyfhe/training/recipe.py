"""The papers' training recipe as small pieces: optimizers, warmup + cosine schedule, EMA, mixup/cutmix, loss.

Each piece is a pure function or a tiny class so it can be tested alone; :mod:`polyfhe.training.loop` wires them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn


# ------------------------------------------------------------------------------------------------ optimizers
class Lamb(torch.optim.Optimizer):
    """LAMB (layer-wise adaptive moments): an Adam step rescaled per tensor by ||w|| / ||update||.

    Offered for APolyNeXt's large-batch runs; decoupled weight decay is part of the update, as in the LAMB paper.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = m / (1 - beta1 ** state["step"])
                v_hat = v / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.sub_(update * (trust * group["lr"]))
        return loss


def on_cuda(groups: list[dict[str, Any]]) -> bool:
    params = [p for group in groups for p in group["params"]]
    return bool(params) and all(p.is_cuda for p in params)


def _adamw(groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    # fused on CUDA: one kernel launch for all parameters; small nets are launch-bound there
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), fused=True if on_cuda(groups) else None)


def _lamb(groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    return Lamb(groups, lr=lr)


def _sgd(groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)


OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]], float], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "lamb": _lamb,
    "sgd": _sgd,
}

# Scales and norm gains are not weights to shrink: decaying them towards 0 fights the normalisation.
_NO_DECAY_SUFFIXES = ("bias", "gamma_hw", "beta_hw")


def _per_channel(p: Tensor) -> bool:
    """A vector in any broadcast shape: ``(C,)``, ``(1, C, 1, 1)`` (PolyNeXt's cell scales), ``(1, 1, C)``."""
    return sum(d > 1 for d in p.shape) <= 1


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices and conv kernels only; vectors (norm gains, biases, scales, also when shaped
    ``(1, C, 1, 1)`` to broadcast) are exempt."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if _per_channel(p) or name.endswith(_NO_DECAY_SUFFIXES) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    try:
        factory = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; accepted: {', '.join(sorted(OPTIMIZERS))}") from None
    return factory(param_groups(model, weight_decay), lr)


# -------------------------------------------------------------------------------------------------- schedule
def cosine_lr(step: int, total_steps: int, warmup_steps: int, base_lr: float, min_lr: float) -> float:
    """Linear warmup from ``base_lr / warmup_steps`` to ``base_lr``, then cosine decay to ``min_lr``."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# ------------------------------------------------------------------------------------------------------ EMA
class ModelEma:
    """Exponential moving average of every float parameter *and buffer* (BN running statistics included,
    as the reference's ``AveragedModel(use_buffers=True)``); integer buffers are copied.

    The decay warms up as ``min(decay, (1 + n) / (10 + n))`` so short runs are not dominated by the init.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.updates = 0
        self.module = copy.deepcopy(getattr(model, "_orig_mod", model)).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.current_decay()
        source = getattr(model, "_orig_mod", model).state_dict()
        for name, avg in self.module.state_dict().items():
            new = source[name].detach()
            if avg.is_floating_point():
                avg.lerp_(new.to(avg.dtype), 1.0 - d)
            else:
                avg.copy_(new)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])


# ------------------------------------------------------------------------------------------ targets and mixing
def smooth_one_hot(y: Tensor, num_classes: int, smoothing: float) -> Tensor:
    """One-hot targets with ``smoothing`` spread evenly over all classes (timm's convention)."""
    off = smoothing / num_classes
    return torch.full((len(y), num_classes), off, device=y.device).scatter_(1, y[:, None], 1.0 - smoothing + off)


def soft_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy against soft targets, computed in float32 even under bf16 autocast."""
    return torch.sum(-targets * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()


def cutmix_box(h: int, w: int, lam: float, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """A box of area about ``(1 - lam) * h * w`` at a random centre, clipped to the image."""
    cut = math.sqrt(1.0 - lam)
    ch, cw = int(h * cut), int(w * cut)
    cy, cx = int(rng.integers(h)), int(rng.integers(w))
    return max(cy - ch // 2, 0), min(cy + ch // 2, h), max(cx - cw // 2, 0), min(cx + cw // 2, w)


def mix_batch(x: Tensor, targets: Tensor, *, mixup: float, cutmix: float, prob: float,
              rng: np.random.Generator) -> tuple[Tensor, Tensor]:
    """Mixup or cutmix (one per batch, chosen at random when both are on) with the batch in reverse order."""
    if (mixup <= 0 and cutmix <= 0) or rng.random() >= prob:
        return x, targets
    use_cutmix = cutmix > 0 and (mixup <= 0 or rng.random() < 0.5)
    lam = float(rng.beta(cutmix, cutmix) if use_cutmix else rng.beta(mixup, mixup))
    if use_cutmix:
        y0, y1, x0, x1 = cutmix_box(x.shape[-2], x.shape[-1], lam, rng)
        x = x.clone()
        x[..., y0:y1, x0:x1] = x.flip(0)[..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (x.shape[-2] * x.shape[-1])  # the box was clipped: use its real area
    else:
        x = x * lam + x.flip(0) * (1.0 - lam)
    return x, targets * lam + targets.flip(0) * (1.0 - lam)
