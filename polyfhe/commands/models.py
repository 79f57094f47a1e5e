"""``polyfhe models``: the zoo table (parameters, MACs, norm, spec depth numbers, analyzer numbers)."""

from __future__ import annotations

import argparse
import json
import math

from rich.console import Console
from rich.table import Table

from polyfhe.zoo import ZooRow, zoo_rows


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="list the model zoo with parameters, MACs and depth numbers")
    p.add_argument("pattern", nargs="?", default="*", help="shell-style name filter, e.g. '*_bn'")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    p.add_argument("--no-macs", action="store_true", help="skip counting MACs (faster)")
    p.add_argument("--no-analyze", action="store_true",
                   help="skip exporting BN variants through the degree analyzer (much faster)")
    p.set_defaults(func=run)


def _fmt(value: int | None, scale: float = 1.0, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value / scale:,.{digits}f}" if scale != 1.0 else f"{value:,}"


def _fmt_degree(degree: int | None) -> str:
    """Huge degrees read better as powers of two (a 34-block MONet has degree 2^68)."""
    if degree is None or degree <= 1 << 20:
        return _fmt(degree)
    if degree & (degree - 1) == 0:
        return f"2^{degree.bit_length() - 1}"
    return f"~2^{math.log2(degree):.1f}"


def render_table(rows: list[ZooRow]) -> Table:
    table = Table(title="polyfhe model zoo")
    for col in ("model", "norm", "input", "classes", "params", "spec params", "GMACs",
                "degree", "ct x ct", "levels", "spec ct x ct", "spec levels"):
        table.add_column(col, justify="left" if col in ("model", "norm", "input") else "right")
    for r in rows:
        table.add_row(
            r.name, r.norm, "x".join(map(str, r.input_shape)), str(r.num_classes),
            _fmt(r.params), _fmt(r.spec_params), _fmt(r.macs, 1e9, 3),
            _fmt_degree(r.degree), _fmt(r.mult_depth), _fmt(r.levels),
            _fmt(r.spec_ct_depth), _fmt(r.spec_levels),
        )
    return table


def run(args: argparse.Namespace) -> int:
    rows = zoo_rows(args.pattern, with_macs=not args.no_macs, with_analyzer=not args.no_analyze)
    if not rows:
        print(f"no model matches {args.pattern!r}")
        return 1
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        Console(width=200).print(render_table(rows))
    return 0
