"""What one evaluation of a program does and holds, as :class:`~polyfhe.runtime.opcosts.OpSite` counts.

Two ways to get it:

* **compiled** (:func:`program_workload`): from a compiled program's steps, counted by the engine's record
  (``Backend.workload``, in ``polyfhe/engines/<engine>/tally.py``) exactly as the engine runs them (SEAL:
  the executor's BSGS schedule, whose rotation and product counts are the manifest's ``info.planned``; Lattigo:
  the evaluator's container, hoisted baby steps apart from giant steps). Every site carries the primes of the
  level it runs at. ``encode`` sites are the plaintexts a cold server encodes: SEAL on the first query, Lattigo
  when it loads the model (each diagonal over its level's primes and the special prime).
* **estimated** (:func:`traced_workload`): for models too large to compile here (the 224x224 ImageNet models need
  more slots than one ciphertext has and gigabytes of sparse matrices to lower). The torch model runs once on
  PyTorch's ``meta`` device (no weights allocated) and every weighted op, ct x ct product and residual sum is
  recorded with its shapes. Each weighted op is costed as the diagonal method over as many ciphertexts as its
  tensors need (plaintext products = its non-zero weights over the diagonal length, BSGS rotations
  ``n_in (b - 1) + n_out (g - 1)``); levels follow the compiler's rule (linear ops between products merge into one
  level). It is an estimate of a plan polyfhe does not build (multi-ciphertext packing); ``docs/cost-model.md``
  compares it with compiled tallies.

Both return a :class:`Workload`; :mod:`polyfhe.cost.model` turns it into seconds and bytes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from polyfhe.program.bootstrapping import bootstraps_needed
from polyfhe.program.engines import BACKEND_NAMES, get_backend
from polyfhe.program.params import CKKSParams
from polyfhe.program.sizes import poly_bytes
from polyfhe.runtime.opcosts import OpSite, Tally, merge
from polyfhe.runtime.workload_types import Workload, data_primes, empty_counters

__all__ = ["TracedModel", "Workload", "data_primes", "program_workload", "trace_model",
           "traced_workload"]

log = logging.getLogger(__name__)


def program_workload(program) -> Workload:
    """The workload of a compiled program, counted by the engine its manifest names."""
    engine = program.manifest.backend
    tally = get_backend(engine).workload
    if tally is None:
        known = sorted(name for name in BACKEND_NAMES if get_backend(name).workload is not None)
        raise ValueError(f"no workload tally for backend {engine!r}; known: {known}")
    return tally(program)


# --------------------------------------------------------------------------------------------------------------
# estimated: a traced torch model
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TracedOp:
    """One recorded op: ``kind`` "linear" (weights), "product" (ct x ct, elementwise), "matmul" (ct x ct) or
    "add" (a residual sum, a checkpoint the planner may read); sizes padded to the layout's power-of-two token
    blocks; ``level`` in the compiler's merged levels; ``reads`` the registers it reads."""

    kind: str
    level: int
    in_size: int
    out_size: int
    nonzeros: int = 0  # linear: non-zero weights of its matrix, padded tokens; matmul: multiply-adds
    reads: tuple[int, ...] = ()
    out: int = -1


@dataclass(frozen=True)
class TracedModel:
    input_size: int
    ops: tuple[TracedOp, ...]
    depth: int
    widest: int  # padded values of the widest tensor a ciphertext holds (maps composed into one are not held)

    def last_reads(self) -> dict[int, int]:
        """Register -> the highest level any op reads it at."""
        out: dict[int, int] = {}
        for op in self.ops:
            for r in op.reads:
                out[r] = max(out.get(r, 0), op.level)
        return out


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _padded(shape) -> int:
    """Values of a tensor in polyfhe's layout: channel-major, each channel's tokens padded to a power of two."""
    dims = [int(d) for d in shape][1:]  # drop the batch
    if not dims:
        return 1
    if len(dims) == 1:
        return _pow2(dims[0])
    return dims[0] * _pow2(int(np.prod(dims[1:])))


