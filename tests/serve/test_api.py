"""The happy path against a real server process: model cards, sessions, encrypted answers, CLI client."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest
from PIL import Image
from serve_testlib import OTHER, TINY

from polyfhe.cli import main
from polyfhe.program.boundary import InputError
from polyfhe.serve.http_client import ServeClient, ServeError

pytestmark = pytest.mark.fhe


def test_health_models_and_manifest(server, programs):
    health = httpx.get(f"{server.url}/healthz").json()
    assert health["status"] == "ok" and health["models"] == [OTHER, TINY]  # "broken" is skipped
    assert "skipped broken" in server.log_text()
    body = httpx.get(f"{server.url}/v1/models").json()
    cards = {m["name"]: m for m in body["models"]}
    tiny, prog = cards[TINY], programs[TINY]
    assert tiny["program_id"] == prog.program_id and tiny["input_shape"] == [1, 1, 8, 8]
    assert tiny["classes"] == 4 and tiny["degree"] == 2 and tiny["levels"] == prog.params.levels
    assert tiny["params"] == prog.params.to_dict() and tiny["galois_keys"] == len(prog.manifest.galois_steps)
    assert tiny["key_sizes"]["estimated_public_context_bytes"] > 1e6
    assert tiny["accuracy"] == 0.875 and tiny["dataset"] == "random 8x8"
    assert cards[OTHER]["accuracy"] is None and cards[OTHER]["params"]["scale_bits"] == 35
    assert body["limits"]["max_ciphertext_bytes"] == 1 << 20
    manifest = httpx.get(f"{server.url}/v1/models/{TINY}/manifest").json()
    assert manifest["program_id"] == prog.program_id and "arrays" not in manifest


def test_session_infer_matches_plaintext_program(server, programs, samples):
    x, plain = samples
    with ServeClient(server.url) as api, api.open_session(TINY) as session:
        results = [session.infer(x[i]) for i in range(3)]
        sid = session.id
        assert httpx.get(f"{server.url}/healthz").json()["sessions"] >= 1
    for i, r in enumerate(results):
        np.testing.assert_allclose(r.logits, plain[i], atol=1e-3)
        assert r.label == int(plain[i].argmax()) and 0 < r.confidence <= 1
        assert r.bytes_sent > 1e5 and r.bytes_received > 1e4 and r.timings["server"] > 0
    # the session was deleted on exit: its id is unknown now
    response = httpx.post(f"{server.url}/v1/sessions/{sid}/infer", content=b"x")
    assert response.status_code == 404 and response.json()["error"] == "unknown_session"
    # observed upload size now shows on the card
    cards = {m["name"]: m for m in httpx.get(f"{server.url}/v1/models").json()["models"]}
    assert cards[TINY]["key_sizes"]["observed_public_context_bytes"] == session.context_bytes


def test_infer_many_shares_ciphertexts_and_matches_plaintext(server, programs, samples):
    x, plain = samples
    holds = programs[TINY].manifest.samples_per_query
    assert holds >= 4  # the tiny program interleaves many samples per ciphertext
    with ServeClient(server.url) as api, api.open_session(TINY) as session:
        results = session.infer_many(x)
        with pytest.raises(InputError, match="one sample.*infer_many"):
            session.infer(x[:2])
        with pytest.raises(InputError, match="non-empty stack"):
            session.infer_many(x[0, 0, 0])
    assert len(results) == len(x) and {r.request_samples for r in results} == {min(len(x), holds)}
    for r, ref in zip(results, plain, strict=True):
        np.testing.assert_allclose(r.logits, ref, atol=1e-3)
        assert r.label == int(ref.argmax())
    assert len({id(r.timings) for r in results}) == -(-len(x) // holds)  # one request per ciphertext


def test_metrics_and_stats(server):
    text = httpx.get(f"{server.url}/metrics").text
    assert "# TYPE polyfhe_requests_total counter" in text
    assert 'polyfhe_requests_total{route="/v1/sessions/{session_id}/infer",status="200"}' in text
    assert "polyfhe_inference_seconds_count" in text and "process_resident_memory_bytes" in text
    stats = httpx.get(f"{server.url}/v1/stats").json()
    assert stats["inferences_total"] >= 3 and stats["rss_bytes"] > 0 and stats["workers"]["workers"] >= 1


def test_web_page_is_served(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "What this server cannot see" in page.text and "/v1/stats" in page.text


def test_cli_client_json_and_text(server, programs, samples, tmp_path, capsys):
    x, plain = samples
    np.save(tmp_path / "a.npy", x[0])
    np.savez(tmp_path / "b.npz", x=x[1:3])  # a stack: as many samples as one ciphertext holds, one request each
    assert main(["client", "infer", "--server", server.url, "--model", TINY, str(tmp_path / "a.npy"),
                 str(tmp_path / "b.npz"), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    holds = getattr(programs[TINY].manifest, "samples_per_ciphertext", 1)
    assert len(rows) == 1 + min(2, holds)
    assert [(r["input"].endswith("a.npy"), r["sample"]) for r in rows][:2] == [(True, 0), (False, 0)]
    assert [(r["request"], r["request_samples"]) for r in rows] == [(0, 1)] + [(1, min(2, holds))] * min(2, holds)
    for row, ref in zip(rows, (plain[0], plain[1], plain[2])):
        np.testing.assert_allclose(row["logits"], ref, atol=1e-3)
        assert row["class"] == int(ref.argmax()) and row["bytes_sent"] > 0 and row["context_bytes"] > 1e6
        assert set(row["timings"]) >= {"encrypt", "request", "server", "decrypt"}
    img = (x[3, 0] * 255).round().astype(np.uint8)
    Image.fromarray(img, mode="L").save(tmp_path / "c.png")
    assert main(["client", "infer", "--server", server.url, "--model", TINY, str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "class " in out and "confidence" in out and "bytes sent" in out and "public context" in out


def test_cli_client_errors_are_clear(server, tmp_path, capsys):
    np.save(tmp_path / "bad.npy", np.zeros((3, 3)))
    assert main(["client", "infer", "--server", server.url, "--model", TINY, str(tmp_path / "bad.npy")]) == 2
    assert re.search(r"takes (one sample|up to \d+ samples) of shape", capsys.readouterr().err)
    assert main(["client", "infer", "--server", server.url, "--model", "nope", str(tmp_path / "bad.npy")]) == 1
    assert "unknown_model" in capsys.readouterr().err
    assert main(["client", "models", "--server", "http://127.0.0.1:9", "--json"]) == 1
    assert "unreachable" in capsys.readouterr().err
    assert main(["client", "models", "--server", server.url]) == 0
    assert "tiny (CKKS on seal):" in capsys.readouterr().out


def test_python_client_refuses_insecure_manifest(server, programs):
    raw = programs[TINY].manifest.to_dict()
    raw["params"]["security"] = "none"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=raw)

    with (ServeClient("http://fake", transport=httpx.MockTransport(handler)) as api,
          pytest.raises(ServeError, match="below 128-bit security")):
        api.manifest(TINY)


def test_warm_server_encodes_every_plaintext_before_serving(programs, samples, tmp_path):
    """``polyfhe serve --warm``: each program's plaintexts are encoded at startup, as many as a first query needs."""
    from serve_testlib import start_server

    x, plain = samples
    warm = start_server(programs["root"], tmp_path / "server.log", "--warm")
    try:
        text = warm.log_text()
        for name in (TINY, OTHER):
            planned = programs[name].manifest.info["planned"]["encodes_cold"]
            assert re.search(rf"warmed {name}: {planned} plaintexts encoded in [0-9.]+ s", text), text
        with ServeClient(warm.url) as api, api.open_session(TINY) as session:
            np.testing.assert_allclose(session.infer(x[0]).logits, plain[0], atol=1e-3)
    finally:
        warm.stop()
