"""Circuit -> program steps for the two layouts.

single: one sample across the slots. A linear map ``A`` (m x n, embedded in S x S) is evaluated with
*period-P diagonals* ``d_k[t] = A[t mod P, (t + k) mod S]`` for ``k < P`` (P a power of two >= m): P = S is
the classic Halevi-Shoup diagonal method, a smaller P the hybrid method for wide maps followed by
log2(S/P) rotate-and-add steps. Only non-zero diagonals are kept; they are grouped baby-step giant-step
(``k = g*B + a``), pre-rotated by ``g*B`` so that each giant group needs one rotation. P and B are chosen per
map by counting rotations and plaintext products. Rotation steps used by all maps form the Galois key set.

Several samples per ciphertext (single layout): when the widest register needs only ``V = S/k`` slots, the
program is planned for a *virtual* ring of V slots and sample j of k lives in the real slots ``u*k + j``.
A real rotation by ``r*k`` is then a cyclic rotation by r of every sample's virtual vector, and a plaintext
vector ``v`` becomes ``repeat(v, k)``, so the plan is unchanged and k samples cost what one does. The Galois
steps are stored as real steps (``r*k``); the executor scales rotations and repeats vectors
(:class:`polyfhe.runtime.execute.InterleavedOps`).

batch: one slot per sample and one ciphertext per tensor element; linear maps are sparse rows of scalars
(CSR), no rotations and no Galois keys.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, MatMulNode, MulNode
from polyfhe.exporters.ckks.cost import COMPOSED_COST, NEW_KEY_COST, ROTATION_COST
from polyfhe.exporters.ckks.layout import FALLBACK, choose_layouts, nonzero, offsets, pow2_at_least
from polyfhe.program.diagonals import stored_diagonals
from polyfhe.program.manifest import Step
from polyfhe.program.steps import Diagonals, LinearAttrs, MatMulAttrs, MulAttrs, SparseRows, Term
from polyfhe.runtime.rotations import choose_key_steps

__all__ = ["BlockSums", "Plan", "block_sums", "plan_batch", "plan_single"]

log = logging.getLogger(__name__)



@dataclass
class Plan:
    steps: list[Step]
    arrays: dict[str, np.ndarray]
    galois_steps: list[int]
    stats: dict
    input_slots: tuple[int, ...] = ()  # single layout: slot of each input element
    output_slots: tuple[int, ...] = ()  # single layout: slot of each output element


def _diagonals(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, period: int, period_in: int,
               slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-zero period-P diagonals of a map given as slot triples, its input replicated every ``period_in``
    slots: (offsets k, values (len(k), slots))."""
    ks, ts = offsets(rows, cols, period, period_in)
    uniq, pos = np.unique(ks, return_inverse=True)
    diags = np.zeros((len(uniq), slots))
    diags[pos, ts] = vals
    return uniq.astype(np.int64), diags


@dataclass
class BabyShare:
    """Baby-step rotations shared between the maps that read one register at one level (the executor rotates a
    register once per offset and level, for every map): what earlier maps made already is free, and a new one
    is paid by every map still to come that reads the register there, so the first of twelve maps reading the
    program input does not pick a schedule that makes the other eleven each pay giant steps of their own."""

    readers: Counter  # (register, level) -> maps reading it there not yet planned (the current one included)
    made: dict  # (register, level) -> baby offsets already rotated

    @classmethod
    def of(cls, circuit: Circuit, levels: dict[int, int]) -> BabyShare:
        readers: Counter = Counter()
        for node in circuit.nodes:
            if isinstance(node, LinearNode):
                read = {reg for reg, m in zip(node.inputs, node.matrices, strict=True) if len(nonzero(m)[0])}
                readers.update((reg, levels[node.out] - 1) for reg in read)
        return cls(readers, {})

    def weights(self, inputs: list[int], level: int) -> tuple[list[set[int]], list[float]]:
        """Per term: the offsets already rotated, and what a new one costs this map (1 / readers to come)."""
        keys = [(reg, level) for reg in inputs]
        return [self.made.get(k, set()) for k in keys], [1.0 / max(1, self.readers[k]) for k in keys]

    def planned(self, inputs: list[int], level: int, babies: list[set[int]]) -> None:
        for reg, offsets_made in zip(inputs, babies, strict=True):
            self.made.setdefault((reg, level), set()).update(offsets_made)
        for reg in set(inputs):
            self.readers[(reg, level)] -= 1


