"""``polyfhe`` command line: one module per subcommand under ``polyfhe.commands``, each with ``add_parser``.

Building the parser imports every command module, so their ``add_parser`` needs only argparse and light helpers:
torch, onnx, numpy, rich and the engines are imported by the function that runs the command (``args.func``), and
``--help`` answers in a fraction of a second (tests/commands/test_cli_startup.py, bench/cli_startup.py).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from polyfhe import __version__

# Registry of subcommands, in the order ``polyfhe --help`` lists them.
COMMANDS: tuple[str, ...] = ("demo", "train", "models", "check", "calibrate", "export", "run", "serve", "client",
                             "cost", "setup")
# subcommands that never load a CKKS engine: they skip the engines' process settings (Lattigo restarts the process
# with Go's settings); any other one, a new one included, gets them
ENGINE_FREE_COMMANDS: frozenset[str] = frozenset({"demo", "train", "models", "check", "calibrate", "setup"})


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
    parser = build_parser()
    args = parser.parse_args(argv)  # --help, --version and usage errors exit here, before any restart
    if argv is None and args.command not in ENGINE_FREE_COMMANDS:
        # the real command line: the engines' process settings (e.g. Go's) before any engine loads; a restart
        # runs this command line again from the start
        from polyfhe.program.engines import prepare_process

        prepare_process()
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
