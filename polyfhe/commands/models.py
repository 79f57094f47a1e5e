"""``polyfhe models``: the zoo table (parameters, MACs, norm, spec depth numbers, analyzer numbers)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from polyfhe.commands.render import zoo_table
from polyfhe.zoo import zoo_rows


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="list the model zoo with parameters, MACs and depth numbers")
    p.add_argument("pattern", nargs="?", default="*", help="shell-style name filter, e.g. '*_bn'")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    p.add_argument("--no-macs", action="store_true", help="skip counting MACs (faster)")
    p.add_argument("--no-analyze", action="store_true",
                   help="skip exporting BN variants through the degree analyzer (much faster)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = zoo_rows(args.pattern, with_macs=not args.no_macs, with_analyzer=not args.no_analyze)
    if not rows:
        print(f"no model matches {args.pattern!r}")
        return 1
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        Console(width=200).print(zoo_table(rows))
    return 0
