"""Replicated (im2col) input packing: an overlapping strided stem read as channel mixing (``replicate.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ckks_testlib import StemNet
from torch import nn

import polyfhe
from polyfhe.engines.lattigo.format import lower_program, run_container_plain
from polyfhe.program.manifest import ProgramError, ProgramManifest
from polyfhe.program.slot_layout import pack_single, unpack_single


def _model(seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    model = StemNet(**kwargs)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.2, 0.2)
        model.bn.running_var.uniform_(0.5, 1.5)
        for p in model.parameters():
            p.mul_(0.5)
    return model.double().eval()


def _inputs(n: int, seed: int = 1, size: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.0, 1.0, size=(n, 1, size, size))


def _torch(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def _lattigo_plain(prog, x: np.ndarray) -> np.ndarray:
    data = lower_program(prog, [1 << b for b in prog.params.coeff_mod_bits[:-1]]).data
    lanes = prog.manifest.samples_per_ciphertext
    flat = x.reshape(len(x), -1)
    return np.concatenate([unpack_single(prog.manifest, run_container_plain(data, pack_single(prog.manifest, c)), len(c))
                           for c in (flat[i:i + lanes] for i in range(0, len(x), lanes))])


@pytest.fixture(scope="module")
def programs():
    model, calib = _model(), _inputs(32)
    packed = polyfhe.export(model, target="ckks", calibration=calib, input_shape=(1, 16, 16))
    once = polyfhe.export(model, target="ckks", calibration=calib, input_shape=(1, 16, 16), replicate_input=False)
    return model, packed, once


def test_overlapping_stem_packs_each_window_and_needs_fewer_diagonals(programs):
    _model, packed, once = programs
    gather = np.asarray(packed.manifest.input_gather)
    assert len(gather) == len(packed.manifest.input_slots) > 16 * 16  # pixels of overlapping windows repeat
    assert set(gather.tolist()) == set(range(16 * 16)) and np.bincount(gather).max() >= 4
    assert len(set(packed.manifest.input_slots)) == len(gather)  # one value per slot
    assert once.manifest.input_gather == ()
    assert packed.manifest.info["plaintext_diagonals"] < once.manifest.info["plaintext_diagonals"]
    # the ring, the levels and the samples per ciphertext are what packing each value once gives
    assert packed.params == once.params
    assert packed.manifest.samples_per_ciphertext == once.manifest.samples_per_ciphertext


def test_replicated_packing_computes_the_model(programs):
    model, packed, once = programs
    x = _inputs(2 * packed.manifest.samples_per_ciphertext + 1, seed=5)
    want = _torch(model, x)
    scale = float(np.abs(want).max())
    for prog in (packed, once):
        assert np.abs(prog.run_plain(x) - want).max() <= 1e-6 * scale
    assert np.abs(_lattigo_plain(packed, x) - want).max() <= 1e-6 * scale


@pytest.mark.fhe
def test_replicated_packing_runs_encrypted(programs):
    model, packed, _ = programs
    x = _inputs(2, seed=9)
    client = packed.client()
    server = packed.server(client.public_context())
    got = client.decrypt(server.run(client.encrypt(x)))
    np.testing.assert_allclose(got, packed.run_plain(x), rtol=0, atol=1e-3)
    np.testing.assert_allclose(got, _torch(model, x), rtol=0, atol=1e-3)


def test_the_gather_survives_save_and_load_and_a_bad_one_is_refused(programs, tmp_path):
    _, packed, once = programs
    packed.save(tmp_path / "packed")
    loaded = polyfhe.load_program(tmp_path / "packed")
    assert loaded.manifest.input_gather == packed.manifest.input_gather
    assert loaded.program_id == packed.program_id
    assert "input_gather" not in once.manifest.to_dict()  # programs packed once keep their old form (and ids)
    d = packed.manifest.to_dict()
    for bad in ([16 * 16] + d["input_gather"][1:], [-1] + d["input_gather"][1:], d["input_gather"][:-1]):
        with pytest.raises(ProgramError, match="input_gather"):
            ProgramManifest.from_dict({**d, "input_gather": bad})


def test_a_patch_embedding_copies_no_pixel_twice():
    """Stride == kernel: every pixel feeds one token, so no window overlaps and nothing is replicated; the
    packing is at most reordered (rank-major per token) when that is cheaper for the dilated branch."""
    model = _model(kernel=4, stride=4)
    kwargs = {"target": "ckks", "calibration": _inputs(16), "input_shape": (1, 16, 16)}
    packed, once = polyfhe.export(model, **kwargs), polyfhe.export(model, replicate_input=False, **kwargs)
    assert sorted(packed.manifest.input_gather) in ([], list(range(16 * 16)))
    assert packed.manifest.info["plaintext_diagonals"] <= once.manifest.info["plaintext_diagonals"]
    x = _inputs(3, seed=2)
    np.testing.assert_allclose(packed.run_plain(x), _torch(model, x), rtol=0, atol=1e-9)


def test_the_circuit_pass_keeps_every_register_and_the_factored_circuit_is_packed_alike():
    from polyfhe.exporters.ckks import to_onnx_model
    from polyfhe.exporters.ckks.lower import factoring_sites, lower_onnx
    from polyfhe.exporters.ckks.replicate import replicate_input
    from polyfhe.exporters.ckks.spend import spend_levels

    model = _model()
    proto, _ = to_onnx_model(model, (1, 16, 16))
    merged = lower_onnx(proto)
    packed = replicate_input(merged)
    assert packed is not merged and packed.input_gather is not None and merged.input_gather is None
    assert replicate_input(packed) is packed and packed.input_size == merged.input_size == 256
    x = _inputs(3, seed=4)
    want, got = merged.evaluate(x, keep=True), packed.evaluate(x, keep=True)
    assert set(want) == set(got)
    for reg in want:
        if reg:  # register 0 is the input itself in one, its replicated windows in the other
            np.testing.assert_allclose(got[reg], want[reg], rtol=0, atol=1e-9 * max(1.0, np.abs(want[reg]).max()))
    assert factoring_sites(proto)
    spent = spend_levels(proto, packed, packed.depth + 4)
    assert spent.circuit.input_gather is not None  # merged or factored, the input is packed the same way


def test_export_command_packs_replicated_unless_told_not_to(tmp_path, capsys):
    from polyfhe.cli import main

    model = _model()
    polyfhe.export(model.float(), target="onnx", path=tmp_path / "stem.onnx", input_shape=(1, 16, 16))
    np.save(tmp_path / "calib.npy", _inputs(16).astype(np.float32))
    base = ["export", str(tmp_path / "stem.onnx"), "--target", "ckks", "--calibration", str(tmp_path / "calib.npy")]
    assert main([*base, "--out", str(tmp_path / "packed")]) == 0
    assert "replicated (im2col)" in capsys.readouterr().out
    assert main([*base, "--out", str(tmp_path / "once"), "--no-replicate-input"]) == 0
    assert "each of the 256 values once" in capsys.readouterr().out
    assert polyfhe.load_program(tmp_path / "packed").manifest.input_gather
    assert not polyfhe.load_program(tmp_path / "once").manifest.input_gather
