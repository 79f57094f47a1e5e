"""Built-in rules: the allow-list of ONNX ops on encrypted values and what each costs.

Conventions (see :mod:`polyfhe.analysis.values`): linear ops keep the degree, ct x ct products add
degrees and one ct depth, ``Pow(k)`` multiplies the degree by k and adds ceil(log2 k) depth; a
plaintext-linear map (const weights, Mul/Div by a const, ReduceMean, average pools) costs one level
unless merged with an adjacent one; Add/Sub/Sum/Concat take maxima; data movement, ReduceSum and Neg
are free. Every op not registered here fails closed when it touches an encrypted value.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from polyfhe.analysis.registry import NodeContext, RuleResult, RuleViolation, register_rule
from polyfhe.analysis.values import CONST, join, linear, power, power_mults, product

__all__ = ["FLOAT_TYPES", "register_rule"]

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})


def _data_input(ctx: NodeContext) -> RuleResult:
    """Input 0 carries the data; every other input (shape, axes, indices, pads) must be constant."""
    ctx.require_const(range(1, len(ctx.inputs)), "a shape/axes/indices operand")
    return ctx.same_for_all(ctx.operand(0))  # encrypted: some input is, and the others are const


register_rule(
    "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Expand", "Identity", "Split",
    summary="data movement; shape/axes/split operands constant",
)(_data_input)
register_rule("ReduceSum", summary="sum of slots (rotations and additions); axes constant")(_data_input)


@register_rule("Gather", summary="constant indices (a public selection, not a table lookup)")
def _gather(ctx: NodeContext) -> RuleResult:
    if ctx.is_encrypted(1):
        raise RuleViolation("Gather with encrypted indices is a data-dependent table lookup")
    return _data_input(ctx)


@register_rule("Neg", summary="always")
def _neg(ctx: NodeContext) -> RuleResult:
    return _data_input(ctx)


@register_rule("Add", "Sub", "Sum", "Concat", summary="always (maximum of the operands)")
def _join(ctx: NodeContext) -> RuleResult:
    return ctx.same_for_all(join(ctx.inputs))


@register_rule("Mul", summary="by a constant (plaintext), or of two encrypted operands (ct x ct)")
def _mul(ctx: NodeContext) -> RuleResult:
    a, b = ctx.operand(0), ctx.operand(1)
    if a.encrypted and b.encrypted:
        return ctx.same_for_all(product(a, b), ct_mults=1)
    return ctx.same_for_all(linear(a if a.encrypted else b), pt_mults=1)


@register_rule("Div", summary="by a constant divisor")
def _div(ctx: NodeContext) -> RuleResult:
    if ctx.is_encrypted(1):
        raise RuleViolation("Div by an encrypted value is not polynomial (only division by a constant is)")
    data = ctx.operand(0)
    return ctx.same_for_all(linear(data), pt_mults=1)


@register_rule("MatMul", summary="with a constant operand (plaintext), or of two encrypted operands (ct x ct)")
def _matmul(ctx: NodeContext) -> RuleResult:
    return _mul(ctx)


@register_rule("Gemm", summary="with constant A or B (plaintext), or encrypted A and B (ct x ct); any C")
def _gemm(ctx: NodeContext) -> RuleResult:
    a, b, c = ctx.operand(0), ctx.operand(1), ctx.input(2)
    if a.encrypted and b.encrypted:
        return ctx.same_for_all(join([product(a, b), c]), ct_mults=1)
    if a.encrypted or b.encrypted:
        return ctx.same_for_all(linear(a if a.encrypted else b, c), pt_mults=1)
    c = ctx.operand(2)  # only the bias is encrypted
    if float(ctx.attr("beta", 1.0)) == 1.0:
        return ctx.same_for_all(c)
    return ctx.same_for_all(linear(c), pt_mults=1)


@register_rule("Conv", "ConvTranspose", summary="constant weights (the bias may be encrypted)")
def _conv(ctx: NodeContext) -> RuleResult:
    if ctx.is_encrypted(1):
        raise RuleViolation(f"{ctx.op} with encrypted weights is not supported (weights must be constant)")
    data = ctx.operand(0)
    if not data.encrypted:  # constant input, encrypted bias only
        return ctx.same_for_all(join([ctx.input(2)]))
    return ctx.same_for_all(linear(data, ctx.input(2)), pt_mults=1)


@register_rule("ReduceMean", summary="sum of slots times a constant 1/n; axes constant")
def _reduce_mean(ctx: NodeContext) -> RuleResult:
    ctx.require_const(range(1, len(ctx.inputs)), "axes")
    data = ctx.operand(0)
    return ctx.same_for_all(linear(data), pt_mults=1)


@register_rule("AveragePool", "GlobalAveragePool", summary="window sums times a constant 1/n")
def _average_pool(ctx: NodeContext) -> RuleResult:
    data = ctx.operand(0)
    return ctx.same_for_all(linear(data), pt_mults=1)


@register_rule("Pow", summary="constant non-negative integer exponent")
def _pow(ctx: NodeContext) -> RuleResult:
    if ctx.is_encrypted(1):
        raise RuleViolation("Pow with an encrypted exponent is not polynomial")
    exponent = ctx.const_value(1)
    if exponent is None:
        raise RuleViolation("Pow exponent is constant but could not be evaluated at compile time")
    values = np.asarray(exponent, dtype=np.float64).ravel()
    if values.size == 0 or not np.all(np.isfinite(values)):
        raise RuleViolation(f"Pow exponent {exponent!r} is not a finite number")
    if np.any(values < 0) or np.any(values != np.round(values)):
        raise RuleViolation(f"Pow exponent {_show(values)} is not a non-negative integer")
    k = int(values.max())
    base = ctx.operand(0)
    if k == 0:
        return ctx.same_for_all(CONST)  # x ** 0 == 1 everywhere: public
    return ctx.same_for_all(power(base, k), ct_mults=power_mults(k))


@register_rule("Pad", summary="mode 'constant' with a zero pad value; pads constant")
def _pad(ctx: NodeContext) -> RuleResult:
    mode = ctx.attr("mode", "constant")
    if mode != "constant":
        raise RuleViolation(f"Pad mode {mode!r} is not supported on encrypted values (only 'constant' with 0)")
    ctx.require_const(range(1, len(ctx.inputs)), "pads/value/axes")
    if ctx.opset < 11:
        fill = np.asarray(ctx.attr("value", 0.0))
    elif len(ctx.node.input) > 2 and ctx.node.input[2]:
        fill = ctx.const_value(2)
        if fill is None:
            raise RuleViolation("Pad constant_value could not be evaluated, so it is not provably zero")
    else:
        fill = np.zeros(())
    if np.any(np.asarray(fill) != 0):
        raise RuleViolation(f"Pad with non-zero value {_show(np.asarray(fill).ravel())} is not allowed")
    return _data_input(ctx)


@register_rule("Cast", summary="to a float type (float, double, float16, bfloat16)")
def _cast(ctx: NodeContext) -> RuleResult:
    to = int(ctx.attr("to", 0))
    if to not in FLOAT_TYPES:
        name = TensorProto.DataType.Name(to) if to in TensorProto.DataType.values() else str(to)
        raise RuleViolation(f"Cast of an encrypted value to {name} rounds, which is not polynomial")
    return _data_input(ctx)


@register_rule("Dropout", summary="inference mode (identity); training_mode constant false")
def _dropout(ctx: NodeContext) -> RuleResult:
    ctx.require_const(range(1, len(ctx.inputs)), "ratio/training_mode")
    if ctx.opset < 7 and int(ctx.attr("is_test", 0)) == 0:
        raise RuleViolation("Dropout with is_test=0 runs in training mode")
    if len(ctx.node.input) > 2 and ctx.node.input[2]:
        training = ctx.const_value(2)
        if training is None or np.any(np.asarray(training)):
            raise RuleViolation("Dropout training_mode is not provably false")
    data = ctx.operand(0)
    states = [data, *[CONST] * (len(ctx.node.output) - 1)]  # the mask output is all ones: public
    return RuleResult(tuple(states))


def _show(values: np.ndarray, limit: int = 4) -> str:
    shown = ", ".join(f"{v:g}" for v in values[:limit])
    return f"[{shown}{', ...' if values.size > limit else ''}]"
