"""Program execution, written once against a small slot-operation backend.

:class:`SlotOps` is what a backend provides (rotate, plaintext product, add, rescale, ct x ct product, level
matching), and :class:`OptionalSlotOps` what it may add (a fused dot, hoisted rotations, bootstrapping).
:class:`NumpyOps` implements it on plain float64 slot vectors, which checks a compiled plan exactly without
encryption; ``polyfhe.engines.seal.ops.SealOps`` implements it on SEAL ciphertexts;
:class:`~polyfhe.runtime.counting.CountingOps` counts the operations without computing (the planned counters).
The ``single`` layout keeps one sample in the slots of one ciphertext per register; ``batch`` keeps one
ciphertext per tensor element with one sample per slot. :func:`execute` reads the schedule (the manifest's
steps, layout, lanes and output register) and the named arrays, never the program object.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from polyfhe.program.manifest import Step
from polyfhe.program.slot_layout import pack_single, unpack_single
from polyfhe.program.steps import BootstrapAttrs
from polyfhe.runtime.plaintexts import PlaintextKey

__all__ = ["OPTIONAL_OPS", "THREADS_ENV", "InterleavedOps", "NumpyOps", "OptionalSlotOps", "Schedule", "SlotOps",
           "default_threads", "dot", "execute", "observe_steps", "optional_op", "run_plain", "sum_of_products"]

ZERO_ROW_WEIGHT = 2.0**-30
GIANT_ROTATION_WEIGHT = 20.0  # a giant step's rotation in plaintext products, to order the pool's work (dearest first)
log = logging.getLogger(__name__)

THREADS_ENV = "POLYFHE_THREADS"  # threads per evaluation (giant steps of the single layout); default: CPU count

# progress(index, step) of the evaluations this context runs, set by ``observe_steps``
_STEP_OBSERVER: contextvars.ContextVar[Callable[[int, Step], None] | None] = contextvars.ContextVar(
    "polyfhe_step_observer", default=None)


@contextlib.contextmanager
def observe_steps(callback: Callable[[int, Step], None]) -> Iterator[None]:
    """Call ``callback(index, step)`` after each step of every evaluation run in this thread inside the block:
    a progress bar for an evaluation whose engine server takes no callback (``polyfhe run``)."""
    token = _STEP_OBSERVER.set(callback)
    try:
        yield
    finally:
        _STEP_OBSERVER.reset(token)


class SlotOps(Protocol):
    slots: int
    parallel_products: bool  # whether ct x ct products (multiply, relin_rescale) release the GIL: then independent
    # products run on the pool's workers at once; else one after another (threads would only take turns)

    def level(self, ct: Any) -> int: ...
    def drop_to(self, ct: Any, level: int) -> Any: ...
    def rotate(self, ct: Any, step: int) -> Any: ...
    def mul_vector(self, ct: Any, vec: np.ndarray, key: PlaintextKey) -> Any: ...  # pre-rescale, scale -> target
    def mul_scalar(self, ct: Any, value: float) -> Any: ...  # pre-rescale, scale -> target
    def add(self, a: Any, b: Any) -> Any: ...
    def add_vector(self, ct: Any, vec: np.ndarray, key: PlaintextKey) -> Any: ...  # at the pre-rescale scale
    def add_scalar(self, ct: Any, value: float) -> Any: ...  # every slot, at the pre-rescale scale
    def rescale(self, ct: Any) -> Any: ...
    def multiply(self, a: Any, b: Any) -> Any: ...  # ct x ct, relinearised, not rescaled
    def relin_rescale(self, ct: Any) -> Any: ...


class OptionalSlotOps(Protocol):
    """What a backend may add to :class:`SlotOps`; the executor asks for each with :func:`optional_op` and runs
    without it (products one by one, rotations one by one) except ``bootstrap``, which a program that bootstraps
    needs."""

    def dot(self, terms: list[tuple[Any, np.ndarray, PlaintextKey]]) -> Any: ...  # sum of mul_vector, one pass
    def decompose(self, ct: Any) -> Any | None: ...  # ct decomposed for several hoisted rotations (None: declined)
    def rotate_decomposed(self, decomposition: Any, step: int) -> Any: ...  # a decomposed ct rotated by step
    def bootstrap(self, ct: Any, attrs: BootstrapAttrs) -> Any: ...  # a fresh ciphertext of the same values
    # an all-zero row of the batch layout, at a product's level and scale, from one of its inputs (without it: that
    # input times ZERO_ROW_WEIGHT, since SEAL refuses a product by 0)
    def zero_row(self, ct: Any) -> Any: ...


OPTIONAL_OPS = frozenset(name for name in OptionalSlotOps.__dict__ if not name.startswith("_"))


def optional_op(ops: SlotOps, name: str) -> Callable | None:
    """``ops``' optional operation ``name`` (one of :class:`OptionalSlotOps`'), or None where ``ops`` lacks it."""
    if name not in OPTIONAL_OPS:
        raise KeyError(f"{name!r} is not an optional slot operation; they are {sorted(OPTIONAL_OPS)}")
    return getattr(ops, name, None)


class Schedule(Protocol):
    """What :func:`execute` reads of a program: a :class:`~polyfhe.program.manifest.ProgramManifest` is one."""

    layout: str
    samples_per_ciphertext: int
    steps: Sequence[Step]
    output: int


class NumpyOps:
    """Plain slots: exact arithmetic, levels ignored. Rotation by k moves slot t+k to t (as SEAL does)."""

    parallel_products = False  # numpy's products of one vector are too short to gain from threads

    def __init__(self, slots: int) -> None:
        self.slots = slots

    def level(self, ct):
        return 0

    def drop_to(self, ct, level):
        return ct

    def rotate(self, ct, step):
        return np.roll(ct, -step, axis=-1)

    def mul_vector(self, ct, vec, key):
        return ct * vec

    def mul_scalar(self, ct, value):
        return ct * value

    def add(self, a, b):
        return b if a is None else a + b

    def add_vector(self, ct, vec, key):
        out = ct.copy()
        out[..., : len(vec)] += vec
        return out

    def add_scalar(self, ct, value):
        return ct + value

    def rescale(self, ct):
        return ct

    def multiply(self, a, b):
        return a * b

    def relin_rescale(self, ct):
        return ct

    def bootstrap(self, ct, attrs: BootstrapAttrs):
        """What the engine's sparse bootstrap returns: the first ``slots`` real slots, repeated over the ring."""
        width = attrs.slots
        head = np.asarray(ct)[..., :width]
        return np.tile(head, (1,) * (head.ndim - 1) + (self.slots // width,))


class InterleavedOps:
    """k samples per ciphertext: sample j in real slots ``u*k + j``. The plan works on ``slots/k`` virtual slots;
    a virtual rotation by r is a real one by ``r*k`` and a virtual plaintext vector is repeated k times."""

    def __init__(self, inner: SlotOps, lanes: int) -> None:
        self.inner, self.lanes = inner, lanes
        self.slots = inner.slots // lanes

    @property
    def parallel_products(self) -> bool:
        return self.inner.parallel_products

    def rotate(self, ct, step):
        return self.inner.rotate(ct, step * self.lanes)

    def rotate_decomposed(self, decomposition, step):
        return self.inner.rotate_decomposed(decomposition, step * self.lanes)

    def mul_vector(self, ct, vec, key):
        return self.inner.mul_vector(ct, np.repeat(vec, self.lanes), key)

    def dot(self, terms):
        return dot(self.inner, [(ct, np.repeat(vec, self.lanes), key) for ct, vec, key in terms])

    def add_vector(self, ct, vec, key):
        return self.inner.add_vector(ct, np.repeat(vec, self.lanes), key)

    def __getattr__(self, name):  # level, drop_to, mul_scalar, add, add_scalar, rescale, multiply, relin_rescale
        return getattr(self.inner, name)


def dot(ops: SlotOps, terms: list[tuple[Any, np.ndarray, PlaintextKey]]) -> Any:
    """The sum of ``ops.mul_vector(ct, vec, key)`` over ``terms``: in one pass where the backend has one (SEAL's
    native dot kernel), else product by product."""
    fused = optional_op(ops, "dot")
    return fused(terms) if fused is not None else sum_of_products(ops, terms)


def sum_of_products(ops: SlotOps, terms: list[tuple[Any, np.ndarray, PlaintextKey]]) -> Any:
    """``ops.mul_vector`` of each term, summed with ``ops.add`` one by one."""
    acc = None
    for ct, vec, key in terms:
        acc = ops.add(acc, ops.mul_vector(ct, vec, key))
    return acc


# ------------------------------------------------------------------------------------------------------------
# single layout: registers are single ciphertexts (or slot vectors)
# ------------------------------------------------------------------------------------------------------------
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(threads: int) -> ThreadPoolExecutor | None:
    """The process's pool of ``threads`` workers (``None`` for one thread), shared by every run: concurrent
    requests share the cores instead of each starting ``threads`` more (``cores^2`` threads on a busy server)."""
    if threads <= 1:
        return None
    with _POOLS_LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="polyfhe-ckks")
        return pool


class RunContext:
    """Per-run state: rotated registers shared between maps, and the process's thread pool (SEAL releases the
    GIL). Work items never submit to the pool themselves, so runs sharing it cannot deadlock."""

    def __init__(self, threads: int) -> None:
        self.cache: dict = {}
        self.pool = shared_pool(threads)

    def map(self, fn: Callable, items: list) -> list:
        if self.pool is None or len(items) < 2:
            return [fn(item) for item in items]
        return list(self.pool.map(fn, items))


class _LinearWork:
    """One single-layout linear step split into phases, so that adjacent independent steps share the thread
    pool's rounds: their baby rotations in one round, their giant steps in the next (fewer idle tails)."""

    def __init__(self, step: Step, regs: dict, ops: SlotOps, arrays: dict, run: RunContext) -> None:
        self.step, self.ops, self.arrays, self.run = step, ops, arrays, run
        attrs = self.attrs = step.linear
        self.baby = int(attrs.baby)
        self.rescale_first = bool(attrs.rescale_giants)
        self.target = step.level - 1
        self.pre = tuple(attrs.pre_sums or ())  # window sums of each input before its diagonals
        self._windows: dict[int, Any] = {}
        self._window_lock = threading.Lock()
        self.groups: dict[int, list] = {}  # giant step g -> [(term index, rows)]: one rotation per g for all terms
        self.needed: dict = {}  # baby rotations this step needs that no earlier map made: key -> input register
        for ti, term in enumerate(attrs.terms):
            ks = arrays[term.diagonals.ks]
            for g in np.unique(ks // self.baby):
                rows = np.nonzero(ks // self.baby == g)[0]
                self.groups.setdefault(int(g), []).append((ti, rows))
                for row in rows:
                    key = self.key(term.input, int(ks[row] % self.baby))
                    if key not in run.cache:
                        self.needed[key] = term.input
        self.dropped = {r: ops.drop_to(regs[r], self.target) for r in {t.input for t in attrs.terms}}

    def key(self, register: int, offset: int) -> tuple:
        """The run cache's key of ``register`` rotated by ``offset`` at this step's level (its window sum's,
        with ``pre_sums``: other maps reading the register must not get that)."""
        return (register, offset, self.target) + ((self.pre,) if self.pre else ())

    def _window(self, register: int) -> Any:
        with self._window_lock:
            if register not in self._windows:
                self._windows[register] = rotate_sums(self.ops, self.dropped[register], self.pre)
            return self._windows[register]

    def base(self, key):
        """The ciphertext a baby rotation ``key`` rotates: the register at this step's level (or its window sum)."""
        return self._window(key[0]) if self.pre else self.dropped[key[0]]

    def rotate_baby(self, key):
        base = self.base(key)
        return base if key[1] == 0 else self.ops.rotate(base, key[1])

    def giant_items(self) -> list[tuple[float, int, Any]]:
        """(estimated cost in plaintext products, giant step, parts) per giant step: the pool takes the dearest
        first, so the round ends with short items."""
        return [(sum(len(rows) for _, rows in parts) + (GIANT_ROTATION_WEIGHT if g else 0.0), g, parts)
                for g, parts in self.groups.items()]

    def giant(self, g: int, parts: list) -> Any:
        step, ops, arrays, run = self.step, self.ops, self.arrays, self.run
        products = []
        for ti, rows in parts:
            term = self.attrs.terms[ti]
            ks, diags = arrays[term.diagonals.ks], arrays[term.diagonals.diags]
            for row in rows:
                rot = run.cache[self.key(term.input, int(ks[row] % self.baby))]
                products.append((rot, diags[row], PlaintextKey.diagonal(step.out, ti, int(row))))
        inner = dot(ops, products)
        if self.rescale_first:  # a rescaled partial sum rotates over one prime fewer (a cheaper key switch)
            inner = ops.rescale(inner)
        return inner if g == 0 else ops.rotate(inner, g * self.baby)

    def finish(self, parts: list) -> Any:
        ops, attrs = self.ops, self.attrs
        acc = None
        for part in parts:  # in giant-step order, as a single step sums them
            acc = ops.add(acc, part)
        shift = int(attrs.period)
        while shift < attrs.reduction_space(ops.slots):
            acc = ops.add(acc, ops.rotate(acc, shift))
            shift *= 2
        if attrs.bias:
            acc = ops.add_vector(acc, self.arrays[attrs.bias], PlaintextKey.bias(self.step.out))
        acc = acc if self.rescale_first else ops.rescale(acc)
        return rotate_sums(ops, acc, attrs.post_sums or ())


def rotate_sums(ops: SlotOps, ct: Any, shifts: tuple[int, ...]) -> Any:
    """``ct += rot(ct, s)`` for each shift in turn, into new ciphertexts (``ct`` itself is left as it was)."""
    for shift in shifts:
        ct = ops.add(ops.rotate(ct, shift), ct)
    return ct


def _single_linear_group(steps: list[Step], regs: dict, ops: SlotOps, arrays: dict, run: RunContext) -> list:
    """Outputs of adjacent linear steps of which none reads another's output, computed in shared rounds."""
    works = [_LinearWork(step, regs, ops, arrays, run) for step in steps]
    needed = {}
    for work in works:
        for key in work.needed:
            needed.setdefault(key, work)
    run.cache.update(_baby_rotations(needed, ops, run))
    items = sorted(((cost, i, g, parts) for i, work in enumerate(works) for cost, g, parts in work.giant_items()),
                   key=lambda item: -item[0])
    done = run.map(lambda item: works[item[1]].giant(item[2], item[3]), items)
    parts: list[dict[int, Any]] = [{} for _ in works]
    for (_, i, g, _), value in zip(items, done, strict=True):
        parts[i][g] = value
    return run.map(lambda pair: pair[0].finish([pair[1][g] for g in sorted(pair[1])]),
                   list(zip(works, parts, strict=True)))


HOIST_BATCH = 4  # bases decomposed at once: a decomposition holds L (L + 1) polynomials (71 MB at N=32768, 16 primes)


def _baby_rotations(needed: dict, ops: SlotOps, run: RunContext) -> dict:
    """Every baby rotation in ``needed`` (key -> the map that makes it). Where ``ops`` hoists (``decompose``),
    the rotations of one ciphertext by two or more steps share its key-switch decomposition: the bases are
    decomposed in one round of the pool (beside the rotations that share nothing), their rotations made in
    the next, :data:`HOIST_BATCH` bases at a time (bounded memory). A base whose decomposition is declined is
    rotated step by step."""
    by_base: dict[tuple, list] = {}
    for key in needed:
        if key[1]:
            by_base.setdefault((key[0], *key[2:]), []).append(key)
    decompose = optional_op(ops, "decompose")
    shared = {base: keys for base, keys in by_base.items() if len(keys) > 1} if decompose is not None else {}
    grouped = {key for keys in shared.values() for key in keys}
    single = [key for key in needed if key not in grouped]

    def first_round(item):
        kind, what = item
        if kind == "decompose":
            return decompose(needed[shared[what][0]].base(shared[what][0]))
        return needed[what].rotate_baby(what)

    bases, out = list(shared), {}
    for start in range(0, max(1, len(bases)), HOIST_BATCH):  # a batch's decompositions are dropped after it
        batch = bases[start:start + HOIST_BATCH]
        alone = single if start == 0 else []
        made = run.map(first_round, [("decompose", base) for base in batch] + [("rotate", key) for key in alone])
        out.update(zip(alone, made[len(batch):], strict=True))
        second = [(key, part) for base, part in zip(batch, made, strict=False) for key in shared[base]]
        rotated = run.map(lambda item: (ops.rotate_decomposed(item[1], item[0][1]) if item[1] is not None
                                        else needed[item[0]].rotate_baby(item[0])), second)
        out.update(zip((key for key, _ in second), rotated, strict=True))
    return out


def _single_linear(step: Step, regs: dict, ops: SlotOps, arrays: dict, run: RunContext) -> Any:
    return _single_linear_group([step], regs, ops, arrays, run)[0]


def _single_bootstrap(step: Step, regs: dict, ops: SlotOps, arrays: dict, run: RunContext) -> Any:
    refresh = optional_op(ops, "bootstrap")
    if refresh is None:
        raise ValueError("this program bootstraps, and the engine running it cannot (export it for "
                         "backend='lattigo')")
    packed = None
    for r in step.inputs:  # a packed bootstrap refreshes the sum of registers masked into disjoint slot blocks
        packed = ops.add(packed, regs[r])
    return refresh(packed, step.bootstrap)


def _single_mul(step: Step, regs: dict, ops: SlotOps, arrays: dict, run: RunContext) -> Any:
    a, b = (regs[i] for i in step.inputs)
    low = max(ops.level(a), ops.level(b))
    return ops.relin_rescale(ops.multiply(ops.drop_to(a, low), ops.drop_to(b, low)))


# ------------------------------------------------------------------------------------------------------------
# batch layout: registers are lists of ciphertexts, one per tensor element
# ------------------------------------------------------------------------------------------------------------
def _batch_linear(step: Step, regs: dict, ops: SlotOps, arrays: dict, run: RunContext) -> list:
    target = step.level - 1
    terms = [
        ([ops.drop_to(ct, target) for ct in regs[t.input]], arrays[t.rows.data], arrays[t.rows.indices],
         arrays[t.rows.indptr])
        for t in step.linear.terms
    ]
    bias = arrays[step.linear.bias] if step.linear.bias else None

    def row(i: int) -> Any:
        acc = None
        for src, data, indices, indptr in terms:
            for p in range(indptr[i], indptr[i + 1]):
                acc = ops.add(acc, ops.mul_scalar(src[indices[p]], float(data[p])))
        if acc is None:  # an all-zero row: SEAL refuses a product by 0 (a transparent ciphertext), so take
            # an input times ZERO_ROW_WEIGHT: the row is off by at most 1e-9 x that input, far below CKKS noise
            zero_row = optional_op(ops, "zero_row")
            acc = zero_row(terms[0][0][0]) if zero_row else ops.mul_scalar(terms[0][0][0], ZERO_ROW_WEIGHT)
        if bias is not None and bias[i] != 0.0:
            acc = ops.add_scalar(acc, float(bias[i]))
        return ops.rescale(acc)

    return run.map(row, list(range(step.size)))


def _batch_mul(step: Step, regs: dict, ops: SlotOps, arrays: dict, run: RunContext) -> list:
    a, b = (regs[i] for i in step.inputs)
    low = max(ops.level(a[0]), ops.level(b[0]))
    return [ops.relin_rescale(ops.multiply(ops.drop_to(x, low), ops.drop_to(y, low))) for x, y in zip(a, b)]


def matmul_indices(a_shape, b_shape, out_shape) -> tuple[np.ndarray, np.ndarray]:
    """For ``out = a @ b`` (flattened), the (out_size, K) element indices of a and b summed per output."""
    ia = np.arange(int(np.prod(a_shape))).reshape(a_shape)
    ib = np.arange(int(np.prod(b_shape))).reshape(b_shape)
    k = a_shape[-1]
    full = (*out_shape, k)
    a_idx = np.broadcast_to(ia[..., :, None, :], full).reshape(-1, k)
    b_idx = np.broadcast_to(np.swapaxes(ib, -1, -2)[..., None, :, :], full).reshape(-1, k)
    return a_idx, b_idx


def _batch_matmul(step: Step, regs: dict, ops: SlotOps, arrays: dict, run: RunContext) -> list:
    a, b = (regs[i] for i in step.inputs)
    low = max(ops.level(a[0]), ops.level(b[0]))
    a = [ops.drop_to(x, low) for x in a]
    b = [ops.drop_to(x, low) for x in b]
    mm = step.matmul
    a_idx, b_idx = matmul_indices(mm.a_shape, mm.b_shape, mm.out_shape)
    out = []
    for ra, rb in zip(a_idx, b_idx, strict=True):
        acc = None
        for i, j in zip(ra, rb, strict=True):
            acc = ops.add(acc, ops.multiply(a[i], b[j]))
        out.append(ops.relin_rescale(acc))
    return out


StepFn = Callable[[Step, dict, SlotOps, dict, RunContext], Any]
EXECUTORS: dict[tuple[str, str], StepFn] = {
    ("single", "linear"): _single_linear,
    ("single", "mul"): _single_mul,
    ("single", "bootstrap"): _single_bootstrap,
    ("batch", "linear"): _batch_linear,
    ("batch", "mul"): _batch_mul,
    ("batch", "matmul"): _batch_matmul,
}


def _last_use(schedule: Schedule) -> dict[int, int]:
    last: dict[int, int] = {}
    for index, step in enumerate(schedule.steps):
        for r in step.reads():
            last[r] = index
    return last


def default_threads() -> int:
    """Threads per evaluation: ``POLYFHE_THREADS`` (``--threads`` of ``polyfhe run/serve/export`` sets it), else
    the CPU count."""
    raw = os.environ.get(THREADS_ENV)
    if raw is None:
        return os.cpu_count() or 1
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if threads < 1:
        log.warning("%s=%r is not a positive thread count; using the CPU count", THREADS_ENV, raw)
        return os.cpu_count() or 1
    return threads


def execute(manifest: Schedule, arrays: dict[str, np.ndarray], ops: SlotOps, encrypted_input: Any,
            progress: Callable | None = None, threads: int | None = None,
            observe: Callable[[int, Any], None] | None = None) -> Any:
    """Run every step of ``manifest`` on ``ops``, reading the named ``arrays``; registers are freed after their
    last use to bound memory. ``observe(register, value)`` sees every register as it is made (the input
    included), e.g. to record calibrated ranges."""
    if manifest.layout == "single" and manifest.samples_per_ciphertext > 1:
        ops = InterleavedOps(ops, manifest.samples_per_ciphertext)
    regs: dict[int, Any] = {0: encrypted_input}
    last = _last_use(manifest)
    run = RunContext(default_threads() if threads is None else threads)
    if progress is None:
        progress = _STEP_OBSERVER.get()
    if observe is not None:
        observe(0, encrypted_input)
    steps = manifest.steps
    computed: set[int] = set()  # steps already run ahead of their place (in a group of ready steps)
    for index, step in enumerate(steps):
        if index not in computed:
            group = _ready_group(steps, index, regs, computed, ops) if manifest.layout == "single" else [index]
            if len(group) > 1 and step.op == "linear":
                outs = _single_linear_group([steps[i] for i in group], regs, ops, arrays, run)
            elif len(group) > 1:  # independent products: one per worker
                outs = run.map(lambda i: _single_mul(steps[i], regs, ops, arrays, run), group)
            else:
                fn = EXECUTORS.get((manifest.layout, step.op))
                if fn is None:
                    raise ValueError(f"step {index} ({step.op}) is not supported in layout {manifest.layout!r}")
                outs = [fn(step, regs, ops, arrays, run)]
            for i, value in zip(group, outs, strict=True):
                regs[steps[i].out] = value
                computed.add(i)
                if observe is not None:
                    observe(steps[i].out, value)
        # registers are freed after their last reader's place in the program, wherever that reader ran
        for r in [r for r, last_use in last.items() if last_use == index and r != manifest.output]:
            regs.pop(r, None)
            for key in [k for k in run.cache if k[0] == r]:
                del run.cache[key]
        if progress is not None:
            progress(index, step)
    return regs[manifest.output]


def _ready_group(steps, start: int, regs: dict, computed: set[int], ops: SlotOps) -> list[int]:
    """The steps run with ``start`` (single layout): ready linear steps with a linear step, ready products with a
    product where ``ops`` runs products without the GIL (SEAL's bindings hold it through a product and its
    relinearisation: two at once took as long as one after the other), else ``start`` alone."""
    if steps[start].op == "mul" and ops.parallel_products:  # products take a worker each
        return _ready_steps_of("mul", steps, start, regs, computed)
    return _ready_linear_steps(steps, start, regs, computed)


def _ready_linear_steps(steps, start: int, regs: dict, computed: set[int]) -> list[int]:
    """``start`` and, when it is a linear step, every later linear step not yet run whose inputs are all
    computed already: one group whose maps share the pool's rounds (registers are written once, so running a
    step ahead of its place changes nothing but the order)."""
    return _ready_steps_of("linear", steps, start, regs, computed)


def _ready_steps_of(op: str, steps, start: int, regs: dict, computed: set[int]) -> list[int]:
    """``start`` and, when it is an ``op`` step, every later ``op`` step not yet run whose inputs are all computed."""
    if steps[start].op != op:
        return [start]
    return [start] + [j for j in range(start + 1, len(steps)) if j not in computed and steps[j].op == op
                      and all(r in regs for r in steps[j].reads())]


# slot values one pass of the single layout's simulation holds per register: rows of ``slots`` values, one per
# ciphertext's worth of samples, evaluated together (every step one array operation over all of them). 2^17
# (1 MiB of float64, about a core's cache) measured fastest on a 28x28 CNN: 12 ms an image against 22 ms at
# 2^22, whose arrays stream through memory, and 55 ms one ciphertext at a time (docs/benchmarks.md)
PLAIN_PASS_VALUES = 1 << 17


def run_plain(m, arrays: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Compiled program (manifest ``m`` and its ``arrays``) on plaintext: ``x`` (batch, *input_shape) ->
    (batch, output_size)."""
    flat = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    if flat.shape[1] != m.input_size:
        raise ValueError(f"input has {flat.shape[1]} values per sample, the program takes {m.input_size}")
    if m.layout == "single":
        lanes = m.samples_per_ciphertext
        chunks = [flat[i:i + lanes] for i in range(0, len(flat), lanes)]  # the real interleaved packing
        per_pass = max(1, PLAIN_PASS_VALUES // m.params.slots)
        outs = []
        for first in range(0, len(chunks), per_pass):  # many ciphertexts' worth at once: one row each
            group = chunks[first:first + per_pass]
            rows = execute(m, arrays, NumpyOps(m.params.slots), np.stack([pack_single(m, c) for c in group]))
            outs += [unpack_single(m, row, len(c)) for row, c in zip(np.atleast_2d(rows), group, strict=True)]
        return np.concatenate(outs)
    ops = NumpyOps(len(flat))
    result = execute(m, arrays, ops, [flat[:, i].copy() for i in range(m.input_size)])
    return np.stack(result, axis=1)
