"""A trainable low-degree polynomial that stands in for an element-wise activation (ReLU, GELU, SiLU, ...).

``y = c_0 + c_1 u + ... + c_d u^d`` with ``u = x / scale``: ``scale`` (a buffer, fixed) puts the typical input
range near [-1, 1], so the coefficients are O(1) and an optimiser moves them at the same pace as the weights.
The forward pass multiplies tensors by tensors and by constants only, so the ONNX export is Mul/Add (the division
by ``scale`` is a constant multiplication the CKKS compiler merges into the neighbouring affine maps); powers are
built as a balanced product tree (degree 2 costs one ct x ct multiplication, degree 4 two).

:func:`fit_polynomial` is the pure weight math: the least-squares coefficients of a function on sample points.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["PolyActivation", "fit_polynomial", "power_tree"]


def fit_polynomial(u: np.ndarray, target: np.ndarray, degree: int) -> np.ndarray:
    """Least-squares coefficients ``c_0..c_degree`` of ``sum_k c_k u^k`` against ``target`` at the points ``u``.

    Fitting on samples of the activation's real inputs weighs the error where the data lies, not uniformly.
    """
    if degree < 1:
        raise ValueError(f"degree must be >= 1, got {degree}")
    u = np.asarray(u, dtype=np.float64).ravel()
    target = np.asarray(target, dtype=np.float64).ravel()
    if u.size != target.size or u.size < degree + 1:
        raise ValueError(f"need at least {degree + 1} matching points to fit degree {degree}, got {u.size}")
    design = np.vander(u, degree + 1, increasing=True)
    coeffs, *_ = np.linalg.lstsq(design, target, rcond=None)
    return coeffs


def power_tree(u: Tensor, degree: int) -> list[Tensor]:
    """``[u, u^2, ..., u^degree]``, each power the product of two lower ones (ct x ct depth ceil(log2 k))."""
    powers = [u]
    for k in range(2, degree + 1):
        half = k // 2
        powers.append(powers[half - 1] * powers[k - half - 1])
    return powers


class PolyActivation(nn.Module):
    """``sum_k coeffs[k] * (x / scale)^k``; ``replaces`` names the activation it stands in for (for reports)."""

    def __init__(self, coeffs: np.ndarray | Tensor | list[float], scale: float = 1.0, replaces: str = "") -> None:
        super().__init__()
        coeffs = torch.as_tensor(np.asarray(coeffs, dtype=np.float32))
        if coeffs.ndim != 1 or coeffs.numel() < 2:
            raise ValueError("coeffs must be a vector c_0..c_d with d >= 1")
        if not np.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be positive and finite, got {scale}")
        self.coeffs = nn.Parameter(coeffs.clone())
        self.register_buffer("scale", torch.tensor(float(scale)))
        self.replaces = replaces

    @property
    def degree(self) -> int:
        return self.coeffs.numel() - 1

    def forward(self, x: Tensor) -> Tensor:
        u = x * (1.0 / self.scale)
        out = self.coeffs[0] + self.coeffs[1] * u
        for k, power in enumerate(power_tree(u, self.degree)[1:], start=2):
            out = out + self.coeffs[k] * power
        return out

    def extra_repr(self) -> str:
        coeffs = ", ".join(f"{c:.4g}" for c in self.coeffs.detach().tolist())
        return f"degree={self.degree}, scale={float(self.scale):.4g}, coeffs=[{coeffs}], replaces={self.replaces!r}"
