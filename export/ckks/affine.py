"""Affine expressions over encrypted registers and the ONNX ops that act on them linearly.

While lowering an ONNX graph, every encrypted tensor ``T`` of shape ``S`` is kept symbolic as

    T = sum_j  M_j(v_j) + c          M_j: a sparse (n_j, size) matrix, the image of each basis vector of v_j

so chains of Conv/Gemm/Reshape/Pad/ReduceMean/Add/residual connections collapse into affine maps between
non-linear boundaries; only a ct x ct product forces a map to be materialised as a program step. Each handler
below applies an op to arrays with one extra leading "basis" axis: it moves the constant part (shape ``S``,
batch axis added) and, applied to the basis of ``S`` once, gives the op's matrix that every term is
multiplied by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import scipy.sparse as sp
from onnx import helper

from polyfhe.analysis.rules import PAD_MODES

__all__ = ["LINEAR_OPS", "AffineExpr", "LoweringError", "align", "apply_linear", "attributes", "identity_term",
           "operator_matrix"]


class LoweringError(ValueError):
    """The graph uses an op or an operand pattern the CKKS compiler cannot lower."""


@dataclass
class AffineExpr:
    """``sum_j terms[j] . v_j + const`` for an encrypted tensor of static shape ``shape``."""

    shape: tuple[int, ...]
    terms: dict[int, sp.csr_matrix] = field(default_factory=dict)  # register -> (n_j, size): basis images
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

    def map(self, fn: Callable[[np.ndarray, bool], np.ndarray], op: sp.csr_matrix | None = None,
            check: ComposeCheck | None = None) -> AffineExpr:
        """Apply a linear op: ``fn(stacked, with_bias)``; terms get the op without bias, the constant with it.

        The op's matrix is built once (``fn`` on the basis of this shape, in chunks) and every term, sparse,
        is multiplied by it: far cheaper than applying ``fn`` to every term's stacked basis images.
        ``check(term, op)``, when given, runs before each product (the compile memory budget, ``memory.py``).
        """
        const = fn(self.const_or_zero()[None], True)[0]
        if op is None and (self.terms or self.alternatives):
            op = operator_matrix(fn, self.shape)
        terms = {}
        for reg, arr in self.terms.items():
            if check is not None:
                check(arr, op)
            terms[reg] = (arr @ op).tocsr()
        return AffineExpr(tuple(const.shape), terms, const, [alt.map(fn, op, check) for alt in self.alternatives])

    def forms(self) -> list[AffineExpr]:
        """Every way to compute this tensor: the merged form first, then the alternatives."""
        return [self, *self.alternatives]

    def scaled(self, factor: np.ndarray | float) -> AffineExpr:
        return self.map(lambda x, _bias: x * factor)


ComposeCheck = Callable[[sp.csr_matrix, sp.csr_matrix], None]  # raises before a term is composed with an op
OPERATOR_CHUNK = 512  # basis vectors per application of an op while building its matrix


def operator_matrix(fn: Callable[[np.ndarray, bool], np.ndarray], shape: tuple[int, ...]) -> sp.csr_matrix:
    """The (size_in, size_out) matrix of the linear part of ``fn`` on tensors of ``shape`` (sparse)."""
    size = int(np.prod(shape, dtype=np.int64))
    blocks = []
    for start in range(0, size, OPERATOR_CHUNK):
        stop = min(size, start + OPERATOR_CHUNK)
        basis = np.zeros((stop - start, size))
        basis[np.arange(stop - start), np.arange(start, stop)] = 1.0
        out = np.asarray(fn(basis.reshape((stop - start, *shape)), False))
        blocks.append(sp.csr_matrix(out.reshape(stop - start, -1)))
    return sp.vstack(blocks, format="csr") if blocks else sp.csr_matrix((0, 0))


def identity_term(size: int) -> sp.csr_matrix:
    return sp.identity(size, format="csr")


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _as_ints(values) -> list[int]:
    return [int(v) for v in np.asarray(values).reshape(-1)]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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


@_register("Sum")
def _sum_const(node, x, consts, attrs, with_bias, out_shape):
    """One encrypted operand plus constants (several encrypted operands are combined by the lowering)."""
    out = np.broadcast_to(align(x, out_shape), (x.shape[0], *out_shape))
    if with_bias:
        out = out + sum(_broadcast_const(x, c, out_shape) for c in consts if c is not None)
    return np.array(out)


@_register("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(node, x, consts, attrs, with_bias, out_shape):
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
    elif x.ndim == 2:  # W @ v with a vector v: one column per stacked row
        w = consts[0]
        out = x @ w if w.ndim == 1 else np.matmul(w, x.reshape((x.shape[0], *[1] * (w.ndim - 2), -1, 1)))
    else:  # W @ X
        out = np.matmul(consts[0], x)
    return out.reshape((x.shape[0], *out_shape))


@_register("Gemm")
def _gemm(node, x, consts, attrs, with_bias, out_shape):
    """``alpha * A' @ B' + beta * C`` with exactly one of A, B, C encrypted (the analyzer refuses more)."""
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    a, b = (x if v is None else v for v in consts[:2])
    a = np.swapaxes(a, -1, -2) if attrs.get("transA", 0) else a
    b = np.swapaxes(b, -1, -2) if attrs.get("transB", 0) else b
    c = consts[2] if len(consts) > 2 else None
    if consts[0] is not None and consts[1] is not None:  # only the bias C is encrypted
        out = beta * np.broadcast_to(align(x, out_shape), (x.shape[0], *out_shape))
        return out + alpha * (a @ b) if with_bias else out
    out = alpha * np.matmul(a, b)
    if with_bias and c is not None:
        out = out + beta * c
    return out.reshape((x.shape[0], *out_shape))


def _window_pads(attrs, x: np.ndarray, out_sp, kernel) -> tuple[list[int], list[int], list[int]]:
    """Conv/pool zero padding per spatial axis: (begin, end to reach every output window, the declared end).

    From explicit ``pads`` or ``auto_pad``; the end grows past the declared one only for ``ceil_mode`` windows.
    """
    in_sp, nd = x.shape[3:], len(out_sp)
    strides, dilations = _as_ints(attrs.get("strides", [1] * nd)), _as_ints(attrs.get("dilations", [1] * nd))
    auto, pads = _text(attrs.get("auto_pad", "NOTSET")), _as_ints(attrs.get("pads", [0] * (2 * nd)))
    begin, end, declared = [], [], []
    for i in range(nd):
        span = (out_sp[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1
        total = max(0, span - in_sp[i])
        b = {"SAME_UPPER": total // 2, "SAME_LOWER": total - total // 2, "VALID": 0}.get(auto, pads[i])
        d = total - b if auto.startswith("SAME") else 0 if auto == "VALID" else pads[nd + i]
        begin.append(b)
        declared.append(d)
        end.append(max(d, span - in_sp[i] - b))
    return begin, end, declared


def _windows(data, weight, attrs, begin, end, out_sp, groups):
    """A zero-padded valid convolution in float64, cut to the output size."""
    import torch.nn.functional as F

    nd = len(out_sp)
    padded = F.pad(data, [p for pair in zip(begin[::-1], end[::-1], strict=True) for p in pair])
    out = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd](
        padded, weight, stride=tuple(_as_ints(attrs.get("strides", [1] * nd))),
        dilation=tuple(_as_ints(attrs.get("dilations", [1] * nd))), groups=groups)
    return out[(slice(None), slice(None), *(slice(0, o) for o in out_sp))]


def _batched(x: np.ndarray):
    """Stacked (K, N, C, *spatial) data as one float64 torch batch (K * N, C, *spatial)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x.reshape((-1, *x.shape[2:])), dtype=np.float64))


