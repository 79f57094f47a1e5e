"""Calibrated CKKS operation costs: the model one op's time follows, its fit, and its cache.

An :class:`OpSite` is one kind of operation at one place (ring N, primes of the ciphertext, key-switching digits
and special primes). Its time is modelled as

    t = c0 + c1 * N log2(N) * primes + c2 * N log2(N) * digits * (primes + special)

with constants per operation and engine: NTTs over every prime (``c1``) and, for key switches, one decomposition
digit NTT'd over the whole key modulus per digit (``c2``; zero for operations without a key switch). The same
tally of sites describes a microbenchmark probe (``opbench.py``) and a whole program (``workload.py``), so a probe
timing several operations at once (Lattigo's evaluator runs whole graphs) fits the same linear system as a single
SEAL call. Constants are fitted by non-negative least squares on relative errors, so the small rings weigh as much
as the large ones.

Results are cached outside the repository (``$POLYFHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/polyfhe``, else
``~/.cache/polyfhe``), one file per engine, keyed by a fingerprint of the machine and the engine's version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

from polyfhe.program.engines import get_backend

__all__ = [
    "CALIBRATION_VERSION", "OPS", "KeyBytesModel", "KeyObservation", "OpCosts", "OpSite", "Probe", "Tally",
    "best_seconds", "cache_dir", "cache_path", "engine_version", "fit_costs", "key_observation",
    "machine_fingerprint", "merge", "read_cached", "write_cached",
]

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 3  # bump when the probes or the model change: old cache files are then ignored
# rotation: a key switch with the step's own key; hoisted_rotation: a baby step sharing its input's decomposition
# (Lattigo; SEAL where hoisting is on); transform: Lattigo's per-transform work (decomposition, ModDown, rescale),
# SEAL's decomposition of a ciphertext its baby steps share; ct_product: ct x ct
# product and relinearisation; io: one query's input and output ciphertexts through the engine's marshalling
OPS = ("rotation", "hoisted_rotation", "transform", "encode", "plain_product", "ct_product", "rescale", "add", "io")
N_TERMS = 3  # c0, c1, c2
# The terms each operation may use (c0 fixed cost, c1 per prime, c2 key switching): only the transform (Lattigo's
# per-map setup) and a query's marshalling have a fixed cost, only key switches a c2 term. Fewer free constants keep
# the fit physical when a loaded machine makes the probes noisy (an unconstrained fit traded per-prime for fixed
# costs and mispriced rings it had not seen).
TERMS = {"rotation": (1, 2), "hoisted_rotation": (1, 2), "transform": (0, 2), "encode": (1,), "plain_product": (1,),
         "ct_product": (1, 2), "rescale": (1,), "add": (1,), "io": (0, 1)}


@dataclass(frozen=True)
class OpSite:
    """One kind of operation at one place in a modulus chain."""

    op: str
    ring: int
    primes: int  # primes of the ciphertext it runs on (special primes excluded)
    digits: int = 0  # key-switching decomposition digits (0: no key switch)
    special: int = 1  # special primes of the key it switches with

    def features(self) -> np.ndarray:
        unit = self.ring * math.log2(self.ring) / 1e9  # per 10^9: constants come out in seconds of the same order
        return np.array([1e-6, unit * self.primes, unit * self.digits * (self.primes + self.special)])


Tally = dict[OpSite, float]  # site -> how many times it runs


def merge(*tallies: Mapping[OpSite, float]) -> Tally:
    out: Tally = {}
    for tally in tallies:
        for site, count in tally.items():
            out[site] = out.get(site, 0.0) + count
    return out


def _design_row(tally: Mapping[OpSite, float]) -> np.ndarray:
    row = np.zeros(len(OPS) * N_TERMS)
    for site, count in tally.items():
        i = OPS.index(site.op) * N_TERMS
        row[i:i + N_TERMS] += count * site.features()
    return row


@dataclass(frozen=True)
class Probe:
    """One microbenchmark: what it ran and how long it took (seconds, the fastest of its repeats)."""

    name: str
    tally: Tally
    seconds: float

    def to_dict(self) -> dict:
        return {"name": self.name, "seconds": self.seconds,
                "tally": [[s.op, s.ring, s.primes, s.digits, s.special, c] for s, c in self.tally.items()]}

    @classmethod
    def from_dict(cls, d: dict) -> Probe:
        tally = {OpSite(str(o), int(n), int(p), int(dg), int(sp)): float(c) for o, n, p, dg, sp, c in d["tally"]}
        return cls(str(d["name"]), tally, float(d["seconds"]))


KeyObservation = tuple[tuple[tuple[int, int], ...], int, int]  # ((bits, coefficients) per prime), polys, bytes


def key_observation(ring: int, bits: tuple[int, ...], digits: int, polys_per_digit: int, size: int
                    ) -> KeyObservation:
    """A key of ``digits`` digits, each ``polys_per_digit`` polynomials over every prime in ``bits``."""
    coeffs = ring * digits * polys_per_digit
    return tuple((b, coeffs) for b in bits), digits * polys_per_digit * len(bits), size


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls: on a shared machine the slower ones measure the other jobs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@dataclass(frozen=True)
class KeyBytesModel:
    """Serialized bytes of a key object: ``w_bits * sum(bits * coeffs) / 8 + w_coeff * coeffs + w_poly * polys +
    w_const``, summed over its primes. Uncompressed marshalling (Lattigo) fits ``w_coeff = 8`` plus headers;
    SEAL's zstd-compressed objects fit about ``bits / 8`` bytes per coefficient plus what zstd cannot squeeze."""

    weights: tuple[float, float, float, float] = (0.0, 8.0, 0.0, 0.0)

    @staticmethod
    def features(primes: Iterable[tuple[int, int]], polys: int) -> np.ndarray:
        """``primes``: (bits, coefficients) per prime of the object; ``polys``: polynomial residues it holds."""
        pairs = list(primes)
        return np.array([sum(b * c for b, c in pairs) / 8, sum(c for _, c in pairs), polys, 1.0])

    def bytes(self, primes: Iterable[tuple[int, int]], polys: int) -> float:
        return float(np.dot(self.weights, self.features(primes, polys)))

    @classmethod
    def fit(cls, observations: Iterable[tuple[Iterable[tuple[int, int]], int, int]]) -> KeyBytesModel:
        obs = list(observations)
        rows = np.stack([cls.features(p, polys) / size for p, polys, size in obs])
        weights, *_ = np.linalg.lstsq(rows, np.ones(len(obs)), rcond=None)  # relative errors
        return cls(tuple(float(w) for w in weights))


