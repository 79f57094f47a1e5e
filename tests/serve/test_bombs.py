"""Decompression bombs uploaded to a real ``polyfhe serve``: refused with 400 while the server's memory stays
within a budget and another client keeps getting right answers.

The context bomb is a Galois key set of about 1 MB: rows of all-zero keys, which SEAL parses as valid keys,
for the program's rotations and many more, 4 GiB of them. The ciphertext bombs: a ciphertext declaring 2^20
components with 4 GiB of zeros behind its metadata, one with a NaN scale, and a transparent one (second
component zero). Built from zstd RLE blocks (:mod:`seal_bombs`), so making them costs nothing.

The server's RSS is read from ``/proc/PID/status`` every 20 ms; its peak (VmHWM, reset before the bombs) must
grow by less than ``POLYFHE_BOMB_RSS_BUDGET_MB`` (default 512). Past ``POLYFHE_BOMB_RSS_CEILING_MB`` (default
8192) the server is killed, so a server that inflates the bombs fails this test instead of exhausting the
machine.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_testlib import TINY, ServerProcess, start_server

from polyfhe.program.boundary import galois_element
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, pack, unpack
from polyfhe.serve.http_client import ServeClient

pytestmark = pytest.mark.fhe

MIB = 1 << 20
GIB = 1 << 30
RSS_BUDGET = int(os.environ.get("POLYFHE_BOMB_RSS_BUDGET_MB", "512")) * MIB
RSS_CEILING = int(os.environ.get("POLYFHE_BOMB_RSS_CEILING_MB", "8192")) * MIB
BOMB = 4 * GIB
OCTETS = {"Content-Type": "application/octet-stream"}


def _load_seal_bombs():
    """tests/testlib/seal_bombs.py, shared with the fuzzing tests (tests/testlib is on pytest's pythonpath)."""
    import seal_bombs

    return seal_bombs


sb = _load_seal_bombs()


# ------------------------------------------------------------------------------------------------------------
class RssWatch:
    """Polls a process's RSS; kills it past ``ceiling``. ``peak``: the highest VmHWM/VmRSS seen since
    :meth:`reset` (which also resets the kernel's high-water mark when allowed)."""

    def __init__(self, pid: int, ceiling: int, period: float = 0.02) -> None:
        self.pid, self.ceiling, self.period = pid, ceiling, period
        self.peak = self.baseline = 0
        self.killed = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def status(self) -> dict[str, int]:
        out = {}
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":")
                    out[key] = int(value.split()[0]) * 1024
        except (OSError, ValueError):
            pass
        return out

    def reset(self) -> int:
        """Start counting the peak from now; returns the RSS now."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        except OSError:
            pass
        with self._lock:
            self.baseline = self.status().get("VmRSS", 0)
            self.peak = self.baseline
        return self.baseline

    def start(self) -> RssWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self.status()
            if not s:
                return
            with self._lock:
                self.peak = max(self.peak, s.get("VmRSS", 0), s.get("VmHWM", 0))
            if s.get("VmRSS", 0) > self.ceiling:
                os.kill(self.pid, 9)
                self.killed = True
                return
            time.sleep(self.period)


class TreeWatch:
    """:class:`RssWatch` over the server and its worker process (where the bytes are inflated and parsed):
    the peak is the sum of their peaks, and either one past the ceiling is killed."""

    def __init__(self, pids: list[int], ceiling: int) -> None:
        self.watches = [RssWatch(pid, ceiling) for pid in pids]

    def start(self) -> TreeWatch:
        for w in self.watches:
            w.start()
        return self

    def stop(self) -> None:
        for w in self.watches:
            w.stop()

    def reset(self) -> int:
        return sum(w.reset() for w in self.watches)

    @property
    def peak(self) -> int:
        return sum(w.peak for w in self.watches)

    @property
    def killed(self) -> bool:
        return any(w.killed for w in self.watches)

    def status(self) -> dict[str, int]:
        return {"VmRSS": sum(w.status().get("VmRSS", 0) for w in self.watches)}


@pytest.fixture(scope="module")
def bomb_server(programs, tmp_path_factory):
    """A server of its own (the bombs must not touch the shared one), watched with its worker process."""
    server = start_server(programs["root"], tmp_path_factory.mktemp("bomb-log") / "server.log",
                          "--max-context-mb", "64", "--max-ciphertext-mb", "4", "--max-sessions", "8")
    workers = [w["pid"] for w in httpx.get(f"{server.url}/v1/stats").json()["host"]["processes"]]
    assert workers and server.proc.pid not in workers
    watch = TreeWatch([server.proc.pid, *workers], RSS_CEILING).start()
    yield server, watch
    watch.stop()
    server.stop()


# ------------------------------------------------------------------------------------------------------------
def context_bomb(context: bytes, program, inflated: int = BOMB) -> bytes:
    """``context`` with a swollen Galois key set: a row of four all-zero keys (SEAL parses them as valid keys)
    for each of the program's rotations and then for other rows, until the set inflates to ``inflated`` bytes.
    About 150 bytes per 640 KiB key on the wire."""
    box = unpack(context, KIND_CONTEXT)
    key_meta, _ = sb.split_cipher(box.sections["public_key"])
    parms_id, _ = sb.kswitch_rows(box.sections["galois_keys"])
    n = program.params.poly_modulus_degree
    needed = {galois_element(s, n) >> 1 for s in program.manifest.galois_steps}
    rows = inflated // (4 * 8 * key_meta.coefficients)
    filled = needed | set([r for r in range(n) if r not in needed][: rows - len(needed)])
    galois = sb.kswitch_object(parms_id, [4 if r in filled else [] for r in range(n)], key_meta=key_meta)
    return pack(KIND_CONTEXT, box.header, {**box.sections, "galois_keys": galois})


def ciphertext_bombs(ciphertext: bytes) -> dict[str, bytes]:
    box = unpack(ciphertext, KIND_CIPHERTEXT)
    meta, data = sb.split_cipher(box.sections["ct0"])

    def one(obj: bytes) -> bytes:
        return pack(KIND_CIPHERTEXT, box.header, {"ct0": obj})

    return {"2^20 components, 4 GiB of zeros": one(sb.cipher_object(meta.with_(size=1 << 20), zeros=BOMB)),
            "NaN scale": one(sb.cipher_object(meta.with_(scale=float("nan")), data)),
            "transparent": one(sb.transparent(box.sections["ct0"]))}


def _mb(n: int) -> str:
    return f"{n / MIB:.0f} MiB"


def test_bombs_are_refused_within_the_memory_budget_while_another_client_is_served(bomb_server, programs,
                                                                                     samples):
    server, watch = bomb_server
    x, plain = samples
    program = programs[TINY]
    attacker = program.client()
    bomb = context_bomb(attacker.public_context(), program)
    ct_bombs = ciphertext_bombs(attacker.encrypt(x[0]))
    assert len(bomb) < len(attacker.public_context()) and all(len(b) < MIB for b in ct_bombs.values())

    stop, answers, failures, ready = threading.Event(), [], [], threading.Event()

    def background() -> None:
        try:
            with ServeClient(server.url) as api, api.open_session(TINY) as session:
                i = 0
                while not stop.is_set():
                    answers.append((i % len(x), session.infer(x[i % len(x)]).logits))
                    ready.set()
                    i += 1
        except Exception as exc:  # noqa: BLE001 - reported by the test
            failures.append(f"{type(exc).__name__}: {exc}")
            ready.set()

    thread = threading.Thread(target=background, daemon=True)
    thread.start()
    outcomes: dict[str, tuple[int, str]] = {}
    baseline = 0
    try:
        assert ready.wait(120), "the background client got no answer"
        assert not failures, failures
        with httpx.Client(base_url=server.url, timeout=300) as http:
            good = http.post("/v1/sessions", params={"model": TINY}, content=attacker.public_context(),
                             headers=OCTETS)
            assert good.status_code == 201, good.text
            sid = good.json()["session_id"]
            baseline = watch.reset()
            for name, body in ct_bombs.items():
                outcomes[f"ciphertext: {name}"] = _post(http, f"/v1/sessions/{sid}/infer", body, server)
            outcomes["context: Galois keys plus 4 GiB of zero keys"] = _post(
                http, "/v1/sessions", bomb, server, params={"model": TINY})
            time.sleep(0.5)  # a last RSS sample
            peak = watch.peak
            status = watch.status()
            print(f"\nserver RSS: {_mb(baseline)} before the bombs, peak {_mb(peak)} (growth "
                  f"{_mb(peak - baseline)}, budget {_mb(RSS_BUDGET)}), {_mb(status.get('VmRSS', 0))} after; "
                  f"killed at the ceiling: {watch.killed}")
            for name, (code, detail) in outcomes.items():
                print(f"  {name}: {code} {detail[:160]}")
            if not watch.killed:  # two more answers for the other client after the bombs
                seen, deadline = len(answers), time.monotonic() + 120
                while len(answers) < seen + 2 and not failures and time.monotonic() < deadline:
                    time.sleep(0.2)
                http.delete(f"/v1/sessions/{sid}")
    finally:
        stop.set()
        thread.join(120)

    assert not watch.killed, (f"the server passed the RSS ceiling of {_mb(RSS_CEILING)} and was killed "
                              f"(peak {_mb(watch.peak)}); outcomes {outcomes}")
    grown = watch.peak - baseline
    assert grown < RSS_BUDGET, (f"server RSS grew by {_mb(grown)} (from {_mb(baseline)} to "
                                f"{_mb(watch.peak)}), over the budget of {_mb(RSS_BUDGET)}; "
                                f"outcomes {outcomes}")
    wrong = {name: outcome for name, outcome in outcomes.items()
             if outcome[0] != 400 or not outcome[1].startswith(("bad_context", "bad_ciphertext"))}
    assert not wrong, f"bombs not refused with 400: {wrong}"
    assert not failures, failures
    assert len(answers) >= 3
    for i, logits in answers:
        np.testing.assert_allclose(logits, plain[i], atol=1e-3)
    assert server.proc.poll() is None, "the server died"


def _post(http: httpx.Client, path: str, body: bytes, server: ServerProcess, **kwargs) -> tuple[int, str]:
    """(status, "code: detail") of a POST; (0, why) when the server went away."""
    try:
        response = http.post(path, content=body, headers=OCTETS, **kwargs)
    except httpx.HTTPError as exc:
        return 0, f"no answer ({type(exc).__name__}); server exit code {server.proc.poll()}"
    try:
        payload = response.json()
        return response.status_code, f"{payload.get('error')}: {payload.get('detail', '')}"
    except ValueError:
        return response.status_code, response.text[:200]
