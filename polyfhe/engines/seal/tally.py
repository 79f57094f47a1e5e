"""A compiled SEAL program's workload, exactly as polyfhe's executor runs it: the executor's own schedule on
:class:`~polyfhe.runtime.counting.CountingOps`, taking SEAL's path (hoisted baby rotations and the fused dot
kernel where this build has them). Its rotation and product counts are the manifest's ``info.planned``;
``encode`` sites are the plaintexts the store encodes on the first query."""

from __future__ import annotations

import numpy as np

from polyfhe.engines.seal.hoist import hoisting_available
from polyfhe.engines.seal.native import dot_available
from polyfhe.runtime.counting import count_operations
from polyfhe.runtime.opcosts import OpSite
from polyfhe.runtime.workload_types import COUNTER_NAMES, Workload, data_primes

__all__ = ["compiled_workload"]


def _single_live(m, arrays, hoisted: bool) -> int:
    """The most ciphertexts held at once (single layout), as the cost model estimates it: the live registers,
    a step's baby rotations not hoisted (a hoisted set is made and used a few at a time), and two more."""
    cached: set[tuple] = set()
    live, peak = {0}, 1
    last = {r: i for i, s in enumerate(m.steps) for r in s.reads()}
    for index, step in enumerate(m.steps):
        if step.op == "linear":
            attrs, target = step.linear, step.level - 1
            baby, pre, babies = int(attrs.baby), tuple(attrs.pre_sums or ()), 0
            for term in attrs.terms:
                if pre and (term.input, pre, target) not in cached:  # its window sum, made once per level
                    cached.add((term.input, pre, target))
                    babies += len(pre)
                fresh = {(term.input, int(a), target, pre) for a in np.unique(arrays[term.diagonals.ks] % baby)
                         if a} - cached
                cached |= fresh
                babies += 0 if hoisted and len(fresh) > 1 else len(fresh)
            peak = max(peak, len(live) + babies + 2)
        live.add(step.out)
        live -= {r for r in list(live) if last.get(r, -1) <= index and r != m.output}
    return peak


def _bias_encodes_at_map_level(m, tally) -> None:
    """The cost model prices a map's bias encode at the primes of its diagonals, also where the bias is added
    after the giant steps' rescale (one prime fewer, where the executor encodes it): kept so predictions stay
    as they were; ``info.planned``'s ``plaintext_bytes`` holds that bias at its real level."""
    n = m.params.poly_modulus_degree
    for step in m.steps:
        if step.op == "linear" and step.linear.bias and step.linear.rescale_giants:
            p = data_primes(m.params, step.level - 1)
            late = OpSite("encode", n, p - 1)
            tally[late] -= 1.0
            if not tally[late]:
                del tally[late]
            tally[OpSite("encode", n, p)] = tally.get(OpSite("encode", n, p), 0.0) + 1.0


def _batch_live(m) -> int:
    """The most ciphertexts held at once (batch layout): a step's inputs and its output, one per element."""
    sizes, peak = {0: m.input_size}, 0
    for step in m.steps:
        sizes[step.out] = step.size
        peak = max(peak, sum(sizes[r] for r in step.reads()) + step.size)
    return peak


def compiled_workload(program) -> Workload:
    """The workload of a compiled SEAL program, counted as polyfhe's executor runs it."""
    m = program.manifest
    if m.layout == "single" and any(s.op not in ("linear", "mul", "bootstrap") for s in m.steps):
        bad = next(i for i, s in enumerate(m.steps) if s.op not in ("linear", "mul", "bootstrap"))
        raise ValueError(f"step {bad} ({m.steps[bad].op}) has no SEAL single-layout tally")
    hoisted = m.layout == "single" and hoisting_available()
    counts = count_operations(m, program.arrays, m.params, m.galois_steps, m.input_size, hoisting=hoisted,
                              fused_dot=m.layout == "single" and dot_available())
    counters = {name: getattr(counts, name) for name in COUNTER_NAMES}
    if m.layout == "single":
        _bias_encodes_at_map_level(m, counts.tally)
    live = _single_live(m, program.arrays, hoisted) if m.layout == "single" else _batch_live(m)
    planned = m.planned
    return Workload("seal", "compiled", m.params, counts.tally, galois_keys=len(m.galois_steps),
                    relin=any(s.op in ("mul", "matmul") for s in m.steps), plaintexts=counters["encodes_cold"],
                    plaintext_bytes=int(planned.get("plaintext_bytes", 0)), live_ciphertexts=live,
                    samples=m.samples_per_ciphertext if m.layout == "single" else m.params.slots,
                    counters=counters)
