"""The exact shape of Lattigo's bootstrapping keys, computed from the bootstrapping parameters.

The wheels build bootstrapping parameters from ``logn``, ``logp``, ``h`` and ``log_slots`` only (the orion bridge's
``NewBootstrapParams``: every other field of ``bootstrapping.ParametersLiteral`` at Lattigo's default) and expose
neither the Galois elements nor the prime counts its keys carry. This module ports, from Lattigo v6.2.0 (the version
both wheels embed), the logic that decides them, so that the server can walk an uploaded key set against exactly
what its parameters imply (:func:`polyfhe.engines.lattigo.keybytes.check_bootstrap_keys`):

* ``circuits/ckks/bootstrapping/parameters.go`` ``NewParametersFromLiteral``: the circuit's levels (SlotsToCoeffs
  ``min(3, max(LogSlots, 1))`` single-factor levels, EvalMod ``mod1.ParametersLiteral.Depth()`` levels, CoeffsToSlots
  ``min(4, max(LogSlots, 1))`` levels, ``parameters_literal.go`` defaults), appended to the residual chain, with
  ``LogP`` special primes and ``LogBSGSRatio`` 1 for both DFT matrices; ``Parameters.GaloisElements``: the sub-sum
  rotations ``2^i`` for ``LogSlots <= i < LogN-1``, the CoeffsToSlots and SlotsToCoeffs matrices' rotations, and
  complex conjugation;
* ``circuits/ckks/dft/dft.go`` ``MatrixLiteral.GaloisElements``, ``computeBootstrappingDFTIndexMap``,
  ``genWfftIndexMap``, ``genWfftRepackIndexMap``, ``nextLevelfftIndexMap``, ``addMatrixRotToList``: which diagonals
  each factor of the (I)DFT has, and the baby-step/giant-step rotations they need;
* ``circuits/common/lintrans/lintrans.go`` ``FindBestBSGSRatio``, ``BSGSIndex``: the baby-step split;
* ``core/rlwe/params.go`` ``GaloisElement`` (5^k mod the ring's 2N), ``GaloisElementOrderTwoOrthogonalSubgroup``
  (conjugation: 2N-1);
* ``circuits/ckks/bootstrapping/keys.go`` ``GenEvaluationKeys``, ``genEncapsulationEvaluationKeysNew``: the
  ring-switching keys N1->N2 and N2->N1 only when the residual ring is smaller (never the conjugate-invariant
  ones: polyfhe's rings are standard), the dense->sparse key on Q[0], P[0] and the sparse->dense key on the whole
  modulus (ephemeral secret weight 32, the default), the relinearisation key and every Galois key on the whole
  bootstrapping modulus (``rlwe.KeyGenerator`` defaults: every Q and P prime, no base-two decomposition).

Pure arithmetic; no engine import. Checked against keys the wheel generates (tests/engines/lattigo/test_lattigo_bootkey_shape.py).
"""

from __future__ import annotations

import math
from functools import lru_cache

from polyfhe.engines.lattigo.format import best_bsgs_n1
from polyfhe.engines.lattigo.keybytes import BootKeyShape

__all__ = ["bootstrap_galois_elements", "bootstrap_key_shape", "circuit_levels", "dft_rotations",
           "expected_bootstrap_keys"]

GALOIS_GEN = 5  # core/rlwe/params.go GaloisGen
# circuits/ckks/bootstrapping/parameters_literal.go defaults (the bridge sets none of these)
COEFFS_TO_SLOTS_DEPTH = 4
SLOTS_TO_COEFFS_DEPTH = 3
MOD1_DEGREE, MOD1_K, MOD1_DOUBLE_ANGLE, MOD1_INV_DEGREE = 30, 16, 3, 0  # CosDiscrete
EPHEMERAL_SECRET_WEIGHT = 32
LOG_BSGS_RATIO = 1  # both DFT matrices' MatrixLiteral.LogBSGSRatio in NewParametersFromLiteral


def galois_element(k: int, nth_root: int) -> int:
    """``rlwe.Parameters.GaloisElement``: 5^(k mod nth_root) mod nth_root (a negative k wraps as Go's uint64)."""
    return pow(GALOIS_GEN, k & (nth_root - 1), nth_root)


def mod1_depth() -> int:
    """``mod1.ParametersLiteral.Depth`` for the default CosDiscrete approximation: bits of max(degree, 2K-1), the
    double angles, bits of the inverse's degree."""
    return max(MOD1_DEGREE, 2 * MOD1_K - 1).bit_length() + MOD1_DOUBLE_ANGLE + MOD1_INV_DEGREE.bit_length()


