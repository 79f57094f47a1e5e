"""Predicted latency, key bytes and peak memory of a CKKS program, from operation costs measured on this machine.

``calibrated_costs(engine)`` runs the microbenchmarks of :mod:`polyfhe.cost.opbench` once per machine and engine
version (about 10-30 s) and caches the fitted constants (:mod:`polyfhe.runtime.opcosts`); ``predict(workload, costs)``
prices a :class:`~polyfhe.cost.workload.Workload` (compiled or estimated). Bootstrapping is priced from measured
bootstraps (the engine's ``bootstrapping.key_switches``, :mod:`polyfhe.runtime.bootcost`): a bootstrap at N=2^16 is never re-measured by the calibration,
whose key generation alone needs 17+ GB.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from polyfhe.cost.workload import Workload
from polyfhe.program.bootstrapping import BootstrapSpec
from polyfhe.program.engines import get_backend
from polyfhe.program.machine import machine_memory_budget
from polyfhe.program.params import CKKSParams, estimated_sizes
from polyfhe.runtime.bootcost import bootstrap_model, bootstrap_seconds, bootstrap_site
from polyfhe.runtime.opcosts import (
    KeyBytesModel,
    OpCosts,
    fit_costs,
    key_observation,
    machine_fingerprint,
    merge,
    read_cached,
    write_cached,
)
from polyfhe.runtime.plaintexts import DEFAULT_PLAINTEXT_BYTES

__all__ = ["BOOTSTRAP_KEYGEN_SECONDS", "CALIBRATION_SECONDS", "CostPrediction",
           "bootstrap_seconds", "bootstrap_site", "calibrate", "calibrated_costs", "eval_threads", "key_bytes", "predict",
           "thread_speedup"]

log = logging.getLogger(__name__)

BOOTSTRAP_KEYGEN_SECONDS = (24.0, 40.0)  # bootstrapping key generation at N=2^16, same machine (range of runs)
PLAINTEXT_BUDGET = DEFAULT_PLAINTEXT_BYTES  # a server's plaintext store (``--plaintext-cache-mb``)


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
    from polyfhe.cost.opbench import calibrator

    logging.basicConfig(level=logging.WARNING)
    return calibrator(engine)()


def calibrate(engine: str, *, isolated: bool = True) -> OpCosts:
    """Run the engine's microbenchmarks here and fit its constants (small, insecure rings: timings only).
    ``isolated``: in a fresh process, so the keys they make never raise the caller's peak memory."""
    from polyfhe.cost.opbench import calibrator, measure_base_rss

    probes_of = calibrator(engine)  # an engine without probes fails here, naming those with some
    log.info("calibrating %s operation costs on this machine (once per machine and engine version)", engine)
    if isolated:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(1) as pool:
            probes, keys = pool.apply(_probe, (engine,))
    else:
        probes, keys = probes_of()
    return fit_costs(engine, probes, machine_fingerprint(engine), base_rss_bytes=measure_base_rss(engine),
                     key_bytes=KeyBytesModel.fit(keys))


CALIBRATION_SECONDS = "10-60 s"  # SEAL about 11 s, Lattigo about 30 s on a 2-core machine (docs/cost-model.md)


def calibrated_costs(engine: str, *, directory: Path | None = None, recalibrate: bool = False,
                     progress: Callable[[str], None] | None = None) -> OpCosts:
    """This machine's constants for ``engine``: the cached ones, else calibrated now and cached. ``progress`` is
    told, in words, before a calibration starts (it takes :data:`CALIBRATION_SECONDS`)."""
    from polyfhe.program.engines import get_backend

    get_backend(engine).available()  # a missing engine fails here, saying how to install it
    costs = None if recalibrate else read_cached(engine, directory)
    if costs is None:
        if progress is not None:
            progress(f"measuring {engine}'s operation costs on this machine, once per machine and engine version "
                     f"({CALIBRATION_SECONDS})")
        costs = calibrate(engine)
        path = write_cached(costs, directory)
        log.info("cached %s calibration in %s", engine, path)
    return costs


