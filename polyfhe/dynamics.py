"""Learn polynomial vector fields from trajectories, so :func:`polyfhe.symbolic` can read the equations off.

Two ways to fit, both differentiable end to end in torch:

* :func:`fit_neural_ode`: the model *is* the vector field ``f``; from every observed state a fixed-step RK4
  integration predicts the next ``horizon`` observations (multiple shooting), and the loss is on those.
* :func:`fit_discrete_map`: the model learns the map ``x_k -> x_{k+1}`` from pairs; :class:`RK4Map` makes that
  map one (or a few) RK4 steps of a learned vector field, so the field stays a small polynomial to extract.

Adam first (robust from a random start), then L-BFGS in float64 (drives the fit to the precision at which
coefficients are readable to 1% and better). Trajectories of known systems come from scipy's ``solve_ivp``
with tight tolerances (:func:`simulate`, :func:`lotka_volterra`, :func:`duffing`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from scipy.integrate import solve_ivp
from torch import nn

log = logging.getLogger(__name__)

Field = Callable[[torch.Tensor], torch.Tensor]
LBFGS_ROUND = 250  # L-BFGS iterations per round (see _run_optimisers)


# ---------------------------------------------------------------------------------------------- systems
def lotka_volterra(alpha: float = 1.56, beta: float = 1.12, gamma: float = 3.10, delta: float = 1.21):
    """``dx/dt = alpha x - beta x y``, ``dy/dt = -gamma y + delta x y`` (defaults: the MONet paper's system)."""

    def rhs(t: float, z: np.ndarray) -> np.ndarray:
        x, y = z
        return np.array([alpha * x - beta * x * y, -gamma * y + delta * x * y])

    return rhs


def duffing(alpha: float = 1.0, beta: float = 1.0):
    """Unforced, undamped Duffing oscillator ``x1' = x2``, ``x2' = alpha x1 - beta x1^3`` (TaylorNet paper)."""

    def rhs(t: float, z: np.ndarray) -> np.ndarray:
        x1, x2 = z
        return np.array([x2, alpha * x1 - beta * x1**3])

    return rhs


def simulate(rhs, x0, t_eval, rtol: float = 1e-11, atol: float = 1e-12) -> np.ndarray:
    """States at ``t_eval`` (shape (T, n)) of ``rhs(t, z)`` from ``x0``, with DOP853 at tight tolerances."""
    t_eval = np.asarray(t_eval, dtype=np.float64)
    sol = solve_ivp(rhs, (float(t_eval[0]), float(t_eval[-1])), np.asarray(x0, dtype=np.float64),
                    method="DOP853", t_eval=t_eval, rtol=rtol, atol=atol)
    if not sol.success:
        raise RuntimeError(f"solve_ivp failed: {sol.message}")
    return sol.y.T.copy()


def simulate_many(rhs, initial_states, steps: int, dt: float, **tolerances) -> np.ndarray:
    """Trajectories (N, steps + 1, n) from each row of ``initial_states``, sampled every ``dt``."""
    t_eval = np.arange(steps + 1) * dt
    return np.stack([simulate(rhs, x0, t_eval, **tolerances) for x0 in np.asarray(initial_states)])


def transition_pairs(trajectories: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive states ``(x_k, x_{k+1})`` of (N, T, n) trajectories, each of shape (N * (T - 1), n)."""
    n = trajectories.shape[-1]
    return trajectories[:, :-1].reshape(-1, n), trajectories[:, 1:].reshape(-1, n)


# ---------------------------------------------------------------------------------------------- RK4
def rk4_step(field: Field, x: torch.Tensor, dt: torch.Tensor | float) -> torch.Tensor:
    """One classical Runge-Kutta step of the autonomous field ``x' = field(x)``; ``dt`` scalar or (B, 1)."""
    k1 = field(x)
    k2 = field(x + 0.5 * dt * k1)
    k3 = field(x + 0.5 * dt * k2)
    k4 = field(x + dt * k3)
    return x + dt / 6.0 * (k1 + 2.0 * k2 + 2.0 * k3 + k4)


def rk4_flow(field: Field, x: torch.Tensor, dt: torch.Tensor | float, substeps: int = 1) -> torch.Tensor:
    """``x`` advanced by ``dt`` with ``substeps`` equal RK4 steps (the learned map of one interval)."""
    h = dt / substeps
    for _ in range(substeps):
        x = rk4_step(field, x, h)
    return x


class RK4Map(nn.Module):
    """The discrete map ``x_k -> x_{k+1}`` as ``substeps`` RK4 steps of the vector field ``field`` over ``dt``.

    Extract ``model.field`` (degree d), not the map itself (degree d^4 per step).
    """

    def __init__(self, field: nn.Module, dt: float, substeps: int = 1) -> None:
        super().__init__()
        if dt <= 0 or substeps < 1:
            raise ValueError(f"RK4Map needs dt > 0 and substeps >= 1, got dt={dt}, substeps={substeps}")
        self.field, self.dt, self.substeps = field, float(dt), int(substeps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rk4_flow(self.field, x, self.dt, self.substeps)


# ---------------------------------------------------------------------------------------------- models
class HadamardField(nn.Module):
    """Degree-2 polynomial network ``C((A z + a) * (B z + b)) + D z + d``: a tiny Mu-Layer without norms.

    The only non-linearity is the Hadamard product, so the analyzer proves degree 2 and
    :func:`polyfhe.symbolic` expands it exactly.
    """

    def __init__(self, n: int, hidden: int = 8, seed: int = 0, init_scale: float = 0.5) -> None:
        super().__init__()
        if n < 1 or hidden < 1:
            raise ValueError(f"HadamardField needs n >= 1 and hidden >= 1, got n={n}, hidden={hidden}")
        self.left, self.right = nn.Linear(n, hidden), nn.Linear(n, hidden)
        self.out, self.skip = nn.Linear(hidden, n), nn.Linear(n, n)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in (self.left, self.right, self.out, self.skip):
                fan_in = layer.weight.shape[1]
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * init_scale / fan_in**0.5)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * init_scale)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.out(self.left(z) * self.right(z)) + self.skip(z)


# ---------------------------------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class FitConfig:
    """Optimiser schedule shared by both fits. ``horizon`` (neural ODE only): intervals rolled out per start.

    ``threads``: torch intra-op threads during the fit (restored afterwards). These problems are tiny, so one
    thread is fastest: thread hand-offs cost more than they save, and far more on a shared, busy machine.
    ``None`` leaves torch's setting alone.
    """

    adam_steps: int = 500
    lr: float = 1e-2
    lbfgs_steps: int = 200
    substeps: int = 4
    horizon: int = 1
    dtype: torch.dtype = torch.float64
    threads: int | None = 1

    def __post_init__(self) -> None:
        if self.adam_steps < 0 or self.lbfgs_steps < 0 or self.adam_steps + self.lbfgs_steps == 0:
            raise ValueError(f"need adam_steps, lbfgs_steps >= 0 and at least one step, got {self}")
        if self.substeps < 1 or self.horizon < 1 or not self.lr > 0:
            raise ValueError(f"substeps and horizon must be >= 1 and lr > 0, got {self}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be None or >= 1, got {self.threads}")


@dataclass(frozen=True)
class FitResult:
    """Losses (mean squared error) after the Adam phase and at the end; ``steps``: Adam + L-BFGS iterations run."""

    adam_loss: float
    final_loss: float
    steps: int


@contextmanager
def _threads(count: int | None) -> Iterator[None]:
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _optimise(params: list[nn.Parameter], loss_fn: Callable[[], torch.Tensor], cfg: FitConfig) -> FitResult:
    with _threads(cfg.threads):
        return _run_optimisers(params, loss_fn, cfg)


def _lbfgs_round(params: list[nn.Parameter], loss_fn: Callable[[], torch.Tensor], iterations: int) -> int:
    """Up to ``iterations`` L-BFGS iterations with a fresh history; returns how many ran (at least 1)."""
    lbfgs = torch.optim.LBFGS(params, lr=1.0, max_iter=iterations, history_size=50, tolerance_grad=1e-14,
                              tolerance_change=1e-18, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        value = loss_fn()
        value.backward()
        return value

    lbfgs.step(closure)
    return max(1, int(lbfgs.state[params[0]].get("n_iter", 1)))


def _run_optimisers(params: list[nn.Parameter], loss_fn: Callable[[], torch.Tensor], cfg: FitConfig) -> FitResult:
    adam = torch.optim.Adam(params, lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(adam, T_max=max(cfg.adam_steps, 1))
    loss = loss_fn().detach()
    for _ in range(cfg.adam_steps):
        adam.zero_grad()
        loss = loss_fn()
        loss.backward()
        adam.step()
        sched.step()
    adam_loss = float(loss.detach())
    remaining = cfg.lbfgs_steps
    best = adam_loss
    while remaining > 0:
        # Rounds with a fresh curvature history: one long run can stall on a stale history (or its evaluation
        # cap) far above the optimum, and a restart from there converges. Stop when a round gains nothing.
        remaining -= _lbfgs_round(params, loss_fn, min(remaining, LBFGS_ROUND))
        with torch.no_grad():
            current = float(loss_fn())
        if not current < best * (1.0 - 1e-3):
            break
        best = current
    with torch.no_grad():
        final = float(loss_fn())
    log.info("fit: loss %.3e after Adam, %.3e after L-BFGS", adam_loss, final)
    return FitResult(adam_loss, final, cfg.adam_steps + cfg.lbfgs_steps - max(remaining, 0))


def fit_neural_ode(field: nn.Module, t: np.ndarray, states: np.ndarray, cfg: FitConfig = FitConfig()) -> FitResult:
    """Fit ``field`` (the vector field, trained in place) to one trajectory ``states`` (T, n) at times ``t``.

    From every observation ``k`` the RK4 flow over the next ``cfg.horizon`` observation intervals is compared
    with the data (mean squared error); non-uniform times are fine.
    """
    t = np.asarray(t, dtype=np.float64)
    states = np.asarray(states, dtype=np.float64)
    if states.ndim != 2 or len(states) != len(t) or len(t) < 2:
        raise ValueError(f"need states (T, n) matching times (T,), T >= 2; got {states.shape} and {t.shape}")
    if cfg.horizon >= len(t):
        raise ValueError(f"horizon={cfg.horizon} must be < the number of observations ({len(t)})")
    field.to(cfg.dtype).train()
    y = torch.as_tensor(states, dtype=cfg.dtype)
    dts = torch.as_tensor(np.diff(t), dtype=cfg.dtype)
    starts = len(t) - cfg.horizon

    def loss_fn() -> torch.Tensor:
        x = y[:starts]
        total = y.new_zeros(())
        for j in range(cfg.horizon):
            x = rk4_flow(field, x, dts[j:j + starts, None], cfg.substeps)
            total = total + ((x - y[j + 1:j + 1 + starts]) ** 2).mean()
        return total / cfg.horizon

    result = _optimise([p for p in field.parameters() if p.requires_grad], loss_fn, cfg)
    field.eval()
    return result


def fit_discrete_map(model: nn.Module, x: np.ndarray, x_next: np.ndarray, cfg: FitConfig = FitConfig()) -> FitResult:
    """Fit ``model`` (trained in place; e.g. an :class:`RK4Map`) to the pairs ``x -> x_next`` (each (N, n))."""
    x_t = torch.as_tensor(np.asarray(x), dtype=cfg.dtype)
    target = torch.as_tensor(np.asarray(x_next), dtype=cfg.dtype)
    if x_t.shape != target.shape or x_t.ndim != 2:
        raise ValueError(f"need pairs of equal shape (N, n); got {tuple(x_t.shape)} and {tuple(target.shape)}")
    model.to(cfg.dtype).train()

    def loss_fn() -> torch.Tensor:
        return ((model(x_t) - target) ** 2).mean()

    result = _optimise([p for p in model.parameters() if p.requires_grad], loss_fn, cfg)
    model.eval()
    return result


__all__ = [
    "FitConfig", "FitResult", "HadamardField", "RK4Map", "duffing", "fit_discrete_map", "fit_neural_ode",
    "lotka_volterra", "rk4_flow", "rk4_step", "simulate", "simulate_many", "transition_pairs",
]
