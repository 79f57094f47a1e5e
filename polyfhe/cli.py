"""``polyfhe`` command line: one module per subcommand under ``polyfhe.commands``, each with ``add_parser``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from polyfhe import __version__

# Registry of subcommands, in the order ``polyfhe --help`` lists them.
COMMANDS: tuple[str, ...] = ("demo", "train", "models", "check", "calibrate", "export", "run", "serve", "client",
                             "cost", "setup")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyfhe",
        description="Polynomial networks, proven add/mul-only, run on CKKS-encrypted images.",
    )
    parser.add_argument("--version", action="version", version=f"polyfhe {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"polyfhe.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the real command line: the engines' process settings (e.g. Go's) before any engine loads
        from polyfhe.program.engines import prepare_process

        prepare_process()
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `polyfhe ... | head`: the reader left; no traceback, the shell's code for SIGPIPE
        _silence_stdout()
        return EXIT_BROKEN_PIPE


EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a process ended by SIGPIPE


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush at exit does not fail again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real descriptor (captured, replaced): nothing to flush
        pass


if __name__ == "__main__":
    sys.exit(main())
