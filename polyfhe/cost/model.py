"""Predicted latency, key bytes and peak memory of a CKKS program, from operation costs measured on this machine.

``calibrated_costs(engine)`` runs the microbenchmarks of :mod:`polyfhe.cost.opbench` once per machine and engine
version (about 10-30 s) and caches the fitted constants (:mod:`polyfhe.runtime.opcosts`); ``predict(workload, costs)``
prices a :class:`~polyfhe.cost.workload.Workload` (compiled or estimated). Bootstrapping is priced from measured
bootstraps (see :data:`BOOTSTRAP_MEASUREMENTS`): a bootstrap at N=2^16 is never re-measured by the calibration,
whose key generation alone needs 17+ GB.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from polyfhe.cost.workload import Workload
from polyfhe.program.bootparams import (
    KEYGEN_PEAK_FACTOR,
    LATTIGO_KEY_COPIES,
    BootstrapSpec,
    bootstrap_key_bytes,
    machine_memory_budget,
)
from polyfhe.program.params import CKKSParams, estimated_sizes
from polyfhe.runtime.bootcost import (
    BOOTSTRAP_MEASUREMENTS,
    bootstrap_key_switches,
    bootstrap_seconds,
    bootstrap_site,
)
from polyfhe.runtime.opcosts import (
    KeyBytesModel,
    OpCosts,
    fit_costs,
    machine_fingerprint,
    merge,
    read_cached,
    write_cached,
)
from polyfhe.runtime.plaintexts import DEFAULT_PLAINTEXT_BYTES

__all__ = ["BOOTSTRAP_KEYGEN_SECONDS", "BOOTSTRAP_MEASUREMENTS", "CostPrediction", "bootstrap_key_switches",
           "bootstrap_seconds", "bootstrap_site", "calibrate", "calibrated_costs", "key_bytes", "predict"]

log = logging.getLogger(__name__)

BOOTSTRAP_KEYGEN_SECONDS = (24.0, 40.0)  # bootstrapping key generation at N=2^16, same machine (range of runs)
SEAL_PLAINTEXT_BUDGET = DEFAULT_PLAINTEXT_BYTES  # the SEAL server's plaintext store (``--plaintext-cache-mb``)
# Server memory beyond the keys and plaintexts, measured factors (docs/ckks.md, "Memory"): Lattigo's key set is
# held three times while the server starts (``LATTIGO_KEY_COPIES``); its container holds every diagonal as float64
# once in Python and once in Go. SEAL keeps the public context bytes, the client's keys and the server's.
LATTIGO_CONTAINER_COPIES = 2.0
SEAL_KEY_COPIES = 2.0
# What SEAL runs without the GIL (``seal_native.py``), spread over the executor's threads, and what each thread
# past the first adds: cpolynext_fhe_bn at 28x28 took 22.5 s on one thread and 12.1 s on two (a 1.86x speedup)
SEAL_PARALLEL_OPS = frozenset({"rotation", "plain_product", "add"})
SEAL_THREAD_EFFICIENCY = 0.86


@dataclass(frozen=True)
class CostPrediction:
    """Predicted cost of one workload on one machine: seconds, bytes, and whether it fits this machine."""

    engine: str
    source: str
    params: CKKSParams
    samples: int
    eval_seconds: float  # one warm evaluation (one query), bootstraps included
    cold_seconds: float  # the first query (SEAL: every plaintext is encoded then)
    setup_seconds: float  # loading the program into a server (Lattigo: every plaintext is encoded then)
    bootstrap_seconds: float
    key_bytes: int  # the public context (evaluation keys; bootstrapping keys apart)
    bootstrap_key_bytes: int
    plaintext_bytes: int  # plaintexts the server holds
    live_bytes: int
    peak_bytes: int  # one process running client and server (as ``polyfhe run``)
    keygen_peak_bytes: int
    machine_bytes: int | None
    by_op: dict[str, float] = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    galois_keys: int = 0
    bootstraps: int = 0
    notes: tuple[str, ...] = ()

    @property
    def image_seconds(self) -> float:
        return self.eval_seconds / max(1, self.samples)

    @property
    def memory_needed(self) -> int:
        return max(self.peak_bytes, self.keygen_peak_bytes)

    @property
    def fits(self) -> bool:
        return self.machine_bytes is None or self.memory_needed <= self.machine_bytes

    def to_dict(self) -> dict:
        return {"engine": self.engine, "source": self.source, "params": self.params.describe(),
                "samples": self.samples, "eval_seconds": self.eval_seconds, "image_seconds": self.image_seconds,
                "cold_seconds": self.cold_seconds, "setup_seconds": self.setup_seconds,
                "bootstrap_seconds": self.bootstrap_seconds,
                "bootstraps": self.bootstraps, "galois_keys": self.galois_keys, "key_bytes": self.key_bytes,
                "bootstrap_key_bytes": self.bootstrap_key_bytes, "plaintext_bytes": self.plaintext_bytes,
                "live_bytes": self.live_bytes, "peak_bytes": self.peak_bytes,
                "keygen_peak_bytes": self.keygen_peak_bytes, "memory_needed": self.memory_needed,
                "machine_bytes": self.machine_bytes, "fits": self.fits, "by_op": self.by_op,
                "counters": self.counters, "notes": list(self.notes)}


# --------------------------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------------------------
def _probe(engine: str) -> tuple[list, list]:
    from polyfhe.cost.opbench import CALIBRATORS

    logging.basicConfig(level=logging.WARNING)
    return CALIBRATORS[engine]()


def calibrate(engine: str, *, isolated: bool = True) -> OpCosts:
    """Run the engine's microbenchmarks here and fit its constants (small, insecure rings: timings only).
    ``isolated``: in a fresh process, so the keys they make never raise the caller's peak memory."""
    from polyfhe.cost.opbench import CALIBRATORS, measure_base_rss

    if engine not in CALIBRATORS:
        raise ValueError(f"no calibration for backend {engine!r}; known: {sorted(CALIBRATORS)}")
    log.warning("calibrating %s operation costs on this machine (once per machine and engine version)", engine)
    if isolated:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(1) as pool:
            probes, keys = pool.apply(_probe, (engine,))
    else:
        probes, keys = CALIBRATORS[engine]()
    return fit_costs(engine, probes, machine_fingerprint(engine), base_rss_bytes=measure_base_rss(engine),
                     key_bytes=KeyBytesModel.fit(keys))


