"""Where a program refreshes its ciphertexts: bootstrap placement as a shortest path over levels.

A planned single-layout program is a list of steps, each finishing at a *level* (rescales consumed since the
input). A ring whose chain holds ``budget`` levels runs it only in segments: a *cut* after level ``c`` bootstraps
every register that is made at a level ``<= c`` and read by a step finishing above ``c`` (once: a bootstrapped
register sits at the top of the chain, so every later reader just drops it). The engine's bootstrap spends one
level on its input (the scale-down into the bootstrap's range), so a cut lies at most ``budget - 1`` levels after
the previous one and the output at most ``budget`` levels after the last.

Cuts are chosen by dynamic programming over the levels (a shortest path whose edges are segments): fewest
bootstraps first, then the least work at high levels (a product on a
ciphertext with more primes costs more). Not one per fixed number of layers: a cut goes where few registers are
live. :func:`place_sized_bootstraps` also chooses how many slots every bootstrap refreshes: the same search
restricted to cuts whose registers fit each power-of-two width, priced by what a bootstrap of that width costs,
so a bootstrap more can win where narrower ones are cheap enough. Pure functions on steps; the ranges that scale
values into the bootstrap's input interval come from a calibration run of the program (``calibrated_ranges``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from polyfhe.program.manifest import Step
from polyfhe.program.steps import BootstrapAttrs

__all__ = ["BootstrapError", "BootstrapPlan", "calibrated_ranges", "insert_bootstraps", "place_bootstraps",
           "place_sized_bootstraps", "refresh_slots", "register_levels", "register_periods"]

# Calibrated ranges are widened by this much before they set the scale-down into the bootstrap's [-1, 1]: inputs
# past the calibration set's extremes still land inside the interval Lattigo's EvalMod approximates well.
RANGE_MARGIN = 1.25


class BootstrapError(ValueError):
    """The program cannot be cut into segments that fit the ring (a single step needs more levels than it has)."""


def register_levels(steps: Sequence[Step]) -> dict[int, int]:
    """Level of every register (the input, register 0, is at level 0)."""
    levels = {0: 0}
    for step in steps:
        levels[step.out] = step.level
    return levels


def _last_reader_level(steps: Sequence[Step], output: int, depth: int) -> dict[int, int]:
    last: dict[int, int] = {}
    for step in steps:
        for r in step.reads():
            last[r] = max(last.get(r, 0), step.level)
    last[output] = max(last.get(output, 0), depth)  # the output is read by the client
    return last


def _step_work(step: Step, sizes: dict[str, int]) -> float:
    """Work of a step in plaintext products per prime (a relinearisation counted as 20, like a key switch)."""
    if step.op != "linear":
        return 20.0
    return float(sum(sizes.get(t.diagonals.ks, 1) for t in step.linear.terms))


@dataclass(frozen=True)
class BootstrapPlan:
    """The cuts (levels after which live registers are bootstrapped), what each refreshes, and the (real) slots
    every bootstrap refreshes when the placement chose them (``None``: the widest refreshed register's)."""

    depth: int
    budget: int
    cuts: tuple[int, ...]
    refreshed: tuple[tuple[int, ...], ...]  # per cut: the (original) registers bootstrapped there
    slots: int | None = None
    packed: tuple[bool, ...] = ()  # per cut: its registers share one bootstrap (``pack.py``); empty: none do

    def is_packed(self, index: int) -> bool:
        return bool(self.packed) and self.packed[index]

    @property
    def count(self) -> int:
        return sum(1 if self.is_packed(i) else len(r) for i, r in enumerate(self.refreshed))

    def levels_left(self) -> list[int]:
        """Levels left after each segment ends (the budget minus what the segment used)."""
        ends = [*self.cuts, self.depth]
        starts = [0, *self.cuts]
        return [self.budget - (end - start) for start, end in zip(starts, ends, strict=True)]

    def to_info(self) -> dict:
        return {"count": self.count, "cuts_after_level": list(self.cuts), "registers": [list(r) for r in self.refreshed],
                "packed": [self.is_packed(i) for i in range(len(self.cuts))],
                "levels_left_after_segment": self.levels_left(), "levels_needed": self.depth,
                "levels_per_segment": self.budget}


class _Segments:
    """What a segment between two cuts costs: the registers a cut refreshes and the work at each level."""

    def __init__(self, steps: Sequence[Step], output: int, depth: int, budget: int, sizes: dict[str, int]) -> None:
        self.depth, self.budget = depth, budget
        self.levels = register_levels(steps)
        self.last = _last_reader_level(steps, output, depth)
        self.work_at = np.zeros(depth + 1)
        for step in steps:
            self.work_at[step.level] += _step_work(step, sizes)

    def refreshed(self, prev: int, cut: int) -> tuple[int, ...]:
        low = 0 if prev == 0 else prev + 1  # the input (level 0) is fresh: only a first cut can refresh it
        return tuple(sorted(r for r, lv in self.levels.items() if low <= lv <= cut and self.last.get(r, -1) > cut))

    def work(self, start: int, end: int) -> float:
        # a step at relative level l runs on a ciphertext of budget - l + 2 primes (the special one excluded)
        return float(sum(self.work_at[lv] * (self.budget - (lv - start) + 2) for lv in range(start + 1, end + 1)))

    def cheapest(self, admissible: Callable[[tuple[int, ...]], bool],
                 packs: Callable[[int, tuple[int, ...]], bool] | None = None) -> BootstrapPlan | None:
        """Fewest bootstraps, then least work, over the cuts whose refreshed registers are all ``admissible``
        (a shortest path over the levels); None when no placement has only admissible cuts. ``packs(cut,
        registers)``: whether a cut's registers share one bootstrap (it then counts one)."""
        depth, budget = self.depth, self.budget
        shared = packs or (lambda cut, regs: False)
        # best[c] = (bootstraps, work, previous cut) for a segment ending with a cut after level c; 0 is the start
        best: dict[int, tuple[int, float, int | None]] = {0: (0, 0.0, None)}
        for cut in range(1, depth):
            options = []
            for prev, (boots, work, _) in best.items():
                if 0 < cut - prev <= budget - 1:
                    regs = self.refreshed(prev, cut)
                    if admissible(regs):
                        count = 1 if shared(cut, regs) else len(regs)
                        options.append((boots + count, work + self.work(prev, cut), prev))
            if options:
                best[cut] = min(options)
        finals = [(b, w + self.work(p, depth), p) for p, (b, w, _) in best.items() if depth - p <= budget]
        if not finals:
            return None
        _, _, prev = min(finals)
        cuts = []
        while prev:
            cuts.append(prev)
            prev = best[prev][2]
        cuts.reverse()
        starts = [0, *cuts]
        refreshed = tuple(self.refreshed(p, c) for p, c in zip(starts[:-1], cuts, strict=True))
        packed = tuple(shared(c, regs) for c, regs in zip(cuts, refreshed, strict=True)) if packs else ()
        return BootstrapPlan(depth, budget, tuple(cuts), refreshed, packed=packed)


def _check_budget(depth: int, budget: int) -> None:
    if budget < 2:
        raise BootstrapError(f"a chain of {budget} level(s) leaves nothing between bootstraps (each spends one "
                             "level scaling its input); use a ring with at least 2 levels after bootstrapping")


def place_bootstraps(steps: Sequence[Step], output: int, depth: int, budget: int,
                     sizes: dict[str, int] | None = None) -> BootstrapPlan:
    """Cheapest cuts for a program of ``depth`` levels on a chain of ``budget`` levels (see module doc)."""
    if depth <= budget:
        return BootstrapPlan(depth, budget, (), ())
    _check_budget(depth, budget)
    plan = _Segments(steps, output, depth, budget, sizes or {}).cheapest(lambda regs: True)
    if plan is None:
        raise BootstrapError(f"no placement fits {depth} levels into segments of {budget}")
    return plan


def place_sized_bootstraps(steps: Sequence[Step], output: int, depth: int, budget: int, *, input_period: int,
                           lanes: int, max_slots: int, price: Callable[[int], float],
                           sizes: dict[str, int] | None = None,
                           packs: Callable[[int, tuple[int, ...], int], bool] | None = None) -> BootstrapPlan:
    """Cuts *and* the slots every bootstrap refreshes, chosen together by price: a bootstrap below the full ring
    runs EvalMod once instead of twice, so a placement with a bootstrap more may cost less when it keeps every
    refreshed register narrow (how much less is the ring's ``price``). For each power-of-two width up to ``max_slots`` (real slots; a register of period P takes
    ``P * lanes``), the fewest bootstraps whose refreshed registers all fit it; the cheapest of those by
    ``bootstraps x price(width)`` wins, ties going to fewer bootstraps, then to the narrower width (smaller keys).
    Never more levels per segment than :func:`place_bootstraps` allows. ``packs(cut, registers, width)``: whether
    a cut's registers can share one bootstrap of ``width`` real slots (``pack.py``); such a cut counts one."""
    if depth <= budget:
        return BootstrapPlan(depth, budget, (), ())
    _check_budget(depth, budget)
    segments = _Segments(steps, output, depth, budget, sizes or {})
    periods = register_periods(steps, input_period)
    widest = max(periods.values()) * lanes
    best: tuple[float, int, int, BootstrapPlan] | None = None
    width = 2
    while width <= max_slots:
        shared = None if packs is None else (lambda cut, regs, w=width: packs(cut, regs, w))
        plan = segments.cheapest(lambda regs, w=width: all(periods[r] * lanes <= w for r in regs), shared)
        if plan is not None:
            key = (plan.count * price(width), plan.count, width, replace(plan, slots=width))
            if best is None or key[:3] < best[:3]:
                best = key
        if width >= widest and packs is None:  # packed registers may need a wider bootstrap than any one
            break
        width *= 2
    if best is None:
        raise BootstrapError(f"no placement fits {depth} levels into segments of {budget} with bootstraps of at "
                             f"most {max_slots} slots")
    return best[3]


def register_periods(steps: Sequence[Step], input_period: int) -> dict[int, int]:
    """The period (virtual slots) every register repeats with: a linear map's output period, the larger of a
    product's operands' (powers of two)."""
    periods = {0: input_period}
    for step in steps:
        if step.op == "linear":
            periods[step.out] = int(step.linear.period)
        else:
            periods[step.out] = max(periods[r] for r in step.inputs)
    return periods


def insert_bootstraps(steps: Sequence[Step], plan: BootstrapPlan, ranges: dict[int, tuple[float, float]],
                      slots: int, blocks: Mapping[int, int] | None = None,
                      retarget: Callable[[Step, Mapping[int, tuple[int, int, int]]], Step] | None = None,
                      ) -> tuple[list[Step], dict[int, int]]:
    """The program with a ``bootstrap`` step per refreshed register (one per packed cut) and every level
    renumbered per segment.

    ``ranges``: (min, max) over the slots each refreshed register has on the calibration inputs; ``slots``: the
    (real) slots every bootstrap refreshes. A packed cut (``plan.packed``) bootstraps the sum of its registers,
    each already masked into its block of ``blocks[cut]`` virtual slots, and ``retarget(step, placed)`` rewrites a
    later step that reads them (``placed``: register -> (packed register, block start, block length)).
    Returns the new steps and a map original register -> its refreshed copy.
    """
    if not plan.cuts:
        return list(steps), {}
    levels = register_levels(steps)
    next_reg = max(levels) + 1
    starts = [0, *plan.cuts]
    refreshed_at = {r: cut for cut, regs in zip(plan.cuts, plan.refreshed, strict=True) for r in regs}
    group_of = {r: regs for i, regs in enumerate(plan.refreshed) if plan.is_packed(i) for r in regs}
    copy_of: dict[int, int] = {}
    placed: dict[int, tuple[int, int, int]] = {}
    out: list[Step] = []
    emitted: set[int] = set()

    def bootstrap(r: int) -> None:
        nonlocal next_reg
        members = group_of.get(r, (r,))
        lo = min(ranges[m][0] for m in members)
        hi = max(ranges[m][1] for m in members)
        centre = 0.5 * (lo + hi)
        half = max(0.5 * (hi - lo), 1e-12) * RANGE_MARGIN
        postscale = max(1, math.ceil(half))
        cut = refreshed_at[r]
        attrs = BootstrapAttrs(int(slots), float(-centre), int(postscale), (float(lo), float(hi)), int(cut))
        out.append(Step("bootstrap", next_reg, tuple(members), 0, 0, attrs))
        for t, m in enumerate(members):
            copy_of[m] = next_reg
            emitted.add(m)
            if len(members) > 1:
                placed[m] = (next_reg, t * blocks[cut], blocks[cut])
        next_reg += 1

    for step in steps:
        start = max(c for c in starts if c < step.level or c == 0)  # the cut that opened this step's segment
        sources = step.reads()
        for r in sources:
            if r in refreshed_at and refreshed_at[r] < step.level and r not in emitted:
                bootstrap(r)
        fresh = [r for r in sources if r in copy_of and refreshed_at[r] < step.level]
        packed_here = {r: placed[r] for r in fresh if r in placed}
        if packed_here:
            if retarget is None:
                raise ValueError("a packed bootstrap needs a retarget function for the steps that read it")
            step = retarget(step, packed_here)
        mapping = {r: copy_of[r] for r in fresh if r not in placed}
        out.append(replace(step.remapped(mapping), level=step.level - start))
    return out, copy_of


def calibrated_ranges(program, samples: np.ndarray, registers: set[int], slots: int) -> dict[int, tuple[float, float]]:
    """(min, max) over the first ``slots`` real slots of each of ``registers``, running ``program`` (without its
    bootstraps) on plain ``samples`` exactly as packed under encryption."""
    from polyfhe.calibration.reduction import RangeProfile
    from polyfhe.program.slot_layout import pack_single
    from polyfhe.runtime.execute import NumpyOps, execute

    m = program.manifest
    profile: RangeProfile[int] = RangeProfile()

    def observe(register: int, value) -> None:
        if register in registers:
            profile.observe(register, np.asarray(value)[:slots])

    flat = np.asarray(samples, dtype=np.float64).reshape(len(samples), -1)
    lanes = m.samples_per_ciphertext
    for start in range(0, len(flat), lanes):
        execute(m, program.arrays, NumpyOps(m.params.slots), pack_single(m, flat[start:start + lanes]),
                observe=observe, threads=1)
    found = profile.extremes()
    return {r: found.get(r, (math.inf, -math.inf)) for r in registers}


def refresh_slots(steps: Sequence[Step], plan: BootstrapPlan, input_period: int, lanes: int, slots: int) -> int:
    """Real slots one bootstrap must refresh: the widest period among the refreshed registers (times the
    interleaved samples), a power of two; registers repeat with their period, so a sparse bootstrap of that many
    slots returns each one whole."""
    if plan.slots is not None:
        return int(plan.slots)
    periods = register_periods(steps, input_period)
    widest = max((periods[r] for regs in plan.refreshed for r in regs), default=1)
    return int(min(slots, max(2, widest * lanes)))
