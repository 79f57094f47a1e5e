"""Verified, not trusted: the analyzer's degree against sympy expansion and float64 finite differences."""

from __future__ import annotations

from math import comb

import numpy as np
import onnx
import pytest
from analysis_testlib import evaluate, input_shapes, make_model, node, random_dag, sympy_degree

from polyfhe.analysis import analyze

R = np.random.default_rng(1234)


def _ints(*shape: int) -> np.ndarray:
    return R.choice([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0], size=shape)


def _mu_layer() -> onnx.ModelProto:
    nodes = [
        node("MatMul", ["x", "W1"], "a"), node("Add", ["a", "b1"], "a1"),
        node("MatMul", ["x", "W2"], "c"), node("Add", ["c", "b2"], "c1"),
        node("Mul", ["a1", "c1"], "p"), node("MatMul", ["p", "W3"], "y"),
    ]
    inits = {"W1": _ints(3, 3), "W2": _ints(3, 3), "W3": _ints(3, 2), "b1": _ints(3), "b2": _ints(3)}
    return make_model(nodes, {"x": (1, 3)}, ["y"], inits)


def _pow3() -> onnx.ModelProto:
    return make_model([node("Pow", ["x", "k"], "y")], {"x": (1, 3)}, ["y"], {"k": np.array(3.0)})


def _affine_pow4_times_x() -> onnx.ModelProto:
    nodes = [
        node("MatMul", ["x", "W"], "h"), node("Add", ["h", "b"], "hb"),
        node("Pow", ["hb", "k"], "h4"), node("Mul", ["h4", "x"], "y"),
    ]
    return make_model(nodes, {"x": (1, 3)}, ["y"], {"W": _ints(3, 3), "b": _ints(3), "k": np.array(4, np.int64)})


def _matmul_ct_ct() -> onnx.ModelProto:
    nodes = [node("MatMul", ["X", "X"], "X2"), node("MatMul", ["X2", "X"], "X3"), node("Add", ["X3", "X"], "y")]
    return make_model(nodes, {"X": (2, 2)}, ["y", "X2"])


def _gemm_square() -> onnx.ModelProto:
    nodes = [node("Gemm", ["x", "W", "b"], "g", transB=1, alpha=0.5), node("Mul", ["g", "g"], "y")]
    return make_model(nodes, {"x": (1, 3)}, ["y"], {"W": _ints(2, 3), "b": _ints(2)})


def _div_then_square() -> onnx.ModelProto:
    nodes = [node("Div", ["x", "d"], "h"), node("Pow", ["h", "k"], "y")]
    return make_model(nodes, {"x": (1, 3)}, ["y"], {"d": np.array([2.0, 4.0, 8.0]), "k": np.array(2.0)})


def _concat_mix() -> onnx.ModelProto:
    nodes = [node("Mul", ["x", "x"], "xx"), node("Concat", ["x", "xx"], "cat", axis=1),
             node("MatMul", ["cat", "W"], "y")]
    return make_model(nodes, {"x": (1, 3)}, ["y"], {"W": _ints(6, 2)})


def _sum_of_powers() -> onnx.ModelProto:
    nodes = [node("Mul", ["x", "x"], "x2"), node("Pow", ["x", "k"], "x3"), node("Sum", ["x", "x2", "x3"], "y")]
    return make_model(nodes, {"x": (1, 3)}, ["y"], {"k": np.array(3, np.int64)})


def _neg_sub_identity() -> onnx.ModelProto:
    nodes = [node("Mul", ["x", "x"], "x2"), node("Neg", ["x"], "nx"), node("Identity", ["x2"], "i2"),
             node("Sub", ["i2", "nx"], "y")]
    return make_model(nodes, {"x": (1, 3)}, ["y"])


def _gram() -> onnx.ModelProto:
    nodes = [node("Transpose", ["X"], "Xt", perm=[1, 0]), node("MatMul", ["Xt", "X"], "G"),
             node("Reshape", ["G", "s"], "g"), node("MatMul", ["g", "W"], "h"), node("Mul", ["h", "h"], "y")]
    return make_model(nodes, {"X": (2, 3)}, ["y"], {"s": np.array([1, 9], np.int64), "W": _ints(9, 2)})


def _two_inputs() -> onnx.ModelProto:
    nodes = [node("Mul", ["x", "z"], "xz"), node("Mul", ["xz", "z"], "xzz"), node("Add", ["xzz", "x"], "y")]
    return make_model(nodes, {"x": (1, 2), "z": (1, 2)}, ["y"])


