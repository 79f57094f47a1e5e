"""A Lattigo public context whose bootstrapping key has a row of no column, uploaded to a real ``polyfhe serve``:
refused with a 4xx JSON error before Go sees it, the worker process that holds every session still the same one,
and an honest session on the same server still answered correctly.

Such a row reaches Lattigo's gadget product, which indexes its first column: a Go panic (``index out of range [0]
with length 0`` on the first bootstrap; where the bridge does not recover it, the end of the worker and, with one
worker, of every session). Accepted, it left a session that could never run. The program bootstraps on a small
INSECURE ring (N=4096), so it is served with ``--allow-insecure``.
"""

from __future__ import annotations

import importlib.util
import struct

import httpx
import numpy as np
import pytest
from serve_testlib import start_server

from polyfhe.program.params import CKKSParams
from polyfhe.program.wire import KIND_CONTEXT, pack, unpack
from polyfhe.serve.http_client import ServeClient

pytestmark = [pytest.mark.fhe, pytest.mark.skipif(
    importlib.util.find_spec("lattigo") is None or importlib.util.find_spec("orion_evaluator") is None,
    reason="needs the orion-v2-lattigo and orion-v2-evaluator wheels")]

MODEL = "boot"
SMALL_RING = CKKSParams(4096, (60, 40, 40, 40, 60), 40, security="none")
OCTETS = {"Content-Type": "application/octet-stream"}


def _bootstrapping_program():
    from ckks_testlib import export_bootstrapping_mlp

    return export_bootstrapping_mlp()


def _zero_column_row(prog, context: bytes, row: int = 1) -> bytes:
    """``context`` with row ``row`` of the last Galois key of its bootstrapping keys left with no column (its
    column count 0, its ciphertext gone), in the layout of ``polyfhe/engines/lattigo/keybytes.py``."""
    from polyfhe.engines.lattigo.bootshape import expected_bootstrap_keys
    from polyfhe.engines.lattigo.keybytes import KeyShape

    shape = expected_bootstrap_keys(prog.params, prog.manifest.bootstrap_spec)
    q, p = shape.galois
    key = KeyShape(shape.n, q, p, 2 * shape.n)
    row_bytes = 16 + 2 * (8 + q * (8 + 8 * shape.n) + 8 + p * (8 + 8 * shape.n))
    assert key.rows > row and key.key_bytes == 16 + key.rows * row_bytes
    box = unpack(context, KIND_CONTEXT)
    keys = bytes(box.sections["bootstrap_keys"])
    at = len(keys) - key.key_bytes + 16 + row * row_bytes
    bad = keys[:at] + struct.pack("<Q", 0) + keys[at + row_bytes:]
    return pack(KIND_CONTEXT, box.header, {**box.sections, "bootstrap_keys": bad})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    prog = _bootstrapping_program()
    root = tmp_path_factory.mktemp("programs")
    prog.save(root / MODEL)
    server = start_server(root, tmp_path_factory.mktemp("log") / "server.log", "--allow-insecure",
                          "--worker-processes", "1", "--max-sessions", "4")
    yield prog, server
    server.stop()


def _worker_pids(url: str) -> list[int]:
    return [w["pid"] for w in httpx.get(f"{url}/v1/stats").json()["host"]["processes"]]


def test_a_zero_column_bootstrapping_key_is_refused_and_the_worker_lives(served):
    prog, server = served
    client = prog.client()
    context = client.public_context()
    pids = _worker_pids(server.url)
    assert pids and server.proc.pid not in pids
    bad = _zero_column_row(prog, context)
    response = httpx.post(f"{server.url}/v1/sessions", params={"model": MODEL}, content=bad, headers=OCTETS,
                          timeout=300)
    assert 400 <= response.status_code < 500, response.text
    body = response.json()
    assert "column count of row 1 of the Galois key of element" in str(body), body
    assert _worker_pids(server.url) == pids
    x = np.random.default_rng(1).random((1, 1, 8, 8))
    with ServeClient(server.url, timeout=300) as api, api.open_session(MODEL, keys=client,
                                                                       allow_insecure=True) as session:
        logits = session.infer(x[0]).logits
    np.testing.assert_allclose(logits, prog.run_plain(x)[0], atol=0.05)
    assert _worker_pids(server.url) == pids
    assert server.proc.poll() is None