@dataclass(frozen=True)
class OpCosts:
    """Fitted constants of one engine on one machine, plus what they were fitted from and the fixed memory."""

    engine: str
    constants: dict[str, tuple[float, float, float]]  # op -> (c0, c1, c2), see the module docstring
    fingerprint: str
    probes: tuple[Probe, ...] = ()
    base_rss_bytes: int = 0  # a server process with the runtime and the engine loaded, before any key
    key_bytes: KeyBytesModel = field(default_factory=KeyBytesModel)
    checks: dict = field(default_factory=dict)  # e.g. a real bootstrap measured against the model

    def seconds(self, tally: Mapping[OpSite, float]) -> float:
        """Predicted time of a tally (sites of operations this engine was not calibrated for cost nothing)."""
        total = 0.0
        for site, count in tally.items():
            c = self.constants.get(site.op)
            if c is not None:
                total += count * float(np.dot(c, site.features()))
        return total

    def by_op(self, tally: Mapping[OpSite, float]) -> dict[str, float]:
        """Predicted seconds per operation kind: where the time goes."""
        out: dict[str, float] = {}
        for site, count in tally.items():
            out[site.op] = out.get(site.op, 0.0) + self.seconds({site: count})
        return out

    def residuals(self) -> list[tuple[str, float, float]]:
        """(probe, measured s, predicted s) for every probe: how well the fit holds on its own data."""
        return [(p.name, p.seconds, self.seconds(p.tally)) for p in self.probes]

    def to_dict(self) -> dict:
        return {"engine": self.engine, "version": CALIBRATION_VERSION, "fingerprint": self.fingerprint,
                "constants": {k: list(v) for k, v in self.constants.items()},
                "base_rss_bytes": self.base_rss_bytes, "key_bytes": list(self.key_bytes.weights),
                "checks": self.checks,
                "probes": [p.to_dict() for p in self.probes]}

    @classmethod
    def from_dict(cls, d: dict) -> OpCosts:
        if int(d.get("version", -1)) != CALIBRATION_VERSION:
            raise ValueError(f"calibration format {d.get('version')!r}, this polyfhe reads {CALIBRATION_VERSION}")
        return cls(str(d["engine"]), {k: tuple(float(x) for x in v) for k, v in d["constants"].items()},
                   str(d["fingerprint"]), tuple(Probe.from_dict(p) for p in d.get("probes", [])),
                   int(d.get("base_rss_bytes", 0)), KeyBytesModel(tuple(float(w) for w in d["key_bytes"])),
                   dict(d.get("checks", {})))


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    return nnls(a, b, maxiter=50 * a.shape[1])[0]


