"""``polyfhe check TARGET``: is this ONNX model polynomial, does it fit the given CKKS limits, and does the
CKKS compiler lower every op?

Polynomial and lowered are two answers: a Gemm of two encrypted operands is polynomial (degree 2) but not
lowered by the CKKS compiler. Both are printed; only --require-lowered makes the second one fail.

Exit codes: 0 polynomial and within every limit (and, with --require-lowered ENGINE, lowered by ENGINE);
1 not polynomial or over a limit; 2 the input cannot be read (missing, corrupt or truncated file, unknown
zoo name, exporter unavailable); 3 polynomial and within the limits, but --require-lowered ENGINE was given
and ENGINE does not lower some op.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyfhe.commands.arguments import non_negative_int
from polyfhe.program.engines import BACKEND_NAMES

if TYPE_CHECKING:  # polyfhe.analysis imports onnx: the run imports it, the parser does not
    from polyfhe.analysis import AnalysisReport

__all__ = ["EXIT_BAD_INPUT", "EXIT_NOT_LOWERED", "EXIT_NOT_POLYNOMIAL", "EXIT_OK", "add_parser", "run"]

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_NOT_POLYNOMIAL = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_LOWERED = 3

_ZOO_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*$")


# --require-lowered's choices: polyfhe.analysis.optable.LOWERING_ENGINES's names (the CKKS compiler and every
# CKKS engine), without importing the analyzer; tests/commands/test_cli_startup.py holds them equal
LOWERING_CHOICES = tuple(sorted({"ckks", *BACKEND_NAMES}))


class _TargetError(Exception):
    """The target could not be turned into a model (maps to exit code 2)."""


def add_parser(subparsers: Any) -> None:
    """Register the ``check`` subcommand on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "check",
        help="prove an ONNX model is polynomial and report its degree, ct x ct depth and CKKS levels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="TARGET", help="an .onnx file, or a model-zoo name to export first")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
    parser.add_argument("--max-degree", type=non_negative_int, metavar="D", help="fail when the degree exceeds D")
    parser.add_argument("--max-depth", type=non_negative_int, metavar="L", help="fail when the ct x ct depth exceeds L")
    parser.add_argument("--max-levels", type=non_negative_int, metavar="L", help="fail when CKKS levels exceed L")
    parser.add_argument("--require-lowered", choices=LOWERING_CHOICES, metavar="ENGINE",
                        help="also fail (exit 3) when ENGINE's compiler does not lower some op "
                             f"({', '.join(LOWERING_CHOICES)}: every CKKS engine runs the CKKS compiler)")
    parser.add_argument("--img-size", type=int, metavar="S",
                        help="for zoo-name targets: build the model at this resolution (default: its own)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Analyze ``args.target`` and print the report; return the exit code."""
    from polyfhe.analysis import ModelLoadError, analyze
    from polyfhe.analysis.optable import compiler_for
    from polyfhe.analysis.registry import CKKS_COMPILER

    as_json = bool(getattr(args, "json", False))
    target = str(args.target)
    try:
        report = analyze(_resolve(target, getattr(args, "img_size", None)))
    except (ModelLoadError, _TargetError) as exc:
        return _fail(target, str(exc), as_json)
    limits = {
        "max_degree": getattr(args, "max_degree", None),
        "max_depth": getattr(args, "max_depth", None),
        "max_levels": getattr(args, "max_levels", None),
    }
    failures = report.limit_failures(**limits)
    required = getattr(args, "require_lowered", None)
    compiler = compiler_for(required) if required else CKKS_COMPILER
    if as_json:
        from polyfhe.analysis.hints import remedy

        payload = {"target": target, **report.to_dict(), "within_limits": not failures,
                   "remedy": remedy(report.violations) or None,
                   "limit_failures": list(failures), "limits": limits,
                   "lowered": report.lowered_by(compiler), "lowered_engine": compiler, "require_lowered": required}
        print(json.dumps(payload))
    else:
        _render(target, report, failures, compiler, limits)
    if failures:
        return EXIT_NOT_POLYNOMIAL
    return EXIT_NOT_LOWERED if required and not report.lowered_by(compiler) else EXIT_OK


def _resolve(target: str, img_size: int | None = None) -> Any:
    """An existing file is analyzed as is; a bare name is exported from the model zoo first."""
    path = Path(target)
    if path.is_file() or not _looks_like_zoo_name(target):
        return path
    try:
        from polyfhe.exporters.onnx import export_zoo_model_for_check
    except ImportError as exc:
        raise _TargetError(f"{target!r} is not a file; zoo-name targets need the ONNX exporter ({exc})") from exc
    try:
        return export_zoo_model_for_check(target, img_size=img_size)
    except Exception as exc:  # unknown name, export failure: the input cannot be produced
        raise _TargetError(f"cannot export zoo model {target!r}: {type(exc).__name__}: {exc}") from exc


def _looks_like_zoo_name(target: str) -> bool:
    return bool(_ZOO_NAME.match(target)) and not target.lower().endswith(".onnx")


def _fail(target: str, message: str, as_json: bool) -> int:
    log.debug("check %s failed to load: %s", target, message)
    if as_json:
        print(json.dumps({"target": target, "error": message, "polynomial": None, "within_limits": False}))
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _render(target: str, report: AnalysisReport, failures: tuple[str, ...], compiler: str,
            limits: dict[str, int | None] | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    verdict = "[green]polynomial[/green]" if report.polynomial else "[red]NOT polynomial[/red]"
    console.print(f"[bold]{escape(target)}[/bold]: {verdict} (opset {report.opset})")
    summary = Table(show_header=False, box=None)
    for key, value in (
        ("degree", report.degree),
        ("ct x ct depth", report.mult_depth),
        ("CKKS levels", report.levels),
        ("ct x ct mults", report.op_counts.ct_ct_mults),
        ("plaintext mults", report.op_counts.pt_mults),
        ("encrypted inputs", escape(", ".join(report.inputs)) or "-"),
    ):
        summary.add_row(key, "-" if value is None else str(value))
    console.print(summary)
    if report.op_counts.by_op:
        ops = Table(title="ops on encrypted values")
        ops.add_column("op")
        ops.add_column("count", justify="right")
        for op, count in report.op_counts.by_op.items():
            ops.add_row(op, str(count))
        console.print(ops)
    if report.violations:
        from polyfhe.analysis.hints import remedy

        console.print(_grouped_table(report.violations, f"{len(report.violations)} violation(s)"))
        way_in = remedy(report.violations)
        if way_in:
            console.print(f"the way in: {escape(way_in)}")
    for failure in failures if report.polynomial else ():
        console.print(f"[red]over limit:[/red] {escape(failure)}")
    given = {name: value for name, value in (limits or {}).items() if value is not None}
    if given and report.polynomial:
        within = "[green]yes[/green]" if not failures else "[red]no[/red]"
        stated = ", ".join(f"{name.removeprefix('max_')} <= {value}" for name, value in given.items())
        console.print(f"within limits ({stated}): {within}")
    elif not given:
        console.print("limits: none given (--max-degree, --max-depth, --max-levels)")
    if report.polynomial:
        unlowered = report.not_lowered_by(compiler)
        lowered = "[green]yes[/green]" if not unlowered else f"[red]no[/red] ({len(unlowered)} node(s))"
        console.print(f"lowered by the {escape(compiler)} compiler: {lowered}")
        if unlowered:
            console.print(_grouped_table(unlowered, f"{len(unlowered)} polynomial node(s) not lowered by {compiler}"))


def _grouped_table(entries: Any, title: str, shown_nodes: int = 3) -> Any:
    """One row per distinct (op, reason): real models repeat the same violation hundreds of times."""
    from rich.markup import escape
    from rich.table import Table

    groups: dict[tuple[str, str], list[str]] = {}
    for v in entries:
        groups.setdefault((v.op, v.reason), []).append(v.node)
    table = Table(title=escape(title))
    for column, overflow in (("op", "fold"), ("count", "fold"), ("nodes", "fold"), ("reason", "fold")):
        table.add_column(column, overflow=overflow, justify="right" if column == "count" else "left")
    for (op, reason), nodes in groups.items():
        more = f" (+{len(nodes) - shown_nodes} more)" if len(nodes) > shown_nodes else ""
        shown = escape("\n".join(nodes[:shown_nodes]) + more)
        table.add_row(escape(op), str(len(nodes)), shown, escape(reason))
    return table


