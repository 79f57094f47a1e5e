"""Affine expressions over encrypted registers and the ONNX ops that act on them linearly.

While lowering an ONNX graph, every encrypted tensor ``T`` of shape ``S`` is kept symbolic as

    T = sum_j  M_j(v_j) + c          M_j: an array (n_j, *S), the image of each basis vector of register v_j

so chains of Conv/Gemm/Reshape/Pad/ReduceMean/Add/residual connections collapse into one affine map per
non-linear boundary; only a ct x ct product forces a map to be materialised as a program step. Each handler
below applies an op to arrays with one extra leading "basis" axis, so the same code moves the constant part
(shape ``S``, batch axis added) and every term (``n_j`` stacked copies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

__all__ = ["LINEAR_OPS", "AffineExpr", "LoweringError", "align", "apply_linear", "attributes"]


class LoweringError(ValueError):
    """The graph uses an op or an operand pattern the CKKS compiler cannot lower."""


@dataclass
class AffineExpr:
    """``sum_j terms[j] . v_j + const`` for an encrypted tensor of static shape ``shape``."""

    shape: tuple[int, ...]
    terms: dict[int, np.ndarray] = field(default_factory=dict)  # register id -> (n_j, *shape)
    const: np.ndarray | None = None  # shape ``shape`` or None for zero
    # Other expressions of the same tensor over other registers: earlier registers that already hold a part
    # of it, residual checkpoints and the outputs of weighted ops. Negative register ids are *shadows*:
    # registers the lowering creates only if a form reading them is chosen (see lower.py).
    alternatives: list[AffineExpr] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def const_or_zero(self) -> np.ndarray:
        return np.zeros(self.shape) if self.const is None else self.const

    def map(self, fn: Callable[[np.ndarray, bool], np.ndarray]) -> AffineExpr:
        """Apply a linear op: ``fn(stacked, with_bias)``; terms get the op without bias, the constant with it."""
        const = fn(self.const_or_zero()[None], True)[0]
        terms = {reg: fn(arr, False) for reg, arr in self.terms.items()}
        return AffineExpr(tuple(const.shape), terms, const, [alt.map(fn) for alt in self.alternatives])

    def forms(self) -> list[AffineExpr]:
        """Every way to compute this tensor: the merged form first, then the alternatives."""
        return [self, *self.alternatives]

    def scaled(self, factor: np.ndarray | float) -> AffineExpr:
        return self.map(lambda x, _bias: x * factor)


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _as_ints(values) -> list[int]:
    return [int(v) for v in np.asarray(values).reshape(-1)]


# --------------------------------------------------------------------------------------------------------------
# Handlers: fn(node, stacked (K, *S), consts: list[np.ndarray | None], attrs, with_bias, out_shape) -> (K, *S')
# ``consts`` holds the compile-time values of every input except the encrypted one (None where encrypted).
# --------------------------------------------------------------------------------------------------------------
Handler = Callable[..., np.ndarray]
LINEAR_OPS: dict[str, Handler] = {}


def _register(*ops: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        for op in ops:
            LINEAR_OPS[op] = fn
        return fn

    return deco


def _broadcast_const(x: np.ndarray, c: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    """Broadcast a constant operand against stacked data (the constant aligns with the trailing axes)."""
    if c.ndim > len(out_shape):
        raise LoweringError(f"constant of shape {c.shape} has more axes than the result {out_shape}")
    return np.broadcast_to(c, out_shape)


def align(x: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    """Give stacked data ``(K, *S)`` as many axes as ``out_shape`` (leading ones) so broadcasting keeps K first."""
    missing = len(out_shape) - (x.ndim - 1)
    if missing < 0:
        raise LoweringError(f"operand of shape {x.shape[1:]} has more axes than the result {out_shape}")
    return x.reshape((x.shape[0], *([1] * missing), *x.shape[1:]))


@_register("Identity", "Dropout")
def _identity(node, x, consts, attrs, with_bias, out_shape):
    return x


@_register("Neg")
def _neg(node, x, consts, attrs, with_bias, out_shape):
    return -x


@_register("Mul")
def _mul_const(node, x, consts, attrs, with_bias, out_shape):
    c = next(v for v in consts if v is not None)
    out = align(x, out_shape) * _broadcast_const(x, c, out_shape)
    return out.reshape((x.shape[0], *out_shape))


@_register("Div")
def _div_const(node, x, consts, attrs, with_bias, out_shape):
    if consts[1] is None:
        raise LoweringError(f"{node.name}: division by an encrypted value is not polynomial")
    return (align(x, out_shape) / _broadcast_const(x, consts[1], out_shape)).reshape((x.shape[0], *out_shape))


@_register("Add", "Sub")
def _add_const(node, x, consts, attrs, with_bias, out_shape):
    """Encrypted +/- constant (two encrypted operands are combined by the lowering, not here)."""
    sign_x = -1.0 if (node.op_type == "Sub" and consts[0] is not None) else 1.0
    c = next(v for v in consts if v is not None)
    sign_c = -1.0 if (node.op_type == "Sub" and consts[1] is not None) else 1.0
    if not with_bias and x.shape[1:] == tuple(out_shape):
        return x if sign_x > 0 else -x  # terms: adding a constant moves nothing (no copy)
    base = np.broadcast_to(sign_x * align(x, out_shape), (x.shape[0], *out_shape))
    if with_bias:
        base = base + sign_c * _broadcast_const(x, c, out_shape)
    return np.array(base)


@_register("Reshape")
def _reshape(node, x, consts, attrs, with_bias, out_shape):
    return x.reshape((x.shape[0], *out_shape))


@_register("Flatten", "Squeeze", "Unsqueeze")
def _reshape_like(node, x, consts, attrs, with_bias, out_shape):
    return x.reshape((x.shape[0], *out_shape))


@_register("Transpose")
def _transpose(node, x, consts, attrs, with_bias, out_shape):
    perm = attrs.get("perm", list(range(x.ndim - 1))[::-1])
    return np.transpose(x, [0, *[int(p) + 1 for p in perm]])


@_register("MatMul")
def _matmul(node, x, consts, attrs, with_bias, out_shape):
    if consts[1] is not None and consts[1].ndim == 2:  # X @ W as one BLAS call over all stacked rows
        w = consts[1]
        out = (x.reshape(-1, w.shape[0]) @ w)
    elif consts[1] is not None:  # X @ W with batched W
        out = np.matmul(x, consts[1])
    else:  # W @ X
        out = np.matmul(consts[0], x)
    return out.reshape((x.shape[0], *out_shape))


@_register("Gemm")
def _gemm(node, x, consts, attrs, with_bias, out_shape):
    if consts[0] is not None:
        raise LoweringError(f"{node.name}: Gemm with an encrypted B operand is not supported; export X @ W")
    a = np.swapaxes(x, -1, -2) if attrs.get("transA", 0) else x
    w = consts[1].T if attrs.get("transB", 0) else consts[1]
    out = attrs.get("alpha", 1.0) * np.matmul(a, w)
    if with_bias and len(consts) > 2 and consts[2] is not None:
        out = out + attrs.get("beta", 1.0) * consts[2]
    return out


@_register("Conv")
def _conv(node, x, consts, attrs, with_bias, out_shape):
    import torch
    import torch.nn.functional as F

    if consts[1] is None:
        raise LoweringError(f"{node.name}: Conv needs constant weights")
    w = consts[1]
    nd = w.ndim - 2
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise LoweringError(f"{node.name}: Conv auto_pad is not supported; export explicit pads")
    pads = _as_ints(attrs.get("pads", [0] * (2 * nd)))
    k, n = x.shape[0], x.shape[1]
    data = torch.from_numpy(np.ascontiguousarray(x.reshape((k * n, *x.shape[2:]))))
    begin, end = pads[:nd], pads[nd:]
    if begin != end:
        data = F.pad(data, [p for pair in zip(begin[::-1], end[::-1], strict=True) for p in pair])
        padding = 0
    else:
        padding = tuple(begin)
    bias = torch.from_numpy(consts[2]) if with_bias and len(consts) > 2 and consts[2] is not None else None
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    out = conv(
        data, torch.from_numpy(np.ascontiguousarray(w, dtype=np.float64)),
        bias.double() if bias is not None else None,
        stride=tuple(_as_ints(attrs.get("strides", [1] * nd))), padding=padding,
        dilation=tuple(_as_ints(attrs.get("dilations", [1] * nd))), groups=int(attrs.get("group", 1)),
    )
    return out.numpy().reshape((k, *out_shape))


@_register("AveragePool", "GlobalAveragePool")
def _avg_pool(node, x, consts, attrs, with_bias, out_shape):
    import torch
    import torch.nn.functional as F

    k, n = x.shape[0], x.shape[1]
    data = torch.from_numpy(np.ascontiguousarray(x.reshape((k * n, *x.shape[2:]))))
    nd = data.ndim - 2
    if node.op_type == "GlobalAveragePool":
        out = data.mean(dim=tuple(range(2, 2 + nd)), keepdim=True)
    else:
        pads = _as_ints(attrs.get("pads", [0] * (2 * nd)))
        if pads[:nd] != pads[nd:]:
            raise LoweringError(f"{node.name}: asymmetric AveragePool pads are not supported")
        pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[nd]
        out = pool(
            data, kernel_size=tuple(_as_ints(attrs["kernel_shape"])),
            stride=tuple(_as_ints(attrs.get("strides", attrs["kernel_shape"]))), padding=tuple(pads[:nd]),
            count_include_pad=bool(attrs.get("count_include_pad", 0)),
        )
    return out.numpy().reshape((k, *out_shape))


def _reduce_axes(node, x, consts, attrs) -> tuple[tuple[int, ...], bool]:
    ndim = x.ndim - 1
    axes = attrs.get("axes")
    if axes is None and len(consts) > 1 and consts[1] is not None:
        axes = consts[1]
    if axes is None or len(_as_ints(axes)) == 0:
        if attrs.get("noop_with_empty_axes", 0):
            return (), bool(attrs.get("keepdims", 1))
        axes = list(range(ndim))
    return tuple(a % ndim + 1 for a in _as_ints(axes)), bool(attrs.get("keepdims", 1))


@_register("ReduceMean", "ReduceSum")
def _reduce(node, x, consts, attrs, with_bias, out_shape):
    axes, keep = _reduce_axes(node, x, consts, attrs)
    if not axes:
        return x
    fn = np.mean if node.op_type == "ReduceMean" else np.sum
    return fn(x, axis=axes, keepdims=keep).reshape((x.shape[0], *out_shape))


@_register("Pad")
def _pad(node, x, consts, attrs, with_bias, out_shape):
    mode = attrs.get("mode", b"constant")
    if mode not in (b"constant", "constant"):
        raise LoweringError(f"{node.name}: Pad mode {mode!r} is not supported (constant zero only)")
    pads = _as_ints(consts[1] if len(consts) > 1 and consts[1] is not None else attrs.get("pads"))
    value = consts[2] if len(consts) > 2 and consts[2] is not None else np.zeros(())
    if float(np.asarray(value).reshape(-1)[0] if np.asarray(value).size else 0.0) != 0.0:
        raise LoweringError(f"{node.name}: Pad with a non-zero constant would not be linear")
    ndim = x.ndim - 1
    axes = _as_ints(consts[3]) if len(consts) > 3 and consts[3] is not None else list(range(ndim))
    width = [(0, 0)] * (ndim + 1)
    for i, ax in enumerate(axes):
        width[ax % ndim + 1] = (pads[i], pads[i + len(axes)])
    if any(p < 0 for pair in width for p in pair):
        raise LoweringError(f"{node.name}: negative pads (cropping) are not supported; use Slice")
    return np.pad(x, width)


@_register("Slice")
def _slice(node, x, consts, attrs, with_bias, out_shape):
    ndim = x.ndim - 1
    starts, ends = _as_ints(consts[1]), _as_ints(consts[2])
    axes = _as_ints(consts[3]) if len(consts) > 3 and consts[3] is not None else list(range(len(starts)))
    steps = _as_ints(consts[4]) if len(consts) > 4 and consts[4] is not None else [1] * len(starts)
    index = [slice(None)] * (ndim + 1)
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        index[a % ndim + 1] = slice(s, e, st)
    return x[tuple(index)].reshape((x.shape[0], *out_shape))


@_register("Gather")
def _gather(node, x, consts, attrs, with_bias, out_shape):
    if consts[1] is None:
        raise LoweringError(f"{node.name}: Gather needs constant indices")
    ndim = x.ndim - 1
    axis = int(attrs.get("axis", 0)) % ndim + 1
    idx = np.asarray(consts[1]).astype(np.int64)
    idx = np.where(idx < 0, idx + x.shape[axis], idx)
    return np.take(x, idx, axis=axis).reshape((x.shape[0], *out_shape))


@_register("Expand")
def _expand(node, x, consts, attrs, with_bias, out_shape):
    return np.array(np.broadcast_to(align(x, out_shape), (x.shape[0], *out_shape)))


def apply_linear(node: onnx.NodeProto, expr: AffineExpr, consts: list[np.ndarray | None],
                 out_shape: tuple[int, ...]) -> AffineExpr:
    """Apply the linear ONNX op ``node`` to the encrypted operand ``expr``."""
    handler = LINEAR_OPS.get(node.op_type)
    if handler is None:
        raise LoweringError(f"node {node.name or '?'} ({node.op_type}) has no CKKS lowering; "
                            f"supported linear ops: {sorted(LINEAR_OPS)}")
    attrs = attributes(node)
    consts = [None if c is None else np.asarray(c, dtype=np.float64) if np.asarray(c).dtype.kind == "f"
              else np.asarray(c) for c in consts]
    result = expr.map(lambda arr, bias: handler(node, arr, consts, attrs, bias, out_shape))
    if result.shape != tuple(out_shape):
        raise LoweringError(f"{node.name} ({node.op_type}): lowered shape {result.shape} != inferred {out_shape}")
    return result
