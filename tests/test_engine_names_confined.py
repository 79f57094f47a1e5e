"""No engine's name is spelled in the library outside its engine folder and the registries that list engines by
name: an engine fact written elsewhere is one a new engine, or a change to this one, would have to find."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("polyfhe", "export", "models", "calibration")
ENGINE_NAMES = {"seal", "lattigo", "concrete", "tenseal"}
# the registries, one line per engine each: where a name must be spelled
REGISTRIES = {
    "polyfhe/program/engines.py": "the engine registry",
    "polyfhe/program/program_formats.py": "the CKKS program format (a manifest naming no engine is SEAL's)",
    "polyfhe/workers/environments.py": "the environments of their own `polyfhe setup` builds",
    "polyfhe/__init__.py": "the export targets",
    "polyfhe/commands/export.py": "what `polyfhe export --target` does per export target",
}


def _engine_strings(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line`` of each string literal (docstrings and comments aside) that is an engine's name."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.STRING and token.string.strip("'\"rbuf").lower() in ENGINE_NAMES:
            found.append(f"{path.relative_to(root)}:{token.start[0]}: {token.line.strip()}")
    return found


def test_engine_names_only_in_engine_folders_and_registries() -> None:
    files = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
    assert files
    outside = [hit for p in files
               if not str(p.relative_to(ROOT)).startswith("polyfhe/engines/")
               and str(p.relative_to(ROOT)) not in REGISTRIES
               for hit in _engine_strings(p)]
    assert not outside, "engine names outside the engines and the registries:\n" + "\n".join(outside)


def test_the_scan_sees_an_engine_name(tmp_path: Path) -> None:
    """The scan is not blind: a literal engine name in a module is found."""
    module = tmp_path / "probe.py"
    module.write_text('"""Lattigo in a docstring is fine."""\nENGINE = "lattigo"\n')
    assert _engine_strings(module, tmp_path) == ['probe.py:2: ENGINE = "lattigo"']
