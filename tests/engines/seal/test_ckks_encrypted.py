"""Encrypted inference end to end on every engine (SEAL, Lattigo): agreement with plaintext, bad bytes rejected."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from ckks_testlib import accuracy, digits, digits_mlp, square_cnn, train

from polyfhe.engines.seal.context import SerializationError
from polyfhe.exporters.ckks import CKKSExportError, export_ckks
from polyfhe.models.registry import create_model
from polyfhe.program.boundary import InputError
from polyfhe.program.wire import WireError

pytestmark = pytest.mark.fhe
log = logging.getLogger(__name__)


def _plain(model, x):
    with torch.no_grad():
        return model(torch.tensor(x, dtype=torch.float32)).numpy().astype(np.float64)


BACKENDS = ["seal", "lattigo"]


@pytest.fixture(scope="module", params=BACKENDS)
def mlp_single(request):
    model = digits_mlp()
    _, _, x, _ = digits()
    prog = export_ckks(model, calibration=x[:128], layout="single", input_shape=(1, 8, 8), backend=request.param)
    assert prog.manifest.backend == request.param
    client = prog.client()
    return model, prog, client, prog.server(client.public_context())


def _encrypted_in_chunks(prog, client, server, x) -> np.ndarray:
    """Logits of all rows of x, ``samples_per_ciphertext`` interleaved samples per encrypted query."""
    lanes = prog.manifest.samples_per_ciphertext
    return np.concatenate([client.decrypt(server.run(client.encrypt(x[i:i + lanes])))
                           for i in range(0, len(x), lanes)])


def test_digits_mlp_single_agrees_on_100_samples(mlp_single):
    model, prog, client, server = mlp_single
    _, _, x, y = digits()
    x = x[:100]
    assert prog.manifest.samples_per_ciphertext > 1  # 64 inputs in 4096 slots: samples share a ciphertext
    enc = _encrypted_in_chunks(prog, client, server, x)
    plain = _plain(model, x)
    err = float(np.abs(enc - plain).max())
    log.info("digits MLP single: max abs error %.3g, plaintext accuracy %.3f", err, accuracy(model, x, y[:100]))
    assert accuracy(model, x, y[:100]) > 0.8  # a real, trained decision is being compared
    assert np.array_equal(enc.argmax(1), plain.argmax(1))
    assert err < 1e-3


@pytest.mark.parametrize("build", [digits_mlp, square_cnn], ids=["mlp", "cnn"])
def test_batch_layout_agrees_on_the_whole_test_split(build):
    model = build()
    _, _, x, y = digits()
    prog = export_ckks(model, calibration=x[:128], layout="batch", input_shape=(1, 8, 8))
    client = prog.client()
    server = prog.server(client.public_context())
    enc = client.decrypt(server.run(client.encrypt(x)))
    plain = _plain(model, x)
    assert enc.shape == plain.shape == (len(x), 10)
    assert accuracy(model, x, y) > 0.7
    assert np.array_equal(enc.argmax(1), plain.argmax(1))
    assert np.abs(enc - plain).max() < 1e-2 * max(1.0, np.abs(plain).max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_square_cnn_single_agrees(backend):
    model = square_cnn()
    _, _, x, _ = digits()
    prog = export_ckks(model, calibration=x[:128], input_shape=(1, 8, 8), backend=backend)
    client = prog.client()
    server = prog.server(client.public_context())
    enc = np.concatenate([client.decrypt(server.run(client.encrypt(row))) for row in x[:12]])
    plain = _plain(model, x[:12])
    assert np.array_equal(enc.argmax(1), plain.argmax(1))
    assert np.abs(enc - plain).max() < 1e-2 * max(1.0, np.abs(plain).max())


def test_one_ciphertext_holds_several_samples_or_one(mlp_single):
    """Interleaved samples give each sample's own logits; a one-sample program gives the same numbers."""
    model, prog, client, server = mlp_single
    _, _, x, _ = digits()
    lanes = prog.manifest.samples_per_ciphertext
    rows = x[:lanes - 3]  # a partly filled ciphertext: unused lanes must not leak into the used ones
    enc = client.decrypt(server.run(client.encrypt(rows)))
    assert enc.shape == (len(rows), 10)
    np.testing.assert_allclose(enc, _plain(model, rows), atol=1e-3)
    with pytest.raises(InputError, match=f"chunks of {lanes}"):
        client.encrypt(x[: lanes + 1])
    one = export_ckks(model, calibration=x[:128], input_shape=(1, 8, 8), samples_per_ciphertext=1,
                      backend=prog.manifest.backend)
    assert one.manifest.samples_per_ciphertext == 1
    if prog.manifest.backend == "seal":  # SEAL runs the plan's own rotations; Lattigo re-plans them (BSGS ratio)
        assert {s // lanes for s in prog.manifest.galois_steps} == set(one.manifest.galois_steps)
    np.testing.assert_allclose(one.run_plain(x[:5]), prog.run_plain(x[:5]), atol=1e-9)
    single_client = one.client()
    got = single_client.decrypt(one.server(single_client.public_context()).run(single_client.encrypt(x[0])))
    np.testing.assert_allclose(got, enc[:1], atol=1e-3)


def test_samples_per_ciphertext_must_fit():
    _, _, x, _ = digits()
    with pytest.raises(CKKSExportError, match="powers of two up to"):
        export_ckks(digits_mlp(), calibration=x[:32], input_shape=(1, 8, 8), samples_per_ciphertext=3)
    with pytest.raises(CKKSExportError, match="powers of two up to"):
        export_ckks(digits_mlp(), calibration=x[:32], input_shape=(1, 8, 8), samples_per_ciphertext=1 << 20)
    with pytest.raises(CKKSExportError, match="layout='single'"):
        export_ckks(digits_mlp(), calibration=x[:32], input_shape=(1, 8, 8), layout="batch",
                    samples_per_ciphertext=4)


ZOO_SAMPLES = 256  # a few hundred digits test images, 16 per ciphertext


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 16 ciphertexts of 16 images: 10-25 min per recipe on 2 cores
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["monet_fhe_bn", "cpolynext_fhe_bn"])
def test_trained_zoo_recipe_encrypted_agrees_on_256_test_images(name, backend):
    """The FHE-sized recipes (8x8 digits variant), trained, folded and encrypted: argmax equal on 256 images."""
    torch.manual_seed(0)
    model = train(create_model(name, img_size=8), epochs=15, lr=0.002)
    _, _, x, y = digits()
    x, y = x[:ZOO_SAMPLES], y[:ZOO_SAMPLES]
    prog = export_ckks(model, calibration=x[:128], backend=backend)
    assert prog.params.security == "tc128" and prog.params.levels <= 19
    plain = _plain(model, x)
    np.testing.assert_allclose(prog.run_plain(x), plain, rtol=1e-3, atol=1e-4)
    client = prog.client()
    server = prog.server(client.public_context())
    enc = _encrypted_in_chunks(prog, client, server, x)
    err = float(np.abs(enc - plain).max())
    log.info("%s single, %d per ciphertext: %d samples, max abs error %.3g, accuracy %.3f", name,
             prog.manifest.samples_per_ciphertext, len(x), err, accuracy(model, x, y))
    assert accuracy(model, x, y) > 0.8
    assert np.array_equal(enc.argmax(1), plain.argmax(1))
    assert err < 1e-2 * max(1.0, np.abs(plain).max())


