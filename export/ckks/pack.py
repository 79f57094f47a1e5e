"""Packing a cut's registers into one bootstrap: several narrow registers share one ciphertext's slots.

A cut of a deep program typically refreshes two registers (a block's product and its residual stream), each
repeating with a period P of at most half the slots. Bootstrapping them one by one pays the engine's bootstrap
once per register for slots that mostly hold copies. Instead register t is made to hold its values only in slot
block ``[t*P, (t+1)*P)`` and zeros elsewhere, the registers are added, and one bootstrap refreshes the sum.
Nothing here spends a level:

* **masking** a register into its block scales the output rows of the linear map that makes it (a product is
  masked through one factor's map: zero times anything is zero);
* **retargeting** a later map that read the register: each coefficient read slot ``j + k`` of a register that
  repeats with period P; the same value now sits at ``offset + (j + k) mod P`` of the packed register, so the
  coefficient moves to diagonal ``offset + (j + k) mod P - j``. The terms of one map that read registers of one
  packed group become a single term, so the map rotates one ciphertext instead of several.

Only registers whose every reader after the cut is such a map, and whose producer can be masked without changing
what any other step reads, are packed (:class:`PackRules`). Pure functions on steps and arrays; diagonals keep the
program's convention (rows pre-rotated by their giant step, ``polyfhe/program/diagonals.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from polyfhe.program.diagonals import plain_diagonals, stored_diagonals
from polyfhe.program.manifest import Step
from polyfhe.program.steps import Diagonals, Term

__all__ = ["PackRules", "Placed", "block_mask", "by_level", "mask_diagonals", "mask_producers", "retarget_diagonals",
           "retarget_step", "unreduce_diagonals"]

# where one register of a packed group lies: (the packed register, its block's first slot, the block's length)
Placed = tuple[int, int, int]


def block_mask(slots: int, lo: int, hi: int) -> np.ndarray:
    """1.0 on the slots ``[lo, hi)``, 0.0 elsewhere."""
    mask = np.zeros(slots)
    mask[lo:hi] = 1.0
    return mask


def mask_diagonals(ks: np.ndarray, stored: np.ndarray, baby: int, mask: np.ndarray) -> np.ndarray:
    """The stored diagonals of the same map with its output rows multiplied by ``mask``."""
    return stored_diagonals(ks, plain_diagonals(ks, stored, baby) * mask, baby)


def _summed(rows: Mapping[int, np.ndarray], baby: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(ks, stored diagonals) from plain rows by diagonal, all-zero ones dropped."""
    keep = sorted(k for k, row in rows.items() if np.any(row != 0.0))
    new_ks = np.asarray(keep, dtype=np.int64)
    if not keep:
        return new_ks, np.zeros((0, slots))
    return new_ks, stored_diagonals(new_ks, np.stack([rows[k] for k in keep]), baby)


def _plain_rows(ks: np.ndarray, stored: np.ndarray, baby: int) -> tuple[np.ndarray, np.ndarray]:
    ks = np.asarray(ks, dtype=np.int64)
    return ks, plain_diagonals(ks, np.asarray(stored, dtype=np.float64), baby)


