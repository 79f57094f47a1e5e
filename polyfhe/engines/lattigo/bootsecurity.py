"""Whether Lattigo's bootstrapping keys are 128-bit secure, decided on the *real* moduli.

The residual primes Lattigo generated (read from the wheel's parameter object where the caller has them, else
generated here exactly as Lattigo does) and the circuit's and special primes (:func:`~polyfhe.engines.lattigo.
bootcircuit.bootstrap_moduli`); log QP is the sum of log2 of every one. It must meet ``MAX_BITS_128`` of the
bootstrapping ring (:mod:`polyfhe.program.params`: N=2^16 is 1,747 bits, from OpenFHE's table of the HE standard
extended with the lattice estimator, see there). That table assumes a *uniform ternary* secret; what holds keys:

* the bootstrapping ring's secret, fixed-weight ternary with h = 2N/3 (``secret_weight``: the weight a uniform
  ternary secret has on average) on the whole modulus QP: the table's bound at 2^logn. A sparser secret (Lattigo's
  own defaults use h=192) is not what the table covers, and is refused;
* Lattigo's ephemeral sparse secret (h=32) of the encapsulation keys, on Q[0]*P[0] only: Lattigo states over
  128-bit security for that key on a 121-bit modulus (``parameters_literal.go``, ``EphemeralSecretWeight``;
  Bossuat, Troncoso-Pastoriza and Hubaux, ePrint 2022/024), checked on the primes' bit sizes. Lattigo before
  6.1.1 generated the dense-to-sparse key at the wrong level (about 106 bits, its SECURITY.md); the wheels use 6.2.0;
* with *ring switching* (a residual ring N1 smaller than the bootstrapping ring N2), Lattigo's ``EvkN2ToN1``
  (``GenEvaluationKeyNew(skN2, skN1)``) encrypts under the residual secret mapped by Y = X^(N2/N1), on the whole
  bootstrapping modulus: an RLWE instance of dimension N1 on log QP bits, which must then meet N1's bound (438 bits
  at 2^14, 881 at 2^15). No bootstrapping modulus does, so a secure program bootstraps on its own ring (N=2^16).
"""

from __future__ import annotations

import math

from polyfhe.engines.lattigo.bootcircuit import bootstrap_moduli
from polyfhe.program.bootstrapping import BootstrapSecurity, BootstrapSpec
from polyfhe.program.params import MAX_BITS_128, CKKSParams

__all__ = ["EPHEMERAL_KEY_MAX_BITS", "EPHEMERAL_SECRET_WEIGHT", "check_bootstrap_security", "uniform_ternary_weight"]

EPHEMERAL_SECRET_WEIGHT = 32
EPHEMERAL_KEY_MAX_BITS = 121


def uniform_ternary_weight(n: int) -> int:
    """Non-zero coefficients of polyfhe's fixed-weight ternary secret: 2n/3, a uniform ternary secret's mean."""
    return (2 * n) // 3


def check_bootstrap_security(params: CKKSParams, spec: BootstrapSpec, residual_q: tuple[int, ...] | None = None,
                             secret_weight: int | None = None) -> BootstrapSecurity:
    """Whether Lattigo's bootstrapping keys for ``params`` and ``spec`` are 128-bit secure, on the real moduli.

    ``residual_q``: the residual ciphertext primes Lattigo holds (``ckks.Parameters.moduli_chain()``); None
    generates them as Lattigo does. ``secret_weight``: the Hamming weight of the bootstrapping ring's secret the
    keys are made with (``lattigo_params``' ``h`` at 2^logn); None: polyfhe's 2N/3. See the module docstring for
    what the table assumes and which key lives on which modulus.
    """
    n_boot = 1 << spec.logn
    q, p = bootstrap_moduli(params, spec, residual_q)
    log_qp = sum(math.log2(m) for m in (*q, *p))
    bound = MAX_BITS_128.get(n_boot)
    problems = []
    if bound is None:
        problems.append(f"no 128-bit bound is known for the bootstrapping ring N={n_boot}")
    elif log_qp > bound:
        problems.append(f"the bootstrapping keys live on a modulus of {log_qp:.2f} bits (log QP of the real "
                        f"primes), over the 128-bit bound of {bound} bits for N={n_boot}")
    weight = uniform_ternary_weight(n_boot) if secret_weight is None else int(secret_weight)
    if weight < uniform_ternary_weight(n_boot):
        problems.append(f"the bootstrapping secret has Hamming weight {weight}, sparser than the uniform ternary "
                        f"secret (weight {uniform_ternary_weight(n_boot)}) the 128-bit table assumes")
    if p and q and round(math.log2(q[0])) + round(math.log2(p[0])) > EPHEMERAL_KEY_MAX_BITS:
        problems.append(f"the ephemeral (h={EPHEMERAL_SECRET_WEIGHT}) encapsulation key lives on Q[0]*P[0] of "
                        f"{math.log2(q[0]) + math.log2(p[0]):.1f} bits, over the {EPHEMERAL_KEY_MAX_BITS} bits "
                        "Lattigo states 128-bit security for")
    n_res = params.poly_modulus_degree
    if n_res < n_boot:
        own = MAX_BITS_128.get(n_res)
        problems.append(f"ring switching from N={n_res}: Lattigo's EvkN2ToN1 key encrypts under the residual "
                        f"secret (an RLWE instance of dimension {n_res}) on the whole {log_qp:.0f}-bit bootstrapping "
                        f"modulus, over the 128-bit bound of {own} bits for N={n_res}")
    return BootstrapSecurity(log_qp, bound, tuple(problems), q, p)
