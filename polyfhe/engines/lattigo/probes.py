"""Lattigo's calibration probes, through the evaluator's model container: its evaluator runs whole model graphs,
so a probe is a small graph (a chain of linear transforms of a chosen baby-step giant-step split, of ct x ct
squares, or of adds) and its tally lists every operation in it; the sizes of Lattigo's keys fit
:class:`~polyfhe.runtime.opcosts.KeyBytesModel`.

Calibration rings use insecure (short) chains on purpose: only timings and sizes are kept, never the keys.
"""

from __future__ import annotations

import logging
import struct
import time

import numpy as np

from polyfhe.engines.lattigo.format import (
    bsgs_rotations,
    evaluation_key_set,
    galois_element,
    lattigo_params,
    write_container,
)
from polyfhe.engines.lattigo.tally import transform_tally
from polyfhe.program.params import CKKSParams
from polyfhe.runtime.opcosts import KeyObservation, OpSite, Probe, Tally, best_seconds, key_observation, merge

__all__ = ["LATTIGO_CHAINS", "graph_container", "graph_node", "lattigo_probes", "transform_split"]

log = logging.getLogger(__name__)

LATTIGO_CHAINS = ((8192, (60,) + (40,) * 4 + (60,)), (16384, (50,) + (35,) * 7 + (50,)),
                  (32768, (60,) + (30,) * 5 + (60,)), (65536, (60,) + (40,) * 4 + (60,)))
# transform probes: (name, diagonal indices, log2 bsgs ratio, most transforms in the chain, largest ring); the
# wide ones separate per-diagonal from per-rotation costs (real maps have hundreds of diagonals, about eight per
# rotation: without the 256-diagonal map the fit could trade plaintext products for rotations)
TRANSFORMS = (("one diagonal", (0,), 0, 8, 1 << 16), ("babies", (0, 1, 2, 3), 5, 8, 1 << 16),
              ("giants", (0, 4, 8, 12), 0, 8, 1 << 16), ("16 diagonals", tuple(range(16)), 0, 8, 1 << 16),
              ("64 diagonals", tuple(range(64)), 2, 2, 1 << 14), ("256 diagonals", tuple(range(256)), 0, 2, 1 << 13))
ADD_CHAIN = 40


def graph_node(name: str, op: str, level: int, config: dict | None = None, refs: dict | None = None) -> dict:
    """A node of the evaluator's model graph (the layout ``lower_program`` writes)."""
    return {"name": name, "op": op, "level": level, "depth": 1 if op == "linear_transform" else 0, "shape": {},
            "config": config or {}, "blob_refs": refs or {}}


def graph_container(params: CKKSParams, nodes: list[dict], edges: list[tuple[str, str]], blobs: list[bytes],
                    galois_steps: list[int], relin: bool, spec: dict | None = None) -> bytes:
    """An Orion v2 container for a hand-made graph (the layout ``lattigo_format.lower_program`` writes)."""
    return write_container(params, spec, galois_steps, relin, params.levels, int(spec is not None),
                           (nodes[0]["name"], nodes[-1]["name"]), nodes,
                           [{"src": s, "dst": d} for s, d in edges], blobs)


def transform_split(ks, slots: int, log_ratio: int) -> tuple[list[int], list[int]]:
    return bsgs_rotations([int(k) for k in ks], slots, log_ratio)


def _transform_chain(params: CKKSParams, ks, log_ratio: int, rng, most: int = 8
                     ) -> tuple[list[dict], list, list[bytes], Tally]:
    """One transform per level from the top down (at most ``most``; the output keeps two primes)."""
    n, slots, top = params.poly_modulus_degree, params.slots, params.levels
    giants, babies = transform_split(ks, slots, log_ratio)
    nodes, edges, blobs, tally = [graph_node("input", "flatten", top)], [], [], {}
    for i, level in enumerate(range(top, max(1, top - most), -1)):
        diags = rng.random((len(ks), slots)) * 1e-3
        blobs.append(struct.pack("<I", len(ks)) + np.asarray(ks, "<i4").tobytes() + diags.astype("<f8").tobytes())
        config = {"bsgs_ratio": float(2.0**log_ratio), "output_rotations": 0, "num_input_cts": 1,
                  "num_output_cts": 1}
        nodes.append(graph_node(f"t{i}", "linear_transform", level, config, {"diag_0_0": i}))
        edges.append((nodes[-2]["name"], nodes[-1]["name"]))
        tally = merge(tally, transform_tally(n, level + 1, len(ks), len(giants), len(babies)))
    return nodes, edges, blobs, tally


def _square_chain(params: CKKSParams) -> tuple[list[dict], list, list[bytes], Tally]:
    n, top = params.poly_modulus_degree, params.levels
    nodes, edges, tally = [graph_node("input", "flatten", top)], [], {}
    for i, level in enumerate(range(top, 1, -1)):  # the output keeps two primes
        nodes.append(graph_node(f"q{i}", "quad", level))
        edges.append((nodes[-2]["name"], nodes[-1]["name"]))
        tally = merge(tally, {OpSite("ct_product", n, level + 1, level + 1): 1.0,
                              OpSite("rescale", n, level + 1): 1.0})
    return nodes, edges, [], tally


def _add_chain(params: CKKSParams) -> tuple[list[dict], list, list[bytes], Tally]:
    top = params.levels
    nodes, edges = [graph_node("input", "flatten", top)], []
    for i in range(ADD_CHAIN):
        nodes.append(graph_node(f"a{i}", "add", top))
        edges += [(nodes[-2]["name"], nodes[-1]["name"])] * 2
    return nodes, edges, [], {OpSite("add", params.poly_modulus_degree, top + 1): float(ADD_CHAIN)}


def lattigo_probes(client_lib, evaluator_lib, chains=LATTIGO_CHAINS, repeats: int = 3
                   ) -> tuple[list[Probe], list[KeyObservation]]:
    """Graph probes at every ring (each includes one query's input/output marshalling: the ``io`` site), on the
    engine's loaded wheels: ``client_lib`` (ckks, rlwe) and ``evaluator_lib``."""
    ckks, rlwe = client_lib
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
        keys += [key_observation(ring, bits, len(bits) - 1, 2, len(relin)),
                 key_observation(ring, bits, len(bits) - 1, 2, len(next(iter(galois.values()))))]
        encoder = ckks.Encoder(lparams)
        plain = encoder.encode((rng.random(params.slots) * 0.1).tolist(), params.levels, 1 << params.scale_bits)
        ct = rlwe.Encryptor(lparams, public).encrypt_new(plain).marshal_binary()
        evaluator = evaluator_lib.Evaluator(lattigo_params(params), b"".join(evaluation_key_set(relin, galois)))
        del galois
        graphs = [("identity", ([graph_node("input", "flatten", params.levels)], [], [], {}))]
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
