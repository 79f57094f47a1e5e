"""The engine registry and the Lattigo backend's own contracts (the shared encrypted tests run on both engines)."""

from __future__ import annotations

import numpy as np
import pytest
from ckks_testlib import digits, digits_mlp

from polyfhe.engines.lattigo.engine import check_security
from polyfhe.engines.lattigo.format import bsgs_rotations, galois_element, parse_container
from polyfhe.exporters.ckks import CKKSExportError, export_ckks
from polyfhe.program.ckks_program import load_program
from polyfhe.program.engines import BACKEND_NAMES, get_backend
from polyfhe.program.params import CKKSParams, ParameterError
from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, WireError, pack, unpack

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


def test_only_an_engine_that_composes_rotations_gets_a_key_budget(monkeypatch):
    """SEAL composes a rotation without a key from power-of-two keys; Lattigo plans its own key set, so a
    key budget (and its composed-rotation fallback and warning) applies to SEAL programs only."""
    import polyfhe.exporters.ckks.passes.plan as exporter

    budgets = {}

    def spy(circuit, slots, max_keys=None, *args, **kwargs):
        budgets[len(budgets)] = max_keys
        return plan_single(circuit, slots, max_keys, *args, **kwargs)

    plan_single = exporter.plan_single
    monkeypatch.setattr(exporter, "plan_single", spy)
    _, _, x, _ = digits()
    for backend in ("seal", "lattigo"):
        export_ckks(digits_mlp(), backend=backend, calibration=x[:64], input_shape=(1, 8, 8))
    assert budgets[0] is not None and budgets[0] >= 26  # SEAL: +-2^i keys at least
    assert budgets[1] is None
    assert get_backend("seal").composes_rotations and not get_backend("lattigo").composes_rotations


def test_lattigo_key_set_size_is_predicted_and_an_unservable_one_refused(programs, monkeypatch):
    from polyfhe.engines.lattigo import engine as lattigo

    prog = programs["lattigo"]
    keys = len(prog.manifest.galois_steps) + 1  # and the relinearisation key
    predicted = lattigo.key_set_bytes(prog.params, keys)
    context = len(prog.client().public_context())
    assert 0.9 * context <= predicted <= context
    monkeypatch.setattr(lattigo, "DEFAULT_MAX_CONTEXT_BYTES", predicted - 1)
    _, _, x, _ = digits()
    # the leveled ring's refusal stays in front when the bootstrapping it falls back to is refused too (here: for
    # memory, 128-bit bootstrapping keys on N=2^16 need about 24 GB; on a larger machine, for the same key limit)
    with pytest.raises(CKKSExportError, match=f"Lattigo needs {keys - 1} rotation keys .* backend='seal'.*; "
                                              "bootstrapping instead was refused too: "):
        export_ckks(digits_mlp(), calibration=x[:64], input_shape=(1, 8, 8), backend="lattigo")


def test_the_container_asks_exactly_for_the_manifests_keys(programs):
    from polyfhe.engines.lattigo.format import lower_program

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
    with pytest.raises(WireError, match="evaluation keys of 1000 bytes; this program.s 11 Galois key"):
        lattigo.server(garbage)
    _, _, x, _ = digits()
    server = lattigo.server(context)
    np.testing.assert_allclose(lattigo_client.decrypt(server.run(lattigo_client.encrypt(x[:3]))),
                               lattigo.run_plain(x[:3]), atol=1e-3)


def test_key_set_made_one_key_at_a_time_is_lattigos_own_marshalling():
    from lattigo import ckks, rlwe

    from polyfhe.engines.lattigo.format import evaluation_key_set

    params = ckks.Parameters.from_dict({"logn": 12, "logq": [40, 30, 30], "logp": [45], "log_default_scale": 30,
                                        "h": 2730, "ring_type": "standard", "boot_logp": None})
    keygen = rlwe.KeyGenerator(params)
    secret = keygen.gen_secret_key()
    relin = keygen.gen_relin_key(secret)
    elements = [8191, 5, 25]  # not in order: Lattigo writes its key map sorted
    galois = [keygen.gen_galois_key(secret, e) for e in elements]
    whole = rlwe.MemEvaluationKeySet(relin, galois).marshal_binary()
    ours = evaluation_key_set(relin.marshal_binary(), {e: g.marshal_binary() for e, g in zip(elements, galois)})
    assert b"".join(ours) == whole
    without_relin = rlwe.MemEvaluationKeySet(None, galois[:1]).marshal_binary()
    assert b"".join(evaluation_key_set(None, {elements[0]: galois[0].marshal_binary()})) == without_relin


def test_adds_of_unequal_scales_are_corrected_as_lattigo_applies_them():
    """Lattigo multiplies the smaller-scale operand of an add by floor(ratio): 1 for a ratio of 1.3."""
    from fractions import Fraction

    from polyfhe.engines.lattigo.format import LattigoScales, Tag

    scales = LattigoScales([1 << 40, (1 << 30) - 2**20, 1 << 30], 30)
    a, b = Tag(1, Fraction(13, 10) * 2**30), Tag(2, Fraction(2**30))
    tag, fa, fb = scales.add(a, b)
    assert tag == Tag(1, a.scale) and fa == 1.0 and fb == pytest.approx(1 / 1.3)
    tag, fa, fb = scales.add(b, Tag(2, Fraction(5, 2) * 2**30))
    assert fa == pytest.approx(2 / 2.5) and fb == 1.0
    out = scales.product(scales.input(2), scales.input(2))  # rescaled by the prime at level 2, exactly 2^30
    assert out == Tag(1, Fraction(2**30))
    assert scales.linear(out, 1) == Tag(0, Fraction(2**30))  # a transform keeps its input's scale


