"""What a new user meets first around the server: each skipped program named once, the engine on every card and
in ``client models``, key estimates that match the upload, and errors that say what to do next."""

from __future__ import annotations

import re

import httpx
import pytest
from serve_testlib import TINY, free_port

from polyfhe.cli import main
from polyfhe.program.ckks_program import load_program
from polyfhe.program.manifest import ProgramError
from polyfhe.serve.http_client import ServeClient, ServeError

pytestmark = pytest.mark.fhe


def test_a_skipped_program_is_reported_once(server):
    log = server.log_text()
    assert "skipped broken" in log
    # once at the default level: not by the registry's warning in the server and in each worker process, and again
    # by the command (the test server runs with -v, which adds INFO records)
    reports = [line for line in log.splitlines() if "broken" in line and not re.search(r"\b(INFO|DEBUG) ", line)]
    assert len(reports) == 1, reports


def test_cards_and_client_models_name_the_engine(server, capsys):
    cards = {m["name"]: m for m in httpx.get(f"{server.url}/v1/models").json()["models"]}
    assert cards[TINY]["engine"] == "seal"
    assert main(["client", "models", "--server", server.url]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith(TINY))
    assert line.startswith(f"{TINY} (CKKS on seal):")


def test_key_estimates_match_the_real_upload(server, programs):
    """The card's and the export table's public-context estimate is what the client uploads (SEAL compresses its
    keys: the uncompressed size overstated it by about a quarter)."""
    from polyfhe.program.engines import public_context_bytes

    program = programs[TINY]
    real = len(program.client().public_context())
    estimate = public_context_bytes(program.manifest)
    assert abs(estimate - real) / real < 0.03, (estimate, real)
    card = {m["name"]: m for m in httpx.get(f"{server.url}/v1/models").json()["models"]}[TINY]
    assert card["key_sizes"]["estimated_public_context_bytes"] == estimate
    assert card["key_sizes"]["estimated_decoded_public_context_bytes"] > real

    from rich.console import Console

    from polyfhe.commands.export import summary_table

    console = Console(width=200, record=True)
    console.print(summary_table(program, programs["root"] / TINY, TINY))
    text = console.export_text()
    assert f"~{estimate / 1e6:.2f} MB as uploaded" in text, text


def test_a_folder_that_does_not_exist_is_named_as_such(tmp_path, capsys):
    missing = tmp_path / "no-such-program"
    with pytest.raises(ProgramError, match="does not exist"):
        load_program(missing)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ProgramError, match="is a file, not a program folder"):
        load_program(tmp_path / "file")
    (tmp_path / "x.npy").write_bytes(b"")
    assert main(["run", str(missing), "--input", str(tmp_path / "x.npy")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "manifest.json is missing" not in err


def test_connection_refused_says_the_server_may_be_down(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    with ServeClient(url) as api, pytest.raises(ServeError, match="is the server running") as caught:
        api.models()
    assert caught.value.status == 0 and "polyfhe serve" in str(caught.value)
    assert main(["client", "models", "--server", url]) == 1
    assert "is the server running" in capsys.readouterr().err
