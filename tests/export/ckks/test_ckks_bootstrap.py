"""Bootstrapping: placement (a shortest path over levels), parameter sets, the refusal of 128-bit bootstrapping
within a 24 GiB machine's memory, and encrypted runs on Lattigo at a small, explicitly INSECURE ring
(``security="none"``, N=4096: a bootstrap takes about half a second there). 128-bit programs are exported here
(planned with ``bootstrap_memory`` for a larger machine), never keyed: their key generation peaks near 24 GB."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import math
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from ckks_testlib import DeepResidual, Square, digits, train
from sympy import isprime as sympy_isprime
from torch import nn

from polyfhe.engines.lattigo.bootcircuit import (
    BOOTSTRAP_RING,
    CIRCUIT_BITS,
    bootstrap_circuit_logq,
    bootstrap_moduli,
)
from polyfhe.engines.lattigo.bootparams import (
    KEYGEN_PEAK_FACTOR,
    bootstrap_candidates,
    bootstrap_key_bytes,
    bootstrap_modulus_bits,
    choose_bootstrap_params,
    default_spec,
    max_refresh_log_slots,
    special_primes,
)
from polyfhe.engines.lattigo.bootsecurity import check_bootstrap_security
from polyfhe.engines.lattigo.engine import lower
from polyfhe.engines.lattigo.format import parse_container, run_container_plain
from polyfhe.exporters.ckks import CKKSExportError, export_ckks
from polyfhe.exporters.ckks.bootstrap import (
    BootstrapError,
    insert_bootstraps,
    place_bootstraps,
    place_sized_bootstraps,
    refresh_slots,
    register_periods,
)
from polyfhe.program.bootstrapping import BootstrapSpec
from polyfhe.program.manifest import Step
from polyfhe.program.params import MAX_BITS_128, CKKSParams, ParameterError
from polyfhe.program.slot_layout import pack_single
from polyfhe.program.steps import Diagonals, LinearAttrs, Term
from polyfhe.runtime.execute import run_plain

LATTIGO = importlib.util.find_spec("lattigo") is not None
# 3 levels between bootstraps, on its own ring; INSECURE on purpose (240 bits at N=4096, whose 128-bit bound is 109)
SMALL_RING = CKKSParams(4096, (60, 40, 40, 40, 60), 40, security="none")
# the default bootstrapping budget of CI's machine: 75% of its 24 GiB (``machine_memory_budget``)
CI_MACHINE_BUDGET = int(0.75 * 24 * 2**30)


@pytest.fixture(scope="module")
def deep_program():
    model = train(DeepResidual(), epochs=10).eval()
    x = digits()[0]
    prog = export_ckks(model, calibration=x[:64], input_shape=(1, 8, 8), backend="lattigo", params=SMALL_RING,
                       allow_insecure=True)
    return model, prog


# ---------------------------------------------------------------------------------------------------------------
# placement
# ---------------------------------------------------------------------------------------------------------------
def _random_program(rng: np.random.Generator, depth: int, periods: tuple[int, ...] = (16,)) -> list[Step]:
    """A layered program: a linear map and a product per two levels, linear maps reading random earlier
    registers (skips), so several registers are live across most levels; each map's output period drawn from
    ``periods``."""
    steps, made = [], [(0, 0)]
    reg = 1
    for level in range(1, depth + 1):
        if level % 2:
            sources = {made[-1][0]} | {r for r, lv in made if lv < level and rng.random() < 0.3}
            terms = tuple(Term(r, Diagonals(f"d{reg}.{r}", f"k{reg}.{r}")) for r in sorted(sources))
            steps.append(Step("linear", reg, (), 4, level, LinearAttrs(terms, period=int(rng.choice(periods)))))
        else:
            steps.append(Step("mul", reg, (made[-1][0], made[-1][0]), 4, level))
        made.append((reg, level))
        reg += 1
    return steps


def _admissible_cut_sets(steps: list[Step], output: int, depth: int, budget: int):
    """Every set of cuts whose segments fit the budget, with the registers each cut refreshes, enumerated
    independently of the planner."""
    levels = {0: 0, **{s.out: s.level for s in steps}}
    last = {}
    for s in steps:
        for r in s.reads():
            last[r] = max(last.get(r, 0), s.level)
    last[output] = depth
    for k in range(depth):
        for cuts in itertools.combinations(range(1, depth), k):
            bounds = [0, *cuts, depth]
            gaps = [b - a for a, b in itertools.pairwise(bounds)]
            if any(g > budget - 1 for g in gaps[:-1]) or gaps[-1] > budget:
                continue
            yield cuts, [r for r in levels if any(levels[r] <= c < last.get(r, -1) for c in cuts)]


def _brute_force(steps: list[Step], output: int, depth: int, budget: int) -> int:
    """Fewest bootstraps over every admissible set of cuts, counted independently of the planner."""
    return min(len(refreshed) for _, refreshed in _admissible_cut_sets(steps, output, depth, budget))


def _check_levels(steps: list[Step], plan, width: int) -> list[Step]:
    """Insert the plan's bootstraps and check every level: each segment within the budget, a level left for the
    bootstrap's scale-down, every read from this segment or a refreshed copy."""
    budget = plan.budget
    ranges = {r: (-1.0, 1.0) for regs in plan.refreshed for r in regs}
    blocks = {c: 1 for i, c in enumerate(plan.cuts) if plan.is_packed(i)}
    placed, copies = insert_bootstraps(steps, plan, ranges, width, blocks, _read_packed)
    original = {0: 0, **{s.out: s.level for s in steps}}

    def segment_of(level: int) -> int:
        return sum(c < level for c in plan.cuts)

    level, segment = {0: 0}, {0: 0}
    for step in placed:
        if step.op == "bootstrap":
            assert all(level[r] <= budget - 1 for r in step.inputs)  # a level left for the scale-down
            assert step.bootstrap.slots == width
            segment[step.out] = plan.cuts.index(step.bootstrap.cut) + 1
        else:
            segment[step.out] = segment_of(original[step.out])
            for r in step.reads():  # only this segment's registers, or refreshed copies at the top of the chain
                assert level[r] <= step.level - 1
                assert segment[r] == segment[step.out] or (level[r] == 0 and segment[r] <= segment[step.out])
        assert step.level <= budget
        level[step.out] = step.level
    assert sum(s.op == "bootstrap" for s in placed) == plan.count
    assert len(copies) == sum(len(regs) for regs in plan.refreshed)
    assert all(left >= 0 for left in plan.levels_left())
    return placed


