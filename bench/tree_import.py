"""polyfhe from this source tree where it is not installed (a GPU machine with its own torch, nothing pip-installed).

``polyfhe.models``, ``.calibration`` and ``.export`` live at the repository root and install under ``polyfhe.``
through pyproject's package-dir; without the install, :func:`use_source_tree` makes the same names resolve.
Run as a script, it is the ``polyfhe`` command line (``python bench/tree_import.py train ...``), which
bench/gpu_issue41.py starts under torch.distributed.run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_source_tree() -> None:
    """Make ``import polyfhe.models`` (and the other root-level packages) work from this tree; no-op if installed."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import polyfhe

    if importlib.util.find_spec("polyfhe.models") is None:
        polyfhe.__path__.append(str(ROOT))  # polyfhe.models -> ROOT/models, as the install maps it


if __name__ == "__main__":
    use_source_tree()
    import argparse
    import logging

    from polyfhe.commands import train as train_command

    # only the train subcommand: the others import packages a GPU machine need not have
    parser = argparse.ArgumentParser(prog="polyfhe")
    parser.add_argument("-v", "--verbose", action="count", default=1)
    train_command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    sys.exit(args.func(args))
