"""Lattigo's bootstrapping keys against the exact shape their parameters imply (lattigo_bootshape, a port of
Lattigo 6.2.0's own key logic).

The proof of the port: keys the wheel really generates, on small INSECURE rings (N=4096 and 8192, a second or a few
each), match the computed shape exactly: every Galois element, every key's ring, Q and P prime counts and rows, the
switching keys present, every residue below the computed primes. Then the refusals: a Galois key removed, added or
replaced is refused naming the element; keys for other parameters (other special primes, other slots) are refused
naming what was expected and what came; and the server walks the upload against the computed shape.
"""

from __future__ import annotations

import importlib.util
import struct
import time

import pytest

from polyfhe.engines.lattigo.bootshape import bootstrap_galois_elements, bootstrap_key_shape
from polyfhe.program.bootstrapping import BootstrapSpec
from polyfhe.program.params import CKKSParams
from polyfhe.program.wire import WireError

pytestmark = pytest.mark.fhe
LATTIGO = importlib.util.find_spec("lattigo") is not None
needs_lattigo = pytest.mark.skipif(not LATTIGO, reason="needs the orion-v2-lattigo wheel")

SMALL_RING = CKKSParams(4096, (60, 40, 40, 40, 60), 40, security="none")
SCALE_30 = CKKSParams(4096, (60, 30, 30, 30, 30, 30, 60), 30, security="none")
BOOT_8192 = CKKSParams(8192, (60, 40, 40, 40, 60), 40, security="none")
# (residual parameters, bootstrapping spec): own ring at 2, 8 and all 2048 slots (the decoding's imaginary repack
# and the merged butterfly levels, or neither); ring switching 4096 -> 8192; a 30-bit scale with 4 special primes
# (SlotsToCoeffs primes of 69 bits: the scale is not added); N=8192 with 3 special primes (7 gadget rows)
CASES = {
    "4096-s1": (SMALL_RING, BootstrapSpec(12, (61,) * 6, 1)),
    "4096-s3": (SMALL_RING, BootstrapSpec(12, (61,) * 6, 3)),
    "4096-s11": (SMALL_RING, BootstrapSpec(12, (61,) * 6, 11)),
    "4096-to-8192-s3": (SMALL_RING, BootstrapSpec(13, (61,) * 6, 3)),
    "scale30-s6": (SCALE_30, BootstrapSpec(12, (61,) * 4, 6)),
    "8192-s10": (BOOT_8192, BootstrapSpec(13, (61,) * 3, 10)),
}


def test_galois_elements_match_those_the_wheel_generated():
    """Without the wheel: the elements Lattigo's keys carried (read from generated keys), for regression."""
    assert bootstrap_galois_elements(12, 3) == (1, 5, 25, 125, 625, 3969, 4033, 4097, 4397, 5601, 6145, 7169, 7681,
                                                7937, 8191)
    # N=2^16 at 2^13 slots (one measured run, residual N=2^16 and 16 special primes: 3 GB of keys): 41 Galois keys
    assert len(bootstrap_galois_elements(16, 13)) == 41
    assert {s: len(bootstrap_galois_elements(16, s)) for s in (10, 12)} == {10: 31, 12: 37}


def _keys(params: CKKSParams, spec: BootstrapSpec) -> bytes:
    from lattigo import ckks, rlwe

    from polyfhe.engines.lattigo.bootkeys import generate_in_child
    from polyfhe.engines.lattigo.format import lattigo_params, secret_weight

    lp = lattigo_params(params, spec.to_dict())
    p = ckks.Parameters.from_dict(lp)
    keygen = rlwe.KeyGenerator(p)
    sk = keygen.gen_secret_key()
    try:
        return bytes(generate_in_child(lp, spec.to_dict(), sk.marshal_binary(), secret_weight(1 << spec.logn),
                                       limit=1 << 31))
    finally:
        sk.close()
        keygen.close()
        p.close()


def _shape(params: CKKSParams, spec: BootstrapSpec):
    from polyfhe.engines.lattigo.bootshape import expected_bootstrap_keys
    from polyfhe.engines.lattigo.engine import lattigo_primes

    return expected_bootstrap_keys(params, spec.to_dict(), lattigo_primes(params, spec.to_dict())[0])


@pytest.fixture(scope="module")
def small_keys():
    params, spec = CASES["4096-s3"]
    return _keys(params, spec), _shape(params, spec)


