"""Renderers the CLI's subcommands share (rich tables of an encrypted run, its operation counts)."""

from __future__ import annotations

from typing import Any

__all__ = ["COUNT_ROWS", "MIB", "SHOWN_SAMPLES", "counts_table", "render_run_result"]

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
        console.print(f"classes of {r['samples']} samples (encrypted agrees with plaintext on {agree}):")
        table = Table("sample", "class", "logits")
        for i in range(min(r["samples"], SHOWN_SAMPLES)):
            table.add_row(str(i), str(r["classes"][i]), " ".join(f"{v:.4g}" for v in r["logits"][i]))
        console.print(table)
    console.print(f"max abs error vs plaintext program: {r['max_abs_error']:.2e}")
    table = Table(title="timings and sizes", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for key, value in r["timings"].items():
        label = "keys restored" if key == "keygen" and r.get("keys", {}).get("restored") else key.replace("_", " ")
        table.add_row(f"{label} time", f"{value * 1000:.1f} ms")
    for key, value in r["sizes"].items():
        table.add_row(key.replace("_", " "), f"{value / 1e6:.3f} MB")
    console.print(table)
    console.print(counts_table(r["counts"], r.get("plaintext_cache", {})))


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
