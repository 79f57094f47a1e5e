"""Pass ``parameters``: the CKKS parameters, and whether the circuit runs on a bootstrapped residual chain.

Reads ``circuit``, ``ranges``, ``ring``, ``min_scale_bits``, ``force_bootstrap`` and the options; writes
``params``, ``boot_spec``, ``boot_memory`` and ``leveled_auto``. The smallest secure ring and largest scale that
fit the levels; past every leveled ring (or on ``force_bootstrap``), a residual chain with bootstraps on engines
that have them. Then the checks every plan needs: levels, slots, the batch layout's memory, the values' range.
"""

from __future__ import annotations

from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.state import CKKSExportError, CompileState
from polyfhe.program.bootstrapping import BootstrapSpec
from polyfhe.program.engine_api import BootstrapModel
from polyfhe.program.engines import bootstrapping_engines
from polyfhe.program.machine import machine_memory_budget
from polyfhe.program.params import CKKSParams, ParameterError, choose_params, largest_value, validate
from polyfhe.program.sizes import ciphertext_bytes

__all__ = ["PASS"]


def bootstrap_hint(state: CompileState) -> str:
    """What would run a circuit too deep for every leveled ring (appended to the refusal)."""
    if not state.engine.bootstraps or state.options.bootstrap != "auto":
        able = " or ".join(f"backend={name!r}" for name in bootstrapping_engines())
        return f"; {able} with bootstrap='auto' (single layout) runs deeper circuits by bootstrapping"
    return "" if state.single else "; bootstrapping needs layout='single'"


def choose_bootstrap(model: BootstrapModel, depth: int, slots_needed: int, scale_bits: int | None,
                     memory_bytes: int | None, machine_default: bool) -> tuple[CKKSParams, BootstrapSpec]:
    """The engine's cheapest residual chain (``model.choose``); a refusal for memory alone also says which setting
    plans for a larger machine (the bootstrapping keys are made where the client runs, so the budget is that
    machine's)."""
    try:
        return model.choose(depth, slots_needed, scale_bits=scale_bits, memory_bytes=memory_bytes)
    except ParameterError as exc:
        if memory_bytes is None:
            raise
        try:  # would it fit without the budget? then memory is what refused it
            model.choose(depth, slots_needed, scale_bits=scale_bits, memory_bytes=None)
        except ParameterError:
            raise exc from None
        whose = "75% of this machine's memory (the default)" if machine_default else "the bootstrap_memory given"
        raise ParameterError(
            f"{exc}. That budget is {whose}; bootstrap_memory= (polyfhe export --bootstrap-memory GB) raises it to "
            "plan for a machine with more memory, where the client must then make its keys") from exc


def _choose(state: CompileState, slots_needed: int) -> None:
    """Sets ``params``, ``boot_spec`` and ``leveled_auto``; a ParameterError when nothing fits."""
    options, depth = state.options, state.circuit.depth
    boot = (depth, slots_needed, options.scale_bits, state.boot_memory, options.bootstrap_memory is None)
    params = options.params
    if params is None and state.force_bootstrap:
        params, state.boot_spec = choose_bootstrap(state.bootstrapping, *boot)
    elif params is None:
        state.leveled_auto = True
        try:
            params = choose_params(depth, slots_needed, state.ranges.max_abs, scale_bits=options.scale_bits,
                                   min_scale_bits=state.min_scale_bits, poly_modulus_degree=state.ring,
                                   reserve_bits=state.reserve_bits)
        except ParameterError as exc:
            if not state.may_bootstrap:
                raise ParameterError(f"{exc}{bootstrap_hint(state)}") from exc
            state.leveled_auto = False
            params, state.boot_spec = choose_bootstrap(state.bootstrapping, *boot)
    state.params = validate(params, allow_insecure=options.allow_insecure)


def _check(state: CompileState, slots_needed: int) -> None:
    """Refuse parameters the circuit does not fit: levels, slots, the batch layout's memory, the values."""
    params, circuit, name = state.params, state.circuit, state.name
    if params.levels < circuit.depth and state.boot_spec is None:
        raise CKKSExportError(f"{name} needs {circuit.depth} levels; {params.describe()} offers {params.levels}"
                              f"{bootstrap_hint(state)}")
    if params.slots < slots_needed:
        raise CKKSExportError(f"{name} needs {slots_needed} slots; {params.describe()} has {params.slots}")
    budget = state.options.batch_memory_budget
    if not state.single:
        ct_bytes = ciphertext_bytes(params.poly_modulus_degree, params.levels + 1)
        live = 3 * circuit.max_size() * ct_bytes
        if live > budget:
            raise CKKSExportError(
                f"layout='batch' keeps one ciphertext per tensor element: about {live / 2**30:.1f} GiB live for "
                f"{circuit.max_size()} elements at {params.describe()}, over the {budget / 2**30:.1f} "
                "GiB budget; use layout='single' or raise batch_memory_budget")
    max_abs = state.ranges.max_abs
    if state.boot_spec is not None and max_abs > largest_value(params, level=1):  # bootstraps read level 1 or above
        raise CKKSExportError(
            f"{name}: its values reach +-{max_abs:.3g} on the calibration inputs; {params.describe()} holds at most "
            f"+-{largest_value(params, level=1):.3g} at the lowest level a bootstrap reads. Is the model trained? "
            "Untrained deep BatchNorm networks overflow in eval mode until their running statistics settle; "
            "calibrate with real inputs, or train longer")


def run(state: CompileState) -> None:
    options = state.options
    slots_needed = state.circuit.max_size() if state.single else 1
    state.boot_memory = machine_memory_budget() if options.bootstrap_memory is None else options.bootstrap_memory
    try:
        _choose(state, slots_needed)
    except ParameterError as exc:
        raise CKKSExportError(str(exc)) from exc
    if state.params.levels < state.circuit.depth and state.may_bootstrap and state.boot_spec is None:
        # the caller's ring as the residual chain
        state.boot_spec = state.bootstrapping.default_spec(state.params, slots_needed)
    _check(state, slots_needed)


PASS = Pass("parameters", run, ("params", "boot_spec", "boot_memory", "leveled_auto"))
