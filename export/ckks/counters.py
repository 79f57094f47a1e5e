"""What one evaluation of a program costs, counted from its plan: the manifest's honest counters.

The counts come from the executor's own schedule: the plan's steps run through
:func:`~polyfhe.runtime.execute.execute` on :class:`~polyfhe.runtime.counting.CountingOps`, which counts each
operation and computes nothing. Rotations are counted as the executor runs them (baby-step rotations of a
register are shared by every map of the same level that reads it); key switches count a rotation whose step has
its own Galois key once, one without by the length of the shortest chain of keys the executor rotates it by
(:class:`~polyfhe.runtime.rotations.KeyChain`), and one per relinearisation. Plaintext products are the diagonals
(single) or the non-zero weights (batch); every one is an encoded plaintext, and ``plaintext_bytes`` is what a
server holds to keep them all encoded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from polyfhe.program.manifest import Step
from polyfhe.program.params import CKKSParams
from polyfhe.runtime.counting import count_operations
from polyfhe.runtime.rotations import naf_terms

__all__ = ["PlannedSchedule", "naf_weight", "plan_counters"]


def naf_weight(step: int) -> int:
    """Non-zero digits of the non-adjacent form of ``step``: the key switches of a composed rotation."""
    return len(naf_terms(step))


@dataclass(frozen=True)
class PlannedSchedule:
    """What the executor reads of a program, before its manifest exists."""

    steps: tuple[Step, ...]
    layout: str
    samples_per_ciphertext: int
    output: int


def plan_counters(steps: list[Step], arrays: dict[str, np.ndarray], galois_steps: list[int], params: CKKSParams,
                  layout: str, slots: int, output: int | None = None, input_size: int | None = None) -> dict:
    """Counts per evaluation (one query); ``galois_steps`` and ``slots`` in the plan's (virtual) slots (the single
    layout's ``params.slots // slots`` samples per ciphertext). ``output``: the result register (default: the last
    step's); ``input_size``: the input's elements (batch layout; default: the most any map reads of it)."""
    steps = tuple(steps)
    lanes = max(1, params.slots // int(slots)) if layout == "single" else 1
    if output is None:
        output = steps[-1].out if steps else 0
    size = _input_size(steps, arrays) if input_size is None and layout == "batch" else int(input_size or 1)
    schedule = PlannedSchedule(steps, layout, lanes, output)
    real_steps = [int(g) * lanes for g in galois_steps]
    return count_operations(schedule, arrays, params, real_steps, size).planned()


def _input_size(steps: tuple[Step, ...], arrays: dict[str, np.ndarray]) -> int:
    """Elements of register 0 a batch plan reads: one past the largest index any term of it names."""
    read = [int(arrays[t.rows.indices].max(initial=-1)) + 1 for s in steps if s.op == "linear"
            for t in s.linear.terms if t.input == 0]
    return max(read, default=1)