def circuit_levels(log_slots: int) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """(SlotsToCoeffs ``Levels``, EvalMod depth, CoeffsToSlots ``Levels``) of the default bootstrapping circuit at
    2^log_slots slots: one factor per level (``Get*FactorizationDepthAndLogScales`` defaults)."""
    stc = (1,) * min(SLOTS_TO_COEFFS_DEPTH, max(log_slots, 1))
    cts = (1,) * min(COEFFS_TO_SLOTS_DEPTH, max(log_slots, 1))
    return stc, mod1_depth(), cts


# --- circuits/ckks/dft/dft.go --------------------------------------------------------------------------------
def _wfft_index_map(log_l: int, level: int, encode: bool) -> set[int]:
    """``genWfftIndexMap`` (not bit-reversed): the diagonals 0, rot and 2^logL - rot of one butterfly level."""
    rot = 1 << (level - 1) if encode else 1 << (log_l - level)
    return {0, rot, (1 << log_l) - rot}


def _next_level_index_map(vec: set[int], log_l: int, n: int, next_level: int, encode: bool) -> set[int]:
    """``nextLevelfftIndexMap``: the diagonals after merging the next butterfly level into ``vec`` (mod n)."""
    rot = ((1 << (next_level - 1)) if encode else (1 << (log_l - next_level))) & (n - 1)
    out = set()
    for i in vec:
        out.update((i, (i + rot) & (n - 1), (i - rot) & (n - 1)))
    return out


def _dft_index_maps(log_slots: int, levels: tuple[int, ...], encode: bool, log_n: int) -> list[set[int]]:
    """``computeBootstrappingDFTIndexMap`` for the RepackImagAsReal format, not bit-reversed: per factor, the
    non-zero diagonals. The butterfly levels are spread over sum(levels) factors, most first in the order the
    transform applies them; the decoding's first factor also repacks the imaginary half when the slots do not
    fill the ring."""
    max_depth = sum(levels)
    merge = [0] * max_depth
    level = log_slots
    for i in range(max_depth):
        depth = math.ceil(level / (max_depth - i))
        merge[i if encode else max_depth - i - 1] = depth
        level -= depth
    maps, level = [], log_slots
    for i in range(max_depth):
        if log_slots < log_n - 1 and not encode and i == 0:
            vec = {0, 1 << log_slots}  # genWfftRepackIndexMap
            vec = _next_level_index_map(vec, log_slots, 2 << log_slots, level, encode)
            size = 2 << log_slots
        else:
            vec = _wfft_index_map(log_slots, level, encode)
            size = 1 << log_slots
        next_level = level - 1
        for _ in range(merge[i] - 1):
            vec = _next_level_index_map(vec, log_slots, size, next_level, encode)
            next_level -= 1
        maps.append(vec)
        level -= merge[i]
    return maps