def _read_packed(step: Step, placed: dict) -> Step:
    """A step reading packed registers (structure only: the diagonals' rewrite is ``test_pack.py``'s)."""
    return step.remapped({r: where[0] for r, where in placed.items()})


@pytest.mark.parametrize("seed", range(6))
def test_placement_is_the_fewest_bootstraps_and_fits_every_segment(seed):
    rng = np.random.default_rng(seed)
    depth, budget = int(rng.integers(7, 12)), int(rng.integers(3, 5))
    steps = _random_program(rng, depth)
    output = steps[-1].out
    plan = place_bootstraps(steps, output, depth, budget)
    assert plan.count == _brute_force(steps, output, depth, budget)
    _check_levels(steps, plan, 16)


def _price(width: int) -> float:
    """A bootstrap's price by width, shaped like Lattigo's: a fixed part and a part growing with the slots."""
    return 40.0 + 4.0 * math.log2(width) + (20.0 if width >= 64 else 0.0)


@pytest.mark.parametrize("seed", range(8))
def test_sized_placement_is_the_cheapest_width_and_cuts_and_never_exceeds_the_level_budget(seed):
    """Against brute force over every admissible set of cuts and every width: the cheapest total price, each
    refreshed register within the chosen width, and every segment within the chain's levels."""
    rng = np.random.default_rng(100 + seed)
    depth, budget = int(rng.integers(7, 12)), int(rng.integers(3, 5))
    lanes, input_period = int(rng.choice([1, 2])), 8
    steps = _random_program(rng, depth, periods=(4, 8, 16, 32))
    output = steps[-1].out
    periods = register_periods(steps, input_period)
    plan = place_sized_bootstraps(steps, output, depth, budget, input_period=input_period, lanes=lanes,
                                  max_slots=64, price=_price)
    best = min(len(refreshed) * _price(width)
               for cuts, refreshed in _admissible_cut_sets(steps, output, depth, budget)
               for width in (2, 4, 8, 16, 32, 64)
               if all(periods[r] * lanes <= width for r in refreshed))
    assert plan.count * _price(plan.slots) == pytest.approx(best)
    assert all(periods[r] * lanes <= plan.slots for regs in plan.refreshed for r in regs)
    assert refresh_slots(steps, plan, input_period, lanes, 64) == plan.slots
    _check_levels(steps, plan, plan.slots)


