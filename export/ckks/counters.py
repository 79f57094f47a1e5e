"""What one evaluation of a program costs, counted from its plan: the manifest's honest counters.

Rotations are counted as the executor runs them (baby-step rotations of a register are shared by every map
of the same level that reads it); key switches count a rotation whose step has its own Galois key once,
one without by the length of the shortest chain of keys the executor rotates it by
(:class:`~polyfhe.runtime.rotations.KeyChain`), and one per relinearisation. Plaintext products are the diagonals
(single) or the non-zero weights (batch); every one is an encoded plaintext, and ``plaintext_bytes`` is what a server holds to keep them all encoded.
"""

from __future__ import annotations

import numpy as np

from polyfhe.program.manifest import Step
from polyfhe.program.params import CKKSParams
from polyfhe.runtime.rotations import KeyChain, naf_terms

__all__ = ["naf_weight", "plan_counters"]


def naf_weight(step: int) -> int:
    """Non-zero digits of the non-adjacent form of ``step``: the key switches of a composed rotation."""
    return len(naf_terms(step))


def _data_primes(params: CKKSParams, level: int) -> int:
    """Primes of a ciphertext (and its plaintexts) after ``level`` rescales (the special prime excluded)."""
    return len(params.coeff_mod_bits) - 1 - level


def plan_counters(steps: list[Step], arrays: dict[str, np.ndarray], galois_steps: list[int], params: CKKSParams,
                  layout: str, slots: int) -> dict:
    """Counts per evaluation (one query); ``galois_steps`` and ``slots`` in the plan's (virtual) slots."""
    chain = KeyChain(galois_steps, slots)
    rotations = key_switches = products = encodes = 0
    plaintext_bytes = 0
    cached: set[tuple] = set()
    bootstraps = 0
    for step in steps:
        if step.op == "bootstrap":  # the engine's own circuit: counted apart, not in the counts below
            bootstraps += 1
            continue
        if step.op != "linear":
            key_switches += step.size if layout == "batch" else 1  # relinearisations
            continue
        linear = step.linear
        terms = linear.terms
        primes = _data_primes(params, step.level - 1)
        plain_bytes = params.poly_modulus_degree * primes * 8
        if layout == "batch":
            count = sum(len(arrays[t.rows.data]) for t in terms)
            products += count
            encodes += count
            continue
        baby, period = int(linear.baby), int(linear.period)
        pre = tuple(linear.pre_sums or ())
        used: list[int] = list(linear.post_sums or ())
        for term in terms:
            ks = arrays[term.diagonals.ks]
            if pre and (term.input, pre, step.level - 1) not in cached:  # its window sum, made once per level
                cached.add((term.input, pre, step.level - 1))
                used += list(pre)
            for a in np.unique(ks % baby):
                key = (term.input, int(a), step.level - 1, pre)
                if a and key not in cached:
                    cached.add(key)
                    used.append(int(a))
        ks_all = np.concatenate([arrays[t.diagonals.ks] for t in terms])
        used += [int(g) for g in np.unique((ks_all // baby) * baby) if g]
        used += [period << i for i in range(int(np.log2(linear.reduction_space(slots) // period)))]
        rotations += len(used)
        key_switches += sum(chain.switches(s) for s in used)
        count = sum(len(arrays[t.diagonals.ks]) for t in terms)
        products += count
        encodes += count + (1 if linear.bias else 0)
        plaintext_bytes += count * plain_bytes
        if linear.bias:  # added after the rescale when giant sums are rescaled first
            late = bool(linear.rescale_giants)
            plaintext_bytes += params.poly_modulus_degree * _data_primes(params, step.level - (0 if late else 1)) * 8
    return {"rotations": rotations, "key_switches": key_switches, "plain_products": products,
            "encodes_cold": encodes, "plaintext_bytes": plaintext_bytes, **({"bootstraps": bootstraps} if bootstraps else {})}