# --- circuits/common/lintrans/lintrans.go: BSGSIndex and FindBestBSGSRatio are lattigo_format's ---------------
def _add_matrix_rotations(diagonals: set[int], rotations: list[int], n1: int, slots: int, repack: bool) -> None:
    """``addMatrixRotToList``: a factor of fewer than three diagonals is rotated by each (0 included: Galois
    element 1); else its non-zero giant steps (mod 2*slots when repacking, else mod slots) and baby steps."""
    if len(diagonals) < 3:
        for j in sorted(diagonals):
            if j not in rotations:
                rotations.append(j)
        return
    if n1 <= 0:
        raise ValueError(f"a baby-step split of {n1} (Lattigo divides by it)")
    for j in sorted(diagonals):
        index = ((j // n1) * n1) & ((2 * slots - 1) if repack else (slots - 1))
        if index and index not in rotations:
            rotations.append(index)
        index = j & (n1 - 1)
        if index and index not in rotations:
            rotations.append(index)


def dft_rotations(log_slots: int, levels: tuple[int, ...], encode: bool, log_n: int,
                  log_bsgs_ratio: int = LOG_BSGS_RATIO) -> list[int]:
    """``dft.MatrixLiteral.GaloisElements`` before the rotations become Galois elements: CoeffsToSlots
    (``encode``) or SlotsToCoeffs, RepackImagAsReal format. With fewer slots than the ring holds the transform
    works on twice the slots, and the encoding also rotates by ``slots`` (to repack the imaginary half)."""
    slots = 1 << log_slots
    dslots, rotations = slots, []
    if log_slots < log_n - 1:
        dslots <<= 1
        if encode:
            rotations.append(slots)
    for i, diagonals in enumerate(_dft_index_maps(log_slots, levels, encode, log_n)):
        n1 = best_bsgs_n1(diagonals, dslots, log_bsgs_ratio)
        _add_matrix_rotations(diagonals, rotations, n1, slots, not encode and log_slots < log_n - 1 and i == 0)
    return rotations


# --- circuits/ckks/bootstrapping --------------------------------------------------------------------------------
@lru_cache(maxsize=32)
def bootstrap_galois_elements(log_n: int, log_slots: int) -> tuple[int, ...]:
    """``bootstrapping.Parameters.GaloisElements`` (plus ``GenEvaluationKeys``' conjugation, already among them)
    for the default circuit on ring 2^log_n at 2^log_slots slots, sorted: the sub-sum rotations, the
    CoeffsToSlots and SlotsToCoeffs rotations, complex conjugation; each as 5^k mod 2N."""
    nth_root = 2 << log_n
    stc, _, cts = circuit_levels(log_slots)
    keys = {galois_element(1 << i, nth_root) for i in range(log_slots, log_n - 1)}
    for levels, encode in ((cts, True), (stc, False)):
        keys.update(galois_element(k, nth_root) for k in dft_rotations(log_slots, levels, encode, log_n))
    keys.add(nth_root - 1)
    return tuple(sorted(keys))


def bootstrap_key_shape(lattigo_params: dict, spec: dict,
                        moduli: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> BootKeyShape:
    """The exact :class:`BootKeyShape` of the bootstrapping keys the wheel generates (``BootstrapParams`` then
    ``gen_eval_keys``) for the residual parameters ``lattigo_params`` (:func:`lattigo_params`' dict: ``logn``,
    ``logq``) and the manifest's ``spec`` (``logn``, ``logp``, ``log_slots``). ``moduli``: the bootstrapping
    parameters' (Q, P) primes (:func:`.bootcircuit.bootstrap_moduli`), for the residue bounds; their
    counts must agree with the ones computed here."""
    log_n, log_slots = int(spec["logn"]), int(spec["log_slots"])
    residual_log_n = int(lattigo_params["logn"])
    if not 1 <= log_slots <= log_n - 1:
        raise ValueError(f"bootstrapping at 2^{log_slots} slots on N=2^{log_n}: Lattigo takes 1..{log_n - 1}")
    if residual_log_n > log_n:
        raise ValueError(f"a residual ring N=2^{residual_log_n} above the bootstrapping ring N=2^{log_n}")
    stc, mod1, cts = circuit_levels(log_slots)
    q = len(lattigo_params["logq"]) + len(stc) + mod1 + len(cts)
    p = len(spec["logp"])
    if p < 1:
        raise ValueError("bootstrapping keys need at least one special prime")
    if moduli is not None and (len(moduli[0]), len(moduli[1])) != (q, p):
        raise ValueError(f"bootstrapping primes {len(moduli[0])}+{len(moduli[1])} for a circuit of {q}+{p}")
    full = (q, p)
    switching = full if residual_log_n < log_n else None
    sparse = (1, 1) if EPHEMERAL_SECRET_WEIGHT else None
    elements = bootstrap_galois_elements(log_n, log_slots)
    q_moduli, p_moduli = ((), ()) if moduli is None else (tuple(int(v) for v in moduli[0]),
                                                          tuple(int(v) for v in moduli[1]))
    return BootKeyShape(1 << log_n, (switching, switching, None, None, sparse, full if sparse else None), full,
                        full, len(elements), elements, q_moduli, p_moduli)


def expected_bootstrap_keys(params, spec: dict, residual_q: tuple[int, ...] | None = None) -> BootKeyShape:
    """:func:`bootstrap_key_shape` for a program's :class:`~polyfhe.program.params.CKKSParams` and manifest spec, with
    the bootstrapping primes generated as Lattigo does (:func:`.bootcircuit.bootstrap_moduli`) from the
    residual primes the wheel holds (``residual_q``; None: generated too)."""
    from polyfhe.engines.lattigo.bootcircuit import bootstrap_moduli
    from polyfhe.engines.lattigo.format import lattigo_params
    from polyfhe.program.bootstrapping import BootstrapSpec

    moduli = bootstrap_moduli(params, BootstrapSpec.from_dict(spec), residual_q)
    return bootstrap_key_shape(lattigo_params(params, spec), spec, moduli)
