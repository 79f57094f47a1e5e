"""A compiled SEAL program's workload, exactly as polyfhe's executor runs it: the BSGS schedule whose rotation and
product counts are the manifest's ``info.planned``; ``encode`` sites are the plaintexts the store encodes on the
first query."""

from __future__ import annotations

import math

import numpy as np

from polyfhe.engines.seal.hoist import hoisting_available
from polyfhe.engines.seal.native import dot_available
from polyfhe.runtime.opcosts import OpSite, Tally, merge
from polyfhe.runtime.rotations import KeyChain
from polyfhe.runtime.workload_types import Workload, data_primes, empty_counters

__all__ = ["compiled_workload"]


def _single(program) -> tuple[Tally, dict, int]:
    m = program.manifest
    params, arrays = m.params, program.arrays
    n, lanes = params.poly_modulus_degree, m.samples_per_ciphertext
    slots = params.slots // lanes
    chain = KeyChain([g // lanes for g in m.galois_steps], slots)  # rotations without a key: chains of keys
    tally: Tally = {}
    counters = empty_counters()
    cached: set[tuple] = set()
    live, peak = {0}, 1
    fused = dot_available()
    hoisted = hoisting_available()
    last = {r: i for i, s in enumerate(m.steps) for r in s.reads()}

    def add(site: OpSite, count: float = 1.0) -> None:
        if count:
            tally[site] = tally.get(site, 0.0) + count

    def hoist(steps: list[int], primes: int) -> None:
        """Baby steps of one ciphertext sharing its decomposition (each with a key of its own, else a chain)."""
        add(OpSite("transform", n, primes, primes))
        for s in steps:
            ks = chain.switches(s)
            counters["rotations"] += 1
            counters["key_switches"] += ks
            add(OpSite("hoisted_rotation", n, primes, primes), 1 if ks == 1 else 0)
            add(OpSite("rotation", n, primes, primes), ks if ks != 1 else 0)
            add(OpSite("add", n, primes))

    def rotate(steps: list[int], primes: int) -> None:
        for s in steps:
            ks = chain.switches(s)
            counters["rotations"] += 1
            counters["key_switches"] += ks
            add(OpSite("rotation", n, primes, primes), ks)
            add(OpSite("add", n, primes))

    for index, step in enumerate(m.steps):
        if step.op == "mul":
            p = data_primes(params, step.level - 1)
            add(OpSite("ct_product", n, p, p))
            add(OpSite("rescale", n, p))
            counters["key_switches"] += 1
        elif step.op == "linear":
            attrs, target = step.linear, step.level - 1
            p = data_primes(params, target)
            late = bool(attrs.rescale_giants)
            baby, period = int(attrs.baby), int(attrs.period)
            babies, count = [], 0
            pre = tuple(attrs.pre_sums or ())
            for term in attrs.terms:
                ks = arrays[term.diagonals.ks]
                count += len(ks)
                if pre and (term.input, pre, target) not in cached:  # its window sum, made once per level
                    cached.add((term.input, pre, target))
                    babies += list(pre)
                shared = []  # this input's new baby steps: hoisted (one decomposition) when two or more
                for a in np.unique(ks % baby):
                    key = (term.input, int(a), target, pre)
                    if a and key not in cached:
                        cached.add(key)
                        shared.append(int(a))
                if hoisted and len(shared) > 1:
                    hoist(shared, p)
                else:
                    babies += shared
            ks_all = np.concatenate([arrays[t.diagonals.ks] for t in attrs.terms])
            giants = [int(g) for g in np.unique((ks_all // baby) * baby)]
            doublings = [period << i for i in range(int(math.log2(attrs.reduction_space(slots) // period)))]
            rotate(babies, p)
            rotate([g for g in giants if g], p - late)
            rotate(doublings, p - late)
            add(OpSite("plain_product", n, p), count)
            # the dot kernel sums a giant step's products itself (its probe times them with their sum): then
            # only the giant steps' partial sums are additions of their own
            add(OpSite("add", n, p), len(giants) if fused else count)
            add(OpSite("rescale", n, p), len(giants) if late else 1)
            rotate(list(attrs.post_sums or ()), p - 1)
            counters["plain_products"] += count
            counters["encodes_cold"] += count + (1 if attrs.bias else 0)
            add(OpSite("encode", n, p), count + (1 if attrs.bias else 0))
            peak = max(peak, len(live) + len(babies) + 2)
        elif step.op != "bootstrap":
            raise ValueError(f"step {index} ({step.op}) has no SEAL single-layout tally")
        live.add(step.out)
        live -= {r for r in list(live) if last.get(r, -1) <= index and r != m.output}
    return tally, counters, peak


def _batch(program) -> tuple[Tally, dict, int]:
    m = program.manifest
    params, arrays, n = m.params, program.arrays, m.params.poly_modulus_degree
    tally: Tally = {}
    counters = empty_counters()
    peak = 0
    sizes = {0: m.input_size}
    for step in m.steps:
        p = data_primes(params, step.level - 1)
        sizes[step.out] = step.size
        if step.op == "linear":
            count = sum(len(arrays[t.rows.data]) for t in step.linear.terms)
            counters["plain_products"] += count
            counters["encodes_cold"] += count
            tally = merge(tally, {OpSite("encode", n, p): count, OpSite("plain_product", n, p): count,
                                  OpSite("add", n, p): count, OpSite("rescale", n, p): step.size})
        else:
            products = step.size * (step.matmul.a_shape[-1] if step.op == "matmul" else 1)
            counters["key_switches"] += step.size
            tally = merge(tally, {OpSite("ct_product", n, p, p): products, OpSite("rescale", n, p): step.size})
        peak = max(peak, sum(sizes[r] for r in step.reads()) + step.size)
    return tally, counters, peak


def compiled_workload(program) -> Workload:
    """The workload of a compiled SEAL program, counted as polyfhe's executor runs it."""
    m = program.manifest
    tally, counters, live = (_single if m.layout == "single" else _batch)(program)
    planned = m.planned
    return Workload("seal", "compiled", m.params, tally, galois_keys=len(m.galois_steps),
                    relin=any(s.op in ("mul", "matmul") for s in m.steps), plaintexts=counters["encodes_cold"],
                    plaintext_bytes=int(planned.get("plaintext_bytes", 0)), live_ciphertexts=live,
                    samples=m.samples_per_ciphertext if m.layout == "single" else m.params.slots,
                    counters=counters)