@needs_lattigo
@pytest.mark.parametrize("case", list(CASES))
def test_real_bootstrapping_keys_match_the_computed_shape_exactly(case, small_keys):
    from polyfhe.engines.lattigo.keybytes import BOOT_KEY_NAMES, check_bootstrap_keys

    params, spec = CASES[case]
    data, shape = small_keys if case == "4096-s3" else (_keys(params, spec), _shape(params, spec))
    found = dict(check_bootstrap_keys(data))  # walked without a shape: what the keys really hold
    real_elements = tuple(int(name.split()[1]) for name in found if name.startswith("galois"))
    assert real_elements == shape.galois_elements and len(real_elements) == shape.galois_count
    for index, name in enumerate(BOOT_KEY_NAMES):
        want = shape.switching[index]
        got = found.get(name)
        assert (got is None) == (want is None), name
        if got is not None:
            assert (got.n, got.q, got.p, got.rows) == (shape.n, *want, shape.rows(*want)), name
    for name, got in found.items():
        if name == "relinearisation" or name.startswith("galois"):
            want = shape.relin if name == "relinearisation" else shape.galois
            assert (got.n, got.q, got.p, got.rows) == (shape.n, *want, shape.rows(*want)), name
    assert len(shape.q_moduli) == shape.galois[0] and len(shape.p_moduli) == shape.galois[1]
    check_bootstrap_keys(data, shape)  # and every residue below the computed primes
    assert (shape.switching[0] is not None) == (params.poly_modulus_degree < 1 << spec.logn)


def _galois_layout(data: bytes) -> tuple[int, int, int]:
    """(offset of the Galois key count, offset of the first entry, bytes per entry) of a real key set."""
    from polyfhe.engines.lattigo.keybytes import KeyShape, check_bootstrap_keys

    found = check_bootstrap_keys(data)
    size = {name: KeyShape(s.n, s.q, s.p, 2 * s.n).key_bytes for name, s in found}
    at = sum(1 + size.get(name, 0) for name in ("N1->N2", "N2->N1", "real->complex", "complex->real",
                                                   "dense->sparse", "sparse->dense"))
    at += 1 + 1 + size["relinearisation"] + 1  # key-set flag, relinearisation flag and key, Galois flag
    galois = [name for name in size if name.startswith("galois")]
    return at, at + 4, 8 + 16 + size[galois[0]]


def _entries(data: bytes) -> tuple[bytes, list[bytes]]:
    """(everything before the Galois key count, each Galois entry: u64 element | the key)."""
    count_at, first, stride = _galois_layout(data)
    (count,) = struct.unpack_from("<I", data, count_at)
    entries = [data[first + i * stride:first + (i + 1) * stride] for i in range(count)]
    assert first + count * stride == len(data)
    return data[:count_at], entries


def _with_entries(head: bytes, entries: list[bytes]) -> bytes:
    return head + struct.pack("<I", len(entries)) + b"".join(entries)


def _renamed(entry: bytes, element: int) -> bytes:
    return struct.pack("<QQ", element, element) + entry[16:]


@needs_lattigo
def test_a_missing_extra_or_replaced_galois_key_is_refused_naming_the_element(small_keys):
    from polyfhe.engines.lattigo.keybytes import check_bootstrap_keys

    data, shape = small_keys
    head, entries = _entries(data)
    elements = list(shape.galois_elements)
    assert [struct.unpack_from("<Q", e)[0] for e in entries] == elements
    removed = elements[5]
    with pytest.raises(WireError, match=rf"hold {len(elements) - 1} Galois keys; these parameters imply "
                                        rf"{len(elements)}: missing the Galois key\(s\) of element\(s\) "
                                        rf"\[{removed}\]$"):
        check_bootstrap_keys(_with_entries(head, entries[:5] + entries[6:]), shape)
    extra = next(e for e in range(elements[5] + 2, elements[6], 2) if e not in elements)
    added = entries[:6] + [_renamed(entries[5], extra)] + entries[6:]
    with pytest.raises(WireError, match=rf"hold {len(elements) + 1} Galois keys; .* imply {len(elements)}: extra "
                                        rf"Galois key\(s\) of element\(s\) \[{extra}\] these parameters do not use"):
        check_bootstrap_keys(_with_entries(head, added), shape)
    replaced = entries[:5] + [_renamed(entries[5], extra)] + entries[6:]
    with pytest.raises(WireError, match=rf"Galois key 5 has element {extra}; these parameters imply {removed}: "
                                        rf"missing .* \[{removed}\]; extra .* \[{extra}\]"):
        check_bootstrap_keys(_with_entries(head, replaced), shape)
    check_bootstrap_keys(_with_entries(head, entries), shape)  # the pieces put back together walk