def fit_costs(engine: str, probes: Iterable[Probe], fingerprint: str = "", **extra) -> OpCosts:
    """Least-squares constants (non-negative, relative errors) for every operation the probes exercise."""
    probes = tuple(probes)
    if not probes:
        raise ValueError("no probes to fit")
    rows = np.stack([_design_row(p.tally) for p in probes])
    times = np.array([p.seconds for p in probes])
    if np.any(times <= 0):
        raise ValueError("probe timings must be positive")
    allowed = np.zeros(rows.shape[1], dtype=bool)
    for i, op in enumerate(OPS):
        allowed[[i * N_TERMS + t for t in TERMS[op]]] = True
    used = np.flatnonzero(np.any(rows != 0, axis=0) & allowed)
    scale = np.abs(rows[:, used]).max(axis=0)  # columns of similar size: better conditioned
    weights = 1.0 / times
    solution = _nnls(rows[:, used] / scale * weights[:, None], times * weights) / scale
    coef = np.zeros(rows.shape[1])
    coef[used] = solution
    exercised = {s.op for p in probes for s in p.tally}
    constants = {op: tuple(float(x) for x in coef[i * N_TERMS:(i + 1) * N_TERMS])
                 for i, op in enumerate(OPS) if op in exercised}
    return OpCosts(engine, constants, fingerprint, probes, **extra)


# --------------------------------------------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------------------------------------------
def engine_version(engine: str) -> str:
    """Installed versions of the engine's distributions (part of the cache key) and its build notes (for SEAL,
    whether plaintext products run on polyfhe's dot kernel: its probe times that kernel then)."""
    record = get_backend(engine)
    parts = []
    for dist in record.distributions:
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}=missing")
    if record.build_notes is not None:
        parts.append(record.build_notes())
    return ",".join(parts)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint(engine: str) -> str:
    """CPU model, usable cores, OS and architecture, the engine's versions and this model's version, hashed."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = json.dumps([_cpu_name(), cores, platform.system(), platform.machine(), engine, engine_version(engine),
                       CALIBRATION_VERSION])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    env = os.environ.get("POLYFHE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "polyfhe"


def cache_path(engine: str, directory: Path | None = None) -> Path:
    return (directory or cache_dir()) / f"opcosts-{engine}-{machine_fingerprint(engine)}.json"


def read_cached(engine: str, directory: Path | None = None) -> OpCosts | None:
    path = cache_path(engine, directory)
    try:
        costs = OpCosts.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable calibration cache %s: %s", path, exc)
        return None
    return costs if costs.fingerprint == machine_fingerprint(engine) else None


def write_cached(costs: OpCosts, directory: Path | None = None) -> Path:
    path = cache_path(costs.engine, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(costs.to_dict(), indent=1))
    tmp.replace(path)
    return path
