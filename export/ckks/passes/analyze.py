"""Pass ``analyze``: refuse a graph that is not polynomial, naming its offending nodes.

Reads ``proto`` and ``report``; writes ``report`` (the analyzer runs only when the ``onnx`` pass brought none).
"""

from __future__ import annotations

from polyfhe.exporters.ckks.passes import Pass
from polyfhe.exporters.ckks.state import CKKSExportError, CompileState

__all__ = ["PASS"]


def run(state: CompileState) -> None:
    if state.report is None:
        from polyfhe.analysis import analyze

        state.report = analyze(state.proto)
    if not state.report.polynomial:
        shown = "; ".join(f"{v.node} ({v.op}): {v.reason}" for v in state.report.violations[:8])
        raise CKKSExportError(f"{state.name} is not polynomial, so it cannot run under CKKS: {shown}")


PASS = Pass("analyze", run, ("report",))
