"""N parallel clients, each with its own keys and session, all get answers equal to the plaintext program's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from serve_testlib import TINY

from polyfhe.serve.http_client import ServeClient

pytestmark = pytest.mark.fhe

CLIENTS = 4
REQUESTS = 2


def test_parallel_clients_get_plaintext_equal_answers(server, samples):
    x, plain = samples

    def client(k: int) -> list[tuple[int, np.ndarray]]:
        with ServeClient(server.url) as api, api.open_session(TINY) as session:
            picks = [(k + j * CLIENTS) % len(x) for j in range(REQUESTS)]
            return [(i, session.infer(x[i]).logits) for i in picks]

    before = httpx.get(f"{server.url}/v1/stats").json()["inferences_total"]
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = [a for got in pool.map(client, range(CLIENTS)) for a in got]
    assert len(answers) == CLIENTS * REQUESTS
    for i, logits in answers:
        np.testing.assert_allclose(logits, plain[i], atol=1e-3)
        assert int(np.argmax(logits)) == int(np.argmax(plain[i]))
    stats = httpx.get(f"{server.url}/v1/stats").json()
    assert stats["inferences_total"] - before == CLIENTS * REQUESTS
    assert stats["sessions"]["active"] == 0  # every client deleted its session