@needs_lattigo
def test_keys_for_other_parameters_are_refused_naming_expected_and_found(small_keys):
    from polyfhe.engines.lattigo.bootshape import bootstrap_key_shape
    from polyfhe.engines.lattigo.format import lattigo_params
    from polyfhe.engines.lattigo.keybytes import check_bootstrap_keys

    data, _ = small_keys  # made for 6 special primes, 2^3 slots, on the residual ring itself
    params, spec = CASES["4096-s3"]
    lp = lattigo_params(params, spec.to_dict())
    fewer_special = (r"the sparse->dense key is on N=4096 with 18\+6 primes in 3 rows; .* imply N=4096 with 18\+5 "
                     r"primes in 4 rows")
    more_slots = r"the sparse->dense key is on N=4096 with 18\+6 primes .* imply N=4096 with 19\+6 primes"
    other = (
        ({**spec.to_dict(), "logp": [61] * 5}, fewer_special),
        ({**spec.to_dict(), "log_slots": 4}, more_slots),
        ({**spec.to_dict(), "logn": 13}, r"the N1->N2 key is missing; these parameters need one"),
    )
    for bad_spec, reason in other:
        with pytest.raises(WireError, match=f"bootstrapping keys: {reason}"):
            check_bootstrap_keys(data, bootstrap_key_shape(lp, bad_spec))


@needs_lattigo
def test_the_check_costs_little(small_keys):
    """The shape is computed in well under a second (N=2^16 included) and the shaped walk costs no more than the
    structural walk and residue scan the server already did."""
    from polyfhe.engines.lattigo.bootshape import bootstrap_galois_elements as elements
    from polyfhe.engines.lattigo.keybytes import check_bootstrap_keys

    data, _ = small_keys
    params, spec = CASES["4096-s3"]
    elements.cache_clear()
    t0 = time.perf_counter()
    shape = _shape(params, spec)
    elements(16, 15)
    computed = time.perf_counter() - t0
    t0 = time.perf_counter()
    check_bootstrap_keys(data)
    bare = time.perf_counter() - t0
    t0 = time.perf_counter()
    check_bootstrap_keys(data, shape)
    shaped = time.perf_counter() - t0
    print(f"shape {computed * 1e3:.1f} ms; walk of {len(data) / 1e6:.0f} MB: {bare * 1e3:.0f} ms bare, "
          f"{shaped * 1e3:.0f} ms against the shape")
    assert computed < 1.0
    assert shaped < 2 * bare + 0.05


def test_the_shape_refuses_parameters_lattigo_refuses():
    lp = {"logn": 13, "logq": [60, 40]}
    for spec, reason in (({"logn": 12, "logp": [61], "log_slots": 3}, "residual ring N=2\\^13 above"),
                         ({"logn": 13, "logp": [61], "log_slots": 13}, "Lattigo takes 1..12"),
                         ({"logn": 13, "logp": [], "log_slots": 3}, "at least one special prime")):
        with pytest.raises(ValueError, match=reason):
            bootstrap_key_shape(lp, spec)


@needs_lattigo
def test_the_server_walks_the_upload_against_the_computed_shape():
    """A bootstrapping program's server takes its client's keys and refuses the same keys with one Galois key
    removed, naming the element, before Go reads them."""
    from ckks_testlib import Square, digits
    from torch import nn

    from polyfhe.engines.lattigo.bootshape import bootstrap_galois_elements
    from polyfhe.exporters.ckks import export_ckks
    from polyfhe.program.wire import KIND_CONTEXT, pack, unpack

    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Square(), nn.Linear(16, 16), Square(), nn.Linear(16, 10))
    x = digits()[0][:32]
    prog = export_ckks(model.eval(), calibration=x, input_shape=(1, 8, 8), backend="lattigo", params=SMALL_RING,
                       allow_insecure=True)
    spec = prog.manifest.info["bootstrap"]["spec"]
    context = prog.client().public_context()
    prog.server(context)  # the real keys: accepted
    box = unpack(context, KIND_CONTEXT)
    head, entries = _entries(bytes(box.sections["bootstrap_keys"]))
    missing = bootstrap_galois_elements(int(spec["logn"]), int(spec["log_slots"]))[2]
    lacking = pack(KIND_CONTEXT, box.header,
                   {**box.sections, "bootstrap_keys": _with_entries(head, entries[:2] + entries[3:])})
    with pytest.raises(WireError, match=rf"missing the Galois key\(s\) of element\(s\) \[{missing}\]"):
        prog.server(lacking)
