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

__all__ = ["COMPONENTS", "add_parser", "run"]

COMPONENTS = ("concrete",)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("setup", description=__doc__, help="create an optional isolated environment "
                              "(concrete: Concrete ML for target='concrete')",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("component", choices=COMPONENTS, help="what to set up")
    p.add_argument("--path", type=Path, metavar="DIR", help="where the environment goes (default: the user's "
                   "cache, or $POLYFHE_CONCRETE_ENV)")
    p.add_argument("--force", action="store_true", help="rebuild it even if it is complete")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from polyfhe.engines.concrete.env import (
        CONCRETE_ML_VERSION,
        ConcreteEnv,
        ConcreteEnvMissing,
        default_env_dir,
        setup_env,
    )

    if args.force or not ConcreteEnv(args.path or default_env_dir()).is_complete():
        print(f"setting up Concrete ML {CONCRETE_ML_VERSION} (a few minutes; about 6.5 GB)", file=sys.stderr)
    try:
        env = setup_env(args.path, force=args.force)
    except ConcreteEnvMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"Concrete ML {CONCRETE_ML_VERSION} is ready in {env.path}")
    return 0