class _Tracer:
    """Taint tracking through torch functions: which tensors are encrypted, at what level, from which registers."""

    LINEAR = frozenset({"conv1d", "conv2d", "conv3d", "linear", "conv_transpose2d"})
    MATMUL = frozenset({"matmul", "mm", "bmm", "__matmul__", "einsum"})
    MUL = frozenset({"mul", "__mul__", "__rmul__", "mul_", "__imul__", "multiply"})
    POW = frozenset({"pow", "__pow__", "square"})
    ADD = frozenset({"add", "__add__", "__radd__", "add_", "__iadd__", "sub", "__sub__", "__rsub__", "sum"})

    def __init__(self) -> None:
        self.ops: list[TracedOp] = []
        self.registers = 0
        # padded values of the widest tensor held in ciphertexts: the input of a linear map that is itself the
        # output of one is never held (the compiler composes adjacent maps, e.g. a two-conv patch embedding)
        self.widest = 0

    @staticmethod
    def info(t):
        return getattr(t, "_polyfhe_trace", None)

    def new_register(self) -> int:
        self.registers += 1
        return self.registers

    def record(self, func, args, kwargs, out):
        import torch

        name = getattr(func, "__name__", "")
        flat = [a for a in args if isinstance(a, torch.Tensor)]
        flat += [a for a in args if isinstance(a, (list, tuple)) for a in a if isinstance(a, torch.Tensor)]
        tainted = [a for a in flat if self.info(a) is not None]
        outs = out if isinstance(out, (list, tuple)) else [out]
        outs = [o for o in outs if isinstance(o, torch.Tensor)]
        if not tainted or not outs:
            return
        infos = [self.info(a) for a in tainted]
        # (level of the registers, pending linear map?, registers read)
        base = max(i[0] for i in infos)
        pending = any(i[1] for i in infos)
        regs = tuple(sorted({r for i in infos for r in i[2]}))
        materialised = max(i[0] + i[1] for i in infos)
        x, y = tainted[0], outs[0]
        constant = next((a for a in flat if self.info(a) is None), None)
        if name in self.LINEAR or (name in self.MATMUL and len(tainted) == 1 and constant is not None):
            nnz = _linear_nonzeros(name, x, constant, y)
            if not pending:
                self.widest = max(self.widest, _padded(x.shape))
            self.ops.append(TracedOp("linear", base + 1, _padded(x.shape), _padded(y.shape), nnz, regs))
            state = (base, True, regs)
        elif (name in self.MUL and len(tainted) == 2) or (name in self.POW and _int_exponent(args) >= 2):
            self.widest = max(self.widest, _padded(y.shape))
            times = max(1, math.ceil(math.log2(_int_exponent(args)))) if name in self.POW else 1
            level = materialised + times
            reg = self.new_register()
            for k in range(times):
                self.ops.append(TracedOp("product", materialised + k + 1, _padded(y.shape), _padded(y.shape), 0,
                                         regs, reg))
            state = (level, False, (reg,))
        elif name in self.MATMUL and len(tainted) == 2:
            reg = self.new_register()
            macs = int(np.prod(y.shape)) * int(x.shape[-1])
            self.widest = max(self.widest, _padded(x.shape), _padded(tainted[1].shape), _padded(y.shape))
            self.ops.append(TracedOp("matmul", materialised + 1, _padded(x.shape) + _padded(tainted[1].shape),
                                     _padded(y.shape), macs, regs, reg))
            state = (materialised + 1, False, (reg,))
        elif name in self.ADD and len(tainted) == 2:
            reg = self.new_register()  # a residual sum: a checkpoint register the planner may read
            self.widest = max(self.widest, _padded(y.shape))
            self.ops.append(TracedOp("add", materialised, _padded(y.shape), _padded(y.shape), 0, regs, reg))
            state = (base, pending, (reg,))
        else:  # reshapes, scalar scales, BatchNorm, pooling, adds of constants: merged into the maps
            state = (base, pending, regs)
        for o in outs:
            o._polyfhe_trace = state


def _int_exponent(args) -> int:
    if len(args) >= 2 and isinstance(args[1], (int, float)) and float(args[1]).is_integer():
        return int(args[1])
    return 2 if len(args) == 1 else 0


