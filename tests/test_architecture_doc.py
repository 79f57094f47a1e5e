"""docs/architecture.md names every module of the library, so a reader finds each one there (it had omitted
several as modules were added)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("polyfhe", "export", "models", "calibration")  # the library's folders (export/ is polyfhe.exporters)


def test_every_module_is_named_in_the_architecture_doc() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if p.name != "__init__.py"]
    assert modules
    def named(p: Path) -> bool:  # as a file (``loop.py``), a bare name (`` `loop` ``) or a dotted path (``training.loop``)
        return p.name in doc or f"`{p.stem}`" in doc or f"{p.parent.name}.{p.stem}" in doc

    unnamed = [str(p.relative_to(ROOT)) for p in modules if not named(p)]
    assert not unnamed, f"docs/architecture.md does not name: {unnamed}"