def calibrated_costs(engine: str, *, directory: Path | None = None, recalibrate: bool = False) -> OpCosts:
    """This machine's constants for ``engine``: the cached ones, else calibrated now and cached."""
    from polyfhe.program.engines import get_backend

    get_backend(engine).available()  # a missing engine fails here, saying how to install it
    costs = None if recalibrate else read_cached(engine, directory)
    if costs is None:
        costs = calibrate(engine)
        path = write_cached(costs, directory)
        log.info("cached %s calibration in %s", engine, path)
    return costs


# --------------------------------------------------------------------------------------------------------------
# prediction
# --------------------------------------------------------------------------------------------------------------
def _key_object(params: CKKSParams, digits: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """(bits, coefficients) per prime and polynomials of a key of ``digits`` digits over every prime."""
    coeffs = params.poly_modulus_degree * digits * 2
    return tuple((b, coeffs) for b in params.coeff_mod_bits), digits * 2 * len(params.coeff_mod_bits)


def key_bytes(costs: OpCosts, params: CKKSParams, galois_keys: int, relin: bool) -> int:
    """Bytes of the public context: key-switching keys (one digit per ciphertext prime), SEAL's public key too."""
    digits = len(params.coeff_mod_bits) - 1
    one = costs.key_bytes.bytes(*_key_object(params, digits))
    public = costs.key_bytes.bytes(*_key_object(params, 1)) if costs.engine == "seal" else 0.0
    return int((galois_keys + relin) * one + public)


def seal_threads() -> int:
    """Threads a SEAL evaluation on this machine keeps busy: the executor's (``POLYFHE_THREADS``, at most the
    cores) when SEAL's kernels run without the GIL, else one."""
    from polyfhe.engines.seal.native import native_available
    from polyfhe.runtime.execute import default_threads

    return max(1, min(default_threads(), os.cpu_count() or 1)) if native_available() else 1


def thread_speedup(threads: int) -> float:
    return 1.0 + SEAL_THREAD_EFFICIENCY * (max(1, threads) - 1)


def predict(workload: Workload, costs: OpCosts, *, machine_bytes: int | None = -1,
            plaintext_budget: int = SEAL_PLAINTEXT_BUDGET, threads: int | None = None) -> CostPrediction:
    """Seconds and bytes of ``workload`` with this machine's ``costs`` (``machine_bytes`` -1: this machine's).

    ``threads``: SEAL threads per evaluation (None: :func:`seal_threads`); the costs are one thread's."""
    if costs.engine != workload.engine:
        raise ValueError(f"costs of {costs.engine!r} cannot price a {workload.engine!r} workload")
    params = workload.params
    machine = machine_memory_budget(0.9) if machine_bytes == -1 else machine_bytes
    warm = {s: c for s, c in workload.tally.items() if s.op != "encode"}
    encodes = {s: c for s, c in workload.tally.items() if s.op == "encode"}
    keys = key_bytes(costs, params, workload.galois_keys, workload.relin)
    live = workload.live_ciphertexts * estimated_sizes(params, 0)["ciphertext"]
    held, re_encoded = workload.plaintext_bytes, {}
    if workload.engine == "seal":
        in_memory = estimated_sizes(params, workload.galois_keys + workload.relin)["public_context"]
        others = costs.base_rss_bytes + keys + SEAL_KEY_COPIES * in_memory + live
        # the store stops at its budget, and earlier where the machine's memory runs short (plaintexts.py)
        room = plaintext_budget if machine is None else min(plaintext_budget, max(0, machine - others))
        if workload.plaintext_bytes > room:
            held = room  # the store keeps what fits; the rest is encoded again on every run
            share = 1.0 - room / workload.plaintext_bytes
            re_encoded = {s: c * share for s, c in encodes.items()}
    boot_one = bootstrap_seconds(costs, workload.boot_spec, params)
    by_op = costs.by_op(merge(warm, re_encoded))
    if workload.engine == "seal":  # giant steps (single layout) and rows (batch) share the cores
        speedup = thread_speedup(seal_threads() if threads is None else threads)
        by_op = {op: s / speedup if op in SEAL_PARALLEL_OPS else s for op, s in by_op.items()}
    if workload.bootstraps:
        by_op["bootstrap"] = boot_one * workload.bootstraps
    eval_s = sum(by_op.values())
    if workload.engine == "lattigo":  # the evaluator encodes every diagonal when it loads the model
        setup_s, cold_s = costs.seconds(encodes), eval_s
    else:  # SEAL's store encodes each plaintext on first use: the first query pays them
        setup_s, cold_s = 0.0, eval_s - costs.seconds(re_encoded) + costs.seconds(encodes)
    boot_keys = bootstrap_key_bytes(params, BootstrapSpec.from_dict(workload.boot_spec)) if workload.boot_spec else 0
    if workload.engine == "lattigo":
        container = workload.plaintexts * params.slots * 8
        peak = (costs.base_rss_bytes + LATTIGO_KEY_COPIES * keys + held + LATTIGO_CONTAINER_COPIES * container
                + live + 2 * boot_keys)
    else:
        peak = others + held
    return CostPrediction(
        engine=workload.engine, source=workload.source, params=params, samples=workload.samples,
        eval_seconds=eval_s, cold_seconds=cold_s, setup_seconds=setup_s, bootstrap_seconds=boot_one, key_bytes=keys,
        bootstrap_key_bytes=boot_keys, plaintext_bytes=int(held), live_bytes=int(live), peak_bytes=int(peak),
        keygen_peak_bytes=int(KEYGEN_PEAK_FACTOR * boot_keys), machine_bytes=machine, by_op=by_op,
        counters=dict(workload.counters), galois_keys=workload.galois_keys, bootstraps=workload.bootstraps,
        notes=workload.notes)
