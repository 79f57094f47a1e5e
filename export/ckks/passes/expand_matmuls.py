"""Pass ``expand_matmuls`` (single layout): each ct x ct MatMul as replicate, multiply and sum maps.

Reads ``circuit``, the options' ``params`` and ``poly_modulus_degree`` and whether the try may bootstrap (they
bound the slots a replicated operand may take); writes ``circuit``.
"""

from __future__ import annotations

from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.matmul import expand_matmuls, slots_available
from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.state import CKKSExportError, CompileState

__all__ = ["PASS"]


def run(state: CompileState) -> None:
    if not state.single:
        return
    options = state.options
    boot_ring = state.bootstrapping.ring if state.may_bootstrap else None
    try:
        state.circuit = expand_matmuls(state.circuit, slots_available(options.params, options.poly_modulus_degree,
                                                                      boot_ring),
                                       max_registers=state.engine.matmul_registers, engine=options.backend)
    except LoweringError as exc:
        raise CKKSExportError(f"{state.name}: {exc}") from exc


PASS = Pass("expand_matmuls", run, ("circuit",))
