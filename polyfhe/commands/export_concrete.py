"""``polyfhe export MODEL --target concrete``: the Concrete ML half of the export command (compile and summarise)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["export_concrete_program", "summary_rows"]


def export_concrete_program(console: Any, model: Any, name: str, shape: tuple[int, ...] | None,
                            calibration: np.ndarray | None, args: argparse.Namespace) -> int:
    from polyfhe.commands.errors import ExportInputError
    from polyfhe.exporters.concrete import export_concrete

    if calibration is None:
        raise ExportInputError("target concrete quantises on calibration data: pass --calibration (a dataset name "
                               "or an .npy/.npz of inputs)")
    # a knob left unset: polyfhe's automatic choice (a small grid scored on the evaluation data when given, else
    # on the calibration inputs; the manifest says which), as in the API
    rounding = "auto" if args.rounding_threshold_bits is None else args.rounding_threshold_bits
    n_bits = "auto" if args.n_bits is None else args.n_bits
    program = export_concrete(model, calibration, n_bits=n_bits, rounding_threshold_bits=rounding,
                              p_error=args.p_error,
                              input_shape=shape, quantization="post-training", env=args.concrete_env, out=args.out)
    program.save(args.out)
    from rich.table import Table

    table = Table(title="Concrete ML program", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in summary_rows(program, name, args.out):
        table.add_row(key, str(value))
    console.print(table)
    console.print(f"[green]saved[/] Concrete program to {args.out}; run it with "
                  f"`polyfhe run {args.out} --input IMAGE.png|X.npy`")
    return 0


def summary_rows(program: Any, name: str, out: Path) -> list[tuple[str, Any]]:
    m, info = program.manifest, program.manifest.info
    disk = sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file())
    stats = info.get("statistics", {})
    engine = f"TFHE (Concrete ML {m.versions.get('concrete_ml', '?')})"
    quantisation = f"{m.quantization}, n_bits={m.n_bits}, rounding_threshold_bits={m.rounding_threshold_bits}"
    keys = info.get("keys") or {}
    predicted = "-" if "evaluation_keys_bytes" not in keys else (
        f"{keys['evaluation_keys_bytes'] / 1e6:.0f} MB (predicted before key generation)")
    cost = (info.get("accuracy_cost") or {}).get("summary", "-")
    return [
        ("model", name), ("program id", m.program_id), ("scheme", engine),
        ("input shape", " x ".join(map(str, m.input_shape))), ("outputs", m.output_size),
        ("quantisation", quantisation),
        ("largest integer", f"{info.get('max_bit_width', '-')} bits"),
        ("evaluation keys", predicted), ("accuracy against float", cost),
        ("programmable bootstraps", stats.get("programmable_bootstrap_count", "-")),
        ("p_error / global", f"{info.get('p_error', '-')} / {info.get('global_p_error', '-')}"),
        ("polynomial graph", f"{info.get('polynomial')} (degree {info.get('degree')})"),
        ("compile time", f"{info.get('compile_seconds', 0):.1f} s"), ("program on disk", f"{disk / 1e6:.2f} MB"),
    ]
