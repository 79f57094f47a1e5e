"""``polyfhe models``: the zoo table (parameters, MACs, norm, spec depth numbers; the analyzer's with --analyze).

Building every model on PyTorch's meta device and counting its MACs takes seconds. ``--analyze`` also exports
each BN variant to ONNX and runs the degree analyzer on it (degree, ct x ct depth, levels): minutes for the whole
zoo, with a progress bar on a terminal.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from typing import TypeVar

from polyfhe.commands.progress import progress_bar

T = TypeVar("T")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="list the model zoo with parameters, MACs and depth numbers")
    p.add_argument("pattern", nargs="?", default="*", help="shell-style name filter, e.g. '*_bn'")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    p.add_argument("--no-macs", action="store_true", help="skip counting MACs (about twice as fast)")
    p.add_argument("--analyze", action="store_true",
                   help="also export every BN variant through the degree analyzer for degree, ct x ct depth and "
                        "levels (minutes for the whole zoo; narrow it with PATTERN)")
    p.add_argument("--no-analyze", action="store_true", help=argparse.SUPPRESS)  # the default since --analyze
    p.set_defaults(func=run)


def bar_progress(items: Iterable[T], desc: str, total: int) -> Iterator[T]:
    """:func:`polyfhe.zoo.zoo_rows`'s ``progress``: a bar on stderr when it is a terminal."""
    with progress_bar(total, desc, unit="model") as bar:
        for item in items:
            yield item
            bar.update()


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from polyfhe.commands.render import zoo_table
    from polyfhe.zoo import zoo_rows  # torch: imported by the run, not by the parser

    rows = zoo_rows(args.pattern, with_macs=not args.no_macs, with_analyzer=args.analyze and not args.no_analyze,
                    progress=bar_progress)
    if not rows:
        print(f"no model matches {args.pattern!r}")
        return 1
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        Console(width=200).print(zoo_table(rows))
        if not args.analyze:
            print("degree, ct x ct depth and levels: polyfhe models --analyze [PATTERN] (exports each BN variant "
                  "through the degree analyzer)")
    return 0
