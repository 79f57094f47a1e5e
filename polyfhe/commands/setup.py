"""``polyfhe setup concrete [--path DIR]``: create Concrete ML's own environment (idempotent, pinned versions).

Concrete ML pins torch 2.3.1 (its CUDA build, about 6.5 GB in all), so it lives in a virtual environment of its
own, under the user's cache by default (``$POLYFHE_CONCRETE_ENV`` or ``--path`` elsewhere); ``target="concrete"``
reaches it through a worker process. Run it again to check an environment; ``--force`` rebuilds it.

Exit codes: 0 ready; 1 the environment could not be built (the installer's output says why).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from polyfhe.workers.environments import ENVIRONMENTS, components, provider

__all__ = ["COMPONENTS", "add_parser", "run"]

COMPONENTS = components()  # the environments of their own (polyfhe.workers.environments)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("setup", description=__doc__, help="create an optional isolated environment "
                              f"({', '.join(f'{e.name}: {e.purpose}' for e in ENVIRONMENTS.values())})",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("component", choices=COMPONENTS, help="what to set up")
    p.add_argument("--path", type=Path, metavar="DIR", help="where the environment goes (default: "
                   f"{'; '.join(e.default_place for e in ENVIRONMENTS.values())})")
    p.add_argument("--force", action="store_true", help="rebuild it even if it is complete")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    entry = provider(args.component)
    if args.force or not entry.is_complete(args.path):
        print(f"setting up {entry.title} ({entry.cost})", file=sys.stderr)
    try:
        path = entry.setup(args.path, args.force)
    except entry.failure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{entry.title} is ready in {path}")
    return 0
