"""Lattigo keys walked exactly: every gadget ciphertext's base-two decomposition (0), row count (ceil(Q/P)) and
column count (1 per row) as the parameters imply, for the bootstrapping keys too; keys whose random part is mostly
zero refused; and the exact bound on a public context's size (``max_context_bytes``).

A row of no column reaches Lattigo's gadget product, which indexes its first column: an index-out-of-range panic
in the Go evaluator (a panic the bridge does not recover ends the server process that holds it). The synthetic
keys follow the layout at the top of ``polyfhe/engines/lattigo/keybytes.py``; the real ones come from the wheel on
small INSECURE rings.
"""

from __future__ import annotations

import importlib.util
import struct

import numpy as np
import pytest

from polyfhe.engines.lattigo.keybytes import (
    METADATA_BYTES,
    BootKeyShape,
    KeyShape,
    check_bootstrap_keys,
    check_ciphertext,
    check_evaluation_keys,
)
from polyfhe.program.params import CKKSParams
from polyfhe.program.wire import KIND_CONTEXT, MAX_HEADER, WireError, pack, unpack

pytestmark = pytest.mark.fhe
LATTIGO = importlib.util.find_spec("lattigo") is not None and importlib.util.find_spec("orion_evaluator") is not None
needs_lattigo = pytest.mark.skipif(not LATTIGO, reason="needs the orion-v2-lattigo and orion-v2-evaluator wheels")

N = 64  # past rns_scan.MAX_ZEROS, so that a mostly-zero row can be told from a random one
LQ = (1_152_921_504_606_830_593, 1_099_511_480_321, 1_099_511_799_809)
LP = (1_152_921_504_606_904_321,)
FULL = (len(LQ), len(LP))
ELEMENTS = (5, 25, 31)
SMALL_RING = CKKSParams(4096, (60, 40, 40, 40, 60), 40, security="none")


# ------------------------------------------------------------------------------------------------------------
# synthetic keys in the wheel's layout
# ------------------------------------------------------------------------------------------------------------
def _poly(rng, moduli, sparse: bool = False) -> bytes:
    """One ring polynomial part: u64 prime count, then per prime u64 N and N residues (``sparse``: one non-zero
    residue per prime, the rest zero)."""
    out = struct.pack("<Q", len(moduli))
    for q in moduli:
        row = rng.integers(1, int(q), N, dtype=np.uint64).astype("<u8")
        if sparse:
            row[1:] = 0
        out += struct.pack("<Q", N) + row.tobytes()
    return out


