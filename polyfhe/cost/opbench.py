"""Microbenchmarks that calibrate :mod:`polyfhe.runtime.opcosts` on the machine that runs them.

SEAL: each operation is timed on its own (median of a few calls) at several rings and at several levels of one
chain (a ciphertext switched down a level has one prime fewer, so one context gives several prime counts).
Lattigo: its evaluator runs whole model graphs, so a probe is a small graph (a chain of linear transforms of a
chosen baby-step giant-step split, of ct x ct squares, or of adds) and its tally lists every operation in it.
Both also record the serialized size of their keys, which fits :class:`KeyBytesModel`.

Calibration rings use insecure (short) chains on purpose: only timings and sizes are kept, never the keys. The
whole run takes well under a minute per engine and up to about 2 GB on a 2-core machine.
"""

from __future__ import annotations

import logging
import struct
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from polyfhe.program.params import CKKSParams
from polyfhe.runtime.opcosts import OpSite, Probe, Tally, merge

__all__ = ["CALIBRATORS", "KeyObservation", "best_seconds", "lattigo_probes", "measure_base_rss", "seal_probes"]

log = logging.getLogger(__name__)

# (ring, chain) per calibration point: first prime, data primes, special prime; bit sizes vary so that the
# key-size fit sees several
SEAL_CHAINS = ((8192, (60, 40, 40, 40, 40, 60)), (16384, (50,) + (35,) * 8 + (50,)),
               (32768, (60,) + (30,) * 12 + (60,)), (65536, (60,) + (40,) * 5 + (60,)))
LATTIGO_CHAINS = ((8192, (60,) + (40,) * 4 + (60,)), (16384, (50,) + (35,) * 7 + (50,)),
                  (32768, (60,) + (30,) * 5 + (60,)), (65536, (60,) + (40,) * 4 + (60,)))
# Lattigo transform probes: (name, diagonal indices, log2 bsgs ratio, most transforms in the chain, largest ring);
# the wide ones separate per-diagonal from per-rotation costs (real maps have hundreds of diagonals, about eight
# per rotation: without the 256-diagonal map the fit could trade plaintext products for rotations)
TRANSFORMS = (("one diagonal", (0,), 0, 8, 1 << 16), ("babies", (0, 1, 2, 3), 5, 8, 1 << 16),
              ("giants", (0, 4, 8, 12), 0, 8, 1 << 16), ("16 diagonals", tuple(range(16)), 0, 8, 1 << 16),
              ("64 diagonals", tuple(range(64)), 2, 2, 1 << 14), ("256 diagonals", tuple(range(256)), 0, 2, 1 << 13))
ADD_CHAIN = 40
STREAM = 32  # distinct plaintexts (and product ciphertexts) a SEAL product or sum probe cycles through


KeyObservation = tuple[tuple[tuple[int, int], ...], int, int]  # ((bits, coefficients) per prime), polys, bytes


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls: on a shared machine the slower ones measure the other jobs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _key_observation(ring: int, bits: tuple[int, ...], digits: int, polys_per_digit: int, size: int
                     ) -> KeyObservation:
    """A key of ``digits`` digits, each ``polys_per_digit`` polynomials over every prime in ``bits``."""
    coeffs = ring * digits * polys_per_digit
    return tuple((b, coeffs) for b in bits), digits * polys_per_digit * len(bits), size


