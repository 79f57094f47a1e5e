"""``polyfhe cost MODEL``: predicted latency, key bytes and peak memory under CKKS on this machine.

MODEL is a zoo model name (``polyfhe models``), an ``.onnx`` file or a compiled CKKS program folder
(``polyfhe export MODEL --target ckks --out DIR``). Operation costs are measured here once per machine and engine
version (10-60 s, cached outside the repository). A model that compiles here (a leveled circuit whose widest
tensor fits one ciphertext) is compiled and its exact operation counts priced: the numbers the exported program
will show. Deeper or wider models are estimated from a trace of the torch model (``--method estimated`` forces
that: instant, but a plan polyfhe does not build). A model whose predicted memory exceeds this machine's gets
exit code 1 with the numbers and what would fit; an input that is none of the above gets exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from polyfhe.commands.arguments import positive_int
from polyfhe.program.engines import BACKEND_NAMES, DEFAULT_BACKEND

if TYPE_CHECKING:  # rich is imported by the run, not by the parser
    from rich.table import Table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("cost", help="predict latency, key bytes and peak memory of a model under CKKS",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL",
                   help="zoo model name (polyfhe models), .onnx file or compiled CKKS program folder")
    p.add_argument("--img-size", type=positive_int, help="input height and width (zoo models; default: the model's)")
    p.add_argument("--backend", choices=BACKEND_NAMES, default=DEFAULT_BACKEND,
                   help=f"CKKS engine (default: {DEFAULT_BACKEND}; a program folder runs on the engine it names)")
    p.add_argument("--method", choices=("auto", "compiled", "estimated"), default="auto",
                   help="compile the model here (exact counts, seconds to minutes) or estimate it from a trace "
                        "(instant, zoo models only); auto compiles whatever compiles here (leveled, widest tensor "
                        "in one ciphertext) and estimates the rest")
    p.add_argument("--memory-gb", type=float, help="memory of the target machine (default: 90%% of this one's)")
    p.add_argument("--recalibrate", action="store_true", help="measure this machine's operation costs again")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def _gb(value: float) -> str:
    return f"{value / 1e9:,.2f} GB" if value >= 1e8 else f"{value / 1e6:,.1f} MB"


def _seconds(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:,.1f} h"
    return f"{value:,.2f} s" if value >= 1 else f"{value * 1e3:,.1f} ms"


def render(report) -> Table:
    from rich.table import Table

    p = report.prediction
    table = Table(title=f"predicted cost: {report.name} at {report.img_size}x{report.img_size} on {p.engine}")
    table.add_column("", style="bold")
    table.add_column("predicted", justify="right")
    counters = p.counters
    rows = [
        ("method", f"{report.method} ({'exact operation counts' if report.method == 'compiled' else 'traced estimate'})"),
        ("parameters", p.params.describe()),
        ("levels (depth)", str(report.depth)),
        ("samples per evaluation", str(p.samples)),
        ("rotations / key switches", f"{counters.get('rotations', 0):,} / {counters.get('key_switches', 0):,}"),
        ("plaintext products", f"{counters.get('plain_products', 0):,}"),
        ("bootstraps", f"{p.bootstraps:,}" + (f" x {_seconds(p.bootstrap_seconds)}" if p.bootstraps else "")),
        ("latency per evaluation (warm / cold)", f"{_seconds(p.eval_seconds)} / {_seconds(p.cold_seconds)}"),
        ("latency per image", _seconds(p.image_seconds)),
        ("where the time goes", ", ".join(f"{op} {_seconds(s)}" for op, s in
                                          sorted(p.by_op.items(), key=lambda kv: -kv[1])[:4])),
        ("Galois keys, public context", f"{p.galois_keys:,}, {_gb(p.key_bytes)}"),
        ("bootstrapping keys (key generation peak)",
         f"{_gb(p.bootstrap_key_bytes)} ({_gb(p.keygen_peak_bytes)})" if p.bootstrap_key_bytes else "-"),
        ("plaintexts held", _gb(p.plaintext_bytes)),
        ("peak memory (client + server, one process)", _gb(p.peak_bytes)),
        ("memory needed / this machine",
         f"{_gb(p.memory_needed)} / {_gb(p.machine_bytes) if p.machine_bytes else 'unknown'}"),
        ("fits", "[green]yes[/]" if p.fits else "[red]no[/]"),
    ]
    for label, value in rows:
        table.add_row(label, value)
    return table


class _StageLine:
    """``progress`` for the cost functions: each slow step as a line on stderr (stdout keeps the table or the
    JSON), and how long the step before it took."""

    def __init__(self) -> None:
        self.started: float | None = None

    def __call__(self, text: str) -> None:
        self.done()
        print(f"polyfhe cost: {text} ...", file=sys.stderr, flush=True)
        self.started = time.perf_counter()

    def done(self) -> None:
        if self.started is not None:
            print(f"polyfhe cost: ... done in {time.perf_counter() - self.started:.0f} s", file=sys.stderr,
                  flush=True)
            self.started = None


def _not_a_model(target: str, reason: str) -> KeyError:
    return KeyError(f"unknown model {target!r}: {reason}; polyfhe cost takes a zoo model name (`polyfhe models` "
                    "lists them), an .onnx file, or a compiled CKKS program folder (`polyfhe export MODEL --target "
                    "ckks --out DIR`)")


def _report(args: argparse.Namespace, machine: int, progress: _StageLine):
    from polyfhe.cost.zoo_models import model_cost, onnx_cost, program_cost

    target = str(args.model)
    path = Path(target)
    if path.is_dir():
        from polyfhe.program.ckks_program import load_program
        from polyfhe.program.errors import ProgramError

        if args.img_size:
            raise ValueError(f"--img-size applies to zoo models; the program in {path} was compiled for its input")
        try:
            program = load_program(path)
        except ProgramError as exc:
            raise _not_a_model(target, f"a folder, but not a program ({str(exc).split(' (create one')[0]})") from None
        return program_cost(program, machine_bytes=machine, progress=progress)
    if path.suffix.lower() == ".onnx":
        if not path.is_file():
            raise _not_a_model(target, "no such file")
        if args.img_size:
            raise ValueError(f"--img-size applies to zoo models; {path.name} has the input shape its graph gives")
        return onnx_cost(path, args.backend, method=args.method, machine_bytes=machine, progress=progress)
    from polyfhe.models.registry import list_models

    names = list_models()
    if target not in names:
        import difflib

        close = difflib.get_close_matches(target, names, n=3)
        reason = ("a file, but neither an .onnx file nor a program folder" if path.is_file()
                  else "no zoo model, .onnx file or folder of that name"
                  + (f" (did you mean {' or '.join(close)}?)" if close else ""))
        raise _not_a_model(target, reason)
    return model_cost(target, args.img_size, args.backend, method=args.method, machine_bytes=machine,
                      progress=progress)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from polyfhe.cost.model import calibrated_costs
    from polyfhe.program.engines import BackendUnavailable
    from polyfhe.program.params import ParameterError

    console = Console(width=160)
    machine = int(args.memory_gb * 1e9) if args.memory_gb else -1
    progress = _StageLine()
    try:
        if args.recalibrate:
            calibrated_costs(args.backend, recalibrate=True, progress=progress)
        report = _report(args, machine, progress)
    except KeyError as exc:
        progress.done()
        console.print(f"[red]error[/]: {exc.args[0]}")
        return 2
    except (BackendUnavailable, ParameterError, ValueError) as exc:
        progress.done()
        console.print(f"[red]error[/]: {exc}")
        return 1
    progress.done()
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, default=str))
    else:
        console.print(render(report))
        for note in (*report.notes, *report.prediction.notes):
            console.print(f"note: {note}")
    if not report.prediction.fits:
        console.print(f"[red]error[/]: too large for this machine: {report.advice}")
        return 1
    return 0
