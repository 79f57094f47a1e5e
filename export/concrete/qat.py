"""Quantization-aware fine-tuning in polyfhe's own torch: make a float model robust to Concrete ML's PTQ.

Concrete ML quantizes each operation's inputs (per tensor, min/max over a calibration set) and each weight
tensor (per tensor, min/max) to ``n_bits`` on a uniform grid with an integer zero point; at 3-5 bits that
costs accuracy. Here the same grids are simulated in float (straight-through gradients) while a trained model
is fine-tuned briefly. The result is a plain float model, no quantizer ops in it, that Concrete ML quantizes
again and loses much less. Pure torch and numpy: this module never imports concrete.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field, fields
from typing import Self

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

__all__ = ["FakeQuantHooks", "QATResult", "fake_quant_accuracy", "fake_quantize", "fake_quantize_weight",
           "quantization_aware_finetune"]

log = logging.getLogger(__name__)

QUANTIZED_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d)
DEFAULT_IO_BITS = 5  # Concrete ML's DEFAULT_MODEL_BITS: model inputs and outputs get max(5, n_bits)
_MIN_SPAN = 1e-8  # a narrower range is widened to this: the scale never reaches 0


def _check_n_bits(n_bits: int) -> None:
    if isinstance(n_bits, bool) or not isinstance(n_bits, int) or not 2 <= n_bits <= 16:
        raise ValueError(f"n_bits must be an integer in 2..16, got {n_bits!r}")


class _GridSTE(torch.autograd.Function):
    """Forward: exactly the grid value. Backward: clipped straight-through (1 inside [lo, hi], 0 outside)."""

    @staticmethod
    def forward(ctx, x: Tensor, lo: Tensor, hi: Tensor, n_bits: int) -> Tensor:
        levels = 2**n_bits - 1
        scale = torch.clamp(hi - lo, min=_MIN_SPAN) / levels
        zero_point = torch.round(-lo / scale)  # an integer, as in Concrete ML: the grid holds 0 when lo <= 0
        q = torch.clamp(torch.round(x / scale + zero_point), 0, levels)  # ties rounded as Concrete ML does
        ctx.save_for_backward((x >= lo) & (x <= hi))
        return (q - zero_point) * scale

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None, None


def _bound(value: Tensor | float, like: Tensor) -> Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).detach()


def fake_quantize(x: Tensor, lo: Tensor | float, hi: Tensor | float, n_bits: int) -> Tensor:
    """Asymmetric uniform quantization of an activation to 2**n_bits levels over [lo, hi] widened to hold 0.

    Concrete ML's grid: scale (hi - lo) / (2**n_bits - 1), integer zero point round(-lo / scale); 0 is exact
    and the outer levels lie within scale/2 of lo and hi. Gradient: clipped straight-through estimator,
    unchanged inside [lo, hi] and zero outside (clamped values do not move with x)."""
    _check_n_bits(n_bits)
    lo_t, hi_t = torch.clamp(_bound(lo, x), max=0.0), torch.clamp(_bound(hi, x), min=0.0)
    return _GridSTE.apply(x, lo_t, hi_t, n_bits)


def fake_quantize_weight(w: Tensor, n_bits: int) -> Tensor:
    """Per-tensor min/max quantization of a weight, Concrete ML 1.9's default (signed, not symmetric: the same
    2**n_bits-level grid with an integer zero point). Straight-through gradient (every weight is inside)."""
    _check_n_bits(n_bits)
    return _GridSTE.apply(w, w.detach().min(), w.detach().max(), n_bits)


def _same_storage(a: Tensor, b: Tensor | None) -> bool:
    """Whether ``a`` is ``b`` or a view of it (Flatten, reshape): one tensor in Concrete ML's graph."""
    return (b is not None and a.numel() == b.numel()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


@dataclass
class _Range:
    """The running [lo, hi] of one activation."""

    lo: Tensor | None = None
    hi: Tensor | None = None

    def update(self, x: Tensor, momentum: float | None) -> None:
        """An EMA step, or with ``momentum=None`` (calibration) the exact min/max seen so far."""
        if x.numel() == 0:
            return
        lo, hi = x.detach().min(), x.detach().max()
        if self.lo is None or self.hi is None:
            self.lo, self.hi = lo, hi
        elif momentum is None:
            self.lo, self.hi = torch.minimum(self.lo, lo), torch.maximum(self.hi, hi)
        else:
            self.lo, self.hi = self.lo + momentum * (lo - self.lo), self.hi + momentum * (hi - self.hi)


class _WeightQuant(nn.Module):
    """A parametrization: the module reads its weight fake-quantized while the hooks are active."""

    def __init__(self, hooks: FakeQuantHooks) -> None:
        super().__init__()
        self.hooks = [hooks]  # in a list: not registered as a child module

    def forward(self, w: Tensor) -> Tensor:
        hooks = self.hooks[0]
        return w if hooks.calibrating else fake_quantize_weight(w, hooks.n_bits)


@dataclass
class FakeQuantHooks:
    """While active, each Linear/Conv1d/Conv2d sees its weight, input and output fake-quantized.

    Activation ranges follow the batches by EMA (``momentum``) while the module trains (the first batch sets
    them) and stay frozen in eval mode; :meth:`calibrate` sets them to the exact min/max of float activations,
    as Concrete ML's calibration does. The model's own input and output (or views of them) get ``io_bits``,
    Concrete ML's default for them, max(5, n_bits) (found during a forward: in effect after calibrate()).
    On exit every hook and parametrization is gone: the forward is exactly the float forward again, with the
    same parameter objects and state_dict keys."""

    model: nn.Module
    n_bits: int
    momentum: float = 0.1
    io_bits: int | None = None
    ranges: dict[str, _Range] = field(default_factory=dict, init=False)
    io_keys: set[str] = field(default_factory=set, init=False)
    calibrating: bool = field(default=False, init=False)
    _handles: list = field(default_factory=list, init=False, repr=False)
    _parametrized: list = field(default_factory=list, init=False, repr=False)
    _seen: dict = field(default_factory=dict, init=False, repr=False)  # this forward's input, last output

    def __post_init__(self) -> None:
        _check_n_bits(self.n_bits)
        self.io_bits = max(DEFAULT_IO_BITS, self.n_bits) if self.io_bits is None else self.io_bits
        _check_n_bits(self.io_bits)
        if not 0.0 < self.momentum <= 1.0:
            raise ValueError(f"momentum must be in (0, 1], got {self.momentum!r}")

    def __enter__(self) -> Self:
        try:
            self._handles.append(self.model.register_forward_pre_hook(self._model_input, prepend=True))
            for name, module in self.model.named_modules():
                if isinstance(module, QUANTIZED_MODULES):
                    self._attach(name or "<root>", module)
            self._handles.append(self.model.register_forward_hook(self._model_output))
        except BaseException:
            self._detach()
            raise
        if not self.ranges:
            log.warning("no Linear/Conv1d/Conv2d in %s: nothing is fake-quantized", type(self.model).__name__)
        return self

    def __exit__(self, *exc: object) -> None:
        self._detach()

    def _attach(self, name: str, module: nn.Module) -> None:
        self.ranges[f"{name}.input"], self.ranges[f"{name}.output"] = _Range(), _Range()
        if "weight" in module._parameters and not parametrize.is_parametrized(module, "weight"):
            order = list(module._parameters)
            parametrize.register_parametrization(module, "weight", _WeightQuant(self))
            self._parametrized.append((module, order))
        else:
            log.warning("%s: weight is not a plain parameter; only its activations are fake-quantized", name)
        self._handles.append(module.register_forward_pre_hook(
            lambda m, args: (self._quantize(f"{name}.input", m, args[0]), *args[1:])))
        self._handles.append(module.register_forward_hook(
            lambda m, args, out: self._quantize(f"{name}.output", m, out)))

    def _detach(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        while self._parametrized:
            module, order = self._parametrized.pop()
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            for key in order:  # the original order, so that state_dict() lists the same keys
                module._parameters[key] = module._parameters.pop(key)

    def _model_input(self, model: nn.Module, args: tuple) -> None:
        self._seen = {"input": args[0] if args and isinstance(args[0], Tensor) else None}

    def _model_output(self, model: nn.Module, args: tuple, out: object) -> None:
        key, last = self._seen.get("output", (None, None))
        if key is not None and isinstance(out, Tensor) and _same_storage(out, last):
            self.io_keys.add(key)

    def _quantize(self, key: str, module: nn.Module, x: Tensor) -> Tensor:
        if key.endswith(".input") and _same_storage(x, self._seen.get("input")):
            self.io_keys.add(key)
        rng = self.ranges[key]
        if self.calibrating:
            rng.update(x, None)
            out = x
        else:
            if module.training or rng.lo is None:
                rng.update(x, self.momentum)
            out = fake_quantize(x, rng.lo, rng.hi, self.io_bits if key in self.io_keys else self.n_bits)
        self._seen["output"] = (key, out)
        return out

    @torch.no_grad()
    def calibrate(self, x: Tensor, batch_size: int = 512) -> None:
        """Reset the ranges to the exact min/max of the float activations over ``x`` (modes unchanged)."""
        for rng in self.ranges.values():
            rng.lo = rng.hi = None
        self.calibrating = True
        try:
            for i in range(0, len(x), batch_size):
                self.model(x[i:i + batch_size])
        finally:
            self.calibrating = False


@dataclass(frozen=True)
class QATResult:
    """A fine-tuned copy (eval mode, float, no hooks) and accuracies on the eval split, before and after."""

    model: nn.Module
    n_bits: int
    epochs: int
    float_accuracy_before: float
    fake_quant_accuracy_before: float
    fake_quant_accuracy_after: float
    float_accuracy_after: float
    seconds: float

    def to_dict(self) -> dict:
        """JSON-ready: the model appears by its class name."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
        return {"model": type(self.model).__name__, **out}


def _as_data(x: np.ndarray | Tensor, y: np.ndarray | Tensor, what: str) -> tuple[Tensor, Tensor]:
    xt = (x if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))).detach().to(torch.float32)
    yt = (y if isinstance(y, Tensor) else torch.as_tensor(np.asarray(y))).detach().to(torch.long).reshape(-1)
    if len(xt) == 0:
        raise ValueError(f"{what}: empty data (no samples)")
    if len(xt) != len(yt):
        raise ValueError(f"{what}: x has {len(xt)} samples but y has {len(yt)} labels")
    return xt, yt


@torch.no_grad()
def _accuracy(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 512) -> float:
    pred = torch.cat([model(x[i:i + batch_size]).argmax(1) for i in range(0, len(x), batch_size)])
    return float((pred == y).float().mean())


def fake_quant_accuracy(model: nn.Module, x: np.ndarray | Tensor, y: np.ndarray | Tensor, n_bits: int,
                        calibration: np.ndarray | Tensor | None = None) -> float:
    """Accuracy under fake quantization, ranges calibrated on ``calibration`` (default ``x``): a float preview
    of Concrete ML's PTQ accuracy. Runs on a copy: the model is left as it was."""
    _check_n_bits(n_bits)
    xt, yt = _as_data(x, y, "fake_quant_accuracy")
    cal = xt if calibration is None else _as_data(calibration, np.zeros(len(calibration)), "calibration")[0]
    work = copy.deepcopy(model).eval()
    with FakeQuantHooks(work, n_bits) as hooks:
        hooks.calibrate(cal)
        return _accuracy(work, xt, yt)


def _train_mode_frozen_bn(model: nn.Module) -> None:
    """Training mode but for BatchNorm: its statistics stay frozen (they are folded into weights later)."""
    model.train()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()


def quantization_aware_finetune(model: nn.Module, x_train: np.ndarray | Tensor, y_train: np.ndarray | Tensor,
                                x_eval: np.ndarray | Tensor, y_eval: np.ndarray | Tensor, n_bits: int,
                                epochs: int = 3, lr: float = 1e-3, batch_size: int = 128,
                                seed: int = 0) -> QATResult:
    """Fine-tune a copy of ``model`` under fake quantization (AdamW, cross-entropy) after one calibration pass
    over ``x_train``. Fake-quant accuracies are calibrated on ``x_train``, as Concrete ML would be.
    Deterministic for a seed; the caller's model and torch's global random state are left untouched."""
    _check_n_bits(n_bits)
    if epochs < 0 or batch_size < 1 or not lr > 0:
        raise ValueError(f"need epochs >= 0, batch_size >= 1 and lr > 0; got {epochs}, {batch_size}, {lr}")
    xt, yt = _as_data(x_train, y_train, "training data")
    xe, ye = _as_data(x_eval, y_eval, "eval data")
    start = time.perf_counter()
    work = copy.deepcopy(model).eval()
    float_before, fq_before = _accuracy(work, xe, ye), fake_quant_accuracy(work, xe, ye, n_bits, xt)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        order = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(work.parameters(), lr=lr)
        with FakeQuantHooks(work, n_bits) as hooks:
            hooks.calibrate(xt, batch_size)
            _train_mode_frozen_bn(work)
            for _ in range(epochs):
                perm = torch.randperm(len(xt), generator=order)
                for i in range(0, len(xt), batch_size):
                    idx = perm[i:i + batch_size]
                    opt.zero_grad()
                    nn.functional.cross_entropy(work(xt[idx]), yt[idx]).backward()
                    opt.step()
    work.eval()
    fq_after = fake_quant_accuracy(work, xe, ye, n_bits, xt)
    result = QATResult(model=work, n_bits=n_bits, epochs=epochs, float_accuracy_before=float_before,
                       fake_quant_accuracy_before=fq_before, fake_quant_accuracy_after=fq_after,
                       float_accuracy_after=_accuracy(work, xe, ye), seconds=time.perf_counter() - start)
    log.info("QAT at %d bits, %d epochs: fake-quant accuracy %.3f -> %.3f, float %.3f -> %.3f (%.1f s)",
             n_bits, epochs, fq_before, fq_after, float_before, result.float_accuracy_after, result.seconds)
    return result
