"""Read an explicit polynomial off a small trained polynomial model (``polyfhe.symbolic(model, variables)``).

A polynomial network of degree D in n inputs *is* a polynomial with C(n + D, D) monomial coefficients per
output, so those coefficients are recovered exactly (to float64 rounding) by evaluating the model at enough
well-conditioned points and solving the linear system in the monomial basis. The degree comes from polyfhe's
degree analyzer (ONNX export) unless given. The fit is then verified on fresh points: a model that is not a
polynomial of that degree in these variables is refused rather than silently approximated. Small coefficients
are pruned relative to the largest one of each output, so that a learned vector field reads like the equations
it was trained on (``dx/dt = 1.56*x - 1.12*x*y``).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import sympy
import torch
from torch import nn

log = logging.getLogger(__name__)

Exponents = tuple[int, ...]
MAX_TERMS = 5000          # monomials per output above which the dense solve is refused
MAX_GRID_POINTS = 4096    # tensor Chebyshev grid up to this size, random points beyond


class SymbolicError(ValueError):
    """The model is not (provably or numerically) a polynomial of the requested degree in these variables."""


@dataclass(frozen=True)
class SymbolicResult:
    """Explicit polynomials recovered from a model, one per output.

    ``coefficients[i]`` holds the kept terms of output i (``{exponents: value}``, exponents in the order of
    ``variables``); ``all_coefficients[i]`` every monomial up to ``degree`` before pruning;
    ``largest_pruned[i]`` the largest dropped term (or None). ``max_rel_error`` is the verification error of
    the unpruned polynomials against the model on fresh points, relative to the largest output magnitude.
    """

    variables: tuple[str, ...]
    outputs: tuple[str, ...]
    degree: int
    prune: float
    coefficients: tuple[dict[Exponents, float], ...]
    all_coefficients: tuple[dict[Exponents, float], ...]
    largest_pruned: tuple[tuple[Exponents, float] | None, ...]
    max_rel_error: float

    @property
    def symbols(self) -> tuple[sympy.Symbol, ...]:
        return tuple(sympy.Symbol(v) for v in self.variables)

    def _expr(self, coeffs: Mapping[Exponents, float]) -> sympy.Expr:
        return sympy.Add(*(sympy.Float(c) * _monomial(self.symbols, e) for e, c in coeffs.items()))

    @property
    def expressions(self) -> tuple[sympy.Expr, ...]:
        """The pruned polynomials as sympy expressions."""
        return tuple(self._expr(c) for c in self.coefficients)

    @property
    def all_expressions(self) -> tuple[sympy.Expr, ...]:
        """The unpruned polynomials (every monomial up to ``degree``)."""
        return tuple(self._expr(c) for c in self.all_coefficients)

    def equations(self) -> dict[str, sympy.Expr]:
        return dict(zip(self.outputs, self.expressions, strict=True))

    def _output_index(self, output: int | str) -> int:
        if isinstance(output, int):
            if not 0 <= output < len(self.outputs):
                raise ValueError(f"output index {output} out of range 0..{len(self.outputs) - 1}")
            return output
        if output not in self.outputs:
            raise ValueError(f"unknown output {output!r}; outputs are {list(self.outputs)}")
        return self.outputs.index(output)

    def exponents(self, monomial: str | Sequence[int]) -> Exponents:
        """Exponent tuple of a monomial given as text (``"x*y"``, ``"x**3"``, ``"1"``) or as exponents."""
        if not isinstance(monomial, str):
            exps = tuple(int(e) for e in monomial)
            if len(exps) != len(self.variables) or min(exps, default=0) < 0:
                raise ValueError(f"exponents {monomial!r} must be {len(self.variables)} non-negative integers")
            return exps
        symbols = self.symbols
        expr = sympy.sympify(monomial, locals={s.name: s for s in symbols})
        poly = sympy.Poly(expr, *symbols)
        terms = poly.terms()
        if len(terms) != 1 or terms[0][1] != 1:
            raise ValueError(f"{monomial!r} is not a single monomial in {list(self.variables)}")
        return tuple(int(e) for e in terms[0][0])

    def coefficient(self, output: int | str, monomial: str | Sequence[int], pruned: bool = True) -> float:
        """Coefficient of ``monomial`` in ``output`` (0.0 when pruned, unless ``pruned=False``)."""
        table = (self.coefficients if pruned else self.all_coefficients)[self._output_index(output)]
        return float(table.get(self.exponents(monomial), 0.0))

    def format(self, digits: int = 4) -> str:
        """One line per output, coefficients to ``digits`` significant digits."""
        lines = []
        for name, coeffs in zip(self.outputs, self.coefficients, strict=True):
            lines.append(f"{name} = {_format_poly(self.symbols, coeffs, digits)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        def table(coeffs: Mapping[Exponents, float]) -> list[list[Any]]:
            return [[list(e), float(c)] for e, c in coeffs.items()]

        return {
            "variables": list(self.variables), "outputs": list(self.outputs), "degree": self.degree,
            "prune": self.prune, "coefficients": [table(c) for c in self.coefficients],
            "all_coefficients": [table(c) for c in self.all_coefficients],
            "largest_pruned": [None if p is None else [list(p[0]), p[1]] for p in self.largest_pruned],
            "max_rel_error": self.max_rel_error,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SymbolicResult:
        def table(rows: Sequence[Sequence[Any]]) -> dict[Exponents, float]:
            return {tuple(int(e) for e in row[0]): float(row[1]) for row in rows}

        return cls(
            variables=tuple(data["variables"]), outputs=tuple(data["outputs"]), degree=int(data["degree"]),
            prune=float(data["prune"]), coefficients=tuple(table(t) for t in data["coefficients"]),
            all_coefficients=tuple(table(t) for t in data["all_coefficients"]),
            largest_pruned=tuple(None if p is None else (tuple(int(e) for e in p[0]), float(p[1]))
                                 for p in data["largest_pruned"]),
            max_rel_error=float(data["max_rel_error"]),
        )


def _monomial(symbols: Sequence[sympy.Symbol], exps: Exponents) -> sympy.Expr:
    return sympy.Mul(*(s**e for s, e in zip(symbols, exps, strict=True) if e))


def _format_poly(symbols: Sequence[sympy.Symbol], coeffs: Mapping[Exponents, float], digits: int) -> str:
    parts: list[str] = []
    for exps, value in coeffs.items():
        magnitude = f"{abs(value):.{digits}g}"
        if any(exps):
            mono = sympy.sstr(_monomial(symbols, exps))
            term = mono if magnitude == "1" else f"{magnitude}*{mono}"
        else:
            term = magnitude
        sign = "-" if value < 0 else "+"
        parts.append(f"{sign} {term}" if parts else (f"-{term}" if sign == "-" else term))
    return " ".join(parts) if parts else "0"


def monomial_exponents(n_vars: int, degree: int) -> list[Exponents]:
    """Every monomial of total degree <= ``degree`` in ``n_vars`` variables, by degree then variable order."""
    out: list[Exponents] = []
    for d in range(degree + 1):
        for combo in itertools.combinations_with_replacement(range(n_vars), d):
            exps = [0] * n_vars
            for i in combo:
                exps[i] += 1
            out.append(tuple(exps))
    return out


def _vandermonde(points: np.ndarray, monomials: Sequence[Exponents]) -> np.ndarray:
    exps = np.asarray(monomials, dtype=np.int64)  # (M, n)
    return np.prod(points[:, None, :] ** exps[None, :, :], axis=-1)


def _sample_points(n_vars: int, degree: int, n_terms: int, bounds: tuple[float, float],
                   rng: np.random.Generator) -> np.ndarray:
    """A tensor Chebyshev grid (unisolvent and well conditioned) when small enough, else oversampled randoms."""
    lo, hi = bounds
    per_axis = degree + 2
    if per_axis**n_vars <= MAX_GRID_POINTS:
        k = np.arange(per_axis)
        nodes = np.cos((2 * k + 1) * np.pi / (2 * per_axis))
        grid = np.stack(np.meshgrid(*([nodes] * n_vars), indexing="ij"), axis=-1).reshape(-1, n_vars)
    else:
        grid = rng.uniform(-1.0, 1.0, size=(max(3 * n_terms, n_terms + 16), n_vars))
    return lo + (grid + 1.0) * (hi - lo) / 2.0


class _FunctionModule(nn.Module):
    """Lets a plain callable go through the ONNX exporter (to ask the analyzer for its degree)."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def analyzed_degree(model: nn.Module | Callable, n_vars: int) -> int:
    """Total degree of ``model`` in its ``n_vars`` inputs, from the ONNX export and polyfhe's analyzer."""
    from polyfhe.exporters.onnx import ExportError, export_onnx

    module = model if isinstance(model, nn.Module) else _FunctionModule(model)
    with tempfile.TemporaryDirectory(prefix="polyfhe-symbolic-") as tmp:
        try:
            report = export_onnx(module, Path(tmp) / "model.onnx", input_shape=(n_vars,), fold_first=True,
                                 require_polynomial=False, rtol=1e-3).analysis
        except (ExportError, RuntimeError, TypeError) as exc:
            raise SymbolicError(
                f"could not export the model to ONNX to find its degree ({exc}); pass degree= explicitly"
            ) from exc
    if not report.polynomial or report.degree is None:
        offenders = ", ".join(f"{v.node} ({v.op})" for v in report.violations[:5])
        raise SymbolicError(f"the model is not polynomial in its input: {offenders}")
    return int(report.degree)


