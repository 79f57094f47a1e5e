"""What one bootstrap costs on this machine: the engine's price in key switches (its record's ``bootstrapping``
part, fitted to measured bootstraps) at the bootstrapping modulus, from the engine's measured operation costs.
The compiler's refusals and the cost model both read it."""

from __future__ import annotations

import math
from dataclasses import replace

from polyfhe.program.bootstrapping import BootstrapSpec
from polyfhe.program.engine_api import BootstrapModel
from polyfhe.program.engines import bootstrapping_engines, get_backend
from polyfhe.program.params import CKKSParams
from polyfhe.runtime.opcosts import OpCosts, OpSite

__all__ = ["bootstrap_model", "bootstrap_seconds", "bootstrap_site", "server_peak_bytes"]


def bootstrap_model(engine: str | None = None) -> BootstrapModel:
    """The bootstrapping part of ``engine``'s record (None: of the one engine that bootstraps); a ``ValueError``
    for an engine that cannot bootstrap, or when None leaves the choice open."""
    if engine is None:
        able = bootstrapping_engines()
        if len(able) != 1:
            raise ValueError(f"name the bootstrapping engine: {able or 'none'} bootstrap")
        engine = able[0]
    model = get_backend(engine).bootstrapping
    if model is None:
        raise ValueError(f"backend {engine!r} does not bootstrap")
    return model


def server_peak_bytes(plaintext_bytes: int, bootstrap_keys: int, galois_keys: int,
                      engine: str | None = None) -> tuple[int, int]:
    """(while loading the keys, while serving): the resident bytes of a bootstrapping server of ``engine`` (None:
    the one engine that bootstraps) holding these plaintexts and keys, as its engine models them."""
    return bootstrap_model(engine).server_peak_bytes(plaintext_bytes, bootstrap_keys, galois_keys)


def bootstrap_site(residual_primes: int, special: int, logn: int, circuit_primes: int) -> OpSite:
    """A key switch at the bootstrapping modulus: residual and circuit primes, ``special`` special primes."""
    primes = residual_primes + circuit_primes
    return OpSite("rotation", 1 << logn, primes, math.ceil(primes / special), special)


def bootstrap_seconds(costs: OpCosts, spec: dict | None, params: CKKSParams) -> float:
    """One bootstrap of ``spec``'s slots on this machine: its key switches at the bootstrapping modulus, as the
    engine the costs were measured on prices them."""
    if spec is None:
        return 0.0
    model = bootstrap_model(costs.engine)
    boot = BootstrapSpec.from_dict(spec)
    site = bootstrap_site(len(params.coeff_mod_bits) - 1, len(boot.logp), boot.logn, model.circuit_primes)
    # Lattigo's probes run rotations and hoisted rotations together, so the fit may put a key switch's whole
    # cost on either op (the other's constants then are zero): a key switch costs the larger of the two
    per_switch = max(costs.seconds({site: 1.0}), costs.seconds({replace(site, op="hoisted_rotation"): 1.0}))
    return model.key_switches(boot.log_slots, boot.logn) * per_switch
