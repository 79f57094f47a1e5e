"""Programs saved by the untyped step format still load, hash to their id, run and re-serialise byte for byte.

The fixtures in ``data/`` were written once, before steps were typed, by exporting
``nn.Sequential(Flatten, Linear(64, 8), Square, Linear(8, 10))`` (``torch.manual_seed(0)``, trained by
``ckks_testlib.train`` on the digits) with ``polyfhe.export(model, target="ckks", calibration=x[:64],
input_shape=(1, 8, 8), layout=..., backend="seal")`` on digits images ``x``, for the single and the batch layout
(the compiler chose N=8192), saving the program, ``x.npy`` = the first 4 test images and
``expected.npy`` = ``program.run_plain(x)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from polyfhe.program.ckks_program import load_program
from polyfhe.program.manifest import ProgramError, ProgramManifest, compute_program_id
from polyfhe.program.steps import BootstrapAttrs, LinearAttrs, MatMulAttrs, Step, Term

DATA = Path(__file__).parent / "data"
FIXTURES = ["legacy_program", "legacy_batch_program"]
IDS = {"legacy_program": "b0e0b9de994ae6f60f7a2aa7", "legacy_batch_program": "d61e5a24273706b640afa72a"}


@pytest.mark.parametrize("name", FIXTURES)
def test_legacy_program_loads_with_its_id(name: str) -> None:
    program = load_program(DATA / name)
    assert program.program_id == IDS[name] == compute_program_id(program.manifest, program.arrays)


@pytest.mark.parametrize("name", FIXTURES)
def test_legacy_program_runs_plain_as_before(name: str) -> None:
    program = load_program(DATA / name)
    x, expected = np.load(DATA / name / "x.npy"), np.load(DATA / name / "expected.npy")
    np.testing.assert_allclose(program.run_plain(x), expected, rtol=1e-12, atol=1e-12)


def test_legacy_program_runs_encrypted_on_seal() -> None:
    program = load_program(DATA / "legacy_program")
    x, expected = np.load(DATA / "legacy_program" / "x.npy"), np.load(DATA / "legacy_program" / "expected.npy")
    client = program.client()
    server = program.server(client.public_context())
    out = client.decrypt(server.run(client.encrypt(x)))
    np.testing.assert_allclose(out, expected, atol=1e-3)


@pytest.mark.parametrize("name", FIXTURES)
def test_steps_round_trip_to_identical_json(name: str) -> None:
    text = (DATA / name / "manifest.json").read_text()
    raw = json.loads(text)
    for d in raw["steps"]:
        step = Step.from_dict(d)
        assert Step.from_dict(step.to_dict()) == step
        assert json.dumps(step.to_dict()) == json.dumps(d)
    assert json.dumps(ProgramManifest.from_dict(raw).to_dict(), indent=1) == text


# the JSON the compiler writes for the ops the fixtures lack (batch MatMul, a bootstrap)
OTHER_STEPS = [
    {"op": "matmul", "out": 4, "inputs": [2, 3], "size": 6, "level": 2,
     "attrs": {"a_shape": [2, 3], "b_shape": [3, 3], "out_shape": [2, 3], "label": "/attn/MatMul"}},
    {"op": "bootstrap", "out": 9, "inputs": [5], "size": 0, "level": 0,
     "attrs": {"slots": 128, "constant": -0.25, "postscale": 3, "range": [-2.5, 3.0], "cut": 7}},
    {"op": "linear", "out": 6, "inputs": [5], "size": 4, "level": 1,
     "attrs": {"period": 8, "baby": 2, "terms": [{"input": 5, "diags": "s1.t0.diags", "ks": "s1.t0.ks"}],
               "bias": None, "label": ""}},  # an older single-layout map: no "space", no "rescale_giants"
    {"op": "mul", "out": 7, "inputs": [6, 6], "size": 4, "level": 2, "attrs": {}},
]


@pytest.mark.parametrize("d", OTHER_STEPS, ids=[d["op"] for d in OTHER_STEPS])
def test_other_ops_round_trip(d: dict) -> None:
    step = Step.from_dict(d)
    assert json.dumps(step.to_dict()) == json.dumps(d) and Step.from_dict(step.to_dict()) == step


def test_typed_fields() -> None:
    matmul, boot, linear = (Step.from_dict(d) for d in OTHER_STEPS[:3])
    assert matmul.matmul == MatMulAttrs((2, 3), (3, 3), (2, 3), "/attn/MatMul")
    assert boot.bootstrap == BootstrapAttrs(128, -0.25, 3, (-2.5, 3.0), 7)
    assert isinstance(linear.attrs, LinearAttrs) and linear.linear.reduction_space(64) == 64
    assert linear.terms == (Term.from_dict({"input": 5, "diags": "s1.t0.diags", "ks": "s1.t0.ks"}),)
    assert linear.array_names() == ["s1.t0.diags", "s1.t0.ks"] and linear.reads() == [5]
    assert linear.remapped({5: 8}).reads() == [8]
    with pytest.raises(ProgramError, match="not Linear"):
        _ = matmul.linear


@pytest.mark.parametrize("path, bad, match", [
    (("attrs",), {"shift": 3}, "unknown key 'shift'"),
    (("attrs", "terms", 0), {"rows": "x"}, "unknown key 'rows' in a linear term"),
    ((), {"op": "conv"}, "unknown step op 'conv'"),
    (("attrs",), {"baby": "2"}, "'baby' must be an integer"),
])
def test_unknown_or_wrong_step_fields_are_refused(path: tuple, bad: dict, match: str) -> None:
    raw = json.loads((DATA / "legacy_program" / "manifest.json").read_text())
    target = raw["steps"][0]
    for key in path:
        target = target[key]
    target.update(bad)
    with pytest.raises(ProgramError, match=match):
        ProgramManifest.from_dict(raw)