# ---------------------------------------------------------------------------------------------------------------
# bad bytes and bad inputs
# ---------------------------------------------------------------------------------------------------------------
def test_server_refuses_secret_context(mlp_single):
    _, prog, client, _ = mlp_single
    with pytest.raises(WireError, match="secret key"):
        prog.server(client.secret_context())


@pytest.mark.parametrize("mangle", [
    lambda b: b"garbage" * 20,
    lambda b: b[: len(b) // 2],
    lambda b: b[:40] + bytes(len(b) - 40),
    lambda b: b + b"x",
], ids=["garbage", "truncated", "zeroed", "trailing"])
def test_bad_ciphertexts_are_rejected(mlp_single, mangle):
    _, _, client, server = mlp_single
    _, _, x, _ = digits()
    good = client.encrypt(x[0])
    with pytest.raises((WireError, SerializationError)):
        server.run(mangle(good))
    assert client.decrypt(server.run(good)).shape == (1, 10)  # the server keeps serving


def test_ciphertext_and_context_from_another_program_rejected(mlp_single):
    _, prog, client, server = mlp_single
    _, _, x, _ = digits()
    other = export_ckks(square_cnn(), calibration=x[:32], input_shape=(1, 8, 8), backend=prog.manifest.backend)
    other_client = other.client()
    with pytest.raises(WireError, match="program"):
        server.run(other_client.encrypt(x[0]))
    with pytest.raises(WireError, match="program"):
        prog.server(other_client.public_context())
    with pytest.raises(WireError):
        client.decrypt(other_client.encrypt(x[0]))


def test_bad_inputs_have_clear_errors(mlp_single):
    _, _, client, _ = mlp_single
    with pytest.raises(InputError, match="64 values"):
        client.encrypt(np.zeros(63))
    with pytest.raises(InputError, match="dtype"):
        client.encrypt(np.array(["a"] * 64))
    with pytest.raises(InputError, match="NaN"):
        client.encrypt(np.full(64, np.nan))
    with pytest.raises(InputError, match="outside the range program"):  # refused, not encrypted to garbage
        client.encrypt(np.full(64, 50.0))

