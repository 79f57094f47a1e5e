"""Rotations without a key of their own: shortest key chains and the keys a budget buys."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from polyfhe.engines.seal.ops import naf_terms
from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.plan import select_galois_steps
from polyfhe.runtime.rotations import (
    KeyChain,
    _greedy_keys,
    choose_key_steps,
    lattice_base,
    power_of_two_steps,
)


def _brute_force(keys: list[int], slots: int) -> dict[int, int]:
    """Fewest keys (with repetition) summing to each residue, by enumerating multisets up to 6 keys."""
    best = {0: 0}
    for size in range(1, 7):
        for combo in itertools.combinations_with_replacement(keys, size):
            best.setdefault(sum(combo) % slots, size)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_chains_are_shortest_and_rotate_by_the_step(seed):
    rng = np.random.default_rng(seed)
    slots = 64
    keys = sorted({int(k) for k in rng.integers(-slots + 1, slots, size=4)} | {1, -8})
    chain = KeyChain(keys, slots)
    want = _brute_force(keys, slots)
    for step in range(-slots, 2 * slots):
        hops = want.get(step % slots)
        if hops is None:  # unreachable within 6 keys: the chain must be longer (or impossible)
            continue
        assert chain.switches(step) == hops, step
        links = chain.chain(step)
        assert len(links) == hops and sum(links) % slots == step % slots
        assert all(link in keys for link in links)  # the steps exactly as the keys were made for them


def test_a_chain_beats_the_naf_when_other_keys_are_held():
    slots = 8192
    keys = sorted(power_of_two_steps(slots) | {14, 78 - 64})
    chain = KeyChain(keys, slots)
    assert len(naf_terms(78)) == 3 and chain.switches(78) == 2  # 64 + 14, not 64 + 16 - 2
    assert chain.switches(slots - 1) == 1 and chain.switches(0) == 0 and chain.chain(slots) == []
    with pytest.raises(ValueError, match="no chain"):
        KeyChain([2, 4], 16).switches(3)


def test_keys_chosen_within_the_budget_save_switches_over_powers_of_two():
    slots = 8192
    uses = Counter({64 * m + d: 3 for m in range(1, 5) for d in (0, 2, 14, 16, -2, -14, -16)})
    uses.update({192 * g: 1 for g in range(1, 40)})
    budget = len(power_of_two_steps(slots)) + 8
    keys = choose_key_steps(uses, slots, budget)
    assert len(keys) <= budget
    chosen = KeyChain(keys, slots)  # every used step has a chain (switches raises otherwise)
    powers = KeyChain(power_of_two_steps(slots), slots)
    total = sum(n * chosen.switches(s) for s, n in uses.items())
    assert total < sum(n * powers.switches(s) for s, n in uses.items())
    # what the previous rule kept (+-2^i plus the most used steps) costs at least as much
    extra = [s for s, _ in sorted(uses.items(), key=lambda kv: (-kv[1], kv[0])) if s not in power_of_two_steps(slots)]
    previous = KeyChain(power_of_two_steps(slots) | set(extra[:8]), slots)
    assert total <= sum(n * previous.switches(s) for s, n in uses.items())


def test_keys_chosen_from_the_used_steps_alone_when_they_reach_every_step_for_less():
    """Channel-mixing offsets (multiples of a 64-slot token block plus a few taps) are reached from a handful of
    used steps; the +-2^i keys would spend 26 of the budget on offsets no map uses."""
    slots = 8192
    uses = Counter({64 * m + d: 2 for m in range(1, 33) for d in (0, 1, -1)})
    budget = len(power_of_two_steps(slots)) + 2
    keys = choose_key_steps(uses, slots, budget)
    chosen = KeyChain(keys, slots)
    total = sum(n * chosen.switches(s) for s, n in uses.items())
    assert len(keys) <= budget and not power_of_two_steps(slots) <= set(keys)
    assert set(keys) <= set(uses)  # used steps only
    steps = np.array(sorted(uses))
    weight = np.array([uses[s] for s in steps])
    with_powers = KeyChain(_greedy_keys(power_of_two_steps(slots), steps, weight, slots, budget), slots)
    assert total < sum(n * with_powers.switches(s) for s, n in uses.items())


def test_every_used_step_gets_a_key_when_they_fit_and_no_key_at_all_is_refused():
    uses = Counter({3: 1, 5: 2, 4095: 1})
    assert choose_key_steps(uses, 4096, 10) == [3, 5, 4095]
    assert choose_key_steps(uses, 4096, None) == [3, 5, 4095]
    with pytest.raises(LoweringError, match="no Galois key fits"):
        select_galois_steps(Counter({s: 1 for s in range(1, 40)}), 4096, 0)


@pytest.mark.parametrize("budget", [1, 3, 5, 8, 12])
def test_a_budget_below_the_power_of_two_keys_still_composes_every_used_step(budget):
    uses = Counter({s: 1 + s % 3 for s in range(1, 40)})
    keys = choose_key_steps(uses, 4096, budget)
    assert 1 <= len(keys) <= budget
    chain = KeyChain(keys, 4096)
    for step in uses:
        hops = chain.chain(step)
        assert sum(hops) % 4096 == step and all(chain.has_key(h) for h in hops)


def test_lattice_base_is_binary_over_the_common_factor_and_coarser_when_the_budget_is_tighter():
    assert sorted(lattice_base([16, 48, 4000], 8192)) == [16 << i for i in range(9)]  # gcd 16: 512 offsets
    assert sorted(lattice_base([16, 48], 8192, 5)) == [16, 64, 256, 1024, 4096]  # radix 4: 5 keys cover 512 offsets
    for budget in (1, 2, 4, 7, 13):
        keys = lattice_base([1], 8192, budget)
        assert len(keys) <= budget
        reach = KeyChain(keys, 8192)
        assert all(reach.switches(s) >= 0 for s in range(0, 8192, 97))
