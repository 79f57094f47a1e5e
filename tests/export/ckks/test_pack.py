"""Packing a cut's registers into one bootstrap (``export/ckks/pack.py``): the diagonal rewrites are exact.

Each rewrite is checked against the map it replaces on random values, in the program's own convention (rows
pre-rotated by their giant step): masking a map's output rows, undoing its block sums, and a later map reading
two registers from their blocks of one packed register instead of from the registers themselves.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyfhe.exporters.ckks.pack import block_mask, mask_diagonals, retarget_diagonals, unreduce_diagonals

SLOTS = 64


def _stored(ks: np.ndarray, plain: np.ndarray, baby: int) -> np.ndarray:
    return np.stack([np.roll(row, int((k // baby) * baby)) for k, row in zip(ks, plain, strict=True)])


def _apply(ks: np.ndarray, stored: np.ndarray, baby: int, x: np.ndarray) -> np.ndarray:
    """What a linear step computes: sum over diagonals of (row pre-rotation undone) * (input rotated by k)."""
    out = np.zeros(len(x))
    for k, row in zip(ks, stored, strict=True):
        out += np.roll(row, -int((k // baby) * baby)) * np.roll(x, -int(k))
    return out


def _random_map(rng, n: int, k_range: int, baby: int) -> tuple[np.ndarray, np.ndarray]:
    ks = np.sort(rng.choice(k_range, size=n, replace=False)).astype(np.int64)
    return ks, _stored(ks, rng.normal(size=(n, SLOTS)), baby)


def _periodic(rng, period: int) -> np.ndarray:
    return np.tile(rng.normal(size=period), SLOTS // period)


@pytest.mark.parametrize("baby", [1, 4, 8])
def test_masked_diagonals_give_the_masked_output(baby):
    rng = np.random.default_rng(baby)
    ks, stored = _random_map(rng, 9, SLOTS, baby)
    x = rng.normal(size=SLOTS)
    mask = block_mask(SLOTS, 16, 48)
    np.testing.assert_allclose(_apply(ks, mask_diagonals(ks, stored, baby, mask), baby, x),
                               mask * _apply(ks, stored, baby, x), atol=1e-12)


@pytest.mark.parametrize(("period", "space", "baby"), [(32, 64, 4), (16, 64, 8), (8, 64, 1), (8, 32, 4)])
def test_unreduced_diagonals_give_the_block_sums(period, space, baby):
    rng = np.random.default_rng(period + space)
    ks, stored = _random_map(rng, 7, SLOTS, baby)
    x = rng.normal(size=SLOTS)
    partial = _apply(ks, stored, baby, x)
    summed = partial.copy()
    shift = period
    while shift < space:  # the executor's rotate-and-add doublings
        summed = summed + np.roll(summed, -shift)
        shift *= 2
    new_ks, new_stored = unreduce_diagonals(ks, stored, baby, period, space, SLOTS)
    np.testing.assert_allclose(_apply(new_ks, new_stored, baby, x), summed, atol=1e-12)
    assert len(new_ks) <= len(ks) * (SLOTS // period)


@pytest.mark.parametrize(("block", "periods", "baby"), [(32, (32, 32), 4), (16, (16, 8, 16, 4), 8), (32, (16, 32), 1)])
def test_a_map_reads_registers_from_their_blocks_of_the_packed_one(block, periods, baby):
    """out = sum_t M_t r_t, each r_t repeating with its period; after packing r_t into [t*block, (t+1)*block) of
    one register p, the single retargeted term over p gives the same out."""
    rng = np.random.default_rng(block + len(periods))
    registers = [_periodic(rng, p) for p in periods]
    maps = [_random_map(rng, 6, min(SLOTS, 2 * block), baby) for _ in periods]
    expected = sum(_apply(ks, stored, baby, r) for (ks, stored), r in zip(maps, registers, strict=True))
    packed = np.zeros(SLOTS)
    for t, r in enumerate(registers):
        packed[t * block:(t + 1) * block] = r[:block]
    parts = [(ks, stored, t * block) for t, (ks, stored) in enumerate(maps)]
    new_ks, new_stored = retarget_diagonals(parts, block, baby, SLOTS)
    np.testing.assert_allclose(_apply(new_ks, new_stored, baby, packed), expected, atol=1e-12)
    assert np.all(np.any(new_stored != 0.0, axis=1))  # no all-zero diagonal kept


def test_terms_sharing_offsets_merge_into_no_more_diagonals_than_they_had():
    """Two registers read through the same offsets k (a residual stream and a product, as in MONet's blocks):
    after packing, the one term holds at most as many diagonals as the two had."""
    rng = np.random.default_rng(0)
    block, baby = SLOTS // 2, 4
    ks = np.arange(0, block, 4, dtype=np.int64)
    maps = [(ks, _stored(ks, rng.normal(size=(len(ks), SLOTS)), baby)) for _ in range(2)]
    new_ks, _ = retarget_diagonals([(k, s, t * block) for t, (k, s) in enumerate(maps)], block, baby, SLOTS)
    assert len(new_ks) <= 2 * len(ks)


def test_unreduced_diagonals_of_an_input_repeating_with_the_block_are_no_more_than_before():
    """A map summing blocks of 16 over 64 slots, reading an input that repeats every 16: undoing the sums keeps
    its diagonal count (diagonals equal modulo 16 read the same values) and its output."""
    rng = np.random.default_rng(3)
    period, baby = 16, 4
    ks, stored = _random_map(rng, 5, period, baby)
    x = _periodic(rng, period)
    summed = _apply(ks, stored, baby, x)
    shift = period
    while shift < SLOTS:
        summed = summed + np.roll(summed, -shift)
        shift *= 2
    new_ks, new_stored = unreduce_diagonals(ks, stored, baby, period, SLOTS, SLOTS, input_period=period)
    assert len(new_ks) <= len(ks)
    np.testing.assert_allclose(_apply(new_ks, new_stored, baby, x), summed, atol=1e-12)