def unreduce_diagonals(ks: np.ndarray, stored: np.ndarray, baby: int, period: int, space: int, slots: int,
                       input_period: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The diagonals of a map that sums its rows over the blocks of ``period`` in its ``space`` by rotate-and-add,
    as one map without the sums: ``out[j] = sum_{m < space/period} partial[j + m*period]`` puts each diagonal k's
    rows ``d_k[j + m*period]`` on diagonal ``k + m*period``. Its output rows can then be masked one by one. An input
    repeating every ``input_period`` slots reads the same value through diagonals that agree modulo that period,
    so those are summed into one (no more diagonals than before when the input repeats with ``period``)."""
    fold = slots if input_period is None else int(input_period)
    sums: dict[int, np.ndarray] = {}
    for k, row in zip(*_plain_rows(ks, stored, baby), strict=True):
        for shift in range(0, space, period):
            acc = sums.setdefault(int((k + shift) % fold), np.zeros(slots))
            acc += np.roll(row, -shift)
    return _summed(sums, baby, slots)


def retarget_diagonals(parts: Sequence[tuple[np.ndarray, np.ndarray, int]], block: int, baby: int,
                       slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(ks, stored diagonals) of one term over a packed register that does what ``parts`` did.

    ``parts``: (ks, stored diagonals, offset) per term, each reading a register that repeats with period
    ``block`` and lies at ``[offset, offset + block)`` of the packed one. Coefficients landing on one diagonal are
    summed; diagonals left all zero are dropped.
    """
    j = np.arange(slots, dtype=np.int64)
    sums: dict[int, np.ndarray] = {}
    for ks, stored, offset in parts:
        for k, row in zip(*_plain_rows(ks, stored, baby), strict=True):
            moved = (offset + (j + int(k)) % block - j) % slots
            for target in np.unique(moved[row != 0.0]):
                where = moved == target
                acc = sums.setdefault(int(target), np.zeros(slots))
                acc[where] += row[where]
    return _summed(sums, baby, slots)


def by_level(steps: Sequence[Step]) -> list[Step]:
    """The steps in level order (stable): still an order in which every step follows what it reads (a step's
    inputs finish at lower levels), and one in which a cut's registers all come before any reader past the cut."""
    return sorted(steps, key=lambda step: step.level)


class PackRules:
    """Which registers of a program may be packed, and where their producers are masked."""

    def __init__(self, steps: Sequence[Step], output: int, slots: int) -> None:
        self.slots = slots  # virtual slots
        self.output = output
        self.position = {step.out: i for i, step in enumerate(by_level(steps))}
        self.producer = {step.out: step for step in steps}
        self.readers: dict[int, list[Step]] = {}
        for step in steps:
            for r in step.reads():
                self.readers.setdefault(r, []).append(step)

    def _maskable_linear(self, step: Step | None) -> bool:
        """A linear map whose output rows can be masked: no rotate-and-add after its rescale (block sums, a period
        below its space, are undone by :func:`unreduce_diagonals`)."""
        return step is not None and step.op == "linear" and not step.linear.post_sums

    def masked_at(self, register: int) -> int | None:
        """The register whose producing map is masked to place ``register`` in a block (itself, or the factor
        of a product that only that product reads); None when there is none."""
        step = self.producer.get(register)
        if self._maskable_linear(step):
            return register
        if step is not None and step.op == "mul":
            for factor in sorted(set(step.inputs)):
                only_this = [s.out for s in self.readers.get(factor, [])] == [register]
                if only_this and self._maskable_linear(self.producer.get(factor)):
                    return factor
        return None

    def _read_only_after(self, register: int, cut: int) -> bool:
        readers = self.readers.get(register, [])
        return bool(readers) and all(s.level > cut and s.op == "linear" and not s.linear.pre_sums for s in readers)

    def packable(self, cut: int, registers: Sequence[int], width: int, period: Mapping[int, int]) -> bool:
        """Whether ``registers`` (refreshed after level ``cut``) can share one bootstrap of ``width`` virtual
        slots, in blocks of their widest period."""
        if len(registers) < 2:
            return False
        block = max(period[r] for r in registers)
        if len(registers) * block > min(width, self.slots):
            return False
        masked = [self.masked_at(r) for r in registers]
        if any(m is None for m in masked) or len(set(masked)) < len(masked):
            return False
        if any(r in (0, self.output) or not self._read_only_after(r, cut) for r in registers):
            return False
        # the packed bootstrap runs before the first reader of any member (steps in level order, ``by_level``):
        # every member is made by then
        first_reader = min(self.position[s.out] for r in registers for s in self.readers[r])
        return all(self.position[r] < first_reader for r in registers)


def mask_producers(steps: Sequence[Step], arrays: Mapping[str, np.ndarray], rules: PackRules,
                   groups: Sequence[tuple[Sequence[int], int]],
                   periods: Mapping[int, int]) -> tuple[list[Step], dict[str, np.ndarray]]:
    """The steps with every packed register's producer masked into its block; ``groups``: (registers in block
    order, block length) per packed cut; ``periods``: every register's period. New arrays are added (``.packed``
    names), none is changed."""
    out_arrays = dict(arrays)
    masks: dict[int, np.ndarray] = {}
    for registers, block in groups:
        for t, r in enumerate(registers):
            masks[rules.masked_at(r)] = block_mask(rules.slots, t * block, (t + 1) * block)
    out_steps = []
    for step in steps:
        mask = masks.get(step.out)
        if mask is None:
            out_steps.append(step)
            continue
        attrs = step.linear
        baby, period = int(attrs.baby), int(attrs.period)
        summed = period < attrs.reduction_space(rules.slots)
        terms = []
        for term in attrs.terms:
            ks_name, diags_name = term.diagonals.ks, term.diagonals.diags
            ks, diags = arrays[ks_name], arrays[diags_name]
            if summed:
                ks, diags = unreduce_diagonals(ks, diags, baby, period, attrs.reduction_space(rules.slots),
                                               rules.slots, periods[term.input])
                ks_name = ks_name + ".packed"
                out_arrays[ks_name] = ks
            out_arrays[diags_name + ".packed"] = mask_diagonals(ks, diags, baby, mask)
            terms.append(replace(term, matrix=Diagonals(diags_name + ".packed", ks_name)))
        bias = attrs.bias
        if bias:  # added after the block sums: masked as it is
            out_arrays[bias + ".packed"] = np.asarray(arrays[bias], dtype=np.float64)[:rules.slots] * mask
            bias = bias + ".packed"
        unsummed = {"period": attrs.reduction_space(rules.slots)} if summed else {}
        out_steps.append(replace(step, attrs=replace(attrs, terms=tuple(terms), bias=bias, **unsummed)))
    return out_steps, out_arrays


def retarget_step(step: Step, placed: Mapping[int, Placed], arrays: dict[str, np.ndarray], slots: int) -> Step:
    """``step`` reading each packed group's register instead of its members (``placed``: member -> where it
    lies), the terms of one group merged into one; the new diagonals are added to ``arrays``."""
    attrs = step.linear
    baby = int(attrs.baby)
    groups: dict[int, list[tuple[np.ndarray, np.ndarray, int]]] = {}
    blocks: dict[int, int] = {}
    terms: list[Term | int] = []
    for term in attrs.terms:
        if term.input not in placed:
            terms.append(term)
            continue
        packed, offset, block = placed[term.input]
        if packed not in groups:
            terms.append(packed)  # the merged term takes the place of the group's first term
            groups[packed] = []
        blocks[packed] = block
        groups[packed].append((arrays[term.diagonals.ks], arrays[term.diagonals.diags], offset))
    merged = []
    for item in terms:
        if isinstance(item, Term):
            merged.append(item)
            continue
        ks, diags = retarget_diagonals(groups[item], blocks[item], baby, slots)
        name = f"s{step.out}.r{item}"
        arrays[name + ".ks"], arrays[name + ".diags"] = ks, diags
        merged.append(Term(item, Diagonals(name + ".diags", name + ".ks")))
    inputs = []
    for r in step.inputs:
        r = placed[r][0] if r in placed else r
        if r not in inputs:
            inputs.append(r)
    return replace(step, inputs=tuple(inputs), attrs=replace(attrs, terms=tuple(merged)))
