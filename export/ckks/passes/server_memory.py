"""Pass ``server_memory``: a bootstrapped program whose server would not fit the memory budget is tried again
with each register bootstrapped alone when its cuts were packed, then with its spatial convolutions and shifts
computed on their own (far fewer diagonals), or refused.

Reads ``server_peak``, ``boot_memory``, ``planned``, ``boot_info``, ``memory_spend``, ``proto`` and ``params``;
writes nothing: it raises :class:`~polyfhe.exporters.ckks.state.SpendForMemory` for the driver to retry with
those sites, or the refusal when they were tried already (or there are none).
"""

from __future__ import annotations

from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.sites import factoring_sites, shift_sites
from polyfhe.exporters.ckks.state import CKKSExportError, CompileState, SpendForMemory, UnpackForMemory
from polyfhe.program.params import CKKSParams

__all__ = ["PASS"]


def _bootstrap_time(engine: str, boot_info: dict, params: CKKSParams) -> str:
    """What the bootstraps alone would take per query, from this machine's cached calibration of ``engine``, the
    engine that will run the program (never calibrated here: a refusal should be quick); without one, where to get
    the prediction."""
    from polyfhe.runtime.bootcost import bootstrap_seconds
    from polyfhe.runtime.opcosts import read_cached

    costs = read_cached(engine)
    if costs is None:
        return f"; `polyfhe cost MODEL --backend {engine}` predicts its latency"
    seconds = boot_info["count"] * bootstrap_seconds(costs, boot_info["spec"], params)
    return f"; its {boot_info['count']} bootstraps alone would take about {seconds:.0f} s per query on this machine"


def _refusal(state: CompileState, tried: str) -> str:
    """Why a bootstrapped program's server would not fit the budget: the numbers, and what would."""
    planned, boot_info, peak, budget = state.planned, state.boot_info, state.server_peak, state.boot_memory
    timing = _bootstrap_time(state.options.backend, boot_info, state.params)
    return (
        f"{state.name}: its server would peak near {peak['peak_bytes'] / 1e9:.1f} GB "
        f"({peak['plaintext_bytes'] / 1e9:.1f} GB of plaintexts for {planned.get('plain_products', '?')} diagonals, "
        f"{peak['bootstrap_key_bytes'] / 1e9:.1f} GB of bootstrapping keys for {boot_info['count']} bootstraps of "
        f"{boot_info['slots']} slots, {peak['galois_key_bytes'] / 1e9:.1f} GB of Galois keys; "
        f"{peak['loading_bytes'] / 1e9:.1f} GB while loading the keys, {peak['serving_bytes'] / 1e9:.1f} GB "
        f"serving){tried}, over the {budget / 1e9:.1f} GB memory budget. What would fit: a narrower model (fewer "
        "channels: fewer diagonals and fewer slots per bootstrap), or a machine with more memory "
        f"(bootstrap_memory= / --bootstrap-memory to plan for it){timing}")


def run(state: CompileState) -> None:
    peak, budget = state.server_peak, state.boot_memory
    if not peak or budget is None or peak["peak_bytes"] <= budget:
        return
    if state.options.pack_bootstraps and any(state.boot_info.get("packed", ())):
        raise UnpackForMemory(
            f"{state.name}: with packed bootstraps its server would peak near {peak['peak_bytes'] / 1e9:.1f} GB, "
            f"over the {budget / 1e9:.1f} GB memory budget; bootstrapping each register alone instead (more "
            "bootstraps, fewer diagonals)")
    sites = [*factoring_sites(state.proto), *shift_sites(state.proto)] if state.single else []
    if state.memory_spend is not None or not sites:
        tried = (f"; with {len(state.memory_spend['factored'])} convolutions and shifts computed on their own"
                 if state.memory_spend else "")
        raise CKKSExportError(_refusal(state, tried))
    merged = {"factored": sites, "reason": "memory", "merged": {
        "depth": state.circuit.depth, "diagonals": state.planned.get("plain_products"),
        "bootstraps": state.boot_info["count"], "server_peak_bytes": peak["peak_bytes"]}, "budget_bytes": budget}
    raise SpendForMemory(
        f"{state.name}: its server would peak near {peak['peak_bytes'] / 1e9:.1f} GB, over the {budget / 1e9:.1f} GB "
        f"memory budget; computing {len(sites)} spatial convolutions and shifts on their own (more levels and "
        "bootstraps, far fewer diagonals) instead", merged)


PASS = Pass("server_memory", run, ())