def _evaluate(model: nn.Module | Callable, points: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.as_tensor(points, dtype=torch.float64))
    out = out.detach().cpu().numpy() if torch.is_tensor(out) else np.asarray(out)
    out = out.astype(np.float64).reshape(len(points), -1)
    return out


def symbolic(
    model: nn.Module | Callable,
    variables: str | Sequence[str] = ("x", "y"),
    degree: int | None = None,
    prune: float = 1e-2,
    *,
    outputs: Sequence[str] | None = None,
    bounds: tuple[float, float] = (-1.0, 1.0),
    rtol: float = 1e-8,
    seed: int = 0,
) -> SymbolicResult:
    """Expand ``model`` ((B, n_vars) -> (B, n_out), a module or a torch callable) into explicit polynomials.

    ``degree`` defaults to the analyzer's degree of the ONNX export. Coefficients are solved from float64
    evaluations on ``bounds``^n and verified on fresh points (relative error <= ``rtol``, else
    :class:`SymbolicError`). Terms with ``|c| < prune * max|c|`` of their output are dropped (``prune=0``
    keeps all). ``outputs`` names the outputs; default ``d<var>/dt`` when there are as many outputs as
    variables (a vector field), else ``y0, y1, ...``.
    """
    names = tuple(str(s) for s in (sympy.symbols(variables, seq=True) if isinstance(variables, str)
                                   else variables))
    if not names or len(set(names)) != len(names):
        raise ValueError(f"variables must be distinct names, got {variables!r}")
    if not 0.0 <= prune < 1.0:
        raise ValueError(f"prune={prune} must lie in [0, 1): the fraction of each output's largest coefficient")
    lo, hi = (float(b) for b in bounds)
    if not hi > lo:
        raise ValueError(f"bounds={bounds} must be (low, high) with low < high")
    n = len(names)
    if isinstance(model, nn.Module):
        model = copy.deepcopy(model).double().eval()
    elif not callable(model):
        raise TypeError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    if degree is None:
        degree = analyzed_degree(model, n)
    if degree < 0:
        raise ValueError(f"degree={degree} must be >= 0")
    monomials = monomial_exponents(n, degree)
    if len(monomials) > MAX_TERMS:
        raise SymbolicError(f"degree {degree} in {n} variables has {len(monomials)} monomials per output "
                            f"(limit {MAX_TERMS}); pass a smaller degree= or fewer variables")
    rng = np.random.default_rng(seed)
    points = _sample_points(n, degree, len(monomials), (lo, hi), rng)
    values = _evaluate(model, points)
    design = _vandermonde(points, monomials)
    norms = np.linalg.norm(design, axis=0)
    solution, *_ = np.linalg.lstsq(design / norms, values, rcond=None)
    coeffs = solution / norms[:, None]  # (M, n_out)

    fresh = rng.uniform(lo, hi, size=(max(64, len(monomials)), n))
    expected = _evaluate(model, fresh)
    got = _vandermonde(fresh, monomials) @ coeffs
    scale = max(float(np.abs(expected).max()), 1e-300)
    rel = float(np.abs(got - expected).max() / scale) if np.isfinite(got).all() else math.inf
    if not rel <= rtol:
        raise SymbolicError(
            f"the model is not a polynomial of degree <= {degree} in {list(names)} on {list(bounds)}^{n}: the "
            f"best such polynomial is off by {rel:.2e} (relative) on fresh points, above rtol={rtol:.0e}. Check "
            "degree=, the number of variables, that no non-polynomial op is inside, and that a callable "
            "computes in float64"
        )
    n_out = coeffs.shape[1]
    if outputs is None:
        outputs = tuple(f"d{v}/dt" for v in names) if n_out == n else tuple(f"y{i}" for i in range(n_out))
    outputs = tuple(outputs)
    if len(outputs) != n_out:
        raise ValueError(f"{len(outputs)} output names given for {n_out} model outputs")

    kept, full, dropped = [], [], []
    for j in range(n_out):
        column = {e: float(c) for e, c in zip(monomials, coeffs[:, j], strict=True)}
        threshold = prune * max((abs(c) for c in column.values()), default=0.0)
        kept.append({e: c for e, c in column.items() if abs(c) >= threshold and c != 0.0})
        pruned = [(e, c) for e, c in column.items() if e not in kept[-1]]
        dropped.append(max(pruned, key=lambda ec: abs(ec[1])) if pruned else None)
        full.append(column)
    result = SymbolicResult(names, outputs, int(degree), float(prune), tuple(kept), tuple(full),
                            tuple(dropped), rel)
    log.info("symbolic: degree %d, %d monomials per output, verification error %.2e\n%s",
             degree, len(monomials), rel, result)
    return result


__all__ = ["SymbolicError", "SymbolicResult", "analyzed_degree", "monomial_exponents", "symbolic"]
