"""Lattigo's bootstrapping as its engine record tells it (``BACKEND.bootstrapping``): ring, circuit, keys, memory,
security, residual chains and price, gathered from the modules that each hold one of them. No wheel import: the
compiler and the cost model read it where the wheels are absent."""

from __future__ import annotations

from polyfhe.engines.lattigo.bootcircuit import BOOTSTRAP_RING, CIRCUIT_PRIMES
from polyfhe.engines.lattigo.bootparams import (
    bootstrap_candidates,
    bootstrap_key_bytes,
    bootstrap_modulus_bits,
    choose_bootstrap_params,
    default_spec,
    keygen_peak_bytes,
    max_refresh_log_slots,
)
from polyfhe.engines.lattigo.bootprice import BOOTSTRAPPER_START_BOOTSTRAPS, bootstrap_key_switches
from polyfhe.engines.lattigo.bootsecurity import check_bootstrap_security
from polyfhe.engines.lattigo.servermem import SERVER_BOOT_KEY_COPIES, server_peak_bytes
from polyfhe.program.engine_api import BootstrapModel

__all__ = ["BOOTSTRAPPING"]

BOOTSTRAPPING = BootstrapModel(
    ring=BOOTSTRAP_RING, circuit_primes=CIRCUIT_PRIMES, modulus_bits=bootstrap_modulus_bits,
    key_bytes=bootstrap_key_bytes, keygen_peak_bytes=keygen_peak_bytes, server_peak_bytes=server_peak_bytes,
    server_key_copies=SERVER_BOOT_KEY_COPIES, security=check_bootstrap_security, candidates=bootstrap_candidates,
    choose=choose_bootstrap_params, default_spec=default_spec, max_refresh_log_slots=max_refresh_log_slots,
    key_switches=bootstrap_key_switches, start_bootstraps=BOOTSTRAPPER_START_BOOTSTRAPS)
