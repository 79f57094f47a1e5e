"""Renderers the CLI's subcommands share (rich tables of an encrypted run, its operation counts, the model zoo)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyfhe.zoo import ZooRow

__all__ = ["COUNT_ROWS", "MIB", "SHOWN_SAMPLES", "counts_table", "render_run_result", "zoo_table"]

MIB = 1 << 20
SHOWN_SAMPLES = 16  # samples listed one per row; the rest only count toward the agreement


def render_run_result(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    console.print(f"program {r['program_id']} ({r['layout']}): {r['params']}")
    if r["samples"] == 1:
        console.print(f"class: {r['classes'][0]}")
        console.print("logits: " + " ".join(f"{v:.5g}" for v in r["logits"][0]))
    else:
        agree = sum(a == b for a, b in zip(r["classes"], r["plain_classes"]))
        queries = f", {r['queries']} queries" if r.get("queries", 1) > 1 else ""
        console.print(f"classes of {r['samples']} samples{queries} (encrypted agrees with plaintext on {agree}):")
        table = Table("sample", "class", "logits")
        for i in range(min(r["samples"], SHOWN_SAMPLES)):
            table.add_row(str(i), str(r["classes"][i]), " ".join(f"{v:.4g}" for v in r["logits"][i]))
        console.print(table)
    console.print(f"max abs error vs plaintext program: {r['max_abs_error']:.2e}{_verdict(r)}")
    table = Table(title="timings and sizes", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    queries = r.get("queries", 1)
    total = f" ({queries} queries)" if queries > 1 else ""
    for key, value in r["timings"].items():
        label = "keys restored" if key == "keygen" and r.get("keys", {}).get("restored") else key.replace("_", " ")
        table.add_row(f"{label} time{total if key != 'keygen' else ''}", f"{value * 1000:.1f} ms")
    for key, value in r["sizes"].items():
        table.add_row(f"{key.replace('_', ' ')}{total if key != 'public_context' else ''}", f"{value / 1e6:.3f} MB")
    console.print(table)
    console.print(counts_table(r["counts"], r.get("plaintext_cache", {})))


def _verdict(r: dict) -> str:
    """Whether the error is within the tolerance CKKS noise explains (absent from older results)."""
    if "tolerance" not in r:
        return ""
    verdict = "within" if r["agrees"] else "OVER"
    return f" ({verdict} the tolerance {r['tolerance']:.2e} the noise explains)"


COUNT_ROWS = (  # (key in counts, label)
    ("rotations", "rotations"), ("key_switches", "key switches (rotations, relinearisations)"),
    ("plain_products", "plaintext products"), ("products", "ct x ct products"), ("rescales", "rescales"),
    ("encodes", "plaintexts encoded"), ("plaintext_hits", "plaintexts reused from the cache"),
    ("evictions", "plaintexts evicted"),
)


def counts_table(counts: dict, cache: dict) -> Any:
    from rich.table import Table

    table = Table(title="operations (this evaluation)", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for key, label in COUNT_ROWS:
        if key in counts:
            table.add_row(label, str(counts[key]))
    for key, value in counts.items():  # an engine that only predicts its counts (Lattigo) reports planned_*
        if key.startswith("planned_"):
            table.add_row(f"{key.removeprefix('planned_').replace('_', ' ')} (planned, not measured)", str(value))
    if "plaintext_bytes" in counts:
        budget = cache.get("max_bytes")
        limit = f" of {budget / MIB:.0f} MiB" if budget is not None else ""
        peak = f", peak {cache['peak_bytes'] / MIB:.1f} MiB" if "peak_bytes" in cache else ""
        table.add_row("plaintext cache held", f"{counts['plaintext_bytes'] / MIB:.1f} MiB{limit}{peak}")
    return table


def _fmt(value: int | None, scale: float = 1.0, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value / scale:,.{digits}f}" if scale != 1.0 else f"{value:,}"


def _fmt_degree(degree: int | None) -> str:
    """Huge degrees read better as powers of two (a 34-block MONet has degree 2^68)."""
    if degree is None or degree <= 1 << 20:
        return _fmt(degree)
    if degree & (degree - 1) == 0:
        return f"2^{degree.bit_length() - 1}"
    return f"~2^{math.log2(degree):.1f}"


def zoo_table(rows: list[ZooRow]) -> Any:
    """The model zoo as a rich table (``polyfhe models``, ``polyfhe demo --zoo``)."""
    from rich.table import Table

    table = Table(title="polyfhe model zoo")
    macs = any(r.macs is not None for r in rows)
    analyzed = any(r.degree is not None for r in rows)  # the analyzer's columns only when it ran
    columns = ("model", "norm", "input", "classes", "params", "spec params", *(("GMACs",) if macs else ()),
               *(("degree", "ct x ct", "levels") if analyzed else ()), "spec ct x ct", "spec levels")
    for col in columns:
        table.add_column(col, justify="left" if col in ("model", "norm", "input") else "right")
    for r in rows:
        table.add_row(
            r.name, r.norm, "x".join(map(str, r.input_shape)), str(r.num_classes),
            _fmt(r.params), _fmt(r.spec_params), *((_fmt(r.macs, 1e9, 3),) if macs else ()),
            *((_fmt_degree(r.degree), _fmt(r.mult_depth), _fmt(r.levels)) if analyzed else ()),
            _fmt(r.spec_ct_depth), _fmt(r.spec_levels),
        )
    return table