@_register("Conv")
def _conv(node, x, consts, attrs, with_bias, out_shape):
    import torch

    if consts[1] is None or consts[0] is not None:
        raise LoweringError(f"{node.name}: Conv needs encrypted data and constant weights and bias")
    w = torch.from_numpy(np.ascontiguousarray(consts[1], dtype=np.float64))
    begin, end, _ = _window_pads(attrs, x, out_shape[2:], w.shape[2:])
    out = _windows(_batched(x), w, attrs, begin, end, out_shape[2:], int(attrs.get("group", 1)))
    if with_bias and len(consts) > 2 and consts[2] is not None:
        out = out + torch.from_numpy(consts[2].astype(np.float64)).reshape((1, -1, *[1] * (out.ndim - 2)))
    return out.numpy().reshape((x.shape[0], *out_shape))


@_register("ConvTranspose")
def _conv_transpose(node, x, consts, attrs, with_bias, out_shape):
    """The full transposed convolution (no padding), then cut at the begin pads and zero-extended to the
    output size (``output_padding``/``output_shape``): one code path for every padding attribute."""
    import torch
    import torch.nn.functional as F

    if consts[1] is None or consts[0] is not None:
        raise LoweringError(f"{node.name}: ConvTranspose needs encrypted data and constant weights and bias")
    w = torch.from_numpy(np.ascontiguousarray(consts[1], dtype=np.float64))
    nd, out_sp = w.ndim - 2, out_shape[2:]
    full = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[nd](
        _batched(x), w, stride=tuple(_as_ints(attrs.get("strides", [1] * nd))),
        dilation=tuple(_as_ints(attrs.get("dilations", [1] * nd))), groups=int(attrs.get("group", 1))).numpy()
    auto, pads = _text(attrs.get("auto_pad", "NOTSET")), _as_ints(attrs.get("pads", [0] * (2 * nd)))
    extra = _as_ints(attrs.get("output_padding", [0] * nd))
    out = np.zeros((full.shape[0], full.shape[1], *out_sp))
    src, dst = [slice(None)] * 2, [slice(None)] * 2
    for i in range(nd):
        total = full.shape[2 + i] + extra[i] - out_sp[i]
        if "output_shape" in attrs or auto.startswith("SAME"):
            begin = total // 2 if auto == "SAME_UPPER" else total - total // 2
        else:
            begin = pads[i]
        stop = min(full.shape[2 + i], begin + out_sp[i])
        src.append(slice(max(begin, 0), stop))
        dst.append(slice(max(-begin, 0), max(-begin, 0) + max(stop - max(begin, 0), 0)))
    out[tuple(dst)] = full[tuple(src)]
    if with_bias and len(consts) > 2 and consts[2] is not None:
        out = out + consts[2].reshape((1, -1, *[1] * nd))
    return out.reshape((x.shape[0], *out_shape))


