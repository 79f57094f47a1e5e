"""Checked ONNX export: fold -> ``torch.onnx.export`` -> ``onnx.checker`` -> onnxruntime parity -> analyzer.

An export that does not reproduce the torch model in onnxruntime, or whose graph is not add/mul-only on the
input, raises instead of leaving a file that would fail later in the CKKS compiler: the graph is written to a
temporary file beside the destination and moved there only when every check passed.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from polyfhe.analysis import AnalysisReport, analyze
from polyfhe.analysis.hints import remedy
from polyfhe.ort_providers import inference_session

log = logging.getLogger(__name__)

DEFAULT_OPSET = 17
STRUCTURAL_CHECK_RTOL = 1e-3
INPUT_NAME, OUTPUT_NAME = "input", "logits"


class ExportError(RuntimeError):
    """The exported graph failed a check (checker, onnxruntime parity, or the polynomial analysis)."""


@dataclass(frozen=True)
class OnnxExport:
    """What an ONNX export produced and measured."""

    path: Path
    opset: int
    input_shape: tuple[int, ...]
    max_rel_error: float
    analysis: AnalysisReport

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path), "opset": self.opset, "input_shape": list(self.input_shape),
            "max_rel_error": self.max_rel_error, "analysis": self.analysis.to_dict(),
        }


def resolve_input_shape(model: nn.Module, input_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    shape = input_shape or getattr(model, "input_shape", None)
    if shape is None:
        raise ValueError(
            f"cannot infer the input shape of {type(model).__name__} (it has no input_shape attribute); pass "
            "input_shape=(C, H, W), the shape of one sample without the batch axis, e.g. input_shape=(1, 28, 28); "
            "target='ckks' also reads it from calibration data shaped (N, C, H, W) (a numpy array or torch tensor)"
        )
    return tuple(int(s) for s in shape)


def _onnxruntime_outputs(path: Path, x: np.ndarray) -> np.ndarray:
    session = inference_session(path)
    return session.run(None, {INPUT_NAME: x})[0]


def export_onnx(
    model: nn.Module,
    path: str | Path,
    input_shape: tuple[int, ...] | None = None,
    *,
    opset: int = DEFAULT_OPSET,
    fold_first: bool = True,
    rtol: float = 1e-5,
    require_polynomial: bool = True,
    parity_batch: int = 4,
    allow_nonfinite: bool = False,
) -> OnnxExport:
    """Fold (unless ``fold_first=False``), export, check and analyse ``model``; returns an :class:`OnnxExport`.

    ``allow_nonfinite`` is for structural checks of randomly initialised deep models, whose outputs overflow
    (degree 2^68 and more): parity is then skipped with a warning and ``max_rel_error`` is NaN.
    """
    shape = resolve_input_shape(model, input_shape)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written next to its destination and moved there only once every check passed: a refused export leaves
    # no file behind (nor replaces an earlier good one).
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".onnx.partial", dir=path.parent)
    os.close(fd)
    partial = Path(name)
    try:
        rel, report = _export_checked(model, partial, shape, opset, fold_first, rtol, require_polynomial,
                                      parity_batch, allow_nonfinite)
        os.chmod(partial, _public_mode())  # mkstemp made it 0600; an ONNX file holds no secret
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    log.info("exported %s to %s (opset %d, rel err %.2e, degree %s, levels %s)",
             type(model).__name__, path, opset, rel, report.degree, report.levels)
    return OnnxExport(path, opset, shape, rel, report)


def _public_mode() -> int:
    """The mode a new file gets under this process's umask (0644 under the usual 022), read without changing the
    umask (``os.umask`` would, for a moment, for every thread); 0644 where the kernel does not say."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o644


def _export_checked(model: nn.Module, path: Path, shape: tuple[int, ...], opset: int, fold_first: bool,
                    rtol: float, require_polynomial: bool, parity_batch: int,
                    allow_nonfinite: bool) -> tuple[float, AnalysisReport]:
    """Export to ``path`` and run the checks; returns (max relative error, analysis) or raises ExportError."""
    from polyfhe.folding import fold

    # Work on copies: .eval() and .float() act in place, and the caller's model must come back unchanged.
    reference = copy.deepcopy(model).eval().float()
    folded = (fold(model, input_shape=shape) if fold_first else copy.deepcopy(model)).eval().float()
    generator = torch.Generator().manual_seed(0)
    x = torch.rand((parity_batch, *shape), generator=generator)
    with torch.no_grad():
        expected = reference(x).numpy()
    with warnings.catch_warnings():
        # The TorchScript exporter is deprecated in favour of dynamo (which needs onnxscript); it is still the
        # one that emits plain, small opset-17 graphs of exactly the ops we use.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            folded, (x,), str(path), dynamo=False, opset_version=opset, input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME], dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )
    proto = onnx.load(str(path))
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"onnx.checker rejected the exported graph: {exc}") from exc
    got = _onnxruntime_outputs(path, x.numpy())
    if not np.isfinite(expected).all():
        if not allow_nonfinite:
            raise ExportError("the torch model's output is not finite on uniform [0, 1) inputs; cannot check parity")
        log.warning("%s: output overflows on random inputs (untrained deep model?); parity not checked",
                    type(model).__name__)
        rel = float("nan")
    else:
        scale = max(float(np.abs(expected).max()), 1e-30)
        rel = float(np.abs(got - expected).max() / scale)
    if np.isfinite(expected).all() and not rel <= rtol:
        raise ExportError(f"onnxruntime disagrees with torch: max relative error {rel:.3e} > {rtol:.1e}")
    report = analyze(proto)
    if require_polynomial and not report.polynomial:
        offenders = ", ".join(f"{v.node} ({v.op})" for v in report.violations[:10])
        hint = remedy(report.violations)
        raise ExportError(f"exported graph is not polynomial on its input: {offenders}; no file was written"
                          + (f"\nThe way in: {hint}" if hint else ""))
    return rel, report


def export_onnx_file(model: nn.Module, path: str | Path | None = None,
                     input_shape: tuple[int, ...] | None = None, **kwargs) -> Path:
    """``polyfhe.export(model, target="onnx", path=...)``: :func:`export_onnx`, returning the written path."""
    if path is None:
        raise ValueError("target='onnx' needs path=... (where to write the .onnx file)")
    return export_onnx(model, path, input_shape, **kwargs).path


def export_zoo_model_for_check(name: str, img_size: int | None = None, out_dir: str | Path | None = None) -> Path:
    """Build zoo model ``name`` (randomly initialised), fold and export it, and return the .onnx path.

    Used by ``polyfhe check MODEL_NAME``. LayerNorm variants cannot be folded; they are exported unfolded so
    the analyzer can name their non-polynomial nodes. The check is structural, so onnxruntime parity is held
    to 1e-3 here: random deep float32 nets (LN ones especially) amplify rounding past the strict 1e-5 that
    :func:`export_onnx` applies to user exports.
    """
    from polyfhe.models.registry import create_model, model_entry

    entry = model_entry(name)
    model = create_model(name, **({"img_size": img_size} if img_size else {})).eval()
    directory = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="polyfhe-check-"))
    path = directory / f"{name}.onnx"
    export_onnx(model, path, fold_first=entry.norm != "ln", require_polynomial=False, allow_nonfinite=True,
                rtol=STRUCTURAL_CHECK_RTOL)
    return path
