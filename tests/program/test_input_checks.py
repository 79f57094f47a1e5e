"""The client's input checks: the calibrated range (refused, tolerated or clipped with a warning), batches of any
size through ``encrypt_batch`` and ``decrypt`` of a list, and the noise tolerance a program records."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testlib.ckks_testlib import export_square_mlp

from polyfhe.program import boundary
from polyfhe.program.boundary import InputError, check_input


@pytest.fixture(scope="module")
def program():
    return export_square_mlp(12, 4)


def test_values_past_the_calibrated_range_are_refused_with_how_to_fix(program):
    m = program.manifest
    lo, hi = m.input_range
    x = np.random.default_rng(0).uniform(lo, hi, (2, 1, 8, 8))
    assert check_input(m, x).shape == (2, 64)
    x[0, 0, 0, 0] = hi + 0.04 * (hi - lo)  # within the 5% tolerated
    check_input(m, x)
    with pytest.raises(InputError, match=r"span \[.*\], outside the range .* takes.*divide them by 255"):
        check_input(m, (x * 255).astype(np.uint8))
    with pytest.raises(InputError, match="Normalise inputs the way the calibration data was"):
        check_input(m, x - 5.0)


def test_clip_clips_and_warns_how_many(program):
    m = program.manifest
    lo, hi = m.input_range
    x = np.full((1, 8, 8), 0.5)
    x[0, 0, :2] = [3.0, -2.0]
    with pytest.warns(boundary.NumericalWarning, match="clipped 2 of 64 input values") as record:
        arr = check_input(m, x, clip=True)
    assert record[0].filename == __file__  # the warning names the caller's line
    assert arr.max() == hi and arr.min() == lo


@pytest.mark.fhe
def test_encrypt_batch_chunks_and_decrypt_joins(program):
    lanes = program.manifest.samples_per_query
    x = np.random.default_rng(1).random((2 * lanes + 5, 1, 8, 8))
    client = program.client()
    with pytest.raises(InputError, match=f"exceed the {lanes}.*encrypt_batch"):
        client.encrypt(x)
    queries = client.encrypt_batch(x)
    assert len(queries) == 3
    assert [len(c) for c in boundary.split_queries(program.manifest, x)] == [lanes, lanes, 5]
    server = program.server(client.public_context())
    logits = client.decrypt([server.run(q) for q in queries])
    assert logits.shape == (len(x), 4)
    plain = program.run_plain(x)
    from polyfhe.program.noise import error_tolerance

    tolerance, source = error_tolerance(program.params, program.manifest.info)
    assert source == "compiler" and np.abs(logits - plain).max() <= tolerance
    with pytest.raises(InputError, match="non-empty list"):
        client.decrypt([])


def test_the_compiler_records_a_tolerance_and_old_programs_fall_back_to_the_parameters(program):
    from polyfhe.program.noise import error_tolerance

    noise = program.manifest.info["noise"]
    assert 0 < noise["simulated"] < noise["tolerance"] < 1e-2 * noise["output_abs_max"]
    fallback, source = error_tolerance(program.params, {})
    assert source == "parameters" and noise["tolerance"] < fallback < 1e3  # far below an overflow's garbage


@pytest.mark.fhe
def test_lattigo_client_encrypts_batches_and_checks_the_range():
    from polyfhe.program.engine_api import BackendUnavailable
    from polyfhe.program.engines import get_backend

    try:
        get_backend("lattigo").available()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    program = export_square_mlp(12, 4, backend="lattigo")
    lanes = program.manifest.samples_per_query
    x = np.random.default_rng(2).random((lanes + 1, 1, 8, 8))
    client = program.client()
    with pytest.raises(InputError, match="divide them by 255"):
        client.encrypt((x[:1] * 255).astype(np.uint8))
    with pytest.raises(InputError, match="encrypt_batch"):
        client.encrypt(x)
    server = program.server(client.public_context())
    logits = client.decrypt([server.run(q) for q in client.encrypt_batch(x)])
    np.testing.assert_allclose(logits, program.run_plain(x), atol=1e-3)


@pytest.mark.fhe
def test_a_program_exported_before_the_noise_record_runs_against_its_parameters_bound(capsys):
    import json

    from polyfhe.cli import main

    legacy = Path(__file__).parent / "data" / "legacy_program"
    assert "noise" not in json.loads((legacy / "manifest.json").read_text())["info"]
    assert main(["run", str(legacy), "--input", str(legacy / "x.npy"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tolerance_source"] == "parameters" and result["agrees"] and result["queries"] == 1


def test_eight_bit_pixels_are_told_to_divide_and_not_offered_clipping(program):
    m = program.manifest
    pixels = (np.random.default_rng(2).random((1, 8, 8)) * 255).astype(np.uint8)
    with pytest.raises(InputError) as refused:
        check_input(m, pixels)
    message = str(refused.value)
    assert "divide them by 255 first" in message and "clip=True" not in message


def test_a_sample_of_another_shape_is_not_read_as_a_batch(program):
    """(3, 8, 8) for a one-channel (1, 8, 8) program is not three samples, nor an invitation to batch them."""
    m = program.manifest
    x = np.random.default_rng(3).uniform(*m.input_range, (3, 8, 8))
    with pytest.raises(InputError) as refused:
        check_input(m, x)
    message = str(refused.value)
    assert "(3, 8, 8)" in message and "(1, 8, 8)" in message and "(n, 1, 8, 8)" in message
    assert "one image with 3 channels" in message and "encrypt_batch" not in message
    assert check_input(m, x.reshape(-1, 1, 8, 8)).shape == (3, 64)  # the batch it names is accepted
    assert check_input(m, x.reshape(3, 64)).shape == (3, 64)
    with pytest.raises(InputError, match="nor a batch"):
        check_input(m, np.zeros((2, 2, 8, 8)))
