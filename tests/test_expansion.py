"""``polyfhe.symbolic``: exact expansion of polynomial models, refusal of non-polynomials, pruning, and the
two equation recoveries of issue 17 (Lotka-Volterra as a polynomial neural ODE, Duffing with a TaylorNet map).
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy
import torch
from torch import nn

import polyfhe
from polyfhe.dynamics import (
    FitConfig,
    HadamardField,
    RK4Map,
    duffing,
    fit_discrete_map,
    fit_neural_ode,
    lotka_volterra,
    rk4_flow,
    simulate,
    simulate_many,
    transition_pairs,
)
from polyfhe.expansion import SymbolicError, SymbolicResult, symbolic
from polyfhe.models.layers.taylor import TaylorLayer

X, Y = sympy.symbols("x y")


def _sympy_linear(layer: nn.Linear, z: sympy.Matrix) -> sympy.Matrix:
    """``W z + b`` with the layer's float weights as exact rationals (an independent, exact expansion)."""
    w = sympy.Matrix(layer.weight.detach().double().tolist()).applyfunc(sympy.nsimplify)
    b = sympy.Matrix(layer.bias.detach().double().tolist()).applyfunc(sympy.nsimplify)
    return w * z + b


def _dyadic_weights(module: nn.Module, seed: int) -> None:
    """Weights that are small dyadic rationals, so the hand expansion is exact and float evaluation is too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=gen).double() / 4)


def _check_against(result: SymbolicResult, expected: list[sympy.Expr], tol: float = 1e-10) -> None:
    for got_coeffs, want in zip(result.all_coefficients, expected, strict=True):
        want_poly = sympy.Poly(sympy.expand(want), X, Y)
        want_coeffs = {tuple(m): float(c) for m, c in want_poly.terms()}
        scale = max(abs(c) for c in want_coeffs.values())
        for exps, value in got_coeffs.items():
            assert abs(value - want_coeffs.get(exps, 0.0)) <= tol * scale, (exps, value, want_coeffs.get(exps))
        assert set(want_coeffs) <= set(got_coeffs)


def test_hadamard_network_equals_hand_expansion() -> None:
    net = HadamardField(2, hidden=3).double()
    _dyadic_weights(net, seed=1)
    z = sympy.Matrix([X, Y])
    hand = _sympy_linear(net.out, _sympy_linear(net.left, z).multiply_elementwise(_sympy_linear(net.right, z)))
    hand = hand + _sympy_linear(net.skip, z)
    result = symbolic(net, variables=("x", "y"), prune=0.0)
    assert result.degree == 2  # from the ONNX analyzer, not given
    assert result.max_rel_error < 1e-12
    _check_against(result, list(hand))
    # The sympy expressions are the same polynomials (to float rounding) as the hand expansion.
    for expr, want in zip(result.all_expressions, hand, strict=True):
        diff = sympy.Poly(sympy.expand(expr - want), X, Y)
        assert max(abs(float(c)) for c in diff.coeffs()) < 1e-10


class _Cubic(nn.Module):
    """A degree-3 network: (A z + a) * (B z + b) * (C z + c) summed by a last linear map."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.out = nn.Linear(2, 3), nn.Linear(2, 3), nn.Linear(2, 3), nn.Linear(3, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(z) * self.b(z) * self.c(z))


def test_cubic_network_and_too_low_degree() -> None:
    net = _Cubic().double()
    _dyadic_weights(net, seed=2)
    z = sympy.Matrix([X, Y])
    prod = _sympy_linear(net.a, z).multiply_elementwise(_sympy_linear(net.b, z))
    hand = _sympy_linear(net.out, prod.multiply_elementwise(_sympy_linear(net.c, z)))
    result = symbolic(net, variables="x y", prune=0.0, outputs=("p",))
    assert result.degree == 3 and result.outputs == ("p",)
    _check_against(result, list(hand))
    with pytest.raises(SymbolicError, match="not a polynomial of degree <= 2"):
        symbolic(net, variables="x y", degree=2)


def _lv_field(z: torch.Tensor) -> torch.Tensor:
    x, y = z[:, 0], z[:, 1]
    return torch.stack([1.56 * x - 1.12 * x * y, -3.10 * y + 1.21 * x * y], dim=-1)


def test_callable_degree_from_analyzer_and_readable_str() -> None:
    result = symbolic(_lv_field)
    assert result.degree == 2
    assert str(result) == "dx/dt = 1.56*x - 1.12*x*y\ndy/dt = -3.1*y + 1.21*x*y"
    assert result.coefficient("dy/dt", "x*y") == pytest.approx(1.21, rel=1e-12)
    assert result.coefficient(0, (1, 0)) == pytest.approx(1.56, rel=1e-12)
    assert result.coefficient("dx/dt", "y**2") == 0.0
    assert result.equations()["dx/dt"].free_symbols == {X, Y}
    assert polyfhe.symbolic(_lv_field) == result  # the public name (module and function) is callable


def test_non_polynomial_callable_is_refused() -> None:
    with pytest.raises(SymbolicError, match="not a polynomial of degree <= 3"):
        symbolic(torch.tanh, variables=("x", "y"), degree=3)
    with pytest.raises(SymbolicError, match="Tanh"):  # the analyzer names the offending op
        symbolic(torch.tanh, variables=("x", "y"))


