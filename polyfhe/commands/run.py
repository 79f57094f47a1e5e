"""``polyfhe run DIR --input FILE``: encrypt an input, evaluate the CKKS program on it, decrypt, and check.

Plays both roles in one process, as a demonstration: the client generates keys and encrypts, the server
sees only the public context and ciphertexts, the client decrypts. The result is compared with the
compiled program run on plaintext (``run_plain``). FILE is an ``.npy`` array, an ``.npz`` with array ``x``
(one sample or a stack of any number: they are encrypted in chunks of as many as one ciphertext holds,
``samples_per_ciphertext`` for the single layout, a slot each for the batch layout, one query per chunk) or an
image (``.png``/``.jpg``: converted to the program's channels and size, scaled to [0, 1]).

Inputs must lie in the range the program was calibrated on (``input_range`` in its manifest, 5% of its span
tolerated either side): values outside it overflow or lose precision without any error from CKKS, so they are
refused (exit code 2, with the range and how to normalise). ``--clip`` clips them to the range instead and warns
how many values it changed.

The encrypted logits must agree with the plaintext program's within the noise the parameters explain: the
tolerance the compiler recorded (``info.noise.tolerance`` in the manifest), or for a program exported before it
recorded one, a bound from its parameters. A larger error means the result is wrong (exit code 3).

A program that bootstraps is checked against the bound from its parameters, and that bound does not include the
bootstraps' error (nothing simulates it): the output says so (``tolerance_source: "parameters"``,
``tolerance_enforced: false`` and the sentence ``tolerance_note`` in ``--json``; a ``tolerance:`` line in the
text), and a larger error is reported with a warning, not as exit code 3.

``--keys KEYDIR`` restores the client's keys from a folder written by ``polyfhe client keys create --program DIR
--out KEYDIR`` instead of making new ones; a folder made for another program is refused. A progress bar follows
the evaluation when stderr is a terminal.

A program exported with insecure parameters (``allow_insecure``: security "none") is refused unless
``--allow-insecure``.

Exit codes: 0 ran, and the encrypted result agrees with the plaintext program; 2 bad input (missing or unreadable
program, file or key folder, wrong shape, not an image, values outside the calibrated range without ``--clip``,
insecure parameters without ``--allow-insecure``); 3 ran, but the encrypted result differs from the plaintext
program by more than the tolerance (``"agrees": false`` in ``--json``), for a program whose tolerance is enforced
(``"tolerance_enforced": true``: one that does not bootstrap).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyfhe.commands.arguments import add_threads_argument, apply_threads, non_negative_float
from polyfhe.commands.inputs import READERS, RunInputError, read_input
from polyfhe.commands.render import MIB, render_run_result
from polyfhe.runtime.plaintexts import DEFAULT_PLAINTEXT_BYTES

if TYPE_CHECKING:  # numpy is imported by the run, not by the parser
    import numpy as np

__all__ = ["EXIT_BAD_INPUT", "EXIT_DISAGREES", "READERS", "RunInputError", "add_parser", "read_input", "run"]

EXIT_BAD_INPUT = 2
EXIT_DISAGREES = 3


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
    p.add_argument("--clip", action="store_true",
                   help="clip input values outside the program's calibrated range to it (with a warning saying "
                        "how many) instead of refusing them (exit code 2)")
    p.add_argument("--allow-insecure", action="store_true",
                   help="run a program exported with insecure parameters (security \"none\"; tests and "
                        "experiments only: refused otherwise, exit code 2)")
    add_threads_argument(p)
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from polyfhe.program.boundary import InputError
    from polyfhe.program.ckks_program import load_program
    from polyfhe.program.keydir import KeyDir, KeyDirError
    from polyfhe.program.manifest import ProgramError
    from polyfhe.program.params import InsecureParametersError, require_secure

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
                               progress=True, clip=args.clip)
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
        if not result["tolerance_enforced"]:
            print(f"tolerance: {result['tolerance_note']}")
    if result["agrees"]:
        return 0
    if not result["tolerance_enforced"]:
        print(f"warning: the encrypted result differs from the plaintext program by {result['max_abs_error']:.3g}, "
              f"more than the tolerance {result['tolerance']:.3g}, {result['tolerance_note']} (exit code 0). Compare "
              "the classes with the plaintext program's and the error with the bootstraps' precision "
              "(docs/bootstrapping.md)", file=sys.stderr)
        return 0
    print(f"error: the encrypted result differs from the plaintext program by {result['max_abs_error']:.3g}, more "
          f"than the {result['tolerance']:.3g} CKKS noise explains ({result['tolerance_note']}); it is wrong. Causes: "
          "inputs far from the calibration data (intermediate values overflow), keys or parameters that do not "
          "match the program, an engine fault", file=sys.stderr)
    return EXIT_DISAGREES


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
                  progress: bool = False, clip: bool = False) -> dict:
    """Keys, encrypt, evaluate, decrypt; timings in seconds, sizes in bytes, error against ``run_plain``.

    ``x``: any number of samples, run as queries of at most ``samples_per_query`` samples each; ``timings`` and
    ``sizes`` of the queries are summed (``per_query`` lists each). ``clip``: clip values outside the calibrated
    range instead of refusing them. ``agrees``: whether the largest logit error is within ``tolerance``; where it
    comes from and whether a larger error means a wrong result: ``tolerance_source``, ``tolerance_note``,
    ``tolerance_enforced`` (false for a program that bootstraps: see :func:`polyfhe.program.noise.tolerance_for`).
    ``plaintext_cache_bytes``: budget of the program's plaintext store (``None``: the default, half of the machine's memory).
    ``client``: keys restored elsewhere (``None``: made here). ``progress``: bars on stderr when it is a terminal."""
    import numpy as np

    from polyfhe.commands.progress import progress_bar
    from polyfhe.program.boundary import split_queries
    from polyfhe.program.noise import tolerance_for

    chunks = split_queries(program.manifest, x, clip)  # refuses (or clips) before any key is made
    restored = client is not None
    if client is None:
        with progress_bar(1, "making keys", unit="key set", enabled=progress) as bar:
            client = program.client()
            bar.update(1)
    context = client.public_context()
    server = program.server(context, max_cache_bytes=plaintext_cache_bytes)
    trips, counts = _round_trips(program, client, server, chunks, progress)
    logits = np.concatenate([trip.logits for trip in trips])
    plain = program.run_plain(np.concatenate(chunks))
    error = float(np.abs(logits - plain).max())
    tolerance = tolerance_for(program.manifest)
    classes, plain_classes = logits.argmax(axis=1).tolist(), plain.argmax(axis=1).tolist()
    per_query = [{"samples": len(t.logits), "encrypt": t.encrypt_s, "evaluate": t.evaluate_s,
                  "server_total": t.server_s, "decrypt": t.decrypt_s, "input_ciphertext": t.input_bytes,
                  "output_ciphertext": t.output_bytes} for t in trips]
    return {
        "program_id": program.program_id, "layout": program.manifest.layout,
        "params": program.params.describe(), "samples": len(logits), "queries": len(trips),
        "classes": classes, "plain_classes": plain_classes,
        "argmax_agreement": sum(a == b for a, b in zip(classes, plain_classes, strict=True)),
        "logits": logits.tolist(), "max_abs_error": error, "tolerance": tolerance.value,
        "tolerance_source": tolerance.source, "tolerance_enforced": tolerance.enforced,
        "tolerance_note": tolerance.note, "agrees": error <= tolerance.value,
        "timings": {"keygen": client.keygen_seconds, **{key: sum(q[key] for q in per_query)
                                                        for key in ("encrypt", "evaluate", "server_total", "decrypt")}},
        "sizes": {"public_context": len(context), "input_ciphertext": sum(q["input_ciphertext"] for q in per_query),
                  "output_ciphertext": sum(q["output_ciphertext"] for q in per_query)},
        "per_query": per_query, "counts": counts, "plaintext_cache": server.last_run.plaintext,
        "keys": {"restored": restored},
    }


def _round_trips(program: Any, client: Any, server: Any, chunks: list[np.ndarray], progress: bool) -> tuple:
    """(a :func:`timed_round_trip` per chunk, the operation counts of all of them) with a bar over the program's
    steps (an engine that runs the program in one call, Lattigo, fills it at the end of each query)."""
    from polyfhe.commands.progress import progress_bar
    from polyfhe.runtime.execute import observe_steps
    from polyfhe.runtime.roundtrip import add_counts, timed_round_trip

    steps = len(program.manifest.steps)
    trips, counts = [], {}
    with progress_bar(steps * len(chunks), "evaluating encrypted", unit="step", enabled=progress) as bar:
        for i, chunk in enumerate(chunks):
            with observe_steps(lambda index, step: bar.update(1)):
                trips.append(timed_round_trip(client, server, chunk))
            bar.update(steps * (i + 1) - bar.n)
            counts = add_counts(counts, server.last_run.counts)
    return trips, counts
