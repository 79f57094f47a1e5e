"""``polyfhe run DIR --input FILE``: encrypt an input, evaluate the CKKS program on it, decrypt, and check.

Plays both roles in one process, as a demonstration: the client generates keys and encrypts, the server
sees only the public context and ciphertexts, the client decrypts. The result is compared with the
compiled program run on plaintext (``run_plain``). FILE is an ``.npy`` array, an ``.npz`` with array ``x``
(up to as many samples as one ciphertext holds: ``samples_per_ciphertext`` for the single layout, a slot
each for the batch layout) or an image (``.png``/``.jpg``: converted to the
program's channels and size, scaled to [0, 1]).

``--keys KEYDIR`` restores the client's keys from a folder written by ``polyfhe client keys create --program DIR
--out KEYDIR`` instead of making new ones; a folder made for another program is refused. A progress bar follows
the evaluation when stderr is a terminal.

A program exported with insecure parameters (``allow_insecure``: security "none") is refused unless
``--allow-insecure``.

Exit codes: 0 ran; 2 bad input (missing or unreadable program, file or key folder, wrong shape, not an image,
insecure parameters without ``--allow-insecure``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from polyfhe.commands.arguments import add_threads_argument, apply_threads, non_negative_float
from polyfhe.commands.inputs import READERS, RunInputError, read_input
from polyfhe.commands.render import MIB, render_run_result
from polyfhe.runtime.plaintexts import DEFAULT_PLAINTEXT_BYTES
from polyfhe.runtime.roundtrip import timed_round_trip

__all__ = ["EXIT_BAD_INPUT", "READERS", "RunInputError", "add_parser", "read_input", "run"]

EXIT_BAD_INPUT = 2


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("run", description=__doc__,
                              help="run a CKKS program on an encrypted input and report timings and sizes",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("program", metavar="DIR", type=Path, help="program folder written by `polyfhe export`")
    p.add_argument("--input", required=True, type=Path, metavar="FILE", help="input: .npy, .npz or .png/.jpg")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--plaintext-cache-mb", type=non_negative_float, default=DEFAULT_PLAINTEXT_BYTES / MIB,
                   metavar="MB", help="memory for encoded plaintext diagonals; past it the cheapest are encoded "
                                      f"again on every run (default {DEFAULT_PLAINTEXT_BYTES / MIB:g} MiB, 0: none)")
    p.add_argument("--keys", type=Path, metavar="KEYDIR",
                   help="restore the client's keys from this folder (`polyfhe client keys create --program DIR "
                        "--out KEYDIR`) instead of making new ones")
    p.add_argument("--allow-insecure", action="store_true",
                   help="run a program exported with insecure parameters (security \"none\"; tests and "
                        "experiments only: refused otherwise, exit code 2)")
    add_threads_argument(p)
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from polyfhe.program.boundary import InputError
    from polyfhe.program.keydir import KeyDir, KeyDirError
    from polyfhe.program.manifest import ProgramError
    from polyfhe.program.params import InsecureParametersError, require_secure
    from polyfhe.runtime.program import load_program

    apply_threads(args)
    from polyfhe.engines.concrete.program import is_concrete_program

    if is_concrete_program(args.program):
        return _run_concrete(args)
    try:
        program = load_program(args.program)
        require_secure(program.params, args.allow_insecure, "run")
        x = read_input(Path(args.input), program.manifest)
        client = None if args.keys is None else KeyDir(args.keys).load(program.manifest, f"program {args.program}")
    except (ProgramError, RunInputError, KeyDirError, InsecureParametersError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        result = encrypted_run(program, x, plaintext_cache_bytes=int(args.plaintext_cache_mb * MIB), client=client,
                               progress=True)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    result["input"] = str(args.input)
    if args.keys is not None:
        result["keys"]["dir"] = str(args.keys)
    if args.json:
        print(json.dumps(result))
    else:
        render_run_result(result)
    return 0


def _run_concrete(args: argparse.Namespace) -> int:
    from polyfhe.commands.run_concrete import encrypted_run_concrete, render
    from polyfhe.engines.concrete import ConcreteEnvMissing, ConcreteProgramError, load_concrete_program

    if args.keys is not None:
        print("error: --keys restores CKKS key folders; a Concrete program makes its keys in a worker process",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        program = load_concrete_program(args.program)
        x = read_input(Path(args.input), program.manifest)
        result = encrypted_run_concrete(program, x)
    except (ConcreteProgramError, RunInputError, ConcreteEnvMissing, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    result["input"] = str(args.input)
    if args.json:
        print(json.dumps(result))
    else:
        render(result)
    return 0


def encrypted_run(program: Any, x: np.ndarray, plaintext_cache_bytes: int | None = None, client: Any = None,
                  progress: bool = False) -> dict:
    """Keys, encrypt, evaluate, decrypt; timings in seconds, sizes in bytes, error against ``run_plain``.

    ``plaintext_cache_bytes``: budget of the program's plaintext store (``None``: the default, half of the machine's memory).
    ``client``: keys restored elsewhere (``None``: made here). ``progress``: bars on stderr when it is a terminal."""
    from polyfhe.commands.progress import progress_bar

    restored = client is not None
    if client is None:
        with progress_bar(1, "making keys", unit="key set", enabled=progress) as bar:
            client = program.client()
            bar.update(1)
    context = client.public_context()
    server = program.server(context, max_cache_bytes=plaintext_cache_bytes)
    trip = _round_trip(program, client, server, x, progress)
    logits = trip.logits
    plain = program.run_plain(x)
    return {
        "program_id": program.program_id, "layout": program.manifest.layout,
        "params": program.params.describe(), "samples": len(logits),
        "classes": logits.argmax(axis=1).tolist(), "plain_classes": plain.argmax(axis=1).tolist(),
        "logits": logits.tolist(), "max_abs_error": float(np.abs(logits - plain).max()),
        "timings": {"keygen": client.keygen_seconds, "encrypt": trip.encrypt_s, "evaluate": trip.evaluate_s,
                    "server_total": trip.server_s, "decrypt": trip.decrypt_s},
        "sizes": {"public_context": len(context), "input_ciphertext": trip.input_bytes,
                  "output_ciphertext": trip.output_bytes},
        "counts": server.last_run.counts, "plaintext_cache": server.last_run.plaintext,
        "keys": {"restored": restored},
    }


def _round_trip(program: Any, client: Any, server: Any, x: np.ndarray, progress: bool) -> Any:
    """:func:`timed_round_trip` with a bar over the program's steps (an engine that runs the program in one call,
    Lattigo, fills it at the end)."""
    from polyfhe.commands.progress import progress_bar
    from polyfhe.runtime.execute import observe_steps

    steps = len(program.manifest.steps)
    with progress_bar(steps, "evaluating encrypted", unit="step", enabled=progress) as bar:
        with observe_steps(lambda index, step: bar.update(1)):
            trip = timed_round_trip(client, server, x)
        bar.update(steps - bar.n)
    return trip


