#!/usr/bin/env python
"""Check the import contracts in pyproject.toml ([tool.importlinter]) and that no module imports itself in a circle.

``models/``, ``calibration/`` and ``export/`` live at the repository root but install as ``polyfhe.models``,
``polyfhe.calibration`` and ``polyfhe.exporters`` ([tool.setuptools.package-dir]). import-linter walks a
package's folder, so this script first lays the sources out under their installed names in a temporary folder
(a copy: the walk does not follow links), then runs import-linter and a cycle search over the same graph.

Usage: ``python scripts/lint_imports.py`` (exit 0 when every contract holds and no cycle exists).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.cpp", "static", "*.txt")


def installed_view(dest: Path) -> Path:
    """Copy every package folder to ``dest`` under the dotted name it installs as; returns ``dest``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = config["tool"]["setuptools"]["package-dir"]
    for name, source in sorted(package_dir.items(), key=lambda item: item[0].count(".")):
        shutil.copytree(ROOT / source, dest.joinpath(*name.split(".")), ignore=SKIP, dirs_exist_ok=True)
    return dest


def import_cycles(source_root: Path, package: str = "polyfhe") -> list[list[str]]:
    """Strongly connected groups of more than one module (every import counts, in functions too)."""
    import grimp

    sys.path.insert(0, str(source_root))
    try:
        graph = grimp.build_graph(package, cache_dir=None, exclude_type_checking_imports=True)
    finally:
        sys.path.remove(str(source_root))
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in edges:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="polyfhe-imports-") as tmp:
        view = installed_view(Path(tmp))
        cycles = import_cycles(view)
        for group in cycles:
            print("import cycle: " + " -> ".join(group))
        env = {**os.environ, "PYTHONPATH": str(view)}
        lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
        result = subprocess.run([lint, str(ROOT / "pyproject.toml"), "--no-cache"], env=env, cwd=tmp, check=False)
    if cycles:
        print(f"{len(cycles)} import cycle(s)")
    return 1 if cycles or result.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
