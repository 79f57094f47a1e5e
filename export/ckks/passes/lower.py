"""Pass ``lower``: the ONNX graph as a :class:`~polyfhe.exporters.ckks.circuit.Circuit` of merged affine maps.

Reads ``proto``, ``memory_spend`` (its sites are lowered on their own) and ``lowered``; writes ``lowered`` and
``circuit``. A retry with the same sites reuses the circuit lowered before.
"""

from __future__ import annotations

from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.lower import lower_onnx
from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.state import CKKSExportError, CompileState

__all__ = ["PASS"]


def run(state: CompileState) -> None:
    factored = frozenset(state.memory_spend["factored"]) if state.memory_spend else frozenset()
    if state.lowered is None or state.lowered[0] != factored:
        try:
            state.lowered = (factored, lower_onnx(state.proto, factored, state.options.term_memory))
        except LoweringError as exc:
            raise CKKSExportError(f"{state.name}: {exc}") from exc
    state.circuit = state.lowered[1]


PASS = Pass("lower", run, ("lowered", "circuit"))