# --------------------------------------------------------------------------------------------------------------
# prediction
# --------------------------------------------------------------------------------------------------------------
def _key_object(params: CKKSParams, digits: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """(bits, coefficients) per prime and polynomials of a key of ``digits`` two-polynomial digits over every
    prime: what :class:`~polyfhe.runtime.opcosts.KeyBytesModel` prices."""
    primes, polys, _ = key_observation(params.poly_modulus_degree, params.coeff_mod_bits, digits, 2, 0)
    return primes, polys


def key_bytes(costs: OpCosts, params: CKKSParams, galois_keys: int, relin: bool) -> int:
    """Bytes of the public context: key-switching keys (one digit per ciphertext prime), and the public key on an
    engine whose context carries one."""
    digits = len(params.coeff_mod_bits) - 1
    one = costs.key_bytes.bytes(*_key_object(params, digits))
    with_public = get_backend(costs.engine).cost.public_key_in_context
    public = costs.key_bytes.bytes(*_key_object(params, 1)) if with_public else 0.0
    return int((galois_keys + relin) * one + public)


def eval_threads(engine: str) -> int:
    """Threads an evaluation on ``engine`` keeps busy on this machine (the engine's own count; else one)."""
    threads = get_backend(engine).cost.threads
    return 1 if threads is None else threads()


def thread_speedup(threads: int, efficiency: float) -> float:
    """Speed of the operations an evaluation spreads over ``threads``, each past the first adding ``efficiency``."""
    return 1.0 + efficiency * (max(1, threads) - 1)


def _plaintext_room(workload: Workload, encodes: dict, room: int) -> tuple[float, dict]:
    """(bytes held, encodes repeated every query) of a plaintext store with ``room`` bytes: it keeps what fits;
    the rest is encoded again on every run."""
    if workload.plaintext_bytes <= room:
        return workload.plaintext_bytes, {}
    share = 1.0 - room / workload.plaintext_bytes
    return room, {s: c * share for s, c in encodes.items()}


def _server_bytes(workload: Workload, costs: OpCosts, keys: int, live: int, boot_keys: int) -> float:
    """A running server's memory beyond its plaintexts: base process, key copies, weight containers, ciphertexts,
    and the bootstrapping keys' copies (as many as its engine's bootstrapping model says)."""
    record = get_backend(workload.engine)
    traits, params = record.cost, workload.params
    boot_copies = record.bootstrapping.server_key_copies if boot_keys else 0.0
    decoded = estimated_sizes(params, workload.galois_keys + workload.relin)["public_context"]
    container = workload.plaintexts * params.slots * 8
    return (costs.base_rss_bytes + traits.key_copies * keys + traits.decoded_key_copies * decoded
            + traits.container_copies * container + live + boot_copies * boot_keys)


def predict(workload: Workload, costs: OpCosts, *, machine_bytes: int | None = -1,
            plaintext_budget: int = PLAINTEXT_BUDGET, threads: int | None = None) -> CostPrediction:
    """Seconds and bytes of ``workload`` with this machine's ``costs`` (``machine_bytes`` -1: this machine's).

    ``threads``: threads per evaluation on an engine that spreads operations over threads (None:
    :func:`eval_threads`); the costs are one thread's."""
    if costs.engine != workload.engine:
        raise ValueError(f"costs of {costs.engine!r} cannot price a {workload.engine!r} workload")
    traits, params = get_backend(workload.engine).cost, workload.params
    machine = machine_memory_budget(0.9) if machine_bytes == -1 else machine_bytes
    warm = {s: c for s, c in workload.tally.items() if s.op != "encode"}
    encodes = {s: c for s, c in workload.tally.items() if s.op == "encode"}
    keys = key_bytes(costs, params, workload.galois_keys, workload.relin)
    live = workload.live_ciphertexts * estimated_sizes(params, 0)["ciphertext"]
    boot = bootstrap_model(workload.engine) if workload.boot_spec else None
    boot_keys = boot.key_bytes(params, BootstrapSpec.from_dict(workload.boot_spec)) if boot else 0
    others = _server_bytes(workload, costs, keys, live, boot_keys)
    held, re_encoded = workload.plaintext_bytes, {}
    if not traits.encodes_at_load:  # the store stops at its budget, and earlier where memory runs short
        room = plaintext_budget if machine is None else min(plaintext_budget, max(0, machine - others))
        held, re_encoded = _plaintext_room(workload, encodes, room)
    boot_one = bootstrap_seconds(costs, workload.boot_spec, params)
    by_op = costs.by_op(merge(warm, re_encoded))
    if traits.parallel_ops:  # e.g. giant steps (single layout) and rows (batch) share the cores
        speedup = thread_speedup(eval_threads(workload.engine) if threads is None else threads,
                                 traits.thread_efficiency)
        by_op = {op: s / speedup if op in traits.parallel_ops else s for op, s in by_op.items()}
    if workload.bootstraps:
        by_op["bootstrap"] = boot_one * workload.bootstraps
    eval_s = sum(by_op.values())
    if traits.encodes_at_load:  # loading the program encodes every plaintext
        setup_s, cold_s = costs.seconds(encodes), eval_s
        if workload.bootstraps:  # the first bootstrap of a process also encodes the bootstrapper's transforms
            cold_s += bootstrap_model(workload.engine).start_bootstraps * boot_one
    else:  # the store encodes each plaintext on first use: the first query pays them
        setup_s, cold_s = 0.0, eval_s - costs.seconds(re_encoded) + costs.seconds(encodes)
    return CostPrediction(
        engine=workload.engine, source=workload.source, params=params, samples=workload.samples,
        eval_seconds=eval_s, cold_seconds=cold_s, setup_seconds=setup_s, bootstrap_seconds=boot_one, key_bytes=keys,
        bootstrap_key_bytes=boot_keys, plaintext_bytes=int(held), live_bytes=int(live),
        peak_bytes=int(others + held), keygen_peak_bytes=boot.keygen_peak_bytes(boot_keys) if boot else 0, machine_bytes=machine,
        by_op=by_op, counters=dict(workload.counters), galois_keys=workload.galois_keys,
        bootstraps=workload.bootstraps, notes=workload.notes)
