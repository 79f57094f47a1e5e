"""Start-up time of the ``polyfhe`` command: ``polyfhe --help`` and every subcommand's ``--help``, this tree beside
another checkout.

    python bench/cli_startup.py                                  # this tree, median of 5 processes per command
    python bench/cli_startup.py --baseline ../polyfhe-prev       # also that checkout, in the same run
    python bench/cli_startup.py --repeats 9 --commands train run

Each measurement is a fresh ``python -m polyfhe CMD --help`` (cold-ish: a new interpreter, the OS file cache warm),
run in the tree's folder with ``PYTHONPATH`` set to it, and without ``GOGC`` in its environment, as in a new shell
(a tree that restarts itself with Go's settings before parsing pays for that restart). The trees alternate
process by process, so load from other work falls on both alike. Printed: the machine, then per command the median
wall time, the median user+sys CPU time of the process and the sum of ``-X importtime``'s self times (one extra
run), for each tree, and the speed-up of the wall time against the baseline; written: ``--out/cli_startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from machine_info import machine_info

_IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|")
_GO_ENV = ("GOGC", "POLYFHE_GO_ENV_SET")  # what a restarted polyfhe process carries; a new shell has neither


def commands() -> list[str]:
    """The subcommands this tree's registry lists (the parser build is light, so asking costs little)."""
    sys.path.insert(0, str(ROOT))
    from polyfhe.cli import COMMANDS

    return list(COMMANDS)


def _env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _GO_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    return env


def time_once(tree: Path, words: list[str]) -> tuple[float, float] | None:
    """(wall seconds, user+sys CPU seconds) of one ``python -m polyfhe WORDS --help``; None when it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "polyfhe", *words, "--help"], cwd=tree, env=_env(tree),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        return None
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def import_seconds(tree: Path, words: list[str]) -> float | None:
    """The sum of ``-X importtime``'s self times (a restarted process: both of its starts)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "polyfhe", *words, "--help"], cwd=tree,
                          env=_env(tree), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        return None
    micros = [int(m.group(1)) for line in done.stderr.splitlines() if (m := _IMPORT_LINE.match(line))]
    return sum(micros) / 1e6


def measure(trees: dict[str, Path], names: list[str], repeats: int) -> list[dict]:
    rows = []
    for name in ["", *names]:
        words = name.split()
        samples: dict[str, list[tuple[float, float] | None]] = {tree: [] for tree in trees}
        for _ in range(repeats):
            for label, tree in trees.items():
                samples[label].append(time_once(tree, words))
        row: dict = {"command": f"polyfhe {name} --help".replace("  ", " ")}
        for label, tree in trees.items():
            ok = [s for s in samples[label] if s is not None]
            row[label] = None if len(ok) < repeats else {
                "wall_s": statistics.median(s[0] for s in ok), "cpu_s": statistics.median(s[1] for s in ok),
                "import_s": import_seconds(tree, words)}
        rows.append(row)
        print(f"  {row['command']}: " + ", ".join(
            f"{label} {row[label]['wall_s']:.2f} s" if row[label] else f"{label} failed" for label in trees),
            flush=True)
    return rows


def table(rows: list[dict], labels: list[str]) -> str:
    head = "| command | " + " | ".join(f"{label}: wall s | user+sys s | import s" for label in labels)
    has_base = len(labels) > 1
    lines = [head + (" | speed-up |" if has_base else " |"),
             "|---|" + "---:|---:|---:|" * len(labels) + ("---:|" if has_base else "")]
    for row in rows:
        cells = []
        for label in labels:
            r = row[label]
            cells += ["failed", "-", "-"] if r is None else [
                f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}", "-" if r["import_s"] is None else f"{r['import_s']:.2f}"]
        if has_base:
            this, base = row[labels[0]], row[labels[-1]]
            cells.append(f"{base['wall_s'] / this['wall_s']:.1f}x" if this and base else "-")
        lines.append(f"| `{row['command']}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", "--baseline-tree", type=Path, metavar="DIR",
                   help="also time this polyfhe checkout (run with PYTHONPATH=DIR), in the same run")
    p.add_argument("--repeats", type=int, default=5, help="fresh processes per command and tree (default 5)")
    p.add_argument("--commands", nargs="+", metavar="CMD",
                   help="subcommands to time (default: every one in polyfhe.cli.COMMANDS); the top level always")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    trees = {"this tree": ROOT}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable), load average "
          f"{info['load_avg_1m']:.2f}; Python {info['python']}; {info['platform']}", flush=True)
    names = args.commands or commands()
    rows = measure(trees, names, args.repeats)
    text = table(rows, list(trees))
    print(f"median of {args.repeats} fresh processes per command; load average now {os.getloadavg()[0]:.2f}")
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cli_startup.json").write_text(json.dumps({
        "machine": info, "repeats": args.repeats, "trees": {k: str(v) for k, v in trees.items()}, "rows": rows,
        "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
