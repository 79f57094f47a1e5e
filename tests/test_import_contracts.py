"""The layer order of docs/architecture.md holds: import-linter's contracts (pyproject.toml) are kept and no module
imports itself in a circle, through any chain of imports (inside functions included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "lint_imports.py"


def test_import_contracts_are_kept_and_no_cycle_exists() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Contracts: 6 kept, 0 broken." in result.stdout


def test_the_checker_finds_a_cycle(tmp_path: Path) -> None:
    """The cycle search is not vacuous: two modules importing each other (one inside a function) are found."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import lint_imports
    finally:
        sys.path.remove(str(SCRIPT.parent))
    package = tmp_path / "circ"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circ import b\n")
    (package / "b.py").write_text("def late():\n    from circ import a\n    return a\n")
    (package / "c.py").write_text("from circ import a\n")
    assert lint_imports.import_cycles(tmp_path, "circ") == [["circ.a", "circ.b"]]


def test_the_contracts_catch_an_upward_import(tmp_path: Path) -> None:
    """A lower layer importing a higher one breaks the layers contract (checked on a copy of the tree)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import lint_imports
    finally:
        sys.path.remove(str(SCRIPT.parent))
    view = lint_imports.installed_view(tmp_path / "view")
    (view / "polyfhe" / "program" / "upward.py").write_text("def late():\n    import polyfhe.serve.app\n")
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), str(ROOT / "pyproject.toml"), "--no-cache"], capture_output=True, text=True,
                            cwd=view, env={"PYTHONPATH": str(view), "PATH": str(lint.parent)}, timeout=600,
                            check=False)
    assert result.returncode != 0
    assert "polyfhe.program.upward -> polyfhe.serve.app" in result.stdout
