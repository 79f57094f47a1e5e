"""``polyfhe cost``: predicted latency, key bytes and peak memory of a model (or compiled program) on this machine.

Operation costs are measured here once per machine and engine version (cached outside the repository); a small
model is compiled and its exact operation counts priced, a large one is estimated from a trace of the model. A
model whose predicted memory exceeds this machine's gets exit code 1 with the numbers and what would fit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from polyfhe.commands.arguments import positive_int
from polyfhe.program.engines import BACKEND_NAMES, DEFAULT_BACKEND


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("cost", help="predict latency, key bytes and peak memory of a model under CKKS")
    p.add_argument("model", help="zoo model name (polyfhe models) or a compiled program folder")
    p.add_argument("--img-size", type=positive_int, help="input height and width (zoo models; default: the model's)")
    p.add_argument("--backend", choices=BACKEND_NAMES, default=DEFAULT_BACKEND,
                   help=f"CKKS engine (default: {DEFAULT_BACKEND})")
    p.add_argument("--method", choices=("auto", "compiled", "estimated"), default="auto",
                   help="compile the model here (exact counts) or estimate from a trace; auto compiles small "
                        "leveled models only")
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


def run(args: argparse.Namespace) -> int:
    from polyfhe.cost.model import calibrated_costs
    from polyfhe.cost.zoo_models import model_cost, program_cost
    from polyfhe.program.engines import BackendUnavailable
    from polyfhe.program.params import ParameterError

    console = Console(width=160)
    machine = int(args.memory_gb * 1e9) if args.memory_gb else -1
    try:
        if args.recalibrate:
            calibrated_costs(args.backend, recalibrate=True)
        if Path(args.model).is_dir():
            from polyfhe.runtime.program import load_program

            report = program_cost(load_program(args.model), machine_bytes=machine)
        else:
            report = model_cost(args.model, args.img_size, args.backend, method=args.method, machine_bytes=machine)
    except KeyError as exc:
        console.print(f"[red]error[/]: {exc.args[0]}")
        return 2
    except (BackendUnavailable, ParameterError, ValueError) as exc:
        console.print(f"[red]error[/]: {exc}")
        return 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, default=str))
    else:
        console.print(render(report))
        for note in report.prediction.notes:
            console.print(f"note: {note}")
    if not report.prediction.fits:
        console.print(f"[red]error[/]: too large for this machine: {report.advice}")
        return 1
    return 0