# --------------------------------------------------------------------------------------------------------------
# SEAL
# --------------------------------------------------------------------------------------------------------------
def seal_probes(chains=SEAL_CHAINS, repeats: int = 5) -> tuple[list[Probe], list[KeyObservation]]:
    """Single-operation timings at every ring and a few levels, and the sizes of SEAL's keys."""
    from polyfhe.engines.seal.context import SealContext
    from polyfhe.program.boundary import galois_element

    probes, keys = [], []
    rng = np.random.default_rng(0)
    for ring, bits in chains:
        seal = SealContext(CKKSParams(ring, bits, bits[1], "none"))
        sa, ev = seal.sa, seal.evaluator
        keygen = sa.KeyGenerator(seal.context)
        public, relin, galois = sa.PublicKey(), sa.RelinKeys(), sa.GaloisKeys()
        keygen.create_public_key(public)
        keygen.create_relin_keys(relin)
        keygen.create_galois_keys([galois_element(1, ring)], galois)
        digits = len(bits) - 1
        keys += [_key_observation(ring, bits, 1, 2, len(seal.dump(public))),
                 _key_observation(ring, bits, digits, 2, len(seal.dump(relin))),
                 _key_observation(ring, bits, digits, 2, len(seal.dump(galois)))]
        top = sa.Ciphertext()
        sa.Encryptor(seal.context, public).encrypt(
            seal.encode(rng.random(ring // 2), seal.context.first_parms_id(), seal.params.scale), top)
        for drop in sorted({0, digits // 2, digits - 2}):
            ct = sa.Ciphertext()
            ev.mod_switch_to(top, seal.parms_id_at(drop), ct)
            primes = digits - drop
            probes += _seal_level(seal, ct, ring, primes, relin, galois, rng, repeats)
        del public, relin, galois, keygen, top
        log.info("calibrated SEAL at N=%d", ring)
    return probes, keys


def _seal_level(seal, ct, ring: int, primes: int, relin, galois, rng, repeats: int) -> list[Probe]:
    from polyfhe.engines.seal.native import native_kernels

    sa, ev = seal.sa, seal.evaluator
    vec = rng.random(ring // 2)
    # products and sums stream over distinct plaintexts and ciphertexts, as a program's diagonals do: one hot
    # plaintext in cache measured 0.82x the product time inside a real program
    plains = [seal.encode(rng.random(ring // 2), ct.parms_id(), seal.params.scale) for _ in range(STREAM)]
    out, product = sa.Ciphertext(), sa.Ciphertext()
    ev.multiply_plain(ct, plains[0], product)
    outs = [sa.Ciphertext() for _ in range(STREAM)]
    for o in outs:
        ev.multiply_plain(ct, plains[0], o)

    native = native_kernels(seal)
    sources = [native.copy(ct) for _ in range(STREAM)] if native is not None and native.dot_terms else []

    def plain_products():
        if sources:  # what a giant step runs: the dot kernel over distinct rotations, their sum included
            native.dot(sources, plains)
            return
        for pt, o in zip(plains, outs, strict=True):
            ev.multiply_plain(ct, pt, o)

    def adds():
        for o in outs:
            ev.add_inplace(product, o)

    def ct_product():
        res = sa.Ciphertext()
        ev.multiply(ct, ct, res)
        ev.relinearize_inplace(res, relin)

    timed = {
        "rotation": (lambda: ev.rotate_vector(ct, 1, galois, out), primes, 1),
        "encode": (lambda: seal.encode(vec, ct.parms_id(), seal.params.scale), 0, 1),
        "plain_product": (plain_products, 0, STREAM),
        "ct_product": (ct_product, primes, 1),
        "rescale": (lambda: ev.rescale_to_next(product, out), 0, 1),
        "add": (adds, 0, STREAM),
    }
    probes = []
    for op, (fn, digits, count) in timed.items():
        fn()  # warm
        probes.append(Probe(f"seal {op} N={ring} p={primes}", {OpSite(op, ring, primes, digits): float(count)},
                            best_seconds(fn, repeats)))
    return probes


# --------------------------------------------------------------------------------------------------------------
# Lattigo (through the evaluator's model container)
# --------------------------------------------------------------------------------------------------------------
def _node(name: str, op: str, level: int, config: dict | None = None, refs: dict | None = None) -> dict:
    return {"name": name, "op": op, "level": level, "depth": 1 if op == "linear_transform" else 0, "shape": {},
            "config": config or {}, "blob_refs": refs or {}}


def graph_container(params: CKKSParams, nodes: list[dict], edges: list[tuple[str, str]], blobs: list[bytes],
                    galois_steps: list[int], relin: bool, spec: dict | None = None) -> bytes:
    """An Orion v2 container for a hand-made graph (the layout ``lattigo_format.lower_program`` writes)."""
    from polyfhe.engines.lattigo.format import write_container

    return write_container(params, spec, galois_steps, relin, params.levels, int(spec is not None),
                           (nodes[0]["name"], nodes[-1]["name"]), nodes,
                           [{"src": s, "dst": d} for s, d in edges], blobs)


def transform_split(ks, slots: int, log_ratio: int) -> tuple[list[int], list[int]]:
    from polyfhe.engines.lattigo.format import bsgs_rotations

    return bsgs_rotations([int(k) for k in ks], slots, log_ratio)


def _transform_chain(params: CKKSParams, ks, log_ratio: int, rng, most: int = 8
                     ) -> tuple[list[dict], list, list[bytes], Tally]:
    """One transform per level from the top down (at most ``most``; the output keeps two primes)."""
    n, slots, top = params.poly_modulus_degree, params.slots, params.levels
    giants, babies = transform_split(ks, slots, log_ratio)
    nodes, edges, blobs, tally = [_node("input", "flatten", top)], [], [], {}
    for i, level in enumerate(range(top, max(1, top - most), -1)):
        diags = rng.random((len(ks), slots)) * 1e-3
        blobs.append(struct.pack("<I", len(ks)) + np.asarray(ks, "<i4").tobytes() + diags.astype("<f8").tobytes())
        config = {"bsgs_ratio": float(2.0**log_ratio), "output_rotations": 0, "num_input_cts": 1,
                  "num_output_cts": 1}
        nodes.append(_node(f"t{i}", "linear_transform", level, config, {"diag_0_0": i}))
        edges.append((nodes[-2]["name"], nodes[-1]["name"]))
        tally = merge(tally, transform_tally(n, level + 1, len(ks), len(giants), len(babies)))
    return nodes, edges, blobs, tally


def transform_tally(ring: int, primes: int, diagonals: int, giants: int, babies: int, digits: int | None = None,
                    special: int = 1) -> Tally:
    """One Lattigo linear transform (hoisted BSGS) on a ciphertext of ``primes`` primes; its ``encode`` sites are
    paid when the model is loaded (every diagonal over the ciphertext's and the special primes), not per query."""
    d = primes if digits is None else digits
    return {OpSite("transform", ring, primes, d, special): 1.0, OpSite("plain_product", ring, primes): diagonals,
            OpSite("rotation", ring, primes, d, special): giants,
            OpSite("hoisted_rotation", ring, primes, d, special): babies,
            OpSite("encode", ring, primes + special): diagonals}


def _square_chain(params: CKKSParams) -> tuple[list[dict], list, list[bytes], Tally]:
    n, top = params.poly_modulus_degree, params.levels
    nodes, edges, tally = [_node("input", "flatten", top)], [], {}
    for i, level in enumerate(range(top, 1, -1)):  # the output keeps two primes
        nodes.append(_node(f"q{i}", "quad", level))
        edges.append((nodes[-2]["name"], nodes[-1]["name"]))
        tally = merge(tally, {OpSite("ct_product", n, level + 1, level + 1): 1.0,
                              OpSite("rescale", n, level + 1): 1.0})
    return nodes, edges, [], tally


def _add_chain(params: CKKSParams) -> tuple[list[dict], list, list[bytes], Tally]:
    top = params.levels
    nodes, edges = [_node("input", "flatten", top)], []
    for i in range(ADD_CHAIN):
        nodes.append(_node(f"a{i}", "add", top))
        edges += [(nodes[-2]["name"], nodes[-1]["name"])] * 2
    return nodes, edges, [], {OpSite("add", params.poly_modulus_degree, top + 1): float(ADD_CHAIN)}


def lattigo_probes(chains=LATTIGO_CHAINS, repeats: int = 3) -> tuple[list[Probe], list[KeyObservation]]:
    """Graph probes at every ring (each includes one query's input/output marshalling: the ``io`` site)."""
    from polyfhe.engines.lattigo.engine import _client_lib, _evaluator_lib
    from polyfhe.engines.lattigo.format import evaluation_key_set, galois_element, lattigo_params

    ckks, rlwe = _client_lib()
    evaluator_lib = _evaluator_lib()
    rng = np.random.default_rng(0)
    probes, keys = [], []
    for ring, bits in chains:
        params = CKKSParams(ring, bits, bits[1], "none")
        transforms = [t for t in TRANSFORMS if ring <= t[4]]
        steps = sorted({s for _, ks, r, _, _ in transforms for part in transform_split(ks, params.slots, r)
                        for s in part})
        lparams = ckks.Parameters.from_dict(lattigo_params(params))
        keygen = rlwe.KeyGenerator(lparams)
        secret = keygen.gen_secret_key()
        public = keygen.gen_public_key(secret)
        relin = keygen.gen_relin_key(secret).marshal_binary()
        galois = {galois_element(s, ring): keygen.gen_galois_key(secret, galois_element(s, ring)).marshal_binary()
                  for s in steps}
        keys += [_key_observation(ring, bits, len(bits) - 1, 2, len(relin)),
                 _key_observation(ring, bits, len(bits) - 1, 2, len(next(iter(galois.values()))))]
        encoder = ckks.Encoder(lparams)
        plain = encoder.encode((rng.random(params.slots) * 0.1).tolist(), params.levels, 1 << params.scale_bits)
        ct = rlwe.Encryptor(lparams, public).encrypt_new(plain).marshal_binary()
        evaluator = evaluator_lib.Evaluator(lattigo_params(params), b"".join(evaluation_key_set(relin, galois)))
        del galois
        graphs = [("identity", ([_node("input", "flatten", params.levels)], [], [], {}))]
        graphs += [(name, _transform_chain(params, ks, r, rng, most)) for name, ks, r, most, _ in transforms]
        graphs += [("squares", _square_chain(params)), ("adds", _add_chain(params))]
        io = {OpSite("io", ring, params.levels + 1): 1.0}
        for name, (nodes, edges, blobs, tally) in graphs:
            container = graph_container(params, nodes, edges, blobs, steps, True)
            encodes = {s: c for s, c in tally.items() if s.op == "encode"}
            tally = {s: c for s, c in tally.items() if s.op != "encode"}
            if encodes:  # loading a model encodes every diagonal (at its level plus the special prime)
                loads = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    evaluator_lib.Model.load(container).close()
                    loads.append(time.perf_counter() - t0)
                probes.append(Probe(f"lattigo load {name} N={ring}", encodes, min(loads)))
            model = evaluator_lib.Model.load(container)
            evaluator.forward(model, [ct])  # warm
            seconds = best_seconds(lambda m=model, e=evaluator, c=ct: e.forward(m, [c]), repeats)
            model.close()
            probes.append(Probe(f"lattigo {name} N={ring}", merge(tally, io), seconds))
        evaluator.close()
        for obj in (plain, public, secret, keygen, encoder, lparams):
            obj.close()
        log.info("calibrated Lattigo at N=%d", ring)
    return probes, keys


# --------------------------------------------------------------------------------------------------------------
def measure_base_rss(engine: str) -> int:
    """Resident bytes of a fresh server process with the runtime and the engine loaded (no keys yet)."""
    code = {"seal": "import polyfhe.engines.seal.server, polyfhe.engines.seal.context as s; s.require_tenseal()",
            "lattigo": "import polyfhe.runtime.execute; from polyfhe.engines.lattigo import engine as l; "
                       "l._client_lib(); l._evaluator_lib()"}[engine]
    probe = (f"{code}\nfor line in open('/proc/self/status'):\n"
             "    if line.startswith('VmRSS:'): print(int(line.split()[1]) * 1024)")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        log.warning("could not measure the %s server's base memory (%s); assuming 300 MB", engine, exc)
        return 300 << 20


CALIBRATORS: dict[str, Callable[[], tuple[list[Probe], list[KeyObservation]]]] = {
    "seal": seal_probes, "lattigo": lattigo_probes}