def _linear_nonzeros(name: str, x, weight, y) -> int:
    """Non-zero weights of a weighted op's matrix, with the output's tokens padded as the layout pads them."""
    out_c = int(y.shape[1]) if y.dim() > 2 else int(y.shape[-1])
    if weight is None:
        return _padded(y.shape)
    if name.startswith("conv"):
        per_out = int(np.prod(weight.shape[1:]))  # input channels of its group x kernel taps
        tokens = _pow2(int(np.prod(y.shape[2:])))
        return out_c * tokens * per_out
    k = int(x.shape[-1])  # linear / matmul by a constant: tokens x K x M
    tokens = _pow2(int(np.prod(y.shape[:-1])) // max(1, int(y.shape[0])))
    return tokens * k * int(y.shape[-1])


def trace_model(model, input_shape: tuple[int, ...]) -> TracedModel:
    """Run ``model`` once on the meta device and record what its encrypted evaluation would do."""
    import torch
    from torch.overrides import TorchFunctionMode

    tracer = _Tracer()

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tracer.record(func, args, kwargs or {}, out)
            return out

    device = next(model.parameters(), torch.empty(0, device="meta")).device
    x = torch.empty((1, *input_shape), device=device)
    x._polyfhe_trace = (0, False, (0,))
    with torch.no_grad(), Mode():
        y = model.eval()(x)
    info = tracer.info(y)
    depth = info[0] + info[1] if info else 0
    widest = max(_padded(x.shape), _padded(y.shape), tracer.widest)
    return TracedModel(_padded(x.shape), tuple(tracer.ops), depth, widest)


def _bsgs(products: int, n_in: int, n_out: int) -> tuple[int, int]:
    """(baby, giant) rotations of a multi-ciphertext BSGS map: baby steps per input ciphertext, giant steps per
    output ciphertext, ``b`` chosen to minimise ``n_in (b - 1) + n_out (g - 1)`` with ``b g = diagonals``."""
    d = max(1, products // max(1, n_in * n_out))
    b = min(d, max(1, round(math.sqrt(d * n_out / n_in))))
    g = math.ceil(d / b)
    return n_in * (b - 1), n_out * (g - 1)


def _diagonal_method(n: int, p: int, products: int, giants: int, babies: int, n_in: int, n_out: int) -> Tally:
    """An estimated linear map as polyfhe's executor runs it: a product, an addition and an encode per diagonal,
    a key-switched rotation per baby and giant step, a rescale per output ciphertext."""
    site = {"plain_product": products, "add": products, "rescale": n_out}
    return merge({OpSite(k, n, p): v for k, v in site.items()},
                 {OpSite("rotation", n, p, p): babies + giants, OpSite("encode", n, p): products})


def traced_workload(traced: TracedModel, engine: str, params: CKKSParams, *, bootstrap_slots: int | None = None,
                    samples: int = 1) -> Workload:
    """The estimated workload of a traced model on ``params`` (a residual chain when ``bootstrap_slots`` is set:
    the model's levels then wrap around it, a bootstrap wherever a register crosses a cut)."""
    record = get_backend(engine)
    traits = record.cost
    linear_tally = traits.traced_linear or _diagonal_method

    n, slots, top = params.poly_modulus_degree, params.slots, params.levels
    scale = (top / max(1, traced.depth)) if bootstrap_slots is None else 1.0
    tally: Tally = {}
    keys: dict[tuple[int, int, int], int] = {}
    counters = empty_counters()
    plaintexts = plain_bytes = 0
    segment = top - 1 if bootstrap_slots else top

    def primes_at(level: int) -> int:
        local = level if bootstrap_slots is None else (level - 1) % max(1, segment) + 1
        return max(1, data_primes(params, min(top, max(1, round(local * scale))) - 1))

    live = peak = 1
    for op in traced.ops:
        p = primes_at(op.level)
        n_in, n_out = math.ceil(op.in_size / slots), math.ceil(op.out_size / slots)
        if op.kind == "linear":
            shortest = max(1, min(op.in_size, op.out_size, slots))
            products = max(n_in, n_out, math.ceil(op.nonzeros / shortest))
            babies, giants = _bsgs(products, n_in, n_out)
            keys[(products // max(1, n_in * n_out), n_in, n_out)] = babies // n_in + giants // n_out
            tally = merge(tally, linear_tally(n, p, products, giants, babies, n_in, n_out))
            counters["rotations"] += babies + giants
            counters["key_switches"] += babies + giants
            counters["plain_products"] += products
            plaintexts += products
            plain_bytes += products * poly_bytes(n, p + traits.special_primes_in_plaintexts)
            peak = max(peak, live + n_in * 2 + n_out)
        elif op.kind == "product":
            tally = merge(tally, {OpSite("ct_product", n, p, p): n_out, OpSite("rescale", n, p): n_out})
            counters["key_switches"] += n_out
        elif op.kind == "matmul":  # ct x ct matmul: products and the rotations that sum them, per slot-full
            count = max(n_out, math.ceil(op.nonzeros / slots))
            tally = merge(tally, {OpSite("ct_product", n, p, p): count, OpSite("rotation", n, p, p): count,
                                  OpSite("rescale", n, p): n_out})
            counters["key_switches"] += 2 * count
        if op.out >= 0:
            live += n_out
    # bootstraps: every register crossing a cut is refreshed, a ciphertext of up to bootstrap_slots at a time
    bootstraps, notes = 0, ["estimated from a traced model: diagonal method over multiple ciphertexts"]
    spec = None
    if bootstrap_slots:
        cuts = [segment * (i + 1) for i in range(bootstraps_needed(traced.depth, top))]
        sizes = {0: traced.input_size, **{op.out: op.out_size for op in traced.ops if op.out >= 0}}
        made = {0: 0, **{op.out: op.level for op in traced.ops if op.out >= 0}}
        last = traced.last_reads()
        for c in cuts:
            bootstraps += sum(math.ceil(sizes[r] / bootstrap_slots) for r, lv in made.items()
                              if lv <= c < last.get(r, -1))
        spec = record.bootstrapping.default_spec(params, bootstrap_slots).to_dict()
        notes.append(f"{len(cuts)} cuts of a {top}-level residual chain")
    galois = sum(keys.values())  # distinct steps: maps of one shape share theirs
    counters["encodes_cold"] = plaintexts
    return Workload(engine, "estimated", params, tally, galois_keys=galois,
                    relin=any(op.kind in ("product", "matmul") for op in traced.ops), plaintexts=plaintexts,
                    plaintext_bytes=plain_bytes, live_ciphertexts=peak, samples=samples, bootstraps=bootstraps,
                    boot_spec=spec, counters=counters, notes=tuple(notes))