@pytest.mark.parametrize("seed", range(8))
def test_packed_placement_takes_no_more_bootstraps_and_never_exceeds_the_level_budget(seed):
    """With a cut's registers allowed to share one bootstrap (when their blocks fit the width), the placement
    never takes more bootstraps than without, a packed cut's registers fit its width side by side, and every
    segment stays within the chain's levels."""
    rng = np.random.default_rng(200 + seed)
    depth, budget = int(rng.integers(7, 12)), int(rng.integers(3, 5))
    lanes, input_period = int(rng.choice([1, 2])), 8
    steps = _random_program(rng, depth, periods=(4, 8))
    output = steps[-1].out
    periods = register_periods(steps, input_period)

    def packs(cut, regs, width):
        return len(regs) > 1 and len(regs) * max(periods[r] for r in regs) * lanes <= width

    def flat(width):
        return 1.0

    alone = place_sized_bootstraps(steps, output, depth, budget, input_period=input_period, lanes=lanes,
                                   max_slots=64, price=flat)
    plan = place_sized_bootstraps(steps, output, depth, budget, input_period=input_period, lanes=lanes,
                                  max_slots=64, price=flat, packs=packs)
    assert plan.count <= alone.count
    assert len(plan.packed) == len(plan.cuts)
    for i, regs in enumerate(plan.refreshed):
        if plan.is_packed(i):
            assert packs(plan.cuts[i], regs, plan.slots)
    placed = _check_levels(steps, plan, plan.slots)
    packed_steps = [s for s in placed if s.op == "bootstrap" and len(s.inputs) > 1]
    assert len(packed_steps) == sum(plan.packed)


def test_a_narrower_bootstrap_wins_only_when_its_extra_bootstraps_cost_less():
    """Same program, two prices: where a wide bootstrap is dear the placement takes more, narrower ones; where
    width costs little it keeps the fewest."""
    rng = np.random.default_rng(3)
    for _ in range(50):  # a program whose fewest bootstraps need a wide register refreshed
        steps = _random_program(rng, 10, periods=(4, 32))
        fewest = place_bootstraps(steps, steps[-1].out, 10, 4)
        wide = refresh_slots(steps, fewest, 8, 1, 64)
        narrow = place_sized_bootstraps(steps, steps[-1].out, 10, 4, input_period=8, lanes=1, max_slots=64,
                                        price=lambda w: 1.0 if w <= 8 else 1000.0)
        if wide > 8 and narrow.slots <= 8 and narrow.count > fewest.count:
            break
    else:
        pytest.fail("no random program needed a wider bootstrap for its fewest count")
    flat = place_sized_bootstraps(steps, steps[-1].out, 10, 4, input_period=8, lanes=1, max_slots=64,
                                  price=lambda w: 1.0)
    assert flat.count == fewest.count and flat.slots == wide


def test_no_bootstrap_when_the_chain_holds_the_circuit_and_a_useless_chain_is_refused():
    steps = _random_program(np.random.default_rng(0), 6)
    assert place_bootstraps(steps, steps[-1].out, 6, 6).count == 0
    with pytest.raises(BootstrapError, match="at least 2 levels"):
        place_bootstraps(steps, steps[-1].out, 6, 1)


# ---------------------------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------------------------
def _independent_log_qp(params, spec):
    """log2 of the bootstrapping modulus from the primes themselves, summed here: every prime checked prime,
    NTT-friendly for the bootstrapping ring and of the bit size Lattigo's circuit asks for."""
    q, p = bootstrap_moduli(params, spec)
    nth_root = 2 << spec.logn
    sizes = (*params.coeff_mod_bits[:-1], *bootstrap_circuit_logq(params, spec), *spec.logp)
    assert len(q) + len(p) == len(sizes) and len(set(q) | set(p)) == len(sizes)
    for prime, bits in zip((*q, *p), sizes):
        assert sympy_isprime(prime) and prime % nth_root == 1 and abs(math.log2(prime) - bits) < 0.5
    return sum(math.log2(x) for x in (*q, *p))


def test_bootstrapping_chains_meet_the_128_bit_bound_on_the_real_moduli():
    for depth in (20, 30, 60):
        params, spec = choose_bootstrap_params(depth, 8192)
        verdict = check_bootstrap_security(params, spec)
        assert spec.logn == 16 and verdict.secure and verdict.bound == MAX_BITS_128[BOOTSTRAP_RING] == 1747
        assert verdict.log_qp == pytest.approx(_independent_log_qp(params, spec), abs=1e-9)
        assert verdict.log_qp <= verdict.bound
        # no ring switching at 128 bits: the residual ring is the bootstrapping ring, secure on its own
        assert params.poly_modulus_degree == BOOTSTRAP_RING and params.levels >= 7
        assert sum(params.coeff_mod_bits) <= MAX_BITS_128[params.poly_modulus_degree]
    spec = default_spec(SMALL_RING, 8)
    assert spec.logn == 12 and not check_bootstrap_security(SMALL_RING, spec).secure


def test_lattigo_named_parameter_sets_give_their_stated_log_qp():
    """Lattigo 6.2.0's default bootstrapping sets name their log QP (N16QP1546H192H32, N16QP1767H32768H32): the
    port of its prime generation reproduces both from their literals (default circuit: 3 x 39, 8 x 60, 4 x 56)."""
    for logq, special, named in (((60,) + (40,) * 9, 5, 1546), ((60,) + (40,) * 13, 6, 1767)):
        params = CKKSParams(1 << 16, (*logq, 61), 40, security="none")
        spec = BootstrapSpec(16, (61,) * special, 15)
        assert round(check_bootstrap_security(params, spec).log_qp) == named


