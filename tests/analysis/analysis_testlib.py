"""Helpers for the analyzer tests: tiny ONNX graph builders, a sympy interpreter and a float64 evaluator.

The sympy interpreter is an independent oracle: inputs become symbols, weights exact rationals, and the
true total degree of each output is read off the expanded polynomial.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import sympy
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

DOUBLE = TensorProto.DOUBLE


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Mapping[str, Sequence[int]],
    outputs: Sequence[str],
    inits: Mapping[str, np.ndarray] | None = None,
    opset: int = 18,
    extra_opsets: Mapping[str, int] | None = None,
    elem_type: int = DOUBLE,
) -> onnx.ModelProto:
    """A model over float64 inputs of the given shapes; outputs carry no shape (we do not need it)."""
    initializers = [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()]
    graph = helper.make_graph(
        list(nodes),
        "test_graph",
        [helper.make_tensor_value_info(k, elem_type, list(v)) for k, v in inputs.items()],
        [helper.make_tensor_value_info(o, elem_type, None) for o in outputs],
        initializers,
    )
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def node(op: str, inputs: Sequence[str], outputs: Sequence[str] | str, name: str = "", **attrs) -> onnx.NodeProto:
    outs = [outputs] if isinstance(outputs, str) else list(outputs)
    return helper.make_node(op, list(inputs), outs, name=name or None, **attrs)


# ----------------------------------------------------------------------------------------------- sympy


def _to_sym(array: np.ndarray) -> np.ndarray:
    flat = [sympy.Rational(float(v)) for v in np.asarray(array, dtype=np.float64).ravel()]
    return np.array(flat, dtype=object).reshape(np.shape(array))


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.matmul(a, b)


def _gemm(n: onnx.NodeProto, args: list[np.ndarray]) -> np.ndarray:
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    a, b = args[0], args[1]
    if attrs.get("transA", 0):
        a = a.T
    if attrs.get("transB", 0):
        b = b.T
    out = _matmul(a, b) * sympy.Rational(float(attrs.get("alpha", 1.0)))
    if len(args) > 2:
        out = out + args[2] * sympy.Rational(float(attrs.get("beta", 1.0)))
    return out


def _attr(n: onnx.NodeProto, name: str, default=None):
    for a in n.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


SYMPY_OPS = {
    "Add": lambda n, a: a[0] + a[1],
    "Sub": lambda n, a: a[0] - a[1],
    "Mul": lambda n, a: a[0] * a[1],
    "Div": lambda n, a: a[0] * np.vectorize(lambda v: 1 / v, otypes=[object])(a[1]),
    "Neg": lambda n, a: -a[0],
    "Identity": lambda n, a: a[0],
    "MatMul": lambda n, a: _matmul(a[0], a[1]),
    "Gemm": _gemm,
    "Pow": lambda n, a: np.vectorize(lambda v: v ** int(np.asarray(a[1]).ravel()[0]), otypes=[object])(a[0]),
    "Sum": lambda n, a: sum(a[1:], a[0]),
    "Concat": lambda n, a: np.concatenate(a, axis=_attr(n, "axis")),
    "Transpose": lambda n, a: np.transpose(a[0], _attr(n, "perm")),
    "Reshape": lambda n, a: a[0].reshape([int(v) for v in a[1]]),
}


def sympy_outputs(model: onnx.ModelProto) -> tuple[dict[str, np.ndarray], list[sympy.Symbol]]:
    """Evaluate the graph symbolically: one symbol per input element, exact rational weights."""
    graph = model.graph
    env: dict[str, np.ndarray] = {}
    symbols: list[sympy.Symbol] = []
    for t in graph.initializer:
        arr = numpy_helper.to_array(t)
        env[t.name] = arr if arr.dtype.kind in "iu" else _to_sym(arr)
    for value in graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        syms = [sympy.Symbol(f"{value.name}_{i}") for i in range(int(np.prod(shape)))]
        symbols += syms
        env[value.name] = np.array(syms, dtype=object).reshape(shape)
    for n in graph.node:
        env[n.output[0]] = np.asarray(SYMPY_OPS[n.op_type](n, [env[i] for i in n.input]), dtype=object)
    return {o.name: env[o.name] for o in graph.output}, symbols


def sympy_degree(model: onnx.ModelProto) -> int:
    """True total degree of the outputs (max over all elements; the zero polynomial counts as 0)."""
    outputs, symbols = sympy_outputs(model)
    best = 0
    for array in outputs.values():
        for expr in np.asarray(array, dtype=object).ravel():
            expanded = sympy.expand(expr)
            if expanded != 0:
                best = max(best, sympy.Poly(expanded, *symbols).total_degree())
    return best


# ----------------------------------------------------------------------------------------- evaluation


def evaluate(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(o, dtype=np.float64) for o in ReferenceEvaluator(model).run(None, dict(feeds))]


def input_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    inits = {t.name for t in model.graph.initializer}
    return {
        v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
        for v in model.graph.input
        if v.name not in inits
    }


# ------------------------------------------------------------------------------------------ random DAGs


@dataclass
class _Val:
    name: str
    degree: int
    root: str  # Identity/Neg keep the root, so Add/Sub never cancel a value against an alias of itself


def random_dag(seed: int, width: int = 3, steps: int = 10, max_degree: int = 10) -> tuple[onnx.ModelProto, int]:
    """A random DAG of Add/Sub/Mul/MatMul-const/Pow/Neg/Identity on a (1, width) input.

    Returns the model and the degree the generator expects (max over the outputs).
    """
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: dict[str, np.ndarray] = {}
    pool = [_Val("x", 1, "x")]
    for step in range(steps):
        out = f"v{step}"
        recent = pool[-3:]  # favour recent values so chains (and degrees) grow
        a = recent[rng.integers(len(recent))]
        op = str(rng.choice(["Add", "Sub", "Mul", "MulConst", "MatMulConst", "Pow", "Neg", "Identity"]))
        if op in ("Add", "Sub", "Mul"):
            others = [v for v in pool if v.root != a.root] or [a]
            b = others[rng.integers(len(others))]
            if op == "Mul" and a.degree + b.degree > max_degree:
                op = "MatMulConst"
            elif op != "Mul" and b.root == a.root:
                op = "Neg"
        if op == "Pow":
            k = int(rng.integers(2, 4))
            if a.degree * k > max_degree:
                op = "MatMulConst"
        if op in ("Add", "Sub"):
            nodes.append(node(op, [a.name, b.name], out))
            pool.append(_Val(out, max(a.degree, b.degree), out))
        elif op == "Mul":
            nodes.append(node("Mul", [a.name, b.name], out))
            pool.append(_Val(out, a.degree + b.degree, out))
        elif op == "MulConst":
            inits[f"c{step}"] = rng.choice([-3.0, -2.0, 2.0, 3.0], size=(1, width))
            nodes.append(node("Mul", [a.name, f"c{step}"], out))
            pool.append(_Val(out, a.degree, out))
        elif op == "MatMulConst":
            inits[f"W{step}"] = rng.choice([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0], size=(width, width))
            nodes.append(node("MatMul", [a.name, f"W{step}"], out))
            pool.append(_Val(out, a.degree, out))
        elif op == "Pow":
            inits[f"k{step}"] = np.array(k, dtype=np.int64)
            nodes.append(node("Pow", [a.name, f"k{step}"], out))
            pool.append(_Val(out, a.degree * k, out))
        else:  # Neg / Identity
            nodes.append(node(op, [a.name], out))
            pool.append(_Val(out, a.degree, a.root))
    outputs = [pool[-1]]
    extra = pool[int(rng.integers(1, len(pool)))]
    if extra.name != outputs[0].name:
        outputs.append(extra)
    model = make_model(nodes, {"x": (1, width)}, [o.name for o in outputs], inits)
    return model, max(o.degree for o in outputs)
