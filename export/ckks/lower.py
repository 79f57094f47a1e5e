"""ONNX graph -> :class:`Circuit`: walk the nodes once, keep encrypted tensors as affine expressions.

Constants (initializers and anything computed only from them, shapes included) are evaluated at compile
time with the analyzer's :class:`ConstantFolder`. Linear ops update affine expressions (see ``affine.py``);
two encrypted operands of Add/Sub/Sum/Concat are combined symbolically; a ct x ct Mul, Pow or MatMul
materialises its operands as :class:`LinearNode` registers and emits a product node. Anything else names the
node and the op and fails.

This is also where the plan is chosen: every expression carries alternative *forms* (registers computed
earlier, checkpoints of weighted ops and residual sums), and a materialised map takes the cheapest form at
the lowest level by the cost model of ``cost.py``.
"""

from __future__ import annotations

import logging
import time
import weakref
from functools import partial

import numpy as np
import onnx
import scipy.sparse as sp

from polyfhe.analysis.constants import ConstantFolder
from polyfhe.analysis.graph import topological_order
from polyfhe.exporters.ckks.affine import (
    AffineExpr,
    LoweringError,
    align,
    apply_linear,
    attributes,
    identity_term,
)
from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, MatMulNode, MulNode
from polyfhe.exporters.ckks.cost import map_cost, term_diagonals
from polyfhe.exporters.ckks.graph_values import fix_batch_axis, probe_values
from polyfhe.exporters.ckks.layout import UNBOUNDED_SLOTS, input_packing
from polyfhe.exporters.ckks.memory import TermBudget, term_bytes
from polyfhe.exporters.ckks.sites import factoring_sites, shift_sites

__all__ = ["factoring_sites", "lower_onnx", "shift_sites"]

log = logging.getLogger(__name__)

# Outputs of weighted ops may be read by later maps as a register of their own (a checkpoint): a low-rank
# pair or a patch embedding stays factored when merging it into its consumers would cost more.
CHECKPOINT_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
# A merged form is dropped (and never composed further) once it holds more than MERGE_KEEP_BYTES of terms and
# another form at its level costs under 1 / MERGE_SLACK of it. Both margins because a merged form can get cheap
# again: a later map that narrows it (a head after the global mean) or a ct x ct MatMul that composes its gathers
# into it. Measured (docs/benchmarks.md): the user attention model's plan is unchanged, monet_fhe_bn's has 0.3%
# fewer diagonals and a 2-block user MONet's 1.3% more; an 8-block user MONet lowers in 0.5 GB of terms
# where the lowering without drops passed 12 GB and was still composing.
MERGE_SLACK = 1.5
MERGE_KEEP_BYTES = 16 << 20
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