def _at_log_qp(target):
    """A residual chain on N=2^16 whose bootstrapping modulus is ``target`` bits, by its nominal sizes."""
    spec = BootstrapSpec(16, (61,) * 6, 10)
    base = CKKSParams(1 << 16, (60, 60), 40)
    room = target - round(check_bootstrap_security(base, spec).log_qp)
    sizes = [40] * (room // 40)
    if room % 40:  # the rest spread over two primes of 20..40 bits
        last = sizes.pop() + room % 40
        sizes += [last // 2, last - last // 2]
    return CKKSParams(1 << 16, (60, *sizes, 60), 40), spec


def test_one_bit_over_the_bound_is_refused_and_at_the_bound_passes():
    at, spec = _at_log_qp(1747)
    over, _ = _at_log_qp(1748)
    verdict = check_bootstrap_security(at, spec)
    assert round(verdict.log_qp) == 1747 and verdict.log_qp <= 1747 and verdict.secure
    verdict = check_bootstrap_security(over, spec)
    assert round(verdict.log_qp) == 1748 and not verdict.secure
    assert "over the 128-bit bound of 1747 bits for N=65536" in verdict.problems[0]


def test_the_verdict_reads_the_real_primes():
    """Swap one real residual prime for a larger one: nothing planned changes, the verdict does."""
    params, spec = _at_log_qp(1747)
    q = bootstrap_moduli(params, spec)[0][: len(params.coeff_mod_bits) - 1]
    assert check_bootstrap_security(params, spec, q).secure
    bigger = (*q[:-1], q[-1] * 4 + 1)  # 2 bits more in one prime
    verdict = check_bootstrap_security(params, spec, bigger)
    assert not verdict.secure and verdict.log_qp == pytest.approx(
        check_bootstrap_security(params, spec, q).log_qp + math.log2(bigger[-1] / q[-1]))


def test_ring_switching_a_sparse_secret_and_a_wide_ephemeral_key_are_refused():
    params, spec = choose_bootstrap_params(20, 4096)
    small = CKKSParams(1 << 14, (60,) + (40,) * 7 + (60,), 40)
    verdict = check_bootstrap_security(small, replace(spec, logp=(61,) * 6))
    assert any("EvkN2ToN1" in p and "438 bits for N=16384" in p for p in verdict.problems)
    assert all(c.params.poly_modulus_degree == BOOTSTRAP_RING for c in bootstrap_candidates(20, 4096))
    sparse = check_bootstrap_security(params, spec, secret_weight=192)
    assert any("Hamming weight 192" in p for p in sparse.problems)
    wide = replace(params, coeff_mod_bits=(60, 40, 40, 60), scale_bits=40)
    assert not check_bootstrap_security(wide, replace(spec, logp=(62, *spec.logp[1:]))).secure


@pytest.mark.skipif(not LATTIGO, reason="the orion-v2-lattigo wheel is not installed")
def test_the_residual_primes_are_the_wheels():
    from polyfhe.engines.lattigo.engine import lattigo_primes

    for params, spec in ((CKKSParams(1 << 16, (60,) + (40,) * 11 + (60,), 40), BootstrapSpec(16, (61,) * 6, 13)),
                         (SMALL_RING, BootstrapSpec(12, (61,) * 6, 3))):
        q, _ = lattigo_primes(params, spec.to_dict())
        assert bootstrap_moduli(params, spec)[0][: len(q)] == q


def test_special_primes_make_the_bootstrapping_keys_smallest_that_fit():
    params, _ = choose_bootstrap_params(30, 1024)
    chosen = special_primes(params)
    used = sum(params.coeff_mod_bits[:-1]) + CIRCUIT_BITS
    for count in range(1, 20):
        if used + 61 * count > MAX_BITS_128[BOOTSTRAP_RING]:
            continue
        other = replace(default_spec(params, 1024), logp=(61,) * count)
        assert bootstrap_key_bytes(params, replace(other, logp=chosen)) <= bootstrap_key_bytes(params, other)


def test_bootstrapping_key_bytes_match_the_measured_lattigo_key_set():
    # measured: residual N=2^14 [60, 40 x 7], six special primes, 2^10 slots -> 4.26 GB marshalled
    params = CKKSParams(1 << 14, (60,) + (40,) * 7 + (60,), 40)
    spec = BootstrapSpec(16, (61,) * 6, 10)
    assert bootstrap_key_bytes(params, spec) == pytest.approx(4.26e9, rel=0.02)


def test_bootstrap_choice_respects_the_memory_budget_and_says_what_would_fit():
    free = bootstrap_candidates(60, 4096)
    assert [c.bootstraps for c in free] == sorted(c.bootstraps for c in free)
    cheapest = free[0]
    params, _ = choose_bootstrap_params(60, 4096, memory_bytes=None)
    assert params == cheapest.params
    tight = cheapest.keygen_peak_bytes - 1
    params, spec = choose_bootstrap_params(60, 4096, memory_bytes=tight)
    assert params != cheapest.params
    assert bootstrap_key_bytes(params, spec) * KEYGEN_PEAK_FACTOR <= tight
    smallest = min(c.keygen_peak_bytes for c in free)
    with pytest.raises(ParameterError, match=r"cannot bootstrap within .* GB: the smallest choice, residual N="):
        choose_bootstrap_params(60, 4096, memory_bytes=smallest - 1)
    # wider refreshes (more interleaved samples) hold more keys: the widest that fits shrinks with memory
    _, spec = choose_bootstrap_params(60, 1024)
    widths = [max_refresh_log_slots(params, spec, m) for m in (None, 40e9, 20e9, 1)]
    assert widths == sorted(widths, reverse=True) and widths[-1] == spec.log_slots


def test_a_circuit_too_deep_for_seal_says_which_engine_bootstraps():
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), *[m for _ in range(16) for m in (Square(), nn.Linear(8, 8))])
    x = digits()[0][:16]
    with pytest.raises(CKKSExportError, match="backend='lattigo' with bootstrap='auto'"):
        export_ckks(model.eval(), calibration=x, input_shape=(1, 8, 8))
    with pytest.raises(CKKSExportError, match="unknown bootstrap mode"):
        export_ckks(model.eval(), calibration=x, input_shape=(1, 8, 8), backend="lattigo", bootstrap="always")
    with pytest.raises(CKKSExportError, match="offers 3.*bootstrap='auto'"):
        export_ckks(DeepResidual().eval(), calibration=x, input_shape=(1, 8, 8), backend="lattigo",
                    params=SMALL_RING, allow_insecure=True, bootstrap="off")


