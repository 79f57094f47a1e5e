"""One timed encrypt -> evaluate -> decrypt round trip, shared by ``polyfhe run`` and the benchmark."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

__all__ = ["RoundTrip", "add_counts", "timed_round_trip"]


@dataclass(frozen=True)
class RoundTrip:
    logits: np.ndarray
    input_bytes: int
    output_bytes: int
    encrypt_s: float
    server_s: float  # evaluation plus (de)serialisation on the server
    evaluate_s: float  # evaluation alone
    decrypt_s: float

    @property
    def total_s(self) -> float:
        return self.encrypt_s + self.server_s + self.decrypt_s


def timed_round_trip(client, server, x) -> RoundTrip:
    t0 = time.perf_counter()
    query = client.encrypt(x)
    t1 = time.perf_counter()
    answer = server.run(query)
    t2 = time.perf_counter()
    logits = client.decrypt(answer)
    t3 = time.perf_counter()
    return RoundTrip(logits, len(query), len(answer), t1 - t0, t2 - t1, server.last_run.seconds, t3 - t2)


STATE_COUNTS = ("plaintext_bytes",)  # what a store holds after a run: the latest, not a sum


def add_counts(total: dict, counts: dict) -> dict:
    """Operation counts of two runs added (the store's state, ``plaintext_bytes``, is the second's)."""
    out = dict(total)
    for key, value in counts.items():
        out[key] = value if key in STATE_COUNTS or key not in out else out[key] + value
    return out