def test_scales_of_a_deep_program_stay_small_and_equal_scales_add_unweighted():
    """Scales are rounded to 256 bits after each step (exact fractions of 33 levels took over a minute to reduce);
    a ratio within rounding of an integer floors to that integer, so scales that differ by rounding add unweighted."""
    from fractions import Fraction

    from polyfhe.engines.lattigo.format import SCALE_BITS_KEPT, LattigoScales, Tag, _floor_ratio

    primes = [(1 << 40) - 87, (1 << 40) - 167, (1 << 40) - 195, (1 << 40) - 203]
    scales = LattigoScales([1 << 60, *primes * 10], 40)
    tag = scales.input(40)
    for level in range(40, 1, -1):  # a product and a transform per level
        tag = scales.linear(scales.product(tag, scales.input(level)), level - 1)
        assert tag.scale.numerator.bit_length() <= SCALE_BITS_KEPT + 64
    small = tag.scale
    assert _floor_ratio(3 * small * (1 - Fraction(1, 1 << 250)), small) == 3  # 3 within rounding
    assert _floor_ratio(small * Fraction(29, 10), small) == 2
    _, fa, fb = scales.add(Tag(1, small * (1 - Fraction(1, 1 << 250))), Tag(1, small))
    assert fa == 1.0 and fb == 1.0


def test_seal_keys_and_ciphertexts_never_pass_through_a_file(programs, monkeypatch):
    """TenSEAL (de)serialises only through paths: polyfhe hands it an anonymous in-memory file, never a temp file."""
    import tempfile

    def no_files(*args, **kwargs):
        raise AssertionError("a SEAL object went through a temporary file")

    monkeypatch.setattr(tempfile, "mkstemp", no_files)
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", no_files)
    prog = programs["seal"]
    client = prog.client()
    assert client.secret_context()  # the secret key serialised
    server = prog.server(client.public_context())  # public key, relin and Galois keys parsed
    _, _, x, _ = digits()
    out = client.decrypt(server.run(client.encrypt(x[:2])))
    assert out.shape == (2, 10)


@pytest.mark.parametrize("given, expected", [(None, "25"), ("80", "80")])
def test_the_command_restarts_once_with_gos_collector_settings(given, expected):
    """Go reads GOGC only from the environment the process started with: the CLI entry restarts itself with it."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GOGC", "POLYFHE_GO_ENV_SET")}
    if given is not None:
        env["GOGC"] = given
    code = ("import os; from polyfhe.engines.lattigo.go_env import restart_with_go_env; print('start', flush=True); "
            "restart_with_go_env(); print(os.environ['GOGC'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == (["start", "start", expected] if given is None else ["start", expected])


def test_lattigo_key_set_is_walked_before_go_reads_it(programs):
    """Every length field of the uploaded key set is checked against the parameters, and the Galois keys must be
    exactly the manifest's: Go would otherwise trust a corrupted count."""
    import struct

    from polyfhe.engines.lattigo.format import lattigo_params
    from polyfhe.engines.lattigo.keybytes import KeyShape

    prog = programs["lattigo"]
    box = unpack(prog.client().public_context(), KIND_CONTEXT)
    keys = bytes(box.sections["evaluation_keys"])
    shape = KeyShape.from_lattigo_params(lattigo_params(prog.params))

    def context(data: bytes) -> bytes:
        return pack(KIND_CONTEXT, box.header, {**box.sections, "evaluation_keys": data})

    count_at = 1 + shape.key_bytes + 1
    (count,) = struct.unpack_from("<I", keys, count_at)
    assert count == len(prog.manifest.galois_steps)
    one_less = bytearray(keys[: len(keys) - 8 - shape.galois_key_bytes])
    struct.pack_into("<I", one_less, count_at, count - 1)
    with pytest.raises(WireError, match=f"this program's {count} Galois key"):
        prog.server(context(bytes(one_less)))
    corrupt = bytearray(keys)
    struct.pack_into("<Q", corrupt, 1 + 8 * 4, 1 << 40)  # the relin key's first Q prime count
    with pytest.raises(WireError, match="the Q prime count is 1099511627776"):
        prog.server(context(bytes(corrupt)))
    renamed = bytearray(keys)
    first_element = count_at + 4
    struct.pack_into("<Q", renamed, first_element, struct.unpack_from("<Q", keys, first_element)[0] + 2)
    with pytest.raises(WireError, match="a Galois element"):
        prog.server(context(bytes(renamed)))


@pytest.mark.parametrize("field, value", [(0, 1 << 33), (1, 1 << 62), (2, 1 << 20), (2, 4097)])
def test_a_lattigo_ciphertext_with_a_lying_count_is_refused_not_fatal(programs, field, value):
    """Unmarshalled as sent, these kill the process (Go: out of memory or stack overflow); the server refuses
    them with a reason and keeps serving."""
    import struct

    from polyfhe.engines.lattigo.keybytes import METADATA_BYTES

    prog = programs["lattigo"]
    client = prog.client()
    server = prog.server(client.public_context())
    _, _, x, _ = digits()
    data = client.encrypt(x[:2])
    box = unpack(data, KIND_CIPHERTEXT)
    raw = bytearray(box.sections["ct0"])
    struct.pack_into("<Q", raw, 1 + METADATA_BYTES + 8 * field, value)  # components, primes, degree
    with pytest.raises(WireError, match="input ciphertext"):
        server.run(pack(KIND_CIPHERTEXT, box.header, {"ct0": bytes(raw)}))
    np.testing.assert_allclose(client.decrypt(server.run(data)), prog.run_plain(x[:2]), atol=1e-3)