@_register("AveragePool", "GlobalAveragePool")
def _avg_pool(node, x, consts, attrs, with_bias, out_shape):
    """Window sums divided by the window counts: explicit, asymmetric or automatic pads and ceil_mode alike."""
    import torch

    k, out_sp = x.shape[0], out_shape[2:]
    if node.op_type == "GlobalAveragePool":
        return x.mean(axis=tuple(range(3, x.ndim)), keepdims=True).reshape((k, *out_shape))
    kernel = _as_ints(attrs["kernel_shape"])
    begin, end, declared = _window_pads(attrs, x, out_sp, kernel)
    channels = x.shape[2]
    ones = torch.ones((channels, 1, *kernel), dtype=torch.float64)
    sums = _windows(_batched(x), ones, attrs, begin, end, out_sp, channels)
    mask = np.zeros([b + n + e for b, n, e in zip(begin, x.shape[3:], end, strict=True)])
    counted = bool(attrs.get("count_include_pad", 0))
    mask[tuple(slice(0 if counted else b, b + n + (d if counted else 0))
               for b, n, d in zip(begin, x.shape[3:], declared, strict=True))] = 1.0
    counts = _windows(torch.from_numpy(mask)[None, None], ones[:1], attrs, [0] * len(out_sp), [0] * len(out_sp),
                      out_sp, 1)
    return (sums / counts).numpy().reshape((k, *out_shape))


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
    """Negative pads crop first (as onnxruntime does); a constant fill lands in the constant part only."""
    mode = _text(attrs.get("mode", "constant"))
    if mode not in PAD_MODES:
        raise LoweringError(f"{node.name}: Pad mode {mode!r} is not supported (supported: {PAD_MODES})")
    pads = _as_ints(consts[1] if len(consts) > 1 and consts[1] is not None else attrs.get("pads", attrs.get("paddings")))
    ndim = x.ndim - 1
    axes = _as_ints(consts[3]) if len(consts) > 3 and consts[3] is not None else list(range(ndim))
    crop, width = [slice(None)] * (ndim + 1), [(0, 0)] * (ndim + 1)
    for i, ax in enumerate(axes):
        lo, hi, axis = pads[i], pads[i + len(axes)], ax % ndim + 1
        crop[axis] = slice(max(-lo, 0), x.shape[axis] - max(-hi, 0))
        width[axis] = (max(lo, 0), max(hi, 0))
    x = x[tuple(crop)]
    if mode != "constant":
        return np.pad(x, width, mode=mode)
    fill = consts[2] if len(consts) > 2 and consts[2] is not None else attrs.get("value", 0.0)
    return np.pad(x, width, constant_values=float(np.asarray(fill).reshape(-1)[0]) if with_bias else 0.0)