# ---------------------------------------------------------------------------------------------------------------
# the exported program
# ---------------------------------------------------------------------------------------------------------------
def test_bootstrapped_program_reports_its_placement_and_matches_torch_in_plain(deep_program):
    model, prog = deep_program
    info = prog.manifest.info["bootstrap"]
    steps = prog.manifest.steps
    assert info["count"] == sum(s.op == "bootstrap" for s in steps) >= 2
    assert info["levels_needed"] == prog.manifest.info["depth"] > prog.params.levels == info["levels_per_segment"]
    assert len(info["levels_left_after_segment"]) == len(info["cuts_after_level"]) + 1
    assert max(s.level for s in steps) <= prog.params.levels
    for step in (s for s in steps if s.op == "bootstrap"):
        lo, hi = step.bootstrap.range
        assert step.bootstrap.postscale >= 1 and lo <= -step.bootstrap.constant <= hi
    x = digits()[2][:32]
    with torch.no_grad():
        ref = model(torch.tensor(x, dtype=torch.float32)).double().numpy()
    assert np.abs(run_plain(prog.manifest, prog.arrays, x) - ref).max() < 1e-4
    # the Lattigo container's own semantics (scale bookkeeping and bootstrap nodes) give the same logits
    lowered = lower(prog)
    header, _ = parse_container(lowered.data)
    assert header["manifest"]["bootstrap_slots"] == [info["slots"]] and header["params"]["btp_logn"] == 12
    m = prog.manifest
    vec = run_container_plain(lowered.data, pack_single(m, x[: m.samples_per_ciphertext].reshape(-1, 64)))
    from polyfhe.program.slot_layout import unpack_single

    out = unpack_single(m, vec, min(len(x), m.samples_per_ciphertext))
    assert np.abs(out - ref[: len(out)]).max() < 1e-4


def test_bootstrapped_program_runs_encrypted_on_lattigo(deep_program):
    model, prog = deep_program
    x = digits()[2]
    k = prog.manifest.samples_per_ciphertext
    client = prog.client()
    server = prog.server(client.public_context())
    out = client.decrypt(server.run(client.encrypt(x[:k])))
    with torch.no_grad():
        ref = model(torch.tensor(x[:k], dtype=torch.float32)).double().numpy()
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() < 1e-3 * max(1.0, np.abs(ref).max())
    assert (out.argmax(1) == ref.argmax(1)).all()


@pytest.fixture(scope="module")
def packed_sparse_program():
    """The deep fixture's model 16 wide, 16 samples per ciphertext: a cut's two 16-value registers share one
    bootstrap of fewer slots than the ring's 2,048."""
    model = train(DeepResidual(width=16), epochs=10).eval()
    prog = export_ckks(model, calibration=digits()[0][:64], input_shape=(1, 8, 8), backend="lattigo",
                       params=SMALL_RING, allow_insecure=True, samples_per_ciphertext=16)
    return model, prog