class _Lowering:
    def __init__(self, model: onnx.ModelProto, factored: frozenset[str] = frozenset(),
                 memory_limit: int | None = None) -> None:
        model = fix_batch_axis(model)
        self.budget = TermBudget(memory_limit)
        self.factored = factored  # names of spatial convolutions computed as registers of their own
        self.model = model
        self.folder = ConstantFolder(model)
        self.probed = probe_values(model)  # values for zero input: exact for constants, shapes for everything
        self.shapes = {name: tuple(np.shape(v)) for name, v in self.probed.items()}
        self.env: dict[str, AffineExpr] = {}
        init = {t.name for t in model.graph.initializer}
        inputs = [i for i in model.graph.input if i.name not in init]
        if len(inputs) != 1:
            raise LoweringError(f"the CKKS compiler needs exactly one encrypted graph input, found {len(inputs)}: "
                                f"{[i.name for i in inputs]}")
        if len(model.graph.output) != 1:
            raise LoweringError(f"exactly one graph output is supported, found {len(model.graph.output)}")
        name = inputs[0].name
        if name not in self.shapes:
            raise LoweringError(f"input {name!r} needs a static shape (got a symbolic or missing dimension); "
                                "export with a fixed input_shape")
        shape = self.shapes[name]
        self.circuit = Circuit(input_shape=shape, output_shape=())
        size = int(np.prod(shape))
        self.circuit.sizes[0] = size
        self.circuit.shapes[0] = tuple(shape)
        self.env[name] = AffineExpr(shape, {0: identity_term(size)}, None)
        self._materialised: dict[int, tuple[weakref.ref, int]] = {}  # id(expr) -> (ref, register): reuse
        self._levels: dict[int, int] = {0: 0}  # register -> rescales consumed
        self._shadows: dict[int, AffineExpr] = {}  # shadow id (< 0) -> the tensor it stands for
        self._shadow_costs: dict[int, float] = {}
        # shadow -> (1 / d as a diagonal matrix, -c / d) when bound to a register holding d * shadow + c
        self._shadow_offsets: dict[int, tuple[sp.csr_matrix, np.ndarray]] = {}
        self._costs: dict[int, tuple[weakref.ref, float]] = {}  # id(form) -> (ref, estimated map cost)
        self._shadow_regs: dict[int, int] = {}  # shadow id -> register, once materialised
        # the client's packing of the input, fixed by its first consumer (layout.input_packing); until then
        # every map reading the input is costed as if it were that consumer
        self._input_slots: np.ndarray | None = None

    # ---------------------------------------------------------------------------------------------------
    def run(self) -> Circuit:
        order = topological_order(self.model.graph)
        out_name = self.model.graph.output[0].name
        last_use = {name: pos for pos, (_, node) in enumerate(order) for name in node.input}
        start, reported = time.perf_counter(), 0
        for pos, (index, node) in enumerate(order):
            if not node.name:
                node.name = f"{node.op_type}_{index}"
            self._lower(node)
            for name in node.input:  # drop expressions nobody reads any more: they hold large term arrays
                if last_use.get(name) == pos and name != out_name:
                    self.env.pop(name, None)
            self.budget.observe(self._held_terms())
            if 10 * (pos + 1) // len(order) > reported:  # every tenth of the graph
                reported = 10 * (pos + 1) // len(order)
                log.info("lowering: %d of %d nodes, %.1f s, %.2f GB of terms held (peak %.2f GB)", pos + 1,
                         len(order), time.perf_counter() - start, self.budget.live / 1e9, self.budget.peak / 1e9)
        if out_name not in self.env:
            raise LoweringError(f"graph output {out_name!r} does not depend on the encrypted input")
        expr = self.env[out_name]
        self.circuit.output = self._materialise(expr, f"output {out_name}", force=False)
        self.circuit.output_shape = expr.shape
        self.circuit.lowering_peak_bytes = self.budget.peak
        return self.circuit

    def _held_terms(self):
        """Every term array the lowering still holds: live tensors' forms and the checkpoints' forms."""
        for expr in (*self.env.values(), *self._shadows.values()):
            for form in expr.forms():
                yield from form.terms.values()

    def _lower(self, node: onnx.NodeProto) -> None:
        enc = [name in self.env for name in node.input]
        if not any(enc):
            return  # constant: evaluated on demand by the folder
        op = node.op_type
        if op in ("Shape", "Size"):
            return  # public shape information: the folder evaluates it from static shapes
        exponent = self._const(node.input[1]) if op == "Pow" and node.input[1] not in self.env else None
        if exponent is not None and np.size(exponent) == 1 and not np.any(exponent):
            return  # x ** 0 == 1 whatever x (the analyzer calls it public): read as a constant from the probe
        out_shape = self._shape(node.output[0], node)
        if op == "Cast":
            if attributes(node).get("to") not in _FLOAT_TYPES:
                raise LoweringError(f"{node.name}: Cast of an encrypted value to a non-float type")
            self.env[node.output[0]] = self.env[node.input[0]]
        elif op in ("Add", "Sub", "Sum") and sum(enc) > 1:
            self.env[node.output[0]] = self._combine(node, out_shape)
        elif op == "Concat":
            self.env[node.output[0]] = self._concat(node, out_shape)
        elif op == "Split":
            self._split(node)
        elif op == "Mul" and sum(enc) == 2:
            a, b = (self._broadcast(self.env[n], out_shape) for n in node.input)
            self.env[node.output[0]] = self._product(node, a, b if node.input[0] != node.input[1] else a, out_shape)
        elif op == "Pow":
            self.env[node.output[0]] = self._power(node, out_shape)
        elif op == "MatMul" and sum(enc) == 2:
            self.env[node.output[0]] = self._matmul(node, out_shape)
        else:
            if sum(enc) > 1:
                raise LoweringError(f"node {node.name} ({op}) with several encrypted operands is not supported")
            consts = [None if e else (self._const(n) if n else None) for n, e in zip(node.input, enc)]
            if any(c is None and n and not e for c, n, e in zip(consts, node.input, enc)):
                raise LoweringError(f"node {node.name} ({op}): an operand is neither encrypted nor a known constant")
            src = self.env[node.input[enc.index(True)]]
            result = apply_linear(node, src, consts, out_shape,
                                  partial(self.budget.check_compose, where=f"node {node.name} ({op})"))
            if node.name in self.factored:  # spend a level: consumers read this register, not the merged map
                result = self._identity(self._materialise(result, f"{node.name} (factored)"), out_shape)
            elif op in CHECKPOINT_OPS:
                result = self._drop_dominated_merge(result)
                self._checkpoint(result)
                result = self._prune(result)
            self.env[node.output[0]] = result

    def _const(self, name: str) -> np.ndarray | None:
        """Compile-time value of a non-encrypted operand (initializer, Constant, or shape arithmetic)."""
        value = self.folder.value(name)
        return value if value is not None else self.probed.get(name)

    def _shape(self, name: str, node: onnx.NodeProto) -> tuple[int, ...]:
        if name not in self.shapes:
            raise LoweringError(f"node {node.name} ({node.op_type}): output {name!r} has no static shape")
        return self.shapes[name]

    # ---------------------------------------------------------------------------------------------------
    def _operand(self, name: str, shape: tuple[int, ...]) -> AffineExpr:
        """An encrypted operand, or a constant one as a term-less expression."""
        if name in self.env:
            return self.env[name]
        value = self._const(name)
        if value is None:
            raise LoweringError(f"operand {name!r} is neither encrypted nor a known constant")
        value = np.asarray(value, dtype=np.float64)
        return AffineExpr(tuple(value.shape), {}, value)

    def _broadcast(self, expr: AffineExpr, out_shape: tuple[int, ...]) -> AffineExpr:
        if expr.shape == tuple(out_shape):
            return expr
        return expr.map(lambda arr, _b: np.array(np.broadcast_to(align(arr, out_shape), (arr.shape[0], *out_shape))))

    @staticmethod
    def _sum(shape: tuple[int, ...], parts: list[tuple[float, AffineExpr]]) -> AffineExpr:
        result = AffineExpr(tuple(shape), {}, np.zeros(shape))
        for sign, expr in parts:
            result.const = result.const + sign * expr.const_or_zero()
            for reg, arr in expr.terms.items():
                result.terms[reg] = result.terms[reg] + sign * arr if reg in result.terms else sign * arr
        return result

    def _per_level(self, operands: list[AffineExpr]) -> list[list[AffineExpr]]:
        """For every level some operand form reaches, the cheapest form of each operand at or below it.

        Forms of a sum (or a concatenation) are combinations of its operands' forms; keeping one per level
        is the Pareto front of (level, cost) when costs add up.
        """
        encrypted = [e for e in operands if e.terms]
        levels = sorted({self._form_level(f) for e in encrypted for f in e.forms()})
        combos = []
        for level in levels:
            combo = [self._cheapest(e, level, pending=False) if e.terms else e for e in operands]
            if all(c is not None for c in combo):
                combos.append(combo)
        return combos

    def _combine(self, node: onnx.NodeProto, out_shape: tuple[int, ...]) -> AffineExpr:
        """Encrypted + encrypted (a residual connection): the sum, its cheaper forms, and a checkpoint.

        Each form sums per-operand forms at one level (earlier registers that hold an operand are read
        directly); the checkpoint is the sum as one *shadow* register, created only if a later map prefers
        it. With them a deep residual stream costs a few terms per map instead of one per earlier block.
        """
        signs = [-1.0 if (node.op_type == "Sub" and pos == 1) else 1.0 for pos in range(len(node.input))]
        operands = [self._broadcast(self._operand(name, out_shape), out_shape) for name in node.input]
        result = self._sum(out_shape, list(zip(signs, operands, strict=True)))
        for combo in self._per_level(operands):
            result.alternatives.append(self._sum(out_shape, list(zip(signs, combo, strict=True))))
        result = self._drop_dominated_merge(result)
        if sum(1 for e in operands if e.terms) > 1:
            self._checkpoint(result)
        return self._prune(result)

    def _checkpoint(self, expr: AffineExpr) -> None:
        """Add a form that reads ``expr`` as one shadow register (materialised only if chosen)."""
        shadow = -(len(self._shadows) + 1)
        self._shadows[shadow] = AffineExpr(expr.shape, expr.terms, expr.const, list(expr.alternatives))
        expr.alternatives.append(self._identity(shadow, expr.shape))

    @staticmethod
    def _identity(reg: int, shape: tuple[int, ...]) -> AffineExpr:
        return AffineExpr(tuple(shape), {reg: identity_term(int(np.prod(shape)))}, None)

    # ---------------------------------------------------------------------------------------------------
    def _level(self, reg: int) -> int:
        """Rescales consumed by a register (a shadow: by the register it would become)."""
        if reg >= 0:
            return self._levels[reg]
        if reg in self._shadow_regs:
            return self._levels[self._shadow_regs[reg]]
        return min(self._form_level(f) for f in self._shadows[reg].forms())

    def _form_level(self, expr: AffineExpr) -> int:
        """The level a map computing this form lands on."""
        return max((self._level(r) for r in expr.terms), default=-1) + 1

    def _form_cost(self, expr: AffineExpr, pending: bool = True) -> float:
        """Estimated cost of the map computing this form, plus (``pending``) that of the shadows it creates."""
        known = self._costs.get(id(expr))
        if known is None or known[0]() is not expr:
            diagonals = sum(term_diagonals(arr, self._reg_shape(r), expr.shape, packed_input=r == 0,
                                           input_slots=self._input_slots) for r, arr in expr.terms.items())
            known = self._costs[id(expr)] = (weakref.ref(expr), map_cost(diagonals))
        return known[1] + (self._pending(expr) if pending else 0.0)

    def _pending(self, expr: AffineExpr) -> float:
        """Half the cost of the checkpoints this form would create: a checkpoint of the stream that feeds a
        product usually serves both of its operands (and often later maps too)."""
        return 0.5 * sum(self._shadow_cost(r) for r in expr.terms if r < 0 and r not in self._shadow_regs)

    def _reg_shape(self, reg: int) -> tuple[int, ...]:
        return self.circuit.shapes[reg] if reg >= 0 else self._shadows[reg].shape

    def _shadow_cost(self, shadow: int) -> float:
        if shadow not in self._shadow_costs:
            expr = self._shadows[shadow]
            self._shadow_costs[shadow] = self._form_cost(self._cheapest(expr, self._level(shadow)))
        return self._shadow_costs[shadow]

    def _cheapest(self, expr: AffineExpr, level: int, pending: bool = True) -> AffineExpr | None:
        """The cheapest form of ``expr`` whose map lands at or below ``level`` (None if none does).

        ``pending=False`` ignores the cost of creating checkpoints: used for the forms of a sum, whose
        final cost is only known once later ops have acted on it.
        """
        forms = [f for f in expr.forms() if self._form_level(f) <= level]
        if len(forms) <= 1:
            return forms[0] if forms else None
        # ties (e.g. a checkpoint and a register holding the same tensor) go to what exists already
        return min(forms, key=lambda f: (self._form_cost(f, pending), self._pending(f)))

    def _drop_dominated_merge(self, expr: AffineExpr) -> AffineExpr:
        """``expr`` without its merged form when that holds over ``MERGE_KEEP_BYTES`` and another form at its
        level is ``MERGE_SLACK`` times cheaper (pending checkpoints counted, as :meth:`_cheapest` counts them):
        the planner would not pick the merged map here, and composing it further along a residual stream is
        what makes deep networks' terms dense (every earlier block's register mapped through every later
        block). The cheaper form becomes the expression.
        """
        if not expr.alternatives or not expr.terms:
            return expr
        held = sum(term_bytes(arr) for arr in expr.terms.values())
        if held <= MERGE_KEEP_BYTES:
            return expr
        level, own = self._form_level(expr), self._form_cost(expr)
        rivals = [f for f in expr.alternatives if f.terms and self._form_level(f) <= level]
        if not rivals:
            return expr
        best = min(rivals, key=lambda f: (self._form_cost(f), self._pending(f)))
        if MERGE_SLACK * self._form_cost(best) >= own:
            return expr
        rest = [f for f in expr.alternatives if f is not best]
        log.debug("merged form of a %s tensor dropped at level %d: cost %.0f against %.0f (registers %s), %.1f MB",
                  expr.shape, level, own, self._form_cost(best), sorted(best.terms), held / 1e6)
        return AffineExpr(expr.shape, dict(best.terms), best.const_or_zero(), rest)

    def _prune(self, expr: AffineExpr) -> AffineExpr:
        """Keep the alternatives on the (level, own cost) Pareto front; the merged form always stays.

        A checkpoint's own map is not counted here: it is paid once, by whichever later map reads it.
        """
        entries = sorted((self._form_level(f), self._form_cost(f, pending=False), i) for i, f in enumerate(expr.forms()))
        kept, best = [], float("inf")
        for _level, cost, i in entries:
            if cost < best:
                best = cost
                if i > 0:
                    kept.append(expr.alternatives[i - 1])
        expr.alternatives = kept
        return expr

    def _resolve(self, expr: AffineExpr) -> AffineExpr:
        """Replace shadow ids by real registers, creating the shadow maps on first use."""
        if all(r >= 0 for r in expr.terms):
            return expr
        terms, const = {}, expr.const_or_zero().copy()
        for reg, arr in expr.terms.items():
            if reg < 0:
                if reg not in self._shadow_regs:
                    self._shadow_regs[reg] = self._materialise(self._shadows[reg], f"checkpoint {-reg}")
                    self._release(reg)
                if reg in self._shadow_offsets:  # shadow = (register - c) / d
                    inverse, offset = self._shadow_offsets[reg]
                    const = const + (arr.T @ offset).reshape(expr.shape)
                    arr = (inverse @ arr).tocsr()
                reg = self._shadow_regs[reg]
            terms[reg] = terms[reg] + arr if reg in terms else arr
        return AffineExpr(expr.shape, terms, const)

    def _concat(self, node: onnx.NodeProto, out_shape: tuple[int, ...]) -> AffineExpr:
        """Concatenation of the parts, and of their cheapest forms per level (e.g. the shift's channel groups)."""
        axis = int(attributes(node).get("axis", 0)) % len(out_shape)
        parts = [self._operand(n, out_shape) for n in node.input]
        result = self._concat_parts(parts, axis, out_shape)
        result.alternatives = [self._concat_parts(combo, axis, out_shape) for combo in self._per_level(parts)]
        return self._prune(result)

    @staticmethod
    def _concat_parts(parts: list[AffineExpr], axis: int, out_shape: tuple[int, ...]) -> AffineExpr:
        """Each part's elements land at their places in the output: a 0/1 selection matrix per part."""
        size = int(np.prod(out_shape))
        places = np.split(np.arange(size).reshape(out_shape), np.cumsum([p.shape[axis] for p in parts])[:-1],
                          axis=axis)
        terms: dict[int, sp.csr_matrix] = {}
        for part, place in zip(parts, places, strict=True):
            index = place.reshape(-1)
            select = sp.csr_matrix((np.ones(len(index)), (np.arange(len(index)), index)), shape=(len(index), size))
            for reg, arr in part.terms.items():
                moved = (arr @ select).tocsr()
                terms[reg] = terms[reg] + moved if reg in terms else moved
        const = np.concatenate([p.const_or_zero() for p in parts], axis=axis)
        return AffineExpr(tuple(out_shape), terms, const)

    def _split(self, node: onnx.NodeProto) -> None:
        src = self.env[node.input[0]]
        axis = int(attributes(node).get("axis", 0)) % len(src.shape)
        start = 0
        for out in node.output:
            shape = self._shape(out, node)
            stop = start + shape[axis]
            index = (slice(None),) * (axis + 1) + (slice(start, stop),)
            self.env[out] = src.map(lambda arr, _b, index=index: arr[index])
            start = stop

    # ---------------------------------------------------------------------------------------------------
    def _materialise(self, expr: AffineExpr, label: str, force: bool = False) -> int:
        """The register holding ``expr``: its cheapest form at its lowest level, emitted as a LinearNode.

        Afterwards ``expr`` also has the form "this register", so later maps may read it directly.
        """
        size = expr.size
        known = self._materialised.get(id(expr))
        if known is not None and known[0]() is expr:
            return known[1]
        if not expr.terms:
            raise LoweringError(f"{label}: the value is a constant; nothing to compute under encryption")
        if not force:
            for form in expr.forms():
                reg = _identity_register(form, size, self.circuit.sizes)
                if reg is not None:
                    return reg
        chosen = self._resolve(self._cheapest(expr, min(self._form_level(f) for f in expr.forms())))
        reg = len(self.circuit.sizes)
        inputs = sorted(chosen.terms)
        matrices = [chosen.terms[r].T.tocsr() for r in inputs]
        bias = None if chosen.const is None or not np.any(chosen.const) else chosen.const.reshape(-1).copy()
        self.circuit.nodes.append(LinearNode(reg, inputs, matrices, bias, size, label))
        if 0 in inputs and self._input_slots is None:
            self._fix_input_packing(matrices[inputs.index(0)], tuple(expr.shape))
        self.circuit.sizes[reg] = size
        self.circuit.shapes[reg] = tuple(expr.shape)
        self._levels[reg] = max(self._levels[r] for r in inputs) + 1
        self._materialised[id(expr)] = (weakref.ref(expr), reg)
        self._bind_checkpoints(expr, reg)
        expr.alternatives.append(self._identity(reg, expr.shape))
        return reg

    def _fix_input_packing(self, matrix: sp.csr_matrix, out_shape: tuple[int, ...]) -> None:
        """The first map reading the input decides its packing: estimates made before assumed every reader
        would get a packing of its own, so they are dropped."""
        self._input_slots = input_packing(matrix, out_shape, UNBOUNDED_SLOTS)
        self._costs.clear()
        self._shadow_costs.clear()

    def _bind_checkpoints(self, expr: AffineExpr, reg: int) -> None:
        """Checkpoints that ``reg`` holds up to a per-element scale and offset are read from ``reg`` instead.

        ``reg = d * shadow + c`` (a BatchNorm, an alpha) gives ``shadow = (reg - c) / d``: a later map that
        wants the checkpoint reads the register that exists already, at the same level and no extra cost.
        """
        for form in expr.alternatives:
            if len(form.terms) != 1:
                continue
            shadow, arr = next(iter(form.terms.items()))
            if shadow >= 0 or shadow in self._shadow_regs or arr.shape != (expr.size, expr.size):
                continue
            scale = arr.diagonal()
            if np.any(scale == 0) or arr.count_nonzero() != expr.size:
                continue
            self._shadow_regs[shadow] = reg
            self._release(shadow)
            self._shadow_offsets[shadow] = (sp.diags(1.0 / scale, format="csr"),
                                            -form.const_or_zero().reshape(-1) / scale)

    def _release(self, shadow: int) -> None:
        """Forget the forms of a checkpoint that is a register now: only its shape is read from here on."""
        self._shadows[shadow] = AffineExpr(self._shadows[shadow].shape)

    def _register_expr(self, reg: int, shape: tuple[int, ...]) -> AffineExpr:
        return self._identity(reg, shape)

    def _mul_regs(self, a: int, b: int, label: str, shape: tuple[int, ...]) -> int:
        reg = len(self.circuit.sizes)
        size = int(np.prod(shape))
        self.circuit.nodes.append(MulNode(reg, a, b, size, label))
        self._levels[reg] = max(self._levels[a], self._levels[b]) + 1
        self.circuit.sizes[reg] = size
        self.circuit.shapes[reg] = tuple(shape)
        return reg

    def _product(self, node, a: AffineExpr, b: AffineExpr, out_shape) -> AffineExpr:
        ra = self._materialise(a, f"{node.name} lhs")
        rb = ra if a is b else self._materialise(b, f"{node.name} rhs")
        return self._register_expr(self._mul_regs(ra, rb, node.name, out_shape), out_shape)

    def _power(self, node: onnx.NodeProto, out_shape) -> AffineExpr:
        exponent = self._const(node.input[1]) if node.input[1] not in self.env else None
        if exponent is None or np.asarray(exponent).size != 1:
            raise LoweringError(f"{node.name}: Pow needs a constant scalar exponent")
        k = float(np.asarray(exponent).reshape(-1)[0])
        if k != int(k) or k < 1:
            raise LoweringError(f"{node.name}: Pow exponent {k} is not a positive integer (not a polynomial)")
        base = self._materialise(self._broadcast(self.env[node.input[0]], out_shape), f"{node.name} base")
        cache: dict[int, int] = {1: base}

        def power(e: int) -> int:  # x^e = x^hi * x^(e-hi) with hi the largest power of two below e: depth ceil(log2 e)
            if e not in cache:
                hi = 1 << ((e - 1).bit_length() - 1)
                cache[e] = self._mul_regs(power(hi), power(e - hi), f"{node.name}^{e}", out_shape)
            return cache[e]

        return self._register_expr(power(int(k)), out_shape)

    def _matmul(self, node: onnx.NodeProto, out_shape) -> AffineExpr:
        a_expr, b_expr = (self.env[n] for n in node.input)
        if len(a_expr.shape) < 2 or len(b_expr.shape) < 2:
            raise LoweringError(f"{node.name}: ct x ct MatMul needs operands with at least 2 axes")
        ra = self._materialise(a_expr, f"{node.name} lhs")
        rb = self._materialise(b_expr, f"{node.name} rhs")
        reg = len(self.circuit.sizes)
        size = int(np.prod(out_shape))
        self.circuit.nodes.append(MatMulNode(reg, ra, rb, a_expr.shape, b_expr.shape, tuple(out_shape), size, node.name))
        self._levels[reg] = max(self._levels[ra], self._levels[rb]) + 1
        self.circuit.sizes[reg] = size
        self.circuit.shapes[reg] = tuple(out_shape)
        return self._register_expr(reg, out_shape)


