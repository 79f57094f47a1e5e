"""Property-based fuzzing of a real ``polyfhe serve`` over HTTP: mutated public contexts and ciphertexts (bytes
flipped in the container header, in the SEAL headers and members, anywhere in the data; truncated; extended) get a
4xx answer, never a 500, and no process of the server dies (its worker processes included)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_testlib import TINY

from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, unpack

pytestmark = pytest.mark.fhe

OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def valid(server, programs, samples):
    """(client, session id, a valid ciphertext, a valid public context, the worker pids) on the shared server."""
    client = programs[TINY].client()
    context = client.public_context()
    response = httpx.post(f"{server.url}/v1/sessions", params={"model": TINY}, content=context, headers=OCTETS,
                          timeout=120)
    assert response.status_code == 201, response.text
    pids = [w["pid"] for w in httpx.get(f"{server.url}/v1/stats").json()["host"]["processes"]]
    session_id = response.json()["session_id"]
    yield client, session_id, client.encrypt(samples[0][:1]), context, pids
    httpx.delete(f"{server.url}/v1/sessions/{session_id}")  # the shared server: leave no session behind


def _hot_offsets(data: bytes, kind: bytes) -> list[int]:
    """Where structure lives: the container header and the first bytes of every section (SEAL headers, members)."""
    box = unpack(data, kind)
    starts = [0]
    position = len(data) - sum(len(s) for s in box.sections.values())  # sections follow the header, in order
    for section in box.sections.values():
        starts.append(position)
        position += len(section)
    return starts


@st.composite
def mutations(draw, data: bytes, kind: bytes):
    """A copy of ``data`` with up to four changes near its structure or anywhere, maybe cut or extended."""
    out = bytearray(data)
    hot = _hot_offsets(data, kind)
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            offset = draw(st.sampled_from(hot)) + draw(st.integers(0, 160))
        else:
            offset = draw(st.integers(0, len(out) - 1))
        offset = min(offset, len(out) - 1)
        out[offset] = draw(st.integers(0, 255))
    cut = draw(st.sampled_from(["none", "none", "truncate", "extend"]))
    if cut == "truncate":
        out = out[: draw(st.integers(0, len(out) - 1))]
    elif cut == "extend":
        out += bytes(draw(st.integers(1, 64)))
    return bytes(out)


def _check(server, response: httpx.Response, pids: list[int]) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert response.json()["error"], response.text
    assert server.proc.poll() is None
    now = [w["pid"] for w in httpx.get(f"{server.url}/v1/stats").json()["host"]["processes"]]
    assert now == pids, "a worker process died"


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_mutated_ciphertexts_get_4xx_and_kill_nothing(server, valid, data):
    _, sid, query, _, pids = valid
    body = data.draw(mutations(query, KIND_CIPHERTEXT))
    if body == query:
        return
    response = httpx.post(f"{server.url}/v1/sessions/{sid}/infer", content=body, headers=OCTETS, timeout=120)
    if response.status_code == 200:  # a flip the format tolerates (e.g. in a residue): a valid ciphertext still
        return
    _check(server, response, pids)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_mutated_public_contexts_get_4xx_and_kill_nothing(server, valid, data):
    _, _, _, context, pids = valid
    body = data.draw(mutations(context, KIND_CONTEXT))
    response = httpx.post(f"{server.url}/v1/sessions", params={"model": TINY}, content=body, headers=OCTETS,
                          timeout=120)
    if response.status_code == 201:  # a tolerated flip: a working session; free it for the next example
        httpx.delete(f"{server.url}/v1/sessions/{response.json()['session_id']}")
        return
    _check(server, response, pids)
