"""Rotations by steps that have no Galois key of their own: the fewest key switches over the keys held.

A public context holds keys for a budgeted set of rotation steps (``galois_key_budget``); any other step is a
chain of rotations by steps that have keys, one key switch each. SEAL's ``rotate_vector`` chains the terms
of the step's non-adjacent form and uses only power-of-two keys for them, so a step of 78 costs three key
switches (64 + 16 - 2) even when keys for 64 and 14 are held. :class:`KeyChain` finds the shortest chain over
*every* key held (a breadth-first search over the cyclic group of slot offsets), and
:func:`choose_key_steps` picks the keys a budget buys so that the steps a program uses, weighted by how often,
need the fewest key switches in all. The planner's counters and the SEAL executor use the same chains.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

__all__ = ["KeyChain", "choose_key_steps", "lattice_base", "naf_terms", "power_of_two_steps"]


def naf_terms(value: int) -> list[int]:
    """Signed powers of two of the non-adjacent form of ``value``, as SEAL's ``util::naf`` lists them."""
    sign, value, out, i = value < 0, abs(int(value)), [], 0
    while value:
        digit = 2 - (value & 3) if value & 1 else 0
        value = (value - digit) >> 1
        if digit:
            out.append((-digit if sign else digit) << i)
        i += 1
    return out


def power_of_two_steps(slots: int) -> set[int]:
    """Rotations by +-2^i: with these every step is a chain (at most its NAF weight long)."""
    return {s * (1 << i) for i in range(max(1, slots.bit_length() - 1)) for s in (1, -1)}


def lattice_base(steps: Iterable[int], slots: int, max_keys: int | None = None) -> set[int]:
    """The fewest-hops chain keys within ``max_keys`` that reach every multiple of g = gcd(steps, slots): g * b^i
    for g * b^i < slots, with the smallest radix b >= 2 whose keys fit (b = 2: log2(slots / g) keys, each step
    the chain of its binary digits; a larger b: fewer keys, longer chains). What a tight key budget (a browser's
    upload) can still afford: far fewer keys than :func:`power_of_two_steps` when steps share a factor."""
    g = slots
    for step in steps:
        g = math.gcd(g, int(step) % slots)
    span = slots // g
    for radix in range(2, max(span, 2) + 1):
        keys, power = set(), 1
        while power < span:
            keys.add(g * power)
            power *= radix
        if max_keys is None or len(keys) <= max_keys:
            return keys
    return {g}


def _distances(keys: Iterable[int], slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(fewest keys summing to each offset mod ``slots``, -1 when none do; the last key of one such chain)."""
    residues = sorted({int(k) % slots for k in keys} - {0})
    dist = np.full(slots, -1, dtype=np.int64)
    via = np.zeros(slots, dtype=np.int64)
    dist[0] = 0
    frontier, hops = np.zeros(1, dtype=np.int64), 0
    while len(frontier):
        hops += 1
        reached = []
        for key in residues:
            new = np.unique((frontier + key) % slots)
            new = new[dist[new] < 0]
            dist[new], via[new] = hops, key
            reached.append(new)
        frontier = np.concatenate(reached) if reached else np.zeros(0, dtype=np.int64)
    return dist, via


class KeyChain:
    """Shortest chains of key steps for every rotation, given the steps that have Galois keys."""

    def __init__(self, key_steps: Iterable[int], slots: int) -> None:
        self.slots = int(slots)
        steps = [int(s) for s in key_steps]
        self._signed = {s % self.slots: s for s in steps}  # residue -> the step as the keys were made for it
        self._dist, self._via = _distances(steps, self.slots)

    def has_key(self, step: int) -> bool:
        return int(step) % self.slots in self._signed

    def switches(self, step: int) -> int:
        """Key switches of a rotation by ``step`` (0 for a full turn); ValueError when the keys cannot make it."""
        hops = int(self._dist[int(step) % self.slots])
        if hops < 0:
            raise ValueError(f"no chain of the {len(self._signed)} Galois keys held rotates by {step}")
        return hops

    def chain(self, step: int) -> list[int]:
        """Key steps whose rotations, one after another, rotate by ``step``: the shortest such chain."""
        self.switches(step)
        residue, out = int(step) % self.slots, []
        while residue:
            key = int(self._via[residue])
            out.append(self._signed[key])
            residue = (residue - key) % self.slots
        return out


UNREACHABLE = 1 << 20  # key switches charged to a used step no chain of the chosen keys makes (greedy only)


def _greedy_keys(start: set[int], steps: np.ndarray, weight: np.ndarray, slots: int, max_keys: int) -> set[int]:
    """``start`` plus, one at a time, the used step whose key saves the most key switches over all uses (a step
    no chain reaches counts :data:`UNREACHABLE`), while the budget allows and a key still saves one."""
    keys = set(start)
    while len(keys) < max_keys:
        dist, _ = _distances(keys, slots)
        dist = np.where(dist < 0, UNREACHABLE, dist)
        now = dist[steps % slots]
        held = {k % slots for k in keys}
        best, best_cost = None, int((weight * now).sum())
        longest = int(now[now < UNREACHABLE].max(initial=0)) + 1
        for cand in steps:
            if cand % slots in held:
                continue
            # a chain using the new key j times and the held keys otherwise: j + dist(step - j * key)
            after = now.copy()
            for j in range(1, max(longest, 2) + 1):
                after = np.minimum(after, j + dist[(steps - j * cand) % slots])
            total = int((weight * after).sum())
            if total < best_cost:
                best, best_cost = int(cand), total
        if best is None:
            break  # no key saves a switch: leave the rest of the budget unspent
        keys.add(best)
    return keys


def choose_key_steps(uses: Mapping[int, int], slots: int, max_keys: int | None) -> list[int]:
    """Exactly the steps used when they fit ``max_keys``; else the cheaper (in key switches over all uses) of two
    greedy sets: the +-2^i keys (every step reachable) plus the used steps that save the most, and used steps
    alone, chosen from nothing, when they reach every used step (the +-2^i keys spend 2 log2(slots) keys on
    offsets a plan may never use). Below 2 log2(slots) keys the base is :func:`lattice_base` instead."""
    used = {int(s): int(n) for s, n in uses.items() if int(s) % slots}
    if max_keys is None or len(used) <= max_keys:
        return sorted(used)
    base = power_of_two_steps(slots)
    if len(base) > max_keys:  # a tight budget: forward power-of-two chains over the steps' common factor
        base = lattice_base(used, slots, max_keys)
        if len(base) > max_keys:
            raise ValueError(f"max_galois_keys={max_keys}: no Galois key fits, and this program rotates (by "
                             f"{len(used)} different steps)")
    steps = np.array(sorted(used), dtype=np.int64)
    weight = np.array([used[s] for s in steps], dtype=np.int64)

    def total(keys: set[int]) -> int:
        dist, _ = _distances(keys, slots)
        reach = dist[steps % slots]
        return int((weight * reach).sum()) if np.all(reach >= 0) else -1

    with_base = _greedy_keys(base, steps, weight, slots, max_keys)
    free = _greedy_keys(set(), steps, weight, slots, max_keys)
    free_total = total(free)
    return sorted(free if 0 <= free_total < total(with_base) else with_base)