HAND_GRAPHS = {
    "mu_layer": (_mu_layer, 2),
    "pow3": (_pow3, 3),
    "affine_pow4_times_x": (_affine_pow4_times_x, 5),
    "matmul_ct_ct": (_matmul_ct_ct, 3),
    "gemm_square": (_gemm_square, 2),
    "div_then_square": (_div_then_square, 2),
    "concat_mix": (_concat_mix, 2),
    "sum_of_powers": (_sum_of_powers, 3),
    "neg_sub_identity": (_neg_sub_identity, 2),
    "gram": (_gram, 4),
    "two_inputs": (_two_inputs, 3),
}
RANDOM_SEEDS = list(range(12))


def _all_graphs() -> list[tuple[str, onnx.ModelProto]]:
    graphs = [(name, build()) for name, (build, _) in HAND_GRAPHS.items()]
    graphs += [(f"random_{seed}", random_dag(seed)[0]) for seed in RANDOM_SEEDS]
    return graphs


GRAPHS = _all_graphs()


@pytest.mark.parametrize("name", list(HAND_GRAPHS))
def test_hand_graph_degree_matches_sympy_and_expectation(name: str) -> None:
    build, expected = HAND_GRAPHS[name]
    model = build()
    report = analyze(model)
    assert report.polynomial, report.violations
    assert report.degree == sympy_degree(model) == expected


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_dag_degree_matches_sympy(seed: int) -> None:
    model, generator_degree = random_dag(seed)
    report = analyze(model)
    assert report.polynomial, report.violations
    assert report.degree == generator_degree
    assert report.degree == sympy_degree(model)


def test_random_dags_are_diverse() -> None:
    """Guard the generator: the seeds must exercise several ops and degrees, else the test proves little."""
    ops: set[str] = set()
    degrees = set()
    for seed in RANDOM_SEEDS:
        model, degree = random_dag(seed)
        ops |= {n.op_type for n in model.graph.node}
        degrees.add(degree)
    assert {"Add", "Sub", "Mul", "MatMul", "Pow", "Neg", "Identity"} <= ops
    assert len(degrees) >= 4


def _difference(values: list[np.ndarray], order: int) -> np.ndarray:
    """Forward difference of the given order at t = 0 from samples at t = 0, 1, ..., order."""
    return sum(((-1) ** (order - i)) * comb(order, i) * values[i] for i in range(order + 1))


@pytest.mark.parametrize("name, model", GRAPHS, ids=[g[0] for g in GRAPHS])
def test_finite_differences_along_random_lines(name: str, model: onnx.ModelProto) -> None:
    """A degree-D polynomial's (D+1)-th difference along any line vanishes; the D-th generically does not."""
    degree = analyze(model).degree
    assert degree is not None
    rng = np.random.default_rng(7)
    for _ in range(2):
        shapes = input_shapes(model)
        x0 = {k: rng.normal(scale=0.5, size=s) for k, s in shapes.items()}
        d = {k: rng.normal(scale=0.5, size=s) for k, s in shapes.items()}
        samples = []
        for t in range(degree + 2):
            outs = evaluate(model, {k: x0[k] + t * d[k] for k in shapes})
            samples.append(np.concatenate([o.ravel() for o in outs]))
        scale = max(float(np.max(np.abs(s))) for s in samples) + 1e-300
        vanishing = np.max(np.abs(_difference(samples, degree + 1))) / scale
        leading = np.max(np.abs(_difference(samples, degree))) / scale
        assert vanishing < 1e-9 * 2 ** (degree + 1), f"{name}: degree {degree} too low ({vanishing:.3g})"
        assert leading > 1e-6, f"{name}: degree {degree} too high (D-th difference {leading:.3g})"


def test_finite_differences_would_catch_an_underestimate() -> None:
    """Sanity of the oracle itself: for x^3 the third difference is far from zero."""
    model = _pow3()
    samples = [evaluate(model, {"x": np.full((1, 3), 0.3 + 0.5 * t)})[0].ravel() for t in range(4)]
    scale = max(float(np.max(np.abs(s))) for s in samples)
    assert np.max(np.abs(_difference(samples, 3))) / scale > 1e-3


def test_degree_is_an_upper_bound_even_with_cancellation() -> None:
    """x*x - x*x is zero, the analyzer (structural) says 2: it bounds, never underestimates."""
    nodes = [node("Mul", ["x", "x"], "a"), node("Mul", ["x", "x"], "b"), node("Sub", ["a", "b"], "y")]
    model = make_model(nodes, {"x": (1, 2)}, ["y"])
    assert sympy_degree(model) == 0
    assert analyze(model).degree == 2
