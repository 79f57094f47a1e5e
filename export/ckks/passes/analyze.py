"""Pass ``analyze``: refuse a graph that is not polynomial, or polynomial but not lowered by the CKKS compiler,
naming its offending nodes.

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
        from polyfhe.analysis.hints import remedy

        shown = "; ".join(f"{v.node} ({v.op}): {v.reason}" for v in state.report.violations[:8])
        hint = remedy(state.report.violations)
        raise CKKSExportError(f"{state.name} is not polynomial, so it cannot run under CKKS: {shown}"
                              + (f"\nThe way in: {hint}" if hint else ""))
    missing = state.report.not_lowered_by("ckks")
    if missing:
        shown = "; ".join(f"{entry.node} ({entry.op}): {entry.reason}" for entry in missing[:8])
        raise CKKSExportError(f"{state.name} is polynomial (degree {state.report.degree}) but the CKKS compiler does "
                              f"not lower every node yet: {shown}")


PASS = Pass("analyze", run, ("report",))