def _identity_register(form: AffineExpr, size: int, sizes: dict[int, int]) -> int | None:
    """The register ``form`` is exactly (one real register, identity, no constant), else None."""
    if len(form.terms) != 1 or (form.const is not None and np.any(form.const)):
        return None
    reg, arr = next(iter(form.terms.items()))
    if reg >= 0 and arr.shape == (size, size) and sizes[reg] == size and arr.count_nonzero() == size \
            and np.all(arr.diagonal() == 1.0):
        return reg
    return None


def lower_onnx(model: onnx.ModelProto, factored: frozenset[str] = frozenset(),
               memory_limit: int | None = None) -> Circuit:
    """Lower a polynomial ONNX model (one input, one output, static shapes) to a :class:`Circuit`.

    ``factored``: names of convolutions (see :func:`factoring_sites`) computed as registers of their own.
    ``memory_limit``: bytes of affine terms the lowering may hold (None: unbounded); past it,
    :class:`~polyfhe.exporters.ckks.memory.CompileMemoryError` names the node before the memory is taken.
    """
    circuit = _Lowering(model, frozenset(factored), memory_limit).run()
    log.info("lowered %d nodes: %d linear maps, %d products, depth %d, largest register %d, peak %.2f GB of terms",
             len(model.graph.node), sum(isinstance(n, LinearNode) for n in circuit.nodes),
             sum(not isinstance(n, LinearNode) for n in circuit.nodes), circuit.depth, circuit.max_size(),
             circuit.lowering_peak_bytes / 1e9)
    return circuit