def _key(rng, q_moduli=LQ, p_moduli=LP, *, base2: int = 0, rows: int | None = None, columns=None,
         sparse_row: int | None = None) -> bytes:
    """A gadget ciphertext: u64 base-two decomposition | u64 rows | per row u64 columns | per column u64 pair (2)
    and two QP polynomials. ``columns``: a row -> column count map (default 1 each); ``sparse_row``: that row's
    second component holds one non-zero residue per prime."""
    rows = -(-len(q_moduli) // len(p_moduli)) if rows is None else rows
    out = struct.pack("<QQ", base2, rows)
    for row in range(rows):
        count = (columns or {}).get(row, 1)
        out += struct.pack("<Q", count)
        for _ in range(count):
            out += struct.pack("<Q", 2)
            for component in range(2):
                sparse = sparse_row == row and component == 1
                out += _poly(rng, q_moduli, sparse) + _poly(rng, p_moduli, sparse)
    return out


def _key_set(rng, elements=(5, 25), galois=None) -> bytes:
    """A ``MemEvaluationKeySet``: the relinearisation key and one Galois key per element (``galois``: element ->
    that key's gadget bytes, replacing a well-formed one)."""
    from polyfhe.engines.lattigo.format import evaluation_key_set

    keys = {e: struct.pack("<QQ", e, 2 * N) + (galois or {}).get(e, _key(rng)) for e in elements}
    return b"".join(evaluation_key_set(_key(rng), keys))


def _boot_keys(rng, last=None) -> bytes:
    """Bootstrapping keys without ring switching: dense->sparse on one prime each, sparse->dense, the key set's
    relinearisation key and the Galois keys of ``ELEMENTS``, the last one ``last`` where given."""
    out = b"\x00" * 4 + b"\x01" + _key(rng, LQ[:1], LP) + b"\x01" + _key(rng)
    out += b"\x01\x01" + _key(rng) + b"\x01" + struct.pack("<I", len(ELEMENTS))
    for e in ELEMENTS:
        out += struct.pack("<QQQ", e, e, 2 * N) + (last if e == ELEMENTS[-1] and last is not None else _key(rng))
    return out


BOOT_SHAPE = BootKeyShape(N, (None, None, None, None, (1, 1), FULL), FULL, FULL, len(ELEMENTS), ELEMENTS, LQ, LP)
EVAL_SHAPE = KeyShape(N, len(LQ), len(LP), 2 * N, LQ, LP)


def test_well_formed_synthetic_keys_walk():
    from polyfhe.engines.lattigo.keybytes import bootstrap_keys_bytes, evaluation_keys_bytes

    rng = np.random.default_rng(0)
    check_evaluation_keys(_key_set(rng), EVAL_SHAPE, {5, 25}, True)
    data = _boot_keys(rng)
    check_bootstrap_keys(data, BOOT_SHAPE)
    check_bootstrap_keys(data)
    assert len(data) == bootstrap_keys_bytes(BOOT_SHAPE)
    assert len(_key_set(rng)) == evaluation_keys_bytes(EVAL_SHAPE, 2, True)


# the gadget's counts, each bad way: (how the key is made, what the refusal must say)
LAST = f"the Galois key of element {ELEMENTS[-1]}"
BAD_GADGETS = {
    "zero-column row": ({"columns": {1: 0}}, rf"the column count of row 1 of {LAST} is 0 at byte \d+, .* need 1$"),
    "two-column row": ({"columns": {2: 2}}, rf"the column count of row 2 of {LAST} is 2 at byte \d+, .* need 1$"),
    "base-two decomposition": ({"base2": 16}, rf"the base-two decomposition of {LAST} is 16 at byte \d+, .* need 0$"),
    "zero rows": ({"rows": 0}, rf"the gadget row count of {LAST} is 0 at byte \d+; a key has ceil\(Q/P\)"),
    "too few rows": ({"rows": 2}, rf"{LAST} has 2 gadget rows on 3\+1 primes; Lattigo's keys have ceil\(3/1\) = 3 rows$"),
    "no special prime": ({"p_moduli": (), "rows": 1}, rf"{LAST} has 1 gadget rows on 3\+0 primes; .* one Q and one P prime$"),
}


def _bad_gadget(rng, case: str) -> tuple[bytes, str]:
    how, reason = BAD_GADGETS[case]
    return _key(rng, **how), reason


@pytest.mark.parametrize("case", list(BAD_GADGETS))
@pytest.mark.parametrize("with_shape", [True, False], ids=["shaped", "unshaped"])
def test_a_bootstrapping_key_with_a_bad_gadget_is_refused(case, with_shape):
    """The bootstrapping keys' gadgets are exact whether or not the walk is given the parameters' shape."""
    rng = np.random.default_rng(1)
    key, reason = _bad_gadget(rng, case)
    with pytest.raises(WireError, match=f"^bootstrapping keys: {reason}"):
        check_bootstrap_keys(_boot_keys(rng, last=key), BOOT_SHAPE if with_shape else None)


@pytest.mark.parametrize("case", ["zero-column row", "base-two decomposition"])
def test_an_evaluation_key_with_a_bad_gadget_is_refused(case):
    """The program's own key set, of exactly the size its shape implies (the bad gadget padded to it)."""
    rng = np.random.default_rng(2)
    key, reason = _bad_gadget(rng, case)
    reason = reason.replace(f"element {ELEMENTS[-1]}", "element 25")
    good = _key_set(rng)
    bad = _key_set(rng, galois={25: key})
    bad += bytes(len(good) - len(bad))  # the size check passes: the walk must find the gadget's fault
    with pytest.raises(WireError, match=f"^evaluation keys: {reason}"):
        check_evaluation_keys(bad, EVAL_SHAPE, {5, 25}, True)


@pytest.mark.parametrize("row", [0, 2])
def test_a_key_with_one_non_zero_residue_per_row_is_refused(row):
    rng = np.random.default_rng(3)
    reason = (rf"row {row} column 0 component 1, Q part: {N - 1} of the {N} residues modulo prime 0 \(q={LQ[0]}\) "
              "are 0; a uniformly random polynomial has .* this is not a key")
    with pytest.raises(WireError, match=f"evaluation keys: the Galois key of element 25, {reason}"):
        check_evaluation_keys(_key_set(rng, galois={25: _key(rng, sparse_row=row)}), EVAL_SHAPE, {5, 25}, True)
    with pytest.raises(WireError, match=f"bootstrapping keys: the Galois key of element 31, {reason}"):
        check_bootstrap_keys(_boot_keys(rng, last=_key(rng, sparse_row=row)), BOOT_SHAPE)


def test_a_ciphertext_whose_random_part_is_mostly_zero_is_refused():
    rng = np.random.default_rng(4)
    body = b"\x01" + bytes(METADATA_BYTES) + struct.pack("<Q", 2)
    first, second = _poly(rng, LQ[:2]), _poly(rng, LQ[:2], sparse=True)
    with pytest.raises(WireError, match=rf"input ciphertext, second component: {N - 1} of the {N} residues modulo "
                                        "prime 0 .* nearly transparent"):
        check_ciphertext(body + first + second, N, {2}, "input ciphertext", moduli=LQ)
    check_ciphertext(body + second + first, N, {2}, "input ciphertext", moduli=LQ)  # the message part may be sparse


# ------------------------------------------------------------------------------------------------------------
# real keys from the wheel
# ------------------------------------------------------------------------------------------------------------
def _leveled():
    from ckks_testlib import export_square_mlp

    return export_square_mlp(12, 4, backend="lattigo", params=SMALL_RING, allow_insecure=True)


def _bootstrapping():
    from ckks_testlib import export_bootstrapping_mlp

    return export_bootstrapping_mlp()


@pytest.fixture(scope="module")
def leveled():
    prog = _leveled()
    return prog, prog.client().public_context()


@pytest.fixture(scope="module")
def bootstrapping():
    prog = _bootstrapping()
    return prog, prog.client().public_context()


def _with_section(context: bytes, name: str, data: bytes) -> bytes:
    box = unpack(context, KIND_CONTEXT)
    return pack(KIND_CONTEXT, box.header, {**box.sections, name: data})


def zero_column_row(keys: bytes, key_bytes: int, row_bytes: int, row: int = 1) -> bytes:
    """``keys`` with row ``row`` of its last gadget ciphertext (``key_bytes`` long, rows of ``row_bytes``) left
    with no column: its column count 0 and its ciphertext gone."""
    at = len(keys) - key_bytes + 16 + row * row_bytes
    return keys[:at] + struct.pack("<Q", 0) + keys[at + row_bytes:]


def gadget_layout(n: int, q: int, p: int) -> tuple[int, int]:
    """(bytes of a gadget ciphertext on N=n with q+p primes, bytes of one of its rows)."""
    polys = 2 * (8 + q * (8 + 8 * n) + 8 + p * (8 + 8 * n))
    shape = KeyShape(n, q, p, 2 * n)
    assert shape.key_bytes == 16 + shape.rows * (16 + polys)
    return shape.key_bytes, 16 + polys


def bootstrap_zero_column_context(prog, context: bytes) -> bytes:
    """``context`` with a zero-column row in the last Galois key of its bootstrapping keys."""
    from polyfhe.engines.lattigo.bootshape import expected_bootstrap_keys

    shape = expected_bootstrap_keys(prog.params, prog.manifest.bootstrap_spec)
    keys = bytes(unpack(context, KIND_CONTEXT).sections["bootstrap_keys"])
    assert shape.rows(*shape.galois) >= 2
    return _with_section(context, "bootstrap_keys", zero_column_row(keys, *gadget_layout(shape.n, *shape.galois)))


@needs_lattigo
def test_honest_leveled_keys_are_accepted_and_a_zero_column_row_refused(leveled):
    prog, context = leveled
    prog.server(context)
    keys = bytes(unpack(context, KIND_CONTEXT).sections["evaluation_keys"])
    shape = KeyShape.from_lattigo_params({"logn": 12, "logq": [0] * 4, "logp": [0]})
    key_bytes, row_bytes = gadget_layout(shape.n, shape.q, shape.p)
    bad = zero_column_row(keys, key_bytes, row_bytes)
    with pytest.raises(WireError, match="evaluation keys of .* bytes"):  # the size is exact before the walk
        prog.server(_with_section(context, "evaluation_keys", bad))
    padded = bad + bytes(len(keys) - len(bad))
    with pytest.raises(WireError, match=r"evaluation keys: the column count of row 1 of the Galois key of element "
                                        r"\d+ is 0 at byte \d+, these parameters need 1"):
        prog.server(_with_section(context, "evaluation_keys", padded))


@needs_lattigo
def test_honest_bootstrapping_keys_are_accepted_and_a_zero_column_row_refused(bootstrapping):
    prog, context = bootstrapping
    prog.server(context)
    with pytest.raises(WireError, match=r"bootstrapping keys: the column count of row 1 of the Galois key of "
                                        r"element \d+ is 0 at byte \d+, these parameters need 1"):
        prog.server(bootstrap_zero_column_context(prog, context))


def _assert_tight(prog, context: bytes) -> None:
    from polyfhe.program.engines import max_context_bytes

    bound = max_context_bytes(prog)
    header = struct.unpack_from("<I", context, 7)[0]
    assert len(context) <= bound, (len(context), bound)
    # exact but for the header: the bound counts the largest header a context may carry
    assert bound - len(context) == MAX_HEADER - header


@needs_lattigo
def test_the_context_bound_holds_a_real_leveled_context(leveled):
    _assert_tight(*leveled)


@needs_lattigo
def test_the_context_bound_holds_a_real_bootstrapping_context(bootstrapping):
    prog, context = bootstrapping
    _assert_tight(prog, context)
    assert len(unpack(context, KIND_CONTEXT).sections["bootstrap_keys"]) > len(context) // 2


def test_the_context_bound_needs_no_wheel(monkeypatch):
    """Pure arithmetic on the manifest (the registry computes it where no engine is loaded): the relinearisation
    key counted only where the manifest says the program needs it, the bootstrapping keys at their exact shape."""
    from types import SimpleNamespace

    from polyfhe.engines.lattigo import engine
    from polyfhe.engines.lattigo.bootshape import bootstrap_key_shape
    from polyfhe.engines.lattigo.format import lattigo_params
    from polyfhe.engines.lattigo.keybytes import bootstrap_keys_bytes

    def no_wheel():
        raise AssertionError("the bound must not load the wheels")

    monkeypatch.setattr(engine, "_client_lib", no_wheel)
    monkeypatch.setattr(engine, "_evaluator_lib", no_wheel)
    shape = KeyShape(4096, 4, 1, 8192)

    def bound(spec, steps, info):
        return engine.max_context_bytes(SimpleNamespace(params=SMALL_RING, manifest=SimpleNamespace(
            bootstrap_spec=spec, galois_steps=steps, info=info)))

    galois = 3 * (8 + shape.galois_key_bytes)
    assert bound(None, (1, 2, 4), {"lattigo": {"needs_relin": False}}) == 11 + MAX_HEADER + 1 + 5 + galois
    assert bound(None, (1, 2, 4), {}) == 11 + MAX_HEADER + 1 + shape.key_bytes + 5 + galois
    spec = {"logn": 12, "logp": [61] * 6, "log_slots": 3}
    boot = bootstrap_key_shape(lattigo_params(SMALL_RING, spec), spec)
    assert (boot.galois, boot.galois_count) == ((18, 6), 15)
    assert bound(spec, (1, 2, 4), {}) == bound(None, (1, 2, 4), {}) + bootstrap_keys_bytes(boot)
