"""Built-in rules: the allow-list of ONNX ops on encrypted values and what each costs.

Conventions (see :mod:`polyfhe.analysis.values`): linear ops keep the degree, ct x ct products add
degrees and one ct depth, ``Pow(k)`` multiplies the degree by k and adds ceil(log2 k) depth; a
plaintext-linear map (const weights, Mul/Div by a const, ReduceMean, average pools) costs one level
unless merged with an adjacent one; Add/Sub/Sum/Concat take maxima; data movement, ReduceSum and Neg
are free. Every op not registered here fails closed when it touches an encrypted value.

Each registration also names how the CKKS compiler lowers the op (:class:`Lowering`). Operand patterns
that are polynomial but that the compiler cannot lower (a Gemm with several encrypted operands, a Conv with
encrypted weights or bias, a per-element Pow exponent) are accepted with their degree and named in
``RuleResult.unlowered``; only non-polynomial uses raise :class:`RuleViolation`.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from polyfhe.analysis.registry import Lowering, NodeContext, RuleResult, RuleViolation, register_rule
from polyfhe.analysis.values import CONST, join, linear, power, power_mults, product

__all__ = ["FLOAT_TYPES", "PAD_MODES", "register_rule"]

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})
PAD_MODES = ("constant", "edge", "reflect", "wrap")  # all move data linearly; 'constant' adds the fill value
LINEAR, COMBINE, PRODUCT = Lowering.LINEAR, Lowering.COMBINE, Lowering.PRODUCT


def _data_input(ctx: NodeContext) -> RuleResult:
    """Input 0 carries the data; every other input (shape, axes, indices, pads) must be constant."""
    ctx.require_const(range(1, len(ctx.inputs)), "a shape/axes/indices operand")
    return ctx.same_for_all(ctx.operand(0))  # encrypted: some input is, and the others are const


register_rule(
    "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Expand", "Identity", "Tile",
    summary="data movement; shape/axes/starts/repeats operands constant", lowering=(LINEAR,),
)(_data_input)
register_rule("Split", summary="data movement into several outputs; split sizes constant",
              lowering=(COMBINE,))(_data_input)
register_rule("ReduceSum", summary="sum of slots (rotations and additions); axes constant",
              lowering=(LINEAR,))(_data_input)


@register_rule("Gather", summary="constant indices (a public selection, not a table lookup)", lowering=(LINEAR,))
def _gather(ctx: NodeContext) -> RuleResult:
    if ctx.is_encrypted(1):
        raise RuleViolation("Gather with encrypted indices is a data-dependent table lookup")
    return _data_input(ctx)


@register_rule("Neg", summary="always", lowering=(LINEAR,))
def _neg(ctx: NodeContext) -> RuleResult:
    return _data_input(ctx)


@register_rule("Add", "Sub", "Sum", summary="always (maximum of the operands)", lowering=(LINEAR, COMBINE))
@register_rule("Concat", summary="always (maximum of the operands)", lowering=(COMBINE,))
def _join(ctx: NodeContext) -> RuleResult:
    return ctx.same_for_all(join(ctx.inputs))


@register_rule("Mul", summary="by a constant (plaintext), or of two encrypted operands (ct x ct)",
               lowering=(LINEAR, PRODUCT))
def _mul(ctx: NodeContext) -> RuleResult:
    a, b = ctx.operand(0), ctx.operand(1)
    if a.encrypted and b.encrypted:
        return ctx.same_for_all(product(a, b), ct_mults=1)
    return ctx.same_for_all(linear(a if a.encrypted else b), pt_mults=1)


@register_rule("Div", summary="by a constant divisor", lowering=(LINEAR,))
def _div(ctx: NodeContext) -> RuleResult:
    if ctx.is_encrypted(1):
        raise RuleViolation("Div by an encrypted value is not polynomial (only division by a constant is)")
    data = ctx.operand(0)
    return ctx.same_for_all(linear(data), pt_mults=1)


@register_rule("MatMul", summary="with a constant operand (plaintext), or of two encrypted operands (ct x ct)",
               lowering=(LINEAR, PRODUCT))
def _matmul(ctx: NodeContext) -> RuleResult:
    return _mul(ctx)


@register_rule("Gemm", summary="alpha * A @ B + beta * C; lowered with one encrypted operand (A, B or the "
               "bias C), the others constant", lowering=(LINEAR,))
def _gemm(ctx: NodeContext) -> RuleResult:
    a, b, c = ctx.operand(0), ctx.operand(1), ctx.input(2)
    encrypted = [name for name, state in zip("ABC", (a, b, c), strict=True) if state is not None and state.encrypted]
    ct_mults = pt_mults = 0
    if a.encrypted and b.encrypted:
        ab, ct_mults = product(a, b), 1
        if float(ctx.attr("alpha", 1.0)) != 1.0:
            ab, pt_mults = linear(ab), 1
    elif a.encrypted or b.encrypted:
        ab, pt_mults = linear(a if a.encrypted else b), 1
    else:
        ab = CONST
    bias = c if c is not None and c.encrypted else CONST
    if bias.encrypted and float(ctx.attr("beta", 1.0)) != 1.0:
        bias, pt_mults = linear(bias), pt_mults + 1
    unlowered = ""
    if len(encrypted) > 1:
        unlowered = (f"Gemm with encrypted {' and '.join(encrypted)} is not lowered by the CKKS compiler "
                     "(only one encrypted operand); write it as MatMul and Add")
    return ctx.same_for_all(join([ab, bias]), ct_mults, pt_mults, unlowered)


@register_rule("Conv", "ConvTranspose", summary="any operands (bilinear in data and weights); lowered with "
               "constant weights and bias", lowering=(LINEAR,))
def _conv(ctx: NodeContext) -> RuleResult:
    x, w = ctx.operand(0), ctx.operand(1)
    if x.encrypted and w.encrypted:
        mapped, ct_mults, pt_mults = product(x, w), 1, 0
    else:
        mapped, ct_mults, pt_mults = linear(x if x.encrypted else w), 0, 1
    unlowered = ""
    if w.encrypted:
        unlowered = f"{ctx.op} with encrypted weights is not lowered by the CKKS compiler (weights must be constant)"
    elif ctx.is_encrypted(2):
        unlowered = (f"{ctx.op} with an encrypted bias is not lowered by the CKKS compiler; "
                     f"add the encrypted term after the {ctx.op}")
    return ctx.same_for_all(join([mapped, ctx.input(2)]), ct_mults, pt_mults, unlowered)


@register_rule("ReduceMean", summary="sum of slots times a constant 1/n; axes constant", lowering=(LINEAR,))
def _reduce_mean(ctx: NodeContext) -> RuleResult:
    ctx.require_const(range(1, len(ctx.inputs)), "axes")
    data = ctx.operand(0)
    return ctx.same_for_all(linear(data), pt_mults=1)


@register_rule("AveragePool", "GlobalAveragePool", summary="window sums times a constant 1/n", lowering=(LINEAR,))
def _average_pool(ctx: NodeContext) -> RuleResult:
    data = ctx.operand(0)
    return ctx.same_for_all(linear(data), pt_mults=1)


@register_rule("Pow", summary="a constant scalar non-negative integer exponent (x ** 0 is the public constant 1)",
               lowering=(PRODUCT, Lowering.PUBLIC))
def _pow(ctx: NodeContext) -> RuleResult:
    if ctx.is_encrypted(1):
        raise RuleViolation("Pow with an encrypted exponent is not polynomial")
    exponent = ctx.const_value(1)
    if exponent is None:
        raise RuleViolation("Pow exponent is constant but could not be evaluated at compile time")
    values = np.asarray(exponent, dtype=np.float64).ravel()
    if not np.all(np.isfinite(values)):
        raise RuleViolation(f"Pow exponent {exponent!r} is not a finite number")
    if np.any(values < 0) or np.any(values != np.round(values)):
        raise RuleViolation(f"Pow exponent {_show(values)} is not a non-negative integer")
    unlowered = ""
    if values.size != 1:
        unlowered = (f"Pow exponent {_show(values)} is not a single number (per-element exponents are not "
                     "lowered by the CKKS compiler)")
    k = int(values.max()) if values.size else 0
    base = ctx.operand(0)
    if k == 0:
        return ctx.same_for_all(CONST, unlowered=unlowered)  # x ** 0 == 1 everywhere: public
    return ctx.same_for_all(power(base, k), ct_mults=power_mults(k), unlowered=unlowered)


@register_rule("Pad", summary="modes constant (any finite fill: affine, the fill is public), edge, reflect, wrap; "
               "pads/value/axes constant", lowering=(LINEAR,))
def _pad(ctx: NodeContext) -> RuleResult:
    mode = ctx.attr("mode", "constant")
    if mode not in PAD_MODES:
        raise RuleViolation(f"Pad mode {mode!r} is not supported on encrypted values (supported: {PAD_MODES})")
    ctx.require_const(range(1, len(ctx.inputs)), "pads/value/axes")
    fill = np.asarray(ctx.attr("value", 0.0)) if ctx.opset < 11 else ctx.const_value(2)
    if fill is not None and not np.all(np.isfinite(np.asarray(fill, dtype=np.float64))):
        raise RuleViolation(f"Pad value {_show(np.asarray(fill, dtype=np.float64).ravel())} is not finite")
    return _data_input(ctx)


@register_rule("Cast", summary="to a float type (float, double, float16, bfloat16)", lowering=(Lowering.ALIAS,))
def _cast(ctx: NodeContext) -> RuleResult:
    to = int(ctx.attr("to", 0))
    if to not in FLOAT_TYPES:
        name = TensorProto.DataType.Name(to) if to in TensorProto.DataType.values() else str(to)
        raise RuleViolation(f"Cast of an encrypted value to {name} rounds, which is not polynomial")
    return _data_input(ctx)


@register_rule("Dropout", summary="inference mode (identity); training_mode constant false", lowering=(LINEAR,))
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