def test_packed_registers_share_a_sparse_bootstrap_and_agree_with_the_plaintext_run(packed_sparse_program):
    """A cut's registers, masked into their slot blocks and added, take one bootstrap of fewer slots than the
    ring has; encrypted on Lattigo, the logits agree with torch's (and the program's plain run)."""
    model, prog = packed_sparse_program
    info = prog.manifest.info["bootstrap"]
    packed = [s for s in prog.manifest.steps if s.op == "bootstrap" and len(s.inputs) > 1]
    assert any(info["packed"]) and len(packed) == sum(info["packed"])
    assert info["slots"] < prog.params.slots  # sparse
    assert info["count"] == sum(s.op == "bootstrap" for s in prog.manifest.steps)
    x = digits()[2][: prog.manifest.samples_per_ciphertext]
    with torch.no_grad():
        ref = model(torch.tensor(x, dtype=torch.float32)).double().numpy()
    assert np.abs(run_plain(prog.manifest, prog.arrays, x) - ref).max() < 1e-4
    client = prog.client()
    server = prog.server(client.public_context())
    out = client.decrypt(server.run(client.encrypt(x)))
    assert np.abs(out - ref).max() < 1e-3 * max(1.0, np.abs(ref).max())
    assert (out.argmax(1) == ref.argmax(1)).all()


def test_packing_saves_a_bootstrap_per_packed_cut_and_changes_no_logit(deep_program):
    """The same model exported with ``pack_bootstraps=False``: one bootstrap more for each packed cut, and the two
    programs compute the same logits in plain (masking and retargeting are exact rewrites)."""
    model, prog = deep_program
    alone = export_ckks(model, calibration=digits()[0][:64], input_shape=(1, 8, 8), backend="lattigo",
                        params=SMALL_RING, allow_insecure=True, pack_bootstraps=False)
    packed_cuts = prog.manifest.info["bootstrap"]["packed"]
    assert any(packed_cuts) and not any(alone.manifest.info["bootstrap"]["packed"])
    extra = sum(len(regs) - 1 for regs, p in zip(prog.manifest.info["bootstrap"]["registers"], packed_cuts,
                                                 strict=True) if p)
    assert alone.manifest.info["bootstrap"]["count"] == prog.manifest.info["bootstrap"]["count"] + extra
    x = digits()[2][:64]
    np.testing.assert_allclose(run_plain(prog.manifest, prog.arrays, x), run_plain(alone.manifest, alone.arrays, x), rtol=0, atol=1e-9)


# the child's own high-water mark (VmHWM): ru_maxrss would carry the forking test process's across exec
SERVER_PEAK_SCRIPT = """
import mmap, sys
from polyfhe.procinfo import peak_resident_bytes
from polyfhe.program.ckks_program import load_program
prog = load_program(sys.argv[1])
with open(sys.argv[2], "rb") as f:
    context = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
server = prog.server(context)
with open(sys.argv[3], "rb") as f:
    out = server.run(f.read())
open(sys.argv[4], "wb").write(out)
print(peak_resident_bytes())
"""


