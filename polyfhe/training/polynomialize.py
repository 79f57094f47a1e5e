"""``polyfhe.polynomialize(model, data=(X, y))``: the way in for a network built with ReLU, GELU, SiLU, ...

CKKS adds and multiplies; a ReLU network cannot run under it. This returns a copy of the model in which every
element-wise activation module is a trainable low-degree polynomial (:class:`PolyActivation`), fitted by least
squares to the activation on the values that reach it when ``data`` flows through the model, and max pooling is
average pooling; then, when ``data`` has labels, fine-tunes the whole copy for a few epochs. The copy exports
like any polynomial model (``polyfhe.export(poly, target="ckks", calibration=X)``).

Modules only: an activation called as a function in ``forward`` (``F.relu(x)``, ``x.relu()``) is not replaced;
it is found by running the copy once and refused with the module that calls it. Softmax and attention have no
polynomial stand-in here and are refused by name.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from polyfhe.models.layers.poly_activation import PolyActivation, fit_polynomial
from polyfhe.training.finetune import DataSource, accuracy, as_source, fine_tune

__all__ = ["ACTIVATIONS", "PolynomializeError", "PolynomializeReport", "Replacement", "polynomialize"]

log = logging.getLogger(__name__)

# element-wise activation modules a polynomial stands in for (the module itself gives the fit's target values)
ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.GELU, nn.SiLU, nn.ELU, nn.SELU, nn.CELU, nn.Softplus, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh,
)
_MAX_POOLS = {nn.MaxPool1d: nn.AvgPool1d, nn.MaxPool2d: nn.AvgPool2d, nn.MaxPool3d: nn.AvgPool3d}
_ADAPTIVE_MAX_POOLS = {nn.AdaptiveMaxPool1d: nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool2d: nn.AdaptiveAvgPool2d,
                       nn.AdaptiveMaxPool3d: nn.AdaptiveAvgPool3d}
_REFUSED = (nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d, nn.GLU, nn.MultiheadAttention)
# torch functions a forward pass may call directly; seen by running the copy once (names as torch reports them)
_NON_POLYNOMIAL_CALLS = frozenset({
    "relu", "relu_", "relu6", "leaky_relu", "leaky_relu_", "prelu", "gelu", "silu", "elu", "selu", "celu",
    "softplus", "mish", "hardswish", "hardsigmoid", "hardtanh", "sigmoid", "tanh", "softmax", "log_softmax",
    "max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "clamp", "clamp_", "clip", "clamp_min", "maximum", "minimum", "abs", "sqrt", "rsqrt", "exp", "log", "erf",
})
_MAX_FIT_POINTS = 200_000
INITS = ("fit", "square")


class PolynomializeError(ValueError):
    """The model holds something polynomialize cannot replace; the message names it and what to do."""


@dataclass(frozen=True)
class Replacement:
    """One module swapped: where, what it was, what it became, and (for activations) the fit."""

    path: str
    was: str
    now: str
    coeffs: tuple[float, ...] = ()
    scale: float | None = None
    fit_rmse: float | None = None  # root-mean-square error of the fit on the calibration values


@dataclass(frozen=True)
class PolynomializeReport:
    """What :func:`polynomialize` did; accuracies are on ``eval_data`` (or ``data``) when it has class labels."""

    replaced: tuple[Replacement, ...]
    degree: int
    init: str
    calibration_samples: int
    epochs: int
    epoch_losses: tuple[float, ...]
    accuracy_original: float | None
    accuracy_fitted: float | None  # after the fit, before fine-tuning
    accuracy_final: float | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        """What ``print(report)`` shows: the run on one line, then one line per module swapped."""
        def pct(value: float | None) -> str:
            return "-" if value is None else f"{value:.1%}"

        lines = [f"polynomialize: {len(self.replaced)} module(s) -> degree-{self.degree} polynomials ({self.init} "
                 f"fit, {self.calibration_samples} samples), {self.epochs} epoch(s) of fine-tuning, "
                 f"{self.seconds:.1f} s",
                 f"  accuracy: original {pct(self.accuracy_original)}, fitted {pct(self.accuracy_fitted)}, "
                 f"fine-tuned {pct(self.accuracy_final)}"]
        for r in self.replaced:
            fit = "" if r.fit_rmse is None else f" (fit rmse {r.fit_rmse:.3g})"
            lines.append(f"  {r.path}: {r.was} -> {r.now}{fit}")
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PolynomializeReport:
        values = dict(data)
        values["replaced"] = tuple(Replacement(**{**r, "coeffs": tuple(r.get("coeffs", ()))})
                                   for r in data["replaced"])
        values["epoch_losses"] = tuple(data.get("epoch_losses", ()))
        return cls(**values)


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, name = path.rpartition(".")
    return (model.get_submodule(head) if head else model), name


def _check_supported(model: nn.Module, maxpool: str) -> None:
    problems = []
    for path, module in model.named_modules():
        if isinstance(module, _REFUSED):
            problems.append(f"{path or '<model>'} ({type(module).__name__}) has no polynomial stand-in: remove it "
                            "(a final softmax does not change the predicted class; export the logits)")
        elif maxpool == "error" and isinstance(module, (*_MAX_POOLS, *_ADAPTIVE_MAX_POOLS)):
            problems.append(f"{path} ({type(module).__name__}) is not polynomial: pass maxpool='avg' to replace it "
                            "with average pooling")
        elif isinstance(module, tuple(_MAX_POOLS)) and (not _all_ones(module.dilation) or module.return_indices):
            problems.append(f"{path} ({type(module).__name__}) is dilated or returns indices; average pooling "
                            "cannot stand in for it: replace it in the model")
    if problems:
        raise PolynomializeError("polynomialize cannot convert this model: " + "; ".join(problems))


def _activation_inputs(model: nn.Module, paths: list[str], x: torch.Tensor | None,
                       batch_size: int) -> dict[str, torch.Tensor]:
    """Values reaching each activation module (subsampled) while ``x`` flows through ``model`` in eval mode."""
    seen: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
    if x is None:
        return {}
    generator = torch.Generator().manual_seed(0)

    def hook(path: str):
        def record(_module: nn.Module, args: tuple) -> None:
            values = args[0].detach().float().reshape(-1).cpu().clone()  # an in-place activation runs next
            if values.numel() > _MAX_FIT_POINTS:
                values = values[torch.randperm(values.numel(), generator=generator)[:_MAX_FIT_POINTS]]
            seen[path].append(values)
        return record

    handles = [model.get_submodule(p).register_forward_pre_hook(hook(p)) for p in paths]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with torch.no_grad():
            for i in range(0, len(x), batch_size):
                model(x[i:i + batch_size].to(device))
    finally:
        for handle in handles:
            handle.remove()
    out = {}
    for path, parts in seen.items():
        values = torch.cat(parts)
        if values.numel() > _MAX_FIT_POINTS:
            values = values[torch.randperm(values.numel(), generator=generator)[:_MAX_FIT_POINTS]]
        out[path] = values
    return out


def _fitted(module: nn.Module, path: str, values: torch.Tensor | None, degree: int, init: str,
            input_range: tuple[float, float]) -> tuple[PolyActivation, Replacement]:
    name = type(module).__name__
    if init == "square":
        poly = PolyActivation([0.0, 0.0, 1.0], 1.0, replaces=name)
        return poly, Replacement(path, name, "x*x", (0.0, 0.0, 1.0), 1.0, None)
    if values is None or values.numel() <= degree:
        lo, hi = input_range
        values = torch.linspace(lo, hi, 2001)
        scale = max(abs(lo), abs(hi))
    else:
        scale = float(torch.quantile(values.abs(), 0.999)) or 1.0
    with torch.no_grad():
        if isinstance(module, nn.PReLU):  # one slope per channel has no channel axis here: fit the mean slope
            target = torch.where(values >= 0, values, float(module.weight.mean()) * values)
        else:
            target = copy.deepcopy(module).float().cpu()(values.clone())  # clone: in-place activations
    u = values.double().numpy() / scale
    coeffs = fit_polynomial(u, target.double().numpy(), degree)
    rmse = float(np.sqrt(np.mean((np.polynomial.polynomial.polyval(u, coeffs) - target.double().numpy()) ** 2)))
    poly = PolyActivation(coeffs, scale, replaces=name)
    return poly, Replacement(path, name, f"degree-{degree} polynomial", tuple(float(c) for c in coeffs), scale,
                             rmse)


def _pool(module: nn.Module, path: str) -> tuple[nn.Module, Replacement]:
    kind = type(module)
    if kind in _ADAPTIVE_MAX_POOLS:
        new: nn.Module = _ADAPTIVE_MAX_POOLS[kind](module.output_size)
    else:
        new = _MAX_POOLS[kind](module.kernel_size, module.stride, module.padding, ceil_mode=module.ceil_mode)
    return new, Replacement(path, kind.__name__, type(new).__name__)


class _CallRecorder(TorchFunctionMode):
    """Records non-polynomial torch functions called during a forward pass, with the module calling them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.calls: dict[str, set[str]] = {}
        self.handles = []
        for path, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(path)))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, path: str):
        def enter(*_: Any) -> None:  # a hook returning a value would replace the module's input or output
            self.stack.append(path)
        return enter

    def _leave(self, *_: Any) -> None:
        self.stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _NON_POLYNOMIAL_CALLS:
            self.calls.setdefault(self.stack[-1] if self.stack else "<model>", set()).add(name)
        return func(*args, **(kwargs or {}))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _check_no_functional_calls(model: nn.Module, example: torch.Tensor) -> None:
    recorder = _CallRecorder(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with torch.no_grad(), recorder:
            model(example.to(device))
    finally:
        recorder.remove()
    if recorder.calls:
        where = "; ".join(f"{path or '<model>'} calls {', '.join(sorted(names))}"
                          for path, names in sorted(recorder.calls.items()))
        raise PolynomializeError(
            f"forward() calls non-polynomial torch functions directly ({where}); polynomialize replaces modules "
            "only: use modules (nn.ReLU(), nn.GELU(), nn.SiLU(), nn.AvgPool2d, ...) in place of F.relu, x.relu(), "
            "torch.sigmoid, F.max_pool2d, ...")


def polynomialize(model: nn.Module, data: Any = None, *, degree: int = 2, init: str = "fit", epochs: int = 3,
                  lr: float = 1e-3, batch_size: int = 128, maxpool: str = "avg", calibration_samples: int = 512,
                  input_range: tuple[float, float] = (-3.0, 3.0), eval_data: Any = None, weight_decay: float = 0.0,
                  seed: int = 0) -> nn.Module:
    """A copy of ``model`` with every activation module a trainable polynomial, fitted and fine-tuned.

    ``data``: ``(X, y)`` arrays/tensors, ``X`` alone, a dataset with ``x_train``/``y_train`` or a DataLoader of
    ``(x, y)``. The first ``calibration_samples`` inputs set each polynomial's fit (least squares on the values
    that reach that activation); without data the fit is on ``input_range``. With labels, ``epochs`` of Adam at
    ``lr`` fine-tune the copy (``epochs=0``: fit only). ``init="square"`` starts every activation at ``x*x``.
    ``maxpool``: "avg" swaps max pooling for average pooling of the same window, "error" refuses it.
    The input model is not modified; the copy carries a :class:`PolynomializeReport` as ``polynomialize_report``.
    """
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if init == "square" and degree != 2:
        raise ValueError("init='square' is x*x, degree 2")
    if maxpool not in ("avg", "error"):
        raise ValueError(f"maxpool must be 'avg' or 'error', got {maxpool!r}")
    start = time.perf_counter()
    torch.manual_seed(seed)
    _check_supported(model, maxpool)
    source: DataSource | None = as_source(data) if data is not None else None
    evaluation = as_source(eval_data) if eval_data is not None else source
    poly = copy.deepcopy(model).eval()
    paths = [p for p, m in poly.named_modules() if isinstance(m, ACTIVATIONS)]
    calib = source.head(calibration_samples) if source is not None else None
    values = _activation_inputs(poly, paths, calib, batch_size)
    before = accuracy(poly, evaluation) if evaluation is not None else None
    replaced = []
    for path, module in list(poly.named_modules()):
        if isinstance(module, ACTIVATIONS):
            new, record = _fitted(module, path, values.get(path), degree, init, input_range)
        elif isinstance(module, (*_MAX_POOLS, *_ADAPTIVE_MAX_POOLS)):
            new, record = _pool(module, path)
        else:
            continue
        if not path:
            raise PolynomializeError(f"the model is itself a {type(module).__name__}; nothing to run encrypted")
        parent, name = _parent(poly, path)
        setattr(parent, name, new.to(_device_of(poly)))
        replaced.append(record)
    example = calib[:2] if calib is not None else _example(model)
    if example is not None:
        _check_no_functional_calls(poly, example)
    fitted = accuracy(poly, evaluation) if evaluation is not None else None
    losses: list[float] = []
    if source is not None and source.labelled and epochs > 0:
        losses = fine_tune(poly, source, epochs=epochs, lr=lr, batch_size=batch_size, weight_decay=weight_decay,
                           seed=seed)
    final = accuracy(poly, evaluation) if evaluation is not None else None
    report = PolynomializeReport(tuple(replaced), degree, init, 0 if calib is None else len(calib),
                                 len(losses), tuple(losses), before, fitted, final, time.perf_counter() - start)
    poly.polynomialize_report = report
    log.info("polynomialize: replaced %d module(s) (%s); accuracy original %s, fitted %s, fine-tuned %s",
             len(replaced), ", ".join(f"{r.path}: {r.was}" for r in replaced) or "none", before, fitted, final)
    return poly.eval()


def _all_ones(value: int | tuple[int, ...]) -> bool:
    return all(v == 1 for v in (value if isinstance(value, tuple) else (value,)))


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _example(model: nn.Module) -> torch.Tensor | None:
    shape = getattr(model, "input_shape", None)
    return torch.rand((2, *shape)) if shape is not None else None
