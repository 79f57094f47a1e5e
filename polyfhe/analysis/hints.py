"""What to do about a violation: the way in for models built with ReLU, GELU, SiLU, max pooling, ...

The analyzer names the offending nodes; a refusal that stops there leaves a user with a ReLU network nowhere to
go. :func:`remedy` turns the violations into one sentence that names the fix (``polyfhe.polynomialize``) when
the offending ops are activations or pooling it can replace, and says so plainly when they are not.
"""

from __future__ import annotations

from collections.abc import Iterable

from polyfhe.analysis.report import Violation

__all__ = ["ACTIVATION_OPS", "POOLING_OPS", "UNREPLACEABLE_OPS", "remedy"]

# ONNX ops that element-wise activations export to (GELU exports as Erf, SiLU as Sigmoid and Mul, ReLU6 as Clip)
ACTIVATION_OPS = frozenset({
    "Celu", "Clip", "Elu", "Erf", "Gelu", "HardSigmoid", "HardSwish", "LeakyRelu", "Mish", "PRelu", "Relu",
    "Selu", "Sigmoid", "Softplus", "Softsign", "Tanh", "ThresholdedRelu",
})
POOLING_OPS = frozenset({"MaxPool", "GlobalMaxPool"})
# non-element-wise ops with no polynomial stand-in polynomialize could fit
UNREPLACEABLE_OPS = frozenset({"Softmax", "LogSoftmax", "Hardmax"})


def remedy(violations: Iterable[Violation]) -> str:
    """One sentence on how to make the model polynomial, or "" when no violation is of a kind it knows."""
    ops = {v.op.rsplit("::", 1)[-1] for v in violations}
    replaceable = sorted(ops & (ACTIVATION_OPS | POOLING_OPS))
    parts = []
    if replaceable:
        parts.append(
            f"{', '.join(replaceable)} can be replaced: polyfhe.polynomialize(model, data=(X, y)) swaps activation "
            "modules (nn.ReLU, nn.GELU, nn.SiLU, ...) for trainable low-degree polynomials fitted to your data "
            "and max pooling for average pooling, then fine-tunes; export the model it returns "
            "(docs/polynomialize.md)")
    dropped = sorted(ops & UNREPLACEABLE_OPS)
    if dropped:
        parts.append(f"{', '.join(dropped)} has no polynomial stand-in: remove it from the model and export the "
                     "logits (argmax is the same)")
    return "; ".join(parts) + "." if parts else ""
