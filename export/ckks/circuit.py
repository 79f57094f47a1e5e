"""The compiler's middle IR: flat registers joined by affine maps and ct x ct products.

A :class:`Circuit` is what is left of a polynomial ONNX graph once every linear op is merged: each register
holds one flattened tensor, each :class:`LinearNode` costs one CKKS level (plaintext multiply + rescale),
each :class:`MulNode` one level (ct x ct + relinearise + rescale). ``evaluate`` runs it in float64 numpy, the
reference both layouts are checked against and the source of calibrated value ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Circuit", "LinearNode", "MatMulNode", "MulNode", "node_reads"]


@dataclass
class LinearNode:
    """``out = sum_j matrices[j] @ inputs[j] + bias`` (matrices are ``(size, n_j)``, sparse or dense)."""

    out: int
    inputs: list[int]
    matrices: list[np.ndarray]
    bias: np.ndarray | None
    size: int
    label: str = ""


@dataclass
class MulNode:
    """Elementwise ``out = a * b`` (``a == b`` is a square)."""

    out: int
    a: int
    b: int
    size: int
    label: str = ""


@dataclass
class MatMulNode:
    """``out = a @ b`` of two encrypted tensors (shapes ``(..., M, K)`` and ``(..., K, N)``, flattened)."""

    out: int
    a: int
    b: int
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    size: int
    label: str = ""


Node = LinearNode | MulNode | MatMulNode


def node_reads(node) -> list[int]:
    """The registers a circuit node reads: a linear map's inputs, or a product's two operands."""
    return list(node.inputs) if isinstance(node, LinearNode) else [node.a, node.b]


@dataclass
class Circuit:
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    nodes: list[Node] = field(default_factory=list)
    sizes: dict[int, int] = field(default_factory=dict)
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)  # register -> ONNX tensor shape
    output: int = 0
    # replicated input packing (``replicate.py``): register 0 holds the flat input's elements ``input_gather``
    # (some more than once) at slots ``input_slots``; None: register 0 is the flat input itself
    input_gather: np.ndarray | None = None
    input_slots: np.ndarray | None = None
    # the single layout's ct x ct MatMuls: per MatMul, the algorithm chosen and the candidates' costs
    matmuls: list[dict] = field(default_factory=list)
    lowering_peak_bytes: int = 0  # the most bytes of affine terms the lowering held at once (``memory.py``)

    @property
    def input_size(self) -> int:
        """Values per sample the client gives (register 0 may hold more: a replicated packing)."""
        return int(np.prod(self.input_shape)) if self.input_gather is not None else self.sizes[0]

    @property
    def output_size(self) -> int:
        return self.sizes[self.output]

    def levels(self) -> dict[int, int]:
        """Rescales consumed on the longest path to every register (the input is at 0)."""
        level = {0: 0}
        for node in self.nodes:
            level[node.out] = max(level[i] for i in node_reads(node)) + 1
        return level

    def degrees(self) -> dict[int, int]:
        degree = {0: 1}
        for node in self.nodes:
            if isinstance(node, LinearNode):
                degree[node.out] = max(degree[i] for i in node.inputs)
            else:
                degree[node.out] = degree[node.a] + degree[node.b]
        return degree

    @property
    def depth(self) -> int:
        return self.levels()[self.output]

    def max_size(self) -> int:
        return max(self.sizes.values())

    def evaluate(self, x: np.ndarray, keep: bool = False,
                 perturb: Callable[[int, np.ndarray], np.ndarray] | None = None) -> np.ndarray | dict[int, np.ndarray]:
        """Run on plaintext ``x`` of shape ``(batch, *input_shape)`` or ``(batch, input_size)`` in float64.
        ``perturb(register, values)``: what a register holds instead of its exact values (a noise model)."""
        regs = {0: np.asarray(x, dtype=np.float64).reshape(len(x), -1)}
        if self.input_gather is not None:
            regs[0] = regs[0][:, self.input_gather]
        if perturb is not None:
            regs[0] = perturb(0, regs[0])
        for node in self.nodes:
            regs[node.out] = _EVAL[type(node)](node, regs)
            if perturb is not None:
                regs[node.out] = perturb(node.out, regs[node.out])
        return regs if keep else regs[self.output]

    def value_ranges(self, x: np.ndarray) -> dict[int, float]:
        """Max |value| of every register on the calibration batch ``x`` (the shared range reduction)."""
        from polyfhe.calibration.reduction import RangeProfile

        profile: RangeProfile[int] = RangeProfile()
        for reg, values in self.evaluate(x, keep=True).items():
            profile.observe(reg, values)
        return profile.abs_max()


def _eval_linear(node: LinearNode, regs: dict[int, np.ndarray]) -> np.ndarray:
    out = sum(np.asarray(m @ regs[i].T).T for i, m in zip(node.inputs, node.matrices, strict=True))
    return out + node.bias if node.bias is not None else out


def _eval_mul(node: MulNode, regs: dict[int, np.ndarray]) -> np.ndarray:
    return regs[node.a] * regs[node.b]


def _eval_matmul(node: MatMulNode, regs: dict[int, np.ndarray]) -> np.ndarray:
    batch = len(regs[node.a])
    a = regs[node.a].reshape((batch, *node.a_shape))
    b = regs[node.b].reshape((batch, *node.b_shape))
    return np.matmul(a, b).reshape(batch, -1)


_EVAL = {LinearNode: _eval_linear, MulNode: _eval_mul, MatMulNode: _eval_matmul}