def _babies(ks_list: list[np.ndarray], baby: int) -> list[set[int]]:
    return [set(np.unique(ks % baby).tolist()) - {0} for ks in ks_list]


def _steps(ks_list: list[np.ndarray], baby: int, period: int, space: int,
           share: tuple[list[set[int]], list[float]] | None = None) -> tuple[float, set[int]]:
    """(rotations, rotation steps) of one map: baby rotations per term (each term rotates its own register;
    ``share``: per term, offsets already rotated and the weight of a new one), giant rotations shared by all
    terms, and the rotate-and-add reductions of the hybrid method."""
    babies = _babies(ks_list, baby)
    giants = set(np.unique(np.concatenate([(ks // baby) * baby for ks in ks_list])).tolist()) - {0}
    reductions = {period << i for i in range(int(np.log2(space // period)))}
    if share is None:
        baby_rotations = float(sum(len(b) for b in babies))
    else:
        made, weights = share
        baby_rotations = sum(len(b - m) * w for b, m, w in zip(babies, made, weights, strict=True))
    return baby_rotations + len(giants) + len(reductions), set().union(*babies, giants, reductions)


def _baby_sizes(period: int) -> list[int]:
    """Baby sizes to try: every size up to 512 (channel mixing in a channel-major layout has offsets
    ``j*T + small`` and splits best at a multiple of the token count T), and the powers of two above it up to
    ``period`` (a baby as wide as the map: no giant steps, the best schedule when many maps share the input's
    rotations)."""
    sizes = list(range(1, min(period, 512) + 1))
    size = 1024
    while size <= period:
        sizes.append(size)
        size *= 2
    return sizes


def _schedule(ks_list: list[np.ndarray], period: int, space: int, keys: Counter,
              max_keys: int | None, share: tuple[list[set[int]], list[float]] | None = None
              ) -> tuple[float, int, set[int]]:
    """(cost, baby size, steps) of the cheapest BSGS schedule for one map, given the keys earlier maps use.

    Every baby size of :func:`_baby_sizes` is tried. A step without a key of its own costs a key in the upload,
    or, past ``max_keys``, a rotation composed of several key switches on every use; the schedule pays for
    that, so maps reuse the steps earlier maps made keys for. ``share``: see :func:`_steps`.
    """
    if not any(len(ks) for ks in ks_list):
        return 0.0, 1, set()
    products = sum(len(ks) for ks in ks_list)
    best = None
    for baby in _baby_sizes(period):
        rotations, steps = _steps(ks_list, baby, period, space, share)
        new = len(steps - keys.keys())
        over = max(0, len(keys) + new - max_keys) if max_keys else 0
        cost = products + ROTATION_COST * (rotations + NEW_KEY_COST * new + COMPOSED_COST * over)
        if best is None or cost < best[0]:
            best = (cost, baby, steps)
    return best


@dataclass(frozen=True)
class BlockSums:
    """A map that sums each aligned block of ``block`` input slots into every output slot of that block, with one
    weight per block (a token sum broadcast back over the tokens, e.g. ``K^T V`` regathered for ``Q (K^T V)``).

    Run as a window sum (``pre``: ``log2(block)`` rotate-and-adds put each block's total on its first slot), one
    diagonal (the weights, on those slots: the map's level) and a spread (``post``: ``log2(block)`` more, back
    over the block): ``2 log2(block)`` rotations where the diagonals would take about ``2 sqrt(2 block)``. The
    input must be zero in its blocks' slots that hold none of its elements (a *clean* register: a window sums the
    whole block); the output holds the block's value in every slot of the block, elements or not (not clean).
    """

    block: int
    period: int  # the input's period: the weights repeat with it, and the spread turns within it
    weights: np.ndarray  # (period,) each block's weight on its first slot, zero elsewhere

    @property
    def pre(self) -> tuple[int, ...]:
        return tuple(1 << i for i in range(self.block.bit_length() - 1))

    @property
    def post(self) -> tuple[int, ...]:  # rotations by -1, -2, -4, ... within the period
        return tuple(self.period - (1 << i) for i in range(self.block.bit_length() - 1))

    @property
    def rotations(self) -> int:
        return len(self.pre) + len(self.post)


def block_sums(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, in_layout: np.ndarray,
               period_in: int) -> BlockSums | None:
    """The :class:`BlockSums` form of a one-term map given as (output slot, input slot, value) triples, or None
    when the map is not one. ``in_layout``: the slots of every element of the input register."""
    if len(rows) == 0:
        return None
    block = pow2_at_least(int(np.abs(rows - cols).max()) + 1)
    while block <= period_in and np.any(rows // block != cols // block):
        block *= 2
    if block < 2 or block > period_in:
        return None
    blocks, pairs = np.unique(cols // block, return_counts=True)
    ins, outs = np.unique(cols), np.unique(rows)
    in_blocks, n_in = np.unique(ins // block, return_counts=True)
    out_blocks, n_out = np.unique(outs // block, return_counts=True)
    if not (np.array_equal(in_blocks, blocks) and np.array_equal(out_blocks, blocks)
            and np.array_equal(pairs, n_in * n_out)):
        return None  # not every input slot of a block feeds every output slot of it
    if np.count_nonzero(np.isin(in_layout // block, blocks)) != len(ins):
        return None  # another element of the input shares a block: a window would add it in
    order = np.argsort(cols // block, kind="stable")
    starts = np.concatenate([[0], np.cumsum(pairs)[:-1]])
    low, high = np.minimum.reduceat(vals[order], starts), np.maximum.reduceat(vals[order], starts)
    if not np.allclose(low, high, rtol=1e-12, atol=0.0):
        return None  # weights vary within a block
    weights = np.zeros(period_in)
    weights[blocks * block] = low
    return BlockSums(block, period_in, weights)


def _plan_linear_single(node: LinearNode, slots: int, index: int, arrays: dict, steps_used: Counter,
                        layouts: dict[int, np.ndarray], periods: dict[int, int], max_keys: int | None,
                        share: BabyShare | None = None, level: int = 0,
                        clean: dict[int, bool] | None = None) -> LinearAttrs:
    """Plan one map; ``periods[r]``: register r repeats every periods[r] slots (the input is replicated);
    ``share``: the baby rotations of the inputs at ``level`` (the map's input level) that maps share;
    ``clean``: registers known to be zero outside their elements (None: no :class:`BlockSums` plans)."""
    slot_out = layouts[node.out]
    widest = max(int(slot_out.max()), *[int(layouts[r].max()) for r in node.inputs]) + 1
    if widest > slots:
        raise LoweringError(f"{node.label}: a tensor of {widest} values does not fit {slots} slots; "
                            "use a larger ring or layout='batch'")
    triples = []
    for reg, matrix in zip(node.inputs, node.matrices, strict=True):
        rows, cols, vals = nonzero(matrix)
        triples.append((slot_out[rows], layouts[reg][cols], vals))
    space = max(pow2_at_least(int(slot_out.max()) + 1), *[periods[r] for r in node.inputs])
    period = pow2_at_least(int(slot_out.max()) + 1)
    best = None
    while period <= space:  # offsets only: the dense diagonals are built for the chosen period alone
        ks_list = [np.unique(offsets(r, c, period, periods[reg])[0])
                   for (r, c, _), reg in zip(triples, node.inputs, strict=True)]
        shared = None if share is None else share.weights(node.inputs, level)
        cost, baby, steps = _schedule(ks_list, period, space, steps_used, max_keys, shared)
        if best is None or cost < best[0]:
            best = (cost, period, baby, steps, ks_list)
        period *= 2
    _, period, baby, steps, ks_list = best
    sums = _block_sums_plan(node, triples, layouts, periods, clean, steps_used, best[0])
    if sums is not None:
        if share is not None:
            share.planned(node.inputs, level, [set()])
        return _block_sums_attrs(node, sums, slots, index, arrays, steps_used, periods)
    if share is not None:
        share.planned(node.inputs, level, _babies(ks_list, baby))
    terms = [_diagonals(r, c, v, period, periods[reg], space)
             for (r, c, v), reg in zip(triples, node.inputs, strict=True)]
    planned: list[Term] = []
    periods[node.out] = period
    tiles = slots // space
    for j, (ks, diags) in enumerate(terms):
        rolled = np.tile(stored_diagonals(ks, diags, baby), (1, tiles))
        name = f"s{index}.t{j}"
        arrays[f"{name}.diags"] = rolled
        arrays[f"{name}.ks"] = ks
        planned.append(Term(node.inputs[j], Diagonals(f"{name}.diags", f"{name}.ks")))
    steps_used.update(int(step) for step in steps)
    bias = None
    if node.bias is not None:
        values = np.zeros(period)
        values[slot_out] = node.bias
        bias = f"s{index}.bias"
        arrays[bias] = np.tile(values, slots // period)  # the output repeats every ``period`` slots: so does its bias
    return LinearAttrs(tuple(planned), bias, node.label, period=period, space=space, baby=baby)


def _block_sums_plan(node: LinearNode, triples: list, layouts: dict[int, np.ndarray], periods: dict[int, int],
                     clean: dict[int, bool] | None, keys: Counter, diagonal_cost: float) -> BlockSums | None:
    """The map as :class:`BlockSums` when it is one, its input is clean and that is cheaper than its diagonals."""
    if clean is None or len(node.inputs) != 1 or node.bias is not None or not clean.get(node.inputs[0], False):
        return None
    reg = node.inputs[0]
    sums = block_sums(*triples[0], layouts[reg], periods[reg])
    if sums is None:
        return None
    new = len(set(sums.pre + sums.post) - keys.keys())
    cost = 1 + ROTATION_COST * (sums.rotations + NEW_KEY_COST * new)
    return sums if cost < diagonal_cost else None


def _block_sums_attrs(node: LinearNode, sums: BlockSums, slots: int, index: int, arrays: dict,
                      steps_used: Counter, periods: dict[int, int]) -> LinearAttrs:
    name = f"s{index}.t0"
    arrays[f"{name}.diags"] = np.tile(sums.weights, slots // sums.period)[None, :]
    arrays[f"{name}.ks"] = np.zeros(1, dtype=np.int64)
    steps_used.update(sums.pre + sums.post)
    periods[node.out] = sums.period
    return LinearAttrs((Term(node.inputs[0], Diagonals(f"{name}.diags", f"{name}.ks")),), None, node.label,
                       period=sums.period, space=sums.period, baby=1, pre_sums=sums.pre, post_sums=sums.post)


def _plan_linear_batch(node: LinearNode, index: int, arrays: dict) -> LinearAttrs:
    planned: list[Term] = []
    for j, matrix in enumerate(node.matrices):
        rows, cols, vals = nonzero(matrix)
        order = np.lexsort((cols, rows))
        rows, cols, vals = rows[order], cols[order], vals[order]
        indptr = np.searchsorted(rows, np.arange(matrix.shape[0] + 1))
        name = f"s{index}.t{j}"
        arrays[f"{name}.data"] = vals
        arrays[f"{name}.indices"] = cols.astype(np.int64)
        arrays[f"{name}.indptr"] = indptr.astype(np.int64)
        planned.append(Term(node.inputs[j], SparseRows(f"{name}.data", f"{name}.indices", f"{name}.indptr")))
    bias = None
    if node.bias is not None:
        bias = f"s{index}.bias"
        arrays[bias] = node.bias
    return LinearAttrs(tuple(planned), bias, node.label)


def _plan(circuit: Circuit, layout: str, slots: int, max_galois_keys: int | None = None,
          block_sum_maps: bool = False) -> Plan:
    levels = circuit.levels()
    layouts = choose_layouts(circuit, slots) if layout == "single" else {}
    fallbacks = ["natural slot layouts (product operands disagreed)"] if layouts.pop(FALLBACK, None) is not None else []
    periods = {0: pow2_at_least(int(layouts[0].max()) + 1)} if layout == "single" else {}
    steps: list[Step] = []
    arrays: dict[str, np.ndarray] = {}
    used: Counter = Counter()
    share = BabyShare.of(circuit, levels) if layout == "single" else None
    clean: dict[int, bool] | None = {0: True} if block_sum_maps else None  # zero outside their elements
    for index, node in enumerate(circuit.nodes):
        if isinstance(node, LinearNode):
            if not any(len(nonzero(m)[0]) for m in node.matrices):
                raise LoweringError(f"{node.label}: the linear map is identically zero (an untrained, zero-initialised "
                                    "layer?), so its output is a constant; train or initialise the model first")
            attrs = (_plan_linear_single(node, slots, index, arrays, used, layouts, periods, max_galois_keys,
                                         share, levels[node.out] - 1, clean)
                     if layout == "single"
                     else _plan_linear_batch(node, index, arrays))
            steps.append(Step("linear", node.out, tuple(node.inputs), node.size, levels[node.out], attrs))
            if clean is not None:
                clean[node.out] = attrs.post_sums is None
        elif isinstance(node, MulNode):
            if layout == "single":
                periods[node.out] = max(periods[node.a], periods[node.b])
            if clean is not None:
                clean[node.out] = clean.get(node.a, False) or clean.get(node.b, False)
            steps.append(Step("mul", node.out, (node.a, node.b), node.size, levels[node.out],
                              MulAttrs(node.label)))
        elif isinstance(node, MatMulNode):
            if layout != "batch":
                raise LoweringError(f"{node.label}: a MatMul of two encrypted tensors is supported in "
                                    "layout='batch' only")
            attrs = MatMulAttrs(tuple(int(d) for d in node.a_shape), tuple(int(d) for d in node.b_shape),
                                tuple(int(d) for d in node.out_shape), node.label)
            steps.append(Step("matmul", node.out, (node.a, node.b), node.size, levels[node.out], attrs))
    stats = {
        "linear_maps": sum(s.op == "linear" for s in steps),
        "products": sum(s.op != "linear" for s in steps),
        "plaintext_diagonals": int(sum(len(arrays[t.matrix.ks]) for s in steps for t in s.terms
                                       if isinstance(t.matrix, Diagonals))),
        "rotation_steps": len(used),
    }
    if layout == "single":
        keys = select_galois_steps(used, slots, max_galois_keys)
        held = {k % slots for k in keys}
        composed = sorted(s for s in used if s % slots not in held)
        if composed:
            fallbacks.append(f"{len(composed)} rotation steps rotated through chains of keyed steps (Galois key budget)")
            log.warning("%d of %d rotation steps have no key of their own within the Galois key budget (%d keys); "
                        "each is a chain of rotations by keyed steps (several key switches)", len(composed),
                        len(used), len(keys))
        stats["galois_keys"] = len(keys)
        stats["fallbacks"] = fallbacks
        stats["input_period"] = periods[0]
        return Plan(steps, arrays, keys, stats, tuple(int(i) for i in layouts[0]),
                    tuple(int(i) for i in layouts[circuit.output]))
    return Plan(steps, arrays, sorted(used), stats)


def select_galois_steps(used: Counter, slots: int, max_keys: int | None) -> list[int]:
    """Exactly the steps used when they fit ``max_keys``; else +-2^i plus the keys that save the most key
    switches over the plan's uses (:func:`~polyfhe.runtime.rotations.choose_key_steps`); the executor rotates
    by a step without a key through the shortest chain of keys.

    Each Galois key is one key-switching key (about 21 MB at N=16384 with 11 primes), so an unbounded set
    makes the public context gigabytes.
    """
    try:
        return choose_key_steps(used, slots, max_keys)
    except ValueError as exc:
        raise LoweringError(str(exc)) from exc


def max_samples_per_ciphertext(circuit: Circuit, slots: int) -> int:
    """Largest power of two k such that the widest register of the single layout fits ``slots / k`` slots."""
    layouts = choose_layouts(circuit, slots)
    widest = max(int(slot_of.max()) + 1 for reg, slot_of in layouts.items() if reg != FALLBACK)
    if widest > slots:
        raise LoweringError(f"a tensor of {widest} values does not fit {slots} slots; use a larger ring or "
                            "layout='batch'")
    return slots // pow2_at_least(widest)


def plan_single(circuit: Circuit, slots: int, max_galois_keys: int | None = None,
                samples_per_ciphertext: int | None = None, rescale_giants: bool = False,
                block_sum_maps: bool = True) -> Plan:
    """Plan for ``samples_per_ciphertext`` interleaved samples (None: as many as fit, 1: one sample).

    ``block_sum_maps``: plan block sums broadcast over their blocks as :class:`BlockSums` where cheaper (the engine
    runs a linear step's ``pre_sums`` and ``post_sums``).

    ``rescale_giants``: rescale each giant-step partial sum before rotating it (a key switch over one prime
    fewer), at the price of key-switching noise at the working scale instead of its square: worth it only at
    scales with precision to spare.
    """
    most = max_samples_per_ciphertext(circuit, slots)
    lanes = most if samples_per_ciphertext is None else int(samples_per_ciphertext)
    if lanes < 1 or lanes & (lanes - 1) or lanes > most:
        raise LoweringError(f"samples_per_ciphertext={samples_per_ciphertext}: accepted are powers of two up to "
                            f"{most} (the widest tensor needs {slots // most} of the {slots} slots)")
    plan = _plan(circuit, "single", slots // lanes, max_galois_keys, block_sum_maps)
    plan.steps = [replace(s, attrs=replace(s.linear, rescale_giants=bool(rescale_giants))) if s.op == "linear" else s
                  for s in plan.steps]
    plan.galois_steps = sorted(step * lanes for step in plan.galois_steps)
    plan.stats["samples_per_ciphertext"] = lanes
    plan.stats["virtual_slots"] = slots // lanes
    return plan


def plan_batch(circuit: Circuit) -> Plan:
    return _plan(circuit, "batch", 0)
