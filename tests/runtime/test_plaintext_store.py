"""The plaintext store (eviction by re-encode cost, budget, at-most-once encoding under threads) and SealOps's
honest counters (encodes, hits, key switches of composed rotations) on a tiny real CKKS program."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

import polyfhe
from polyfhe.cli import main
from polyfhe.engines.seal.ops import naf_terms, rotation_key_switches
from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.runtime.plaintexts import PlaintextKey, PlaintextStore, plaintext_cost, store_with_budget


@dataclasses.dataclass
class Fake:
    """A stand-in plaintext: ``cost`` to encode again, ``nbytes`` held."""

    name: str
    cost: int
    nbytes: int = 100


def _measure(pt: Fake) -> tuple[int, int]:
    return pt.nbytes, pt.cost


def _put(store: PlaintextStore, pt: Fake) -> Fake:
    return store.get(pt.name, lambda: pt)


# ------------------------------------------------------------------------------------------------------------
# the store on its own
# ------------------------------------------------------------------------------------------------------------
def test_evicts_the_cheapest_first_and_the_least_recently_used_among_equals():
    store = PlaintextStore(300, measure=_measure)
    for pt in (Fake("a", 1), Fake("b", 1), Fake("c", 5)):
        _put(store, pt)
    _put(store, Fake("a", 1))  # a hit: b is now the least recently used of the cheap ones
    assert store.stats().hits == 1 and store.stats().encodes == 3
    _put(store, Fake("d", 3))
    assert "b" not in store and {"a", "c", "d"} <= {k for k in "abcd" if k in store}
    _put(store, Fake("e", 3))
    assert "a" not in store and all(k in store for k in "cde")
    _put(store, Fake("f", 3))  # nothing strictly cheaper is left: f is used but not kept (no LRU thrash)
    assert "f" not in store and all(k in store for k in "cde")
    _put(store, Fake("g", 9, 200))  # needs 200 bytes: d then e (equal cost, d used earlier), never c
    assert all(k in store for k in "cg") and "d" not in store and "e" not in store
    stats = store.stats()
    assert (stats.evictions, stats.rejected, stats.bytes, stats.entries) == (4, 1, 300, 2)


def test_stops_growing_when_the_machine_runs_short_of_memory_not_only_at_its_budget(caplog):
    """A process holding gigabytes of keys: the store keeps what fits beside them and re-encodes the rest,
    displacing only strictly cheaper plaintexts, instead of growing to its budget and being killed."""
    free = {"bytes": 1_000}
    store = PlaintextStore(10_000, measure=_measure, available=lambda: free["bytes"], reserve=700)

    def put(pt):
        value = _put(store, pt)
        if pt.name in store:
            free["bytes"] -= pt.nbytes  # what the store holds comes out of the machine's memory
        return value

    for name in "abc":
        put(Fake(name, 2))
    assert all(k in store for k in "abc") and free["bytes"] == 700  # 300 bytes taken, the reserve reached
    with caplog.at_level("WARNING", logger="polyfhe.runtime.plaintexts"):
        assert put(Fake("d", 2)).name == "d"  # used, not kept: memory, not the 10,000-byte budget, is short
        put(Fake("e", 2))
    assert "d" not in store and "e" not in store and store.stats().rejected == 2
    assert sum("stops growing" in r.message for r in caplog.records) == 1  # said once
    put(Fake("f", 9))  # a dearer plaintext still displaces a cheaper one: the store stays the same size
    assert "f" in store and store.stats().bytes == 300 and store.stats().evictions == 1
    free["bytes"] = 5_000  # memory freed elsewhere: the store grows again
    put(Fake("g", 2))
    assert "g" in store and store.stats().bytes == 400
    unknown = PlaintextStore(250, measure=_measure, available=lambda: None, reserve=10**12)
    for name in "xyz":
        _put(unknown, Fake(name, 1))
    assert unknown.stats().bytes == 200  # the platform does not say: the budget alone bounds it


def test_cost_is_the_coefficient_count_so_low_level_plaintexts_go_first():
    class Pt:
        def __init__(self, primes: int) -> None:
            self.primes = primes

        def coeff_count(self) -> int:
            return 8192 * self.primes

    assert plaintext_cost(Pt(3)) == (8192 * 3 * 8, 8192 * 3)
    store = PlaintextStore(8192 * 8 * 8)  # room for 8 primes' worth
    store.get("top", lambda: Pt(4))
    store.get("low", lambda: Pt(2))
    store.get("mid", lambda: Pt(3))  # 9 primes: the 2-prime plaintext goes
    assert "low" not in store and "top" in store and "mid" in store
    store.get("low", lambda: Pt(2))  # cheaper than everything held: encoded, used, not kept
    assert "low" not in store and store.stats().encodes == 4


def test_budget_is_respected_and_can_shrink():
    rng = np.random.default_rng(0)
    store = PlaintextStore(1000, measure=_measure)
    for i in range(300):
        key = int(rng.integers(60))
        got = store.get(key, lambda key=key: Fake(str(key), 1 + key % 7, 50 + 10 * (key % 5)))
        assert got.name == str(key)
        assert store.stats().bytes <= 1000
    stats = store.stats()
    assert stats.peak_bytes <= 1000 and stats.encodes + stats.hits == 300 and stats.entries > 0
    assert store.get("huge", lambda: Fake("huge", 100, 5000)).name == "huge"  # returned, never held
    assert "huge" not in store
    store.set_max_bytes(200)
    assert store.stats().bytes <= 200
    store.set_max_bytes(0)
    assert store.stats().bytes == 0 and len(store) == 0


def test_a_leased_plaintext_is_never_evicted():
    store = PlaintextStore(200, measure=_measure)
    _put(store, Fake("cheap", 1))
    with store.lease("cheap", lambda: pytest.fail("held: must not be encoded again")) as pt:
        assert pt.name == "cheap"
        _put(store, Fake("x", 5))
        _put(store, Fake("y", 5))  # full: the only cheaper entry is leased, so y is not kept
        assert "cheap" in store and "y" not in store
        store.set_max_bytes(100)
        assert "cheap" in store and "x" not in store
    store.set_max_bytes(0)
    assert "cheap" not in store


def test_each_key_is_encoded_once_under_threads():
    store = PlaintextStore(10_000, measure=_measure)
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def encode(key: str) -> Fake:
        with lock:
            calls[key] = calls.get(key, 0) + 1
        time.sleep(0.02)  # wide window for a second thread to ask for the same key
        return Fake(key, 1)

    barrier = threading.Barrier(16)

    def worker(seed: int) -> None:
        barrier.wait()
        for key in np.random.default_rng(seed).permutation([f"k{i}" for i in range(8)]):
            assert store.get(key, lambda key=key: encode(key)).name == key

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == {f"k{i}": 1 for i in range(8)}
    stats = store.stats()
    assert (stats.encodes, stats.hits) == (8, 16 * 8 - 8)


def test_a_failed_encode_is_not_cached_and_is_tried_again():
    store = PlaintextStore(1000, measure=_measure)

    def broken():
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        store.get("k", broken)
    assert _put(store, Fake("k", 1)).name == "k" and store.stats().encodes == 1


def test_a_program_keeps_one_store_for_its_servers_and_budgets_apply_to_it():
    from polyfhe.program.ckks_program import CKKSProgram

    prog = CKKSProgram(manifest=None, arrays={})
    first = prog.shared.plaintexts
    assert store_with_budget(first) is first and store_with_budget(first, 1234) is first and first.max_bytes == 1234
    assert store_with_budget(None) is not first
    assert CKKSProgram(manifest=None, arrays={}).shared.plaintexts is not first  # per program, not per process


def test_plaintext_keys_name_what_they_hold():
    diag = PlaintextKey.diagonal(7, 1, 3)
    assert diag.encoded_at([1, 2], 2.0**30 + 0.4) == PlaintextKey(7, 1, 3, (1, 2), 2**30)
    assert diag.encoded_at([1, 2], 2.0**30) != diag.encoded_at([1], 2.0**30)  # another level: another plaintext
    assert PlaintextKey.bias(7) != PlaintextKey.diagonal(7, 0, 0) and PlaintextKey.bias(7).row is None


# ------------------------------------------------------------------------------------------------------------
# key switches of a rotation, as SEAL spends them
# ------------------------------------------------------------------------------------------------------------
def test_naf_and_composed_rotation_costs():
    assert naf_terms(7) == [-1, 8] and naf_terms(11) == [-1, -4, 16] and naf_terms(-6) == [2, -8]
    assert naf_terms(0) == [] and naf_terms(64) == [64]
    powers = {s * (1 << i) for i in range(12) for s in (1, -1)}
    assert rotation_key_switches(7, 4096, {7}.__contains__) == 1  # a key of its own
    assert rotation_key_switches(7, 4096, powers.__contains__) == 2
    assert rotation_key_switches(11, 4096, powers.__contains__) == 3
    assert rotation_key_switches(4095, 4096, powers.__contains__) == 1  # 4096 - 1: the full turn is skipped
    with pytest.raises(ValueError, match="no Galois key"):
        rotation_key_switches(8, 4096, {1}.__contains__)


# ------------------------------------------------------------------------------------------------------------
# SealOps on a tiny real program (CKKS)
# ------------------------------------------------------------------------------------------------------------
class _Square(nn.Module):
    def forward(self, x):
        return x * x


@pytest.fixture(scope="module")
def tiny():
    """(model inputs, program): 1x8x8 -> 16 -> x^2 -> 4, single layout, several samples per ciphertext."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), _Square(), nn.Linear(16, 4)).eval()
    x = np.random.default_rng(0).random((16, 1, 8, 8))
    return x, polyfhe.export(model, target="ckks", calibration=x, input_shape=(1, 8, 8))