@_register("Slice")
def _slice(node, x, consts, attrs, with_bias, out_shape):
    ndim = x.ndim - 1

    def operand(index: int, name: str):  # inputs since opset 10, attributes before
        value = consts[index] if len(consts) > index and consts[index] is not None else attrs.get(name)
        return None if value is None else _as_ints(value)

    starts, ends = operand(1, "starts"), operand(2, "ends")
    axes = operand(3, "axes") or list(range(len(starts)))
    steps = operand(4, "steps") or [1] * len(starts)
    index = [slice(None)] * (ndim + 1)
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        index[a % ndim + 1] = slice(s, e, st)
    return x[tuple(index)].reshape((x.shape[0], *out_shape))


@_register("Tile")
def _tile(node, x, consts, attrs, with_bias, out_shape):
    ndim = x.ndim - 1
    if len(consts) > 2:  # Tile-1: a count of copies along one axis
        reps = [1] * ndim
        reps[int(np.asarray(consts[2]).reshape(-1)[0]) % ndim] = int(np.asarray(consts[1]).reshape(-1)[0])
    else:
        reps = _as_ints(consts[1])
    return np.tile(x, [1, *reps])


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


def _weights_matrix(node: onnx.NodeProto, consts: list, attrs: dict, expr: AffineExpr,
                    out_shape: tuple[int, ...]) -> sp.csr_matrix | None:
    """The op's matrix straight from its weights where that is cheaper than running it on a basis (Conv)."""
    if node.op_type != "Conv" or not (expr.terms or expr.alternatives) or consts[1] is None:
        return None
    from polyfhe.exporters.ckks.opmatrix import conv_matrix

    weight = consts[1]
    nd = weight.ndim - 2
    begin, _, _ = _window_pads(attrs, np.empty((1, *expr.shape)), out_shape[2:], weight.shape[2:])
    return conv_matrix(weight, expr.shape, tuple(out_shape), _as_ints(attrs.get("strides", [1] * nd)),
                       _as_ints(attrs.get("dilations", [1] * nd)), begin, int(attrs.get("group", 1)))


def apply_linear(node: onnx.NodeProto, expr: AffineExpr, consts: list[np.ndarray | None],
                 out_shape: tuple[int, ...], check: ComposeCheck | None = None) -> AffineExpr:
    """Apply the linear ONNX op ``node`` to the encrypted operand ``expr`` (``check``: see ``AffineExpr.map``)."""
    handler = LINEAR_OPS.get(node.op_type)
    if handler is None:
        raise LoweringError(f"node {node.name or '?'} ({node.op_type}) has no CKKS lowering; "
                            f"supported linear ops: {sorted(LINEAR_OPS)}")
    attrs = attributes(node)
    consts = [None if c is None else np.asarray(c, dtype=np.float64) if np.asarray(c).dtype.kind == "f"
              else np.asarray(c) for c in consts]
    op = _weights_matrix(node, consts, attrs, expr, out_shape)
    result = expr.map(lambda arr, bias: handler(node, arr, consts, attrs, bias, out_shape), op, check)
    if result.shape != tuple(out_shape):
        raise LoweringError(f"{node.name} ({node.op_type}): lowered shape {result.shape} != inferred {out_shape}")
    return result
