"""``polyfhe client infer`` and ``RemoteSession.infer_many``: stacks larger than one ciphertext go in several
requests; inputs outside the calibrated range are refused before anything is encrypted, or clipped with a warning."""

from __future__ import annotations

import json

import numpy as np
import pytest
from serve_testlib import TINY

from polyfhe.cli import main
from polyfhe.program import boundary
from polyfhe.program.boundary import InputError
from polyfhe.serve.http_client import ServeClient


@pytest.mark.fhe
def test_client_infer_sends_a_large_stack_in_chunks(server, programs, tmp_path, capsys):
    lanes = programs[TINY].manifest.samples_per_query
    x = np.random.default_rng(2).random((lanes + 3, 1, 8, 8))
    np.save(tmp_path / "many.npy", x)
    assert main(["client", "infer", "--server", server.url, "--model", TINY, str(tmp_path / "many.npy"),
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == lanes + 3 and [r["sample"] for r in rows] == list(range(lanes + 3))
    assert [r["request"] for r in rows] == [0] * lanes + [1] * 3
    assert [r["request_samples"] for r in rows] == [lanes] * lanes + [3] * 3
    plain = programs[TINY].run_plain(x)
    np.testing.assert_allclose([r["logits"] for r in rows], plain, atol=1e-3)


@pytest.mark.fhe
def test_client_infer_refuses_uint8_images_and_clips_on_request(server, programs, tmp_path, capsys):
    x = np.random.default_rng(3).random((2, 1, 8, 8))
    np.save(tmp_path / "u8.npy", (x * 255).astype(np.uint8))
    assert main(["client", "infer", "--server", server.url, "--model", TINY, str(tmp_path / "u8.npy")]) == 2
    err = capsys.readouterr().err
    assert "outside the range" in err and "divide them by 255 first" in err and "--clip" not in err  # not clipping
    wide = x.copy()
    wide[0, 0, 0, 0] = 3.0
    np.save(tmp_path / "wide.npy", wide)
    with pytest.warns(boundary.NumericalWarning, match="clipped 1 of 128 input values"):
        assert main(["client", "infer", "--server", server.url, "--model", TINY, str(tmp_path / "wide.npy"),
                     "--clip", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    plain = programs[TINY].run_plain(np.clip(wide, *programs[TINY].manifest.input_range))
    np.testing.assert_allclose([r["logits"] for r in rows], plain, atol=1e-3)


@pytest.mark.fhe
def test_infer_many_refuses_out_of_range_before_any_request(server, programs):
    with ServeClient(server.url) as api, api.open_session(TINY) as session:
        with pytest.raises(InputError, match="divide them by 255"):
            session.infer_many(np.full((3, 1, 8, 8), 200, dtype=np.uint8))
        with pytest.warns(boundary.NumericalWarning, match="clipped 64 of 64"):
            result = session.infer(np.full((1, 8, 8), 2.0), clip=True)
    hi = programs[TINY].manifest.input_range[1]
    np.testing.assert_allclose(result.logits, programs[TINY].run_plain(np.full((1, 8, 8), hi))[0], atol=1e-3)
