"""Shared by the cost tests: operation costs made up for a test, so no test measures this machine."""

from __future__ import annotations

from polyfhe.runtime.opcosts import KeyBytesModel, OpCosts, machine_fingerprint


def synthetic_costs(engine: str) -> OpCosts:
    """Fixed (intercept, slope, ...) constants per operation for ``engine``, keyed to this machine's fingerprint."""
    constants = {"rotation": (0.0, 1.0, 0.5), "hoisted_rotation": (0.0, 0.2, 0.2), "transform": (500.0, 0.0, 0.5),
                 "encode": (0.0, 1.5, 0.0), "plain_product": (0.0, 0.3, 0.0), "ct_product": (0.0, 3.0, 0.9),
                 "rescale": (0.0, 1.4, 0.0), "add": (0.0, 0.1, 0.0), "io": (100.0, 1.0, 0.0)}
    return OpCosts(engine, constants, machine_fingerprint(engine), base_rss_bytes=200 << 20,
                   key_bytes=KeyBytesModel((0.0, 8.0, 0.0, 0.0)))
