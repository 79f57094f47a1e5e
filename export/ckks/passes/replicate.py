"""Pass ``replicate`` (single layout, ``replicate_input``): let the client pack the input im2col-style where
that cuts the diagonals of the maps reading it (``replicate.py``).

Reads ``circuit`` and the options; writes ``circuit``.
"""

from __future__ import annotations

from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.replicate import replicate_input
from polyfhe.exporters.ckks.state import CKKSExportError, CompileState

__all__ = ["PASS"]


def run(state: CompileState) -> None:
    if not (state.single and state.options.replicate_input):
        return
    try:
        state.circuit = replicate_input(state.circuit)
    except LoweringError as exc:
        raise CKKSExportError(f"{state.name}: {exc}") from exc


PASS = Pass("replicate", run, ("circuit",))
