"""The engine registry and the Lattigo backend's own contracts (the shared encrypted tests run on both engines)."""

from __future__ import annotations

import numpy as np
import pytest
from ckks_testlib import digits, digits_mlp

from polyfhe.export.ckks import CKKSExportError, export_ckks
from polyfhe.fhe.backends import BACKEND_NAMES, get_backend
from polyfhe.fhe.backends.lattigo import check_security
from polyfhe.fhe.backends.lattigo_format import bsgs_rotations, galois_element, parse_container
from polyfhe.fhe.params import CKKSParams, ParameterError
from polyfhe.fhe.program import load_program
from polyfhe.fhe.wire import KIND_CONTEXT, WireError, pack, unpack

pytestmark = pytest.mark.fhe


@pytest.fixture(scope="module")
def programs():
    _, _, x, _ = digits()
    model = digits_mlp()
    return {b: export_ckks(model, calibration=x[:64], input_shape=(1, 8, 8), backend=b) for b in BACKEND_NAMES}


def test_registry_names_every_engine_and_refuses_others():
    assert set(BACKEND_NAMES) == {"seal", "lattigo"}
    for name in BACKEND_NAMES:
        assert get_backend(name).name == name
    with pytest.raises(ValueError, match="accepted: \\['seal', 'lattigo'\\]"):
        get_backend("openfhe")
    _, _, x, _ = digits()
    with pytest.raises(CKKSExportError, match="unknown CKKS backend"):
        export_ckks(digits_mlp(), calibration=x[:8], input_shape=(1, 8, 8), backend="openfhe")
    with pytest.raises(CKKSExportError, match="runs layouts \\['single'\\]"):
        export_ckks(digits_mlp(), calibration=x[:8], input_shape=(1, 8, 8), layout="batch", backend="lattigo")


def test_manifest_names_its_backend_and_survives_a_round_trip(programs, tmp_path):
    seal, lattigo = programs["seal"], programs["lattigo"]
    assert seal.manifest.backend == "seal" and lattigo.manifest.backend == "lattigo"
    assert seal.program_id != lattigo.program_id
    loaded = load_program(lattigo.save(tmp_path / "p"))
    assert loaded.manifest.backend == "lattigo" and loaded.program_id == lattigo.program_id
    facts = lattigo.manifest.info["lattigo"]
    assert facts["galois_keys"] == len(lattigo.manifest.galois_steps) and facts["needs_relin"]
    assert facts["modulus_bits"] <= 218  # N=8192's 128-bit bound, on Lattigo's own primes


def test_the_container_asks_exactly_for_the_manifests_keys(programs):
    from polyfhe.fhe.backends.lattigo_format import lower_program

    prog = programs["lattigo"]
    header, blobs = parse_container(lower_program(prog).data)
    n = prog.params.poly_modulus_degree
    assert header["manifest"]["galois_elements"] == [galois_element(s, n) for s in prog.manifest.galois_steps]
    assert header["blob_count"] == len(blobs) and header["graph"]["input"] == "input"
    assert {node["op"] for node in header["graph"]["nodes"]} <= {"flatten", "linear_transform", "quad", "mult", "add"}


@pytest.mark.parametrize("diags, log_ratio, giants, babies", [
    ([0], 1, [], []),  # a plain scaling needs no rotation at all
    ([0, 1, 2, 3], 0, [2], [1]),  # n1 = 2: giant steps {0, 2}, baby steps {0, 1}
    (list(range(16)), 2, [4, 8, 12], [1, 2, 3]),  # n1 = 8 would give 7 baby per giant step, over 4
    (list(range(16)), 3, [8], [1, 2, 3, 4, 5, 6, 7]),  # n1 = 16 would leave no giant step (x/0 = inf)
])
def test_bsgs_rotations_follow_lattigos_split(diags, log_ratio, giants, babies):
    assert bsgs_rotations(diags, 4096, log_ratio) == (giants, babies)


def test_lattigo_security_uses_its_own_primes():
    # 218 bits by SEAL's count, but Lattigo's primes lie a hair above 2^bits: over N=8192's bound
    over = CKKSParams(8192, (49, 40, 40, 40, 49), 40)
    with pytest.raises(ParameterError, match="over the 128-bit bound"):
        check_security(over)
    check_security(CKKSParams(8192, (48, 39, 39, 39, 48), 39))  # 213 bits: accepted
    check_security(CKKSParams(8192, (49, 40, 40, 40, 49), 40, security="none"))  # allow_insecure: warns only


def test_contexts_cross_engines_are_refused(programs):
    seal, lattigo = programs["seal"], programs["lattigo"]
    lattigo_client = lattigo.client()
    context = lattigo_client.public_context()
    box = unpack(context, KIND_CONTEXT)
    with pytest.raises(WireError, match="program"):
        seal.server(context)  # another program id (the backend is part of it)
    relabelled = pack(KIND_CONTEXT, {k: v for k, v in box.header.items() if k != "backend"},
                      {"evaluation_keys": box.sections["evaluation_keys"]})
    with pytest.raises(WireError, match="backend"):
        lattigo.server(relabelled)
    garbage = pack(KIND_CONTEXT, box.header, {"evaluation_keys": b"\x01" * 1000})
    with pytest.raises(WireError, match="not valid Lattigo keys"):
        lattigo.server(garbage)
    _, _, x, _ = digits()
    server = lattigo.server(context)
    np.testing.assert_allclose(lattigo_client.decrypt(server.run(lattigo_client.encrypt(x[:3]))),
                               lattigo.run_plain(x[:3]), atol=1e-3)