def test_pruning_keeps_largest_dropped_and_unpruned() -> None:
    def poly(z: torch.Tensor) -> torch.Tensor:
        x, y = z[:, 0], z[:, 1]
        return (2.0 * x + 1.0 * x * y - 0.018 * y**2 + 0.04 * x**2)[:, None]

    result = symbolic(poly, variables=("x", "y"), degree=2, prune=1e-2)  # threshold 0.02
    kept = result.coefficients[0]
    assert set(kept) == {(1, 0), (1, 1), (2, 0)}
    exps, value = result.largest_pruned[0]
    assert exps == (0, 2) and value == pytest.approx(-0.018, rel=1e-9)
    assert result.coefficient(0, "y**2") == 0.0
    assert result.coefficient(0, "y**2", pruned=False) == pytest.approx(-0.018, rel=1e-9)
    assert len(result.all_coefficients[0]) == 6
    assert set(symbolic(poly, variables=("x", "y"), degree=2, prune=0.3).coefficients[0]) == {(1, 0), (1, 1)}
    assert SymbolicResult.from_dict(result.to_dict()) == result
    with pytest.raises(ValueError, match="prune"):
        symbolic(poly, degree=2, prune=1.5)
    with pytest.raises(ValueError, match="distinct"):
        symbolic(poly, variables=("x", "x"), degree=2)
    with pytest.raises(ValueError, match="single monomial"):
        result.coefficient(0, "x + y")


def _rotation(z: torch.Tensor) -> torch.Tensor:
    return torch.stack([-z[:, 1], z[:, 0]], dim=-1)  # exact flow over time t: rotation by t


def test_rk4_flow_is_fourth_order_accurate() -> None:
    x0 = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    exact = torch.tensor([[np.cos(1.0), np.sin(1.0)]], dtype=torch.float64)
    coarse = float((rk4_flow(_rotation, x0, 1.0, substeps=10) - exact).abs().max())
    fine = float((rk4_flow(_rotation, x0, 1.0, substeps=20) - exact).abs().max())
    assert fine < 1e-7 and 12.0 < coarse / fine < 20.0  # halving the step divides the error by ~2^4
    with pytest.raises(ValueError, match="substeps"):
        RK4Map(nn.Identity(), dt=0.1, substeps=0)
    with pytest.raises(ValueError, match="lr"):
        FitConfig(lr=0.0)


def _recovery_errors(result: SymbolicResult, truth: dict[tuple[str, str], float]) -> tuple[float, float]:
    """Worst relative coefficient error, and the largest term outside ``truth`` relative to its output's max."""
    worst = max(abs(result.coefficient(o, m) / v - 1.0) for (o, m), v in truth.items())
    spurious = 0.0
    for i, name in enumerate(result.outputs):
        wanted = {result.exponents(m) for (o, m) in truth if o == name}
        coeffs = result.all_coefficients[i]
        top = max(abs(c) for c in coeffs.values())
        spurious = max([spurious, *(abs(c) / top for e, c in coeffs.items() if e not in wanted)])
        assert set(result.coefficients[i]) == wanted, (name, result)
    return worst, spurious


def test_lotka_volterra_neural_ode_recovery() -> None:
    """MONet paper's system: 100 points on [0, 10] from (1, 1); a degree-2 Hadamard net as the neural ODE field."""
    t = np.linspace(0.0, 10.0, 100)
    states = simulate(lotka_volterra(), (1.0, 1.0), t)
    field = HadamardField(2, hidden=8, seed=0)
    fit = fit_neural_ode(field, t, states, FitConfig(adam_steps=200, lbfgs_steps=500, substeps=4))
    assert fit.final_loss < 1e-10
    result = symbolic(field, variables=("x", "y"))
    truth = {("dx/dt", "x"): 1.56, ("dx/dt", "x*y"): -1.12, ("dy/dt", "y"): -3.10, ("dy/dt", "x*y"): 1.21}
    worst, spurious = _recovery_errors(result, truth)
    assert worst < 1e-2 and spurious < 1e-2, (worst, spurious, result)


def test_duffing_taylornet_map_recovery() -> None:
    """TaylorNet paper's system: 100 trajectories from [-1, 1]^2; an order-3 TaylorLayer field inside one RK4 step."""
    rng = np.random.default_rng(0)
    trajectories = simulate_many(duffing(), rng.uniform(-1.0, 1.0, size=(100, 2)), steps=10, dt=0.1)
    x, x_next = transition_pairs(trajectories)
    torch.manual_seed(0)
    model = RK4Map(TaylorLayer(2, 2, order=3, rank=2), dt=0.1, substeps=1)
    fit = fit_discrete_map(model, x, x_next, FitConfig(adam_steps=200, lbfgs_steps=500))
    assert fit.final_loss < 1e-8
    result = symbolic(model.field, variables=("x1", "x2"))
    assert result.degree == 3
    truth = {("dx1/dt", "x2"): 1.0, ("dx2/dt", "x1"): 1.0, ("dx2/dt", "x1**3"): -1.0}
    worst, spurious = _recovery_errors(result, truth)
    assert worst < 1e-2 and spurious < 1e-2, (worst, spurious, result)