@pytest.mark.skipif(not LATTIGO, reason="needs the orion-v2 Lattigo wheels (pip install 'polyfhe[lattigo]')")
def test_the_predicted_server_peak_bounds_a_real_servers(deep_program, tmp_path):
    """A bootstrapped program's server, alone in a fresh process as deployed (context mapped from disk, one query):
    its peak resident memory stays under the export's prediction (``server_peak_bytes``: what the export plans
    with and refuses by), and the prediction is no looser than its own margins (Go's heap growth and the fixed
    process allowance). The full-size check is the deep recipe's bench (docs/benchmarks.md): 18.16 GB predicted,
    16.4-16.8 GB measured."""
    import subprocess
    import sys

    from polyfhe.engines.lattigo.servermem import GO_HEAP_GROWTH, SERVER_PROCESS_BYTES

    _, prog = deep_program
    x = digits()[2][: prog.manifest.samples_per_ciphertext]
    client = prog.client()
    prog.save(tmp_path / "prog")
    (tmp_path / "context.bin").write_bytes(client.public_context())
    (tmp_path / "query.bin").write_bytes(client.encrypt(x))
    done = subprocess.run([sys.executable, "-c", SERVER_PEAK_SCRIPT, str(tmp_path / "prog"),
                           str(tmp_path / "context.bin"), str(tmp_path / "query.bin"), str(tmp_path / "out.bin")],
                          check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GOGC": "25"})
    assert done.returncode == 0, done.stderr[-2000:]
    measured = int(done.stdout.split()[-1])
    assert client.decrypt((tmp_path / "out.bin").read_bytes()).shape[0] == len(x)  # it really served
    predicted = prog.manifest.info["bootstrap"]["server_memory"]["peak_bytes"]
    logging.getLogger(__name__).info("server peak %.3f GB, predicted %.3f GB", measured / 1e9, predicted / 1e9)
    # an upper bound, and no looser than the formula's own margins: Go's heap growth and the process allowance
    assert measured <= predicted <= GO_HEAP_GROWTH * measured + SERVER_PROCESS_BYTES, (measured, predicted)


def test_a_context_without_bootstrapping_keys_is_refused(deep_program):
    from polyfhe.program.wire import KIND_CONTEXT, WireError, pack, unpack

    _, prog = deep_program
    client = prog.client()
    box = unpack(client.public_context(), KIND_CONTEXT)
    stripped = pack(KIND_CONTEXT, box.header, {"evaluation_keys": box.sections["evaluation_keys"]})
    with pytest.raises(WireError, match="no bootstrapping keys"):
        prog.server(stripped)


def _deep_chain() -> nn.Module:
    """15 squares between small linear maps: 31 levels, past every leveled ring."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), *[m for _ in range(15) for m in (Square(), nn.Linear(8, 8))])
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight.mul_(0.5)
    return model.eval()


def test_the_small_ring_is_labelled_insecure_and_needs_allow_insecure(deep_program):
    assert SMALL_RING.security == "none" and deep_program[1].params.security == "none"
    assert sum(SMALL_RING.coeff_mod_bits) > MAX_BITS_128[SMALL_RING.poly_modulus_degree]
    with pytest.raises(CKKSExportError, match="allow_insecure"):
        export_ckks(DeepResidual().eval(), calibration=digits()[0][:16], input_shape=(1, 8, 8), backend="lattigo",
                    params=SMALL_RING)


def test_128_bit_bootstrapping_is_refused_within_a_24_gib_machine_saying_what_it_needs(tmp_path, capsys,
                                                                                       monkeypatch):
    """128-bit bootstrapping runs on N=2^16 only, and its key generation peaks near 24 GB: on CI's 24 GiB machine
    (default budget 75% of it) the export refuses, with the memory it needs and the setting that plans for more."""
    import polyfhe.exporters.ckks.passes.parameters as exporter
    from polyfhe.cli import main
    from polyfhe.exporters.onnx import export_onnx

    monkeypatch.setattr(exporter, "machine_memory_budget", lambda: CI_MACHINE_BUDGET)
    x = digits()[0][:16]
    with pytest.raises(CKKSExportError) as refused:
        export_ckks(_deep_chain(), calibration=x, input_shape=(1, 8, 8), backend="lattigo")
    message = str(refused.value)
    assert f"cannot bootstrap within {CI_MACHINE_BUDGET / 1e9:.1f} GB" in message
    assert f"residual N={BOOTSTRAP_RING}" in message and "75% of this machine's memory (the default)" in message
    assert "bootstrap_memory=" in message and "--bootstrap-memory" in message
    need_gb = int(message.split("run it on a machine with at least ")[1].split(" GB")[0])
    smallest = min(c.keygen_peak_bytes for c in bootstrap_candidates(31, 64))
    assert need_gb == round(smallest / 1e9) and smallest > CI_MACHINE_BUDGET
    # an explicit budget is named as such; one that holds the key generation plans the 128-bit program
    with pytest.raises(CKKSExportError, match="the bootstrap_memory given"):
        export_ckks(_deep_chain(), calibration=x, input_shape=(1, 8, 8), backend="lattigo",
                    bootstrap_memory=CI_MACHINE_BUDGET)
    # the command line says the same
    onnx_path = tmp_path / "deep.onnx"
    export_onnx(_deep_chain(), onnx_path, (1, 8, 8))
    np.save(tmp_path / "cal.npy", x.astype(np.float32))
    assert main(["export", str(onnx_path), "--calibration", str(tmp_path / "cal.npy"), "--backend", "lattigo",
                 "--out", str(tmp_path / "p")]) != 0
    err = capsys.readouterr().err
    assert f"at least {need_gb} GB" in err and "--bootstrap-memory" in err and not (tmp_path / "p").exists()


def test_cli_exports_a_deep_model_with_bootstraps_and_refuses_it_with_bootstrap_off(tmp_path, capsys):
    from polyfhe.cli import main
    from polyfhe.exporters.onnx import export_onnx
    from polyfhe.program.ckks_program import load_program

    onnx_path = tmp_path / "deep.onnx"
    export_onnx(_deep_chain(), onnx_path, (1, 8, 8))
    np.save(tmp_path / "cal.npy", digits()[0][:16].astype(np.float32))
    common = ["export", str(onnx_path), "--calibration", str(tmp_path / "cal.npy"), "--backend", "lattigo",
              "--bootstrap-memory", "64"]  # planned for a machine that holds N=2^16 key generation (about 24 GB)
    assert main([*common, "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "bootstraps" in out and "after levels" in out
    prog = load_program(tmp_path / "p")
    info = prog.manifest.info["bootstrap"]
    assert prog.params.poly_modulus_degree == BOOTSTRAP_RING and prog.params.security == "tc128"  # no switching
    assert info["spec"]["logn"] == 16 and info["key_bytes"] > 0
    assert info["count"] >= 1 and info["modulus_bits"] <= MAX_BITS_128[BOOTSTRAP_RING]
    # the real log QP (every prime as Lattigo makes them), below the planned bit sizes chains are made with
    spec = BootstrapSpec.from_dict(info["spec"])
    assert info["modulus_bits"] == round(check_bootstrap_security(prog.params, spec).log_qp, 3)
    assert info["modulus_bits"] < info["planned_modulus_bits"] == bootstrap_modulus_bits(prog.params, spec)
    assert prog.manifest.info["planned"]["bootstraps"] == info["count"]
    assert main([*common, "--out", str(tmp_path / "alone"), "--no-pack-bootstraps"]) == 0
    alone = load_program(tmp_path / "alone").manifest.info["bootstrap"]
    assert not any(alone["packed"])
    assert alone["count"] == sum(len(regs) for regs in alone["registers"]) >= info["count"]
    assert main([*common, "--out", str(tmp_path / "q"), "--bootstrap", "off"]) != 0
    assert "levels" in capsys.readouterr().err


def test_a_leveled_ring_whose_keys_no_server_accepts_falls_back_to_bootstrapping(caplog):
    """25 levels fit N=32768 leveled, but Lattigo's rotation keys there exceed a server's context limit: the
    export bootstraps instead of refusing the model, on N=2^16 (the only residual ring that bootstraps securely:
    fewer levels a key there, so fewer bytes)."""
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.head = nn.Linear(64, 32), nn.Linear(32, 10)
            self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(12))

        def forward(self, x):
            h = self.stem(x.flatten(1))
            for block in self.blocks:
                h = h + 0.25 * block(h) * block(h)
            return self.head(h)

    torch.manual_seed(0)
    x = digits()[0][:32]
    with caplog.at_level("WARNING"):
        prog = export_ckks(Residual().eval(), calibration=x, input_shape=(1, 8, 8), backend="lattigo",
                           bootstrap_memory=int(64e9))
    assert "with bootstrapping instead" in caplog.text
    assert prog.params.poly_modulus_degree == BOOTSTRAP_RING and prog.params.security == "tc128"
    assert prog.manifest.info["bootstrap"]["count"] >= 1
    with pytest.raises(CKKSExportError, match="rotation keys"):
        export_ckks(Residual().eval(), calibration=x, input_shape=(1, 8, 8), backend="lattigo", bootstrap="off")


def test_a_bootstrapped_server_over_the_memory_budget_is_refused_with_its_numbers(caplog):
    """Over the budget, a packed program is first tried with each register bootstrapped alone (its masked and
    retargeted maps hold more diagonals), then refused with its numbers."""
    x = digits()[0][:32]
    with caplog.at_level(logging.WARNING, logger="polyfhe.exporters.ckks.pipeline"), \
            pytest.raises(CKKSExportError, match=r"server would peak near .* GB of plaintexts .* bootstrapping keys "
                                                 r".* What would fit: a narrower model"):
        export_ckks(DeepResidual().eval(), calibration=x, input_shape=(1, 8, 8), backend="lattigo",
                    params=SMALL_RING, allow_insecure=True, bootstrap_memory=100_000_000)
    unpacked = [r.getMessage() for r in caplog.records if "bootstrapping each register alone" in r.getMessage()]
    assert len(unpacked) == 1 and "with packed bootstraps" in unpacked[0]


def test_bootstrapping_keys_with_a_lying_count_are_refused_before_go_reads_them(deep_program):
    """Go trusts the counts it unmarshals (2^33 polynomials: the process dies of out-of-memory); every count of
    the bootstrapping keys must fit in the bytes present."""
    import struct

    from polyfhe.engines.lattigo.keybytes import check_bootstrap_keys
    from polyfhe.program.wire import KIND_CONTEXT, WireError, pack, unpack

    _, prog = deep_program
    box = unpack(prog.client().public_context(), KIND_CONTEXT)
    keys = bytes(box.sections["bootstrap_keys"])
    check_bootstrap_keys(keys)  # the real ones walk to their last byte
    first_key = keys.index(b"\x01")  # the first present key's flag
    for field, value in ((1, 1 << 33), (3, 1 << 40), (4, 3)):  # rows, the components, the Q prime count
        lying = bytearray(keys)
        struct.pack_into("<Q", lying, first_key + 1 + 8 * field, value)
        context = pack(KIND_CONTEXT, box.header, {**box.sections, "bootstrap_keys": bytes(lying)})
        with pytest.raises(WireError, match="bootstrapping keys"):
            prog.server(context)
    with pytest.raises(WireError, match="trailing bytes"):
        check_bootstrap_keys(keys + b"\x00")
