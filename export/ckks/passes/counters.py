"""Pass ``counters``: what the plan will cost to run (operations, plaintext bytes), and for a bootstrapped
program, the resident bytes its server is predicted to peak at.

Reads ``plan``, ``params``, ``boot_info`` and the layout; writes ``planned`` and ``server_peak``.
"""

from __future__ import annotations

from polyfhe.exporters.ckks.counters import plan_counters
from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.state import CompileState
from polyfhe.program.params import estimated_sizes
from polyfhe.runtime.bootcost import server_peak_bytes

__all__ = ["PASS", "server_peak"]


def server_peak(planned: dict, boot_info: dict, galois_bytes: int) -> dict:
    """A bootstrapping Lattigo server's predicted resident bytes, and what makes them up (for the manifest)."""
    plaintexts, keys = int(planned.get("plaintext_bytes", 0)), int(boot_info["key_bytes"])
    loading, serving = server_peak_bytes(plaintexts, keys, galois_bytes)
    return {"peak_bytes": max(loading, serving), "loading_bytes": loading, "serving_bytes": serving,
            "plaintext_bytes": plaintexts, "bootstrap_key_bytes": keys, "galois_key_bytes": galois_bytes}


def run(state: CompileState) -> None:
    plan, params = state.plan, state.params
    lanes = int(plan.stats.get("samples_per_ciphertext", 1))
    state.planned = plan_counters(plan.steps, plan.arrays, [g // lanes for g in plan.galois_steps], params,
                                  state.options.layout, params.slots // lanes, output=state.circuit.output,
                                  input_size=state.circuit.input_size)
    if state.boot_info:  # Lattigo's keys travel uncompressed
        galois = estimated_sizes(params, len(plan.galois_steps))["galois_keys"]
        state.server_peak = server_peak(state.planned, state.boot_info, galois)


PASS = Pass("counters", run, ("planned", "server_peak"))