def _fresh(program: CKKSProgram, **changes) -> CKKSProgram:
    """The same program with an empty plaintext store (and manifest fields replaced)."""
    return CKKSProgram.create(dataclasses.replace(program.manifest, **changes), program.arrays)


@pytest.mark.fhe
def test_second_run_encodes_nothing_when_everything_fits(tiny):
    x, program = tiny
    program = _fresh(program)
    planned = program.manifest.info["planned"]
    client = program.client()
    server = program.server(client.public_context())
    cold = client.decrypt(server.run(client.encrypt(x[:4])))
    first = dict(server.last_run.counts)
    warm = client.decrypt(server.run(client.encrypt(x[:4])))
    second = server.last_run.counts
    assert np.abs(warm - program.run_plain(x[:4])).max() < 1e-3 and np.abs(cold - warm).max() < 1e-3
    diagonals_and_biases = planned["encodes_cold"]
    assert first["encodes"] == diagonals_and_biases and first["plaintext_hits"] == 0
    assert second["encodes"] == 0 and second["plaintext_hits"] == diagonals_and_biases
    for counts in (first, second):
        assert counts["rotations"] == planned["rotations"] and counts["plain_products"] == planned["plain_products"]
        assert counts["key_switches"] == counts["rotations"] + counts["products"] == planned["key_switches"]
        assert counts["plaintext_bytes"] > 0 and counts["evictions"] == 0 and counts["rescales"] > 0
    assert server.last_run.plaintext["entries"] == diagonals_and_biases
    assert server.last_run.plaintext["peak_bytes"] == second["plaintext_bytes"]


