"""pyproject lists every package: a subpackage missing from `packages` works in an editable install and is
silently absent from the wheel (it happened to the CKKS engines once)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_with_an_init_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    assert {"polyfhe.engines.seal", "polyfhe.exporters.ckks", "polyfhe.models.layers"} <= found
    assert sorted(found - set(setuptools["packages"])) == []


def test_ci_runs_the_readme_test_command_and_a_ray_and_browser_stage() -> None:
    """CI must run what the README tells users to run, and the tests that command leaves out (Ray, Chromium)
    somewhere: otherwise they would run nowhere."""
    import re

    readme = (ROOT / "README.md").read_text()
    command = re.search(r"bash scripts/setup\.sh && (\.venv/bin/python -m pytest [^\n]*)", readme).group(1)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert f"bash scripts/setup.sh && {command}" in ci
    assert "not ray and not browser" in command
    assert '.venv/bin/python -m pytest -m "(ray or browser) and not slow and not concrete"' in ci
