"""The page's static files: served only from the package, with the right types; node-seal pinned by hash."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from polyfhe.serve.page import static_asset, static_names

NODE_SEAL = {
    "vendor/node-seal/seal_throws.js": "15344370faee621f82671521959d0511aea0e520b6befb0b959a625db7893e25",
    "vendor/node-seal/seal_throws.wasm": "b30d3776265a56373a2001d2cd48baa8d72ddd571e04ddfaefd4c231271170e4",
}


def test_vendored_node_seal_is_the_pinned_release():
    for name, digest in NODE_SEAL.items():
        data, _ = static_asset(name)
        assert hashlib.sha256(data).hexdigest() == digest, f"{name} differs from node-seal 7.0.0's"
    assert static_asset("vendor/node-seal/seal_throws.wasm")[1] == "application/wasm"
    assert "MIT" in static_asset("vendor/node-seal/LICENSE")[0].decode()


def test_only_shipped_files_are_served(server):
    assert {"app.js", "fheclient.js", *NODE_SEAL} <= set(static_names())
    ok = httpx.get(f"{server.url}/static/fheclient.js", timeout=10)
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/javascript")
    assert ok.headers["x-content-type-options"] == "nosniff"
    for bad in ("../app.py", "..%2fapp.py", "%2e%2e/registry.py", "/etc/passwd", "vendor/../../app.py", "nope.js",
                "vendor", ""):
        response = httpx.get(f"{server.url}/static/{bad}", timeout=10)
        assert response.status_code == 404, (bad, response.status_code)
        assert "import" not in response.text


def test_client_spec_gives_the_page_what_the_python_client_uses(server, programs):
    from serve_testlib import TINY

    from polyfhe.program.params import fingerprint_params, seeded_sizes

    program = programs[TINY]
    m = program.manifest
    spec = httpx.get(f"{server.url}/v1/models/{TINY}/client-spec", timeout=10).json()
    assert spec["browser"] is True and spec["program_id"] == m.program_id
    assert spec["identity"] == {"program_id": m.program_id, "params": fingerprint_params(program.params)}
    assert spec["galois_steps"] == list(m.galois_steps)
    assert spec["packing"]["input_slots"] == list(m.input_slots)
    assert spec["packing"]["samples_per_ciphertext"] == m.samples_per_ciphertext
    assert spec["output"]["slots"] == list(m.output_slots)
    assert spec["input"]["range"] == pytest.approx(list(m.input_range)) and spec["input"]["shape"] == list(m.input_shape)
    assert (spec["input"]["channels"], spec["input"]["height"], spec["input"]["width"]) == (1, 8, 8)
    assert spec["classes"] == [f"class {i}" for i in range(4)]
    assert spec["upload"]["public_context_bytes"] == seeded_sizes(program.params, len(m.galois_steps))["public_context"]
    assert "steps" not in spec and "arrays" not in spec  # no weights
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["models"]
    assert all(card["browser"] is True and "node-seal" in card["browser_client"] for card in models)
    missing = httpx.get(f"{server.url}/v1/models/nope/client-spec", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"] == "unknown_model"


def test_programs_of_other_engines_are_cli_only(programs):
    from dataclasses import replace
    from types import SimpleNamespace

    from serve_testlib import TINY

    from polyfhe.serve.clientspec import client_spec
    from polyfhe.serve.registry import Model

    program = programs[TINY]
    lattigo = SimpleNamespace(scheme="ckks", manifest=replace(program.manifest, backend="lattigo"),
                              program_id=program.program_id)
    spec = client_spec(Model("deep", lattigo, {"class_names": ["a", "b"]}))
    assert spec["browser"] is False and spec["reason"].startswith("CLI only") and "Lattigo" in spec["reason"]
    concrete = SimpleNamespace(scheme="concrete", manifest=program.manifest, program_id=program.program_id)
    assert "Concrete ML" in client_spec(Model("tfhe", concrete))["reason"]


def test_card_class_names_and_normalisation_reach_the_spec(programs):
    from serve_testlib import TINY

    from polyfhe.serve.clientspec import client_spec
    from polyfhe.serve.registry import Model

    names = ["cat", "dog", "bird", "fish"]
    spec = client_spec(Model(TINY, programs[TINY], {"class_names": names, "input_mean": 0.5, "input_std": 0.25}))
    assert spec["classes"] == names and spec["input"]["mean"] == 0.5 and spec["input"]["std"] == 0.25
    wrong = client_spec(Model(TINY, programs[TINY], {"class_names": ["only", "two"]}))
    assert wrong["classes"] == [f"class {i}" for i in range(4)]  # a list of the wrong length is not used


def test_every_static_file_ships_in_the_package():
    """package-data must name each file the page loads: an installed (non-editable) polyfhe serves them too."""
    import fnmatch
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["polyfhe.serve"]

    def shipped(path: str) -> bool:
        parts = path.split("/")
        return any(len(g.split("/")) == len(parts) and all(map(fnmatch.fnmatch, parts, g.split("/"))) for g in globs)

    names = [f"static/{name}" for name in static_names()]
    assert names and all(shipped(n) for n in names), [n for n in names if not shipped(n)]


def test_the_page_asks_for_no_favicon_and_the_server_answers_one_without_a_404(server):
    page = httpx.get(f"{server.url}/", timeout=10).text
    assert '<link rel="icon" href="data:,">' in page  # the browser then requests none
    assert httpx.get(f"{server.url}/favicon.ico", timeout=10).status_code == 204