@pytest.mark.fhe
def test_a_tiny_budget_encodes_again_on_every_run(tiny):
    x, program = tiny
    program = _fresh(program)
    client = program.client()
    one_plaintext = program.params.poly_modulus_degree * len(program.params.coeff_mod_bits) * 8
    server = program.server(client.public_context(), max_cache_bytes=3 * one_plaintext)
    cold = program.manifest.info["planned"]["encodes_cold"]
    for run in range(2):
        server.run(client.encrypt(x[:1]))
        counts, held = server.last_run.counts, server.last_run.plaintext["entries"]
        assert 0 < held < cold and 0 < counts["plaintext_bytes"] <= 3 * one_plaintext
        assert counts["encodes"] + counts["plaintext_hits"] == cold
        assert counts["encodes"] == (cold if run == 0 else cold - held)  # the held ones stay held: no thrash
    assert server.plaintext_store.stats().peak_bytes <= 3 * one_plaintext


@pytest.mark.fhe
def test_concurrent_runs_of_one_program_encode_each_plaintext_once(tiny, monkeypatch):
    monkeypatch.setenv("POLYFHE_THREADS", "4")
    x, program = tiny
    program = _fresh(program)
    client = program.client()
    context, query = client.public_context(), client.encrypt(x[:2])
    servers = [program.server(context) for _ in range(3)]  # three sessions, one store
    answers: list = [None] * len(servers)

    def run(i: int) -> None:
        answers[i] = client.decrypt(servers[i].run(query))

    before, peak, done = threading.active_count(), [0], threading.Event()

    def watch() -> None:  # the most threads alive at once while the three sessions run
        while not done.is_set():
            peak[0] = max(peak[0], threading.active_count())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(servers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    # one pool of 4 workers for the process (possibly already alive), not 4 more per request
    assert peak[0] <= before + 1 + len(servers) + 4
    stats = servers[0].plaintext_store.stats()
    assert stats.encodes == program.manifest.info["planned"]["encodes_cold"] == stats.entries
    assert sum(s.last_run.counts["encodes"] for s in servers) == stats.encodes
    assert all(np.abs(a - answers[0]).max() < 1e-3 for a in answers)


@pytest.mark.fhe
def test_rotations_composed_from_power_of_two_keys_cost_more_key_switches(tiny):
    """Galois keys for +-2^i only (what a small ``galois_key_budget`` falls back to): SEAL composes the rest."""
    from polyfhe.exporters.ckks.counters import plan_counters
    from polyfhe.runtime.rotations import power_of_two_steps

    x, program = tiny
    lanes = program.manifest.samples_per_ciphertext
    virtual = program.params.slots // lanes
    steps = sorted(s * lanes for s in power_of_two_steps(virtual))
    assert set(program.manifest.galois_steps) - set(steps)  # some steps of the plan lose their own key
    composed = _fresh(program, galois_steps=tuple(steps))
    client = composed.client()
    server = composed.server(client.public_context())
    got = client.decrypt(server.run(client.encrypt(x[:2])))
    assert np.abs(got - composed.run_plain(x[:2])).max() < 1e-3
    counts = server.last_run.counts
    assert counts["rotations"] == program.manifest.info["planned"]["rotations"]
    assert counts["key_switches"] > counts["rotations"] + counts["products"]
    planned = plan_counters(list(composed.manifest.steps), composed.arrays, [s // lanes for s in steps],
                            composed.params, "single", virtual)
    assert counts["key_switches"] == planned["key_switches"]


@pytest.mark.fhe
def test_run_command_reports_the_counters(tiny, tmp_path, capsys):
    x, program = tiny
    program.save(tmp_path / "prog")
    np.save(tmp_path / "x.npy", x[:1])
    assert main(["run", str(tmp_path / "prog"), "--input", str(tmp_path / "x.npy"), "--json",
                 "--plaintext-cache-mb", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    counts = out["counts"]
    for key in ("rotations", "key_switches", "plain_products", "products", "rescales", "encodes", "plaintext_bytes"):
        assert key in counts
    assert counts["plaintext_bytes"] == 0 and out["plaintext_cache"]["max_bytes"] == 0
    assert main(["run", str(tmp_path / "prog"), "--input", str(tmp_path / "x.npy")]) == 0
    text = capsys.readouterr().out
    assert "key switches" in text and "plaintexts encoded" in text and "plaintext cache held" in text
