"""Argument types shared by the subcommands (argparse ``type=`` callables with clear messages)."""

from __future__ import annotations

import argparse
import os


def _int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "a non-negative integer")


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two (1, 2, 4, ...), got {text}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help="threads per encrypted evaluation (SEAL engine); sets POLYFHE_THREADS for this command "
                             "(default: that variable, else the CPU count)")


def apply_threads(args: argparse.Namespace) -> None:
    """``--threads N`` as ``POLYFHE_THREADS``, the variable the evaluator reads on every run, so the flag and the
    variable cannot disagree."""
    from polyfhe.runtime.execute import THREADS_ENV

    if getattr(args, "threads", None) is not None:
        os.environ[THREADS_ENV] = str(args.threads)
