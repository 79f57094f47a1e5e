"""Lattigo's operation tallies: one hoisted BSGS linear transform, a compiled program's workload (counted from the
evaluator's container: hoisted baby steps apart from giant steps; ``encode`` sites are paid when the model loads,
each diagonal over its level's primes and the special prime), and one estimated multi-ciphertext linear map."""

from __future__ import annotations

import math
import struct

import numpy as np

from polyfhe.engines.lattigo.format import bootstrap_spec, bsgs_rotations, lower_program, parse_container
from polyfhe.program.sizes import poly_bytes
from polyfhe.runtime.opcosts import OpSite, Tally, merge
from polyfhe.runtime.workload_types import Workload, empty_counters

__all__ = ["compiled_workload", "traced_linear", "transform_tally"]


def transform_tally(ring: int, primes: int, diagonals: int, giants: int, babies: int, digits: int | None = None,
                    special: int = 1) -> Tally:
    """One Lattigo linear transform (hoisted BSGS) on a ciphertext of ``primes`` primes; its ``encode`` sites are
    paid when the model is loaded (every diagonal over the ciphertext's and the special primes), not per query."""
    d = primes if digits is None else digits
    return {OpSite("transform", ring, primes, d, special): 1.0, OpSite("plain_product", ring, primes): diagonals,
            OpSite("rotation", ring, primes, d, special): giants,
            OpSite("hoisted_rotation", ring, primes, d, special): babies,
            OpSite("encode", ring, primes + special): diagonals}


def traced_linear(n: int, primes: int, products: int, giants: int, babies: int, n_in: int, n_out: int) -> Tally:
    """An estimated linear map over ``n_in`` input and ``n_out`` output ciphertexts: hoisted transforms, one per
    ciphertext pair beyond the first sharing its work, and the additions that sum them."""
    tally = merge(transform_tally(n, primes, products, giants, babies), {OpSite("add", n, primes): products})
    site = OpSite("transform", n, primes, primes)
    tally[site] = tally.get(site, 0) + max(n_in, n_out) - 1
    return tally


def compiled_workload(program) -> Workload:
    """The workload of a compiled Lattigo program, counted from the container its evaluator runs."""
    m = program.manifest
    params, n = m.params, m.params.poly_modulus_degree
    header, blobs = parse_container(lower_program(program).data)
    tally: Tally = {OpSite("io", n, params.levels + 1): 1.0}
    plaintexts = plain_bytes = bootstraps = 0
    counters = empty_counters()
    consumers: dict[str, int] = {}
    for edge in header["graph"]["edges"]:
        consumers[edge["src"]] = consumers.get(edge["src"], 0) + 1
    live, peak = 1, 1
    for node in header["graph"]["nodes"]:
        op, primes = node["op"], int(node["level"]) + 1
        if op == "linear_transform":
            raw = blobs[node["blob_refs"]["diag_0_0"]]
            (count,) = struct.unpack_from("<I", raw)
            ks = np.frombuffer(raw, "<i4", count, 4)
            log_ratio = round(math.log2(float(node["config"]["bsgs_ratio"])))
            giants, babies = bsgs_rotations([int(k) for k in ks], params.slots, log_ratio)
            doublings = int(node["config"]["output_rotations"])
            tally = merge(tally, transform_tally(n, primes, count, len(giants), len(babies)),
                          {OpSite("rotation", n, primes - 1, primes - 1): doublings,
                           OpSite("add", n, primes - 1): doublings + ("bias_0" in node["blob_refs"]),
                           OpSite("encode", n, primes): float("bias_0" in node["blob_refs"])})
            counters["rotations"] += len(giants) + len(babies) + doublings
            counters["key_switches"] += len(giants) + len(babies) + doublings
            counters["plain_products"] += count
            held = count + ("bias_0" in node["blob_refs"])
            plaintexts += held
            plain_bytes += held * poly_bytes(n, primes + 1)  # each at its level plus the special prime
            peak = max(peak, live + len(babies) + 2)
        elif op in ("quad", "mult"):
            tally = merge(tally, {OpSite("ct_product", n, primes, primes): 1.0, OpSite("rescale", n, primes): 1.0})
            counters["key_switches"] += 1
        elif op == "add":
            tally = merge(tally, {OpSite("add", n, primes): 1.0})
        elif op == "bootstrap":
            bootstraps += 1
        live += 1 if consumers.get(node["name"]) else 0
        peak = max(peak, live)
    counters["encodes_cold"] = plaintexts
    return Workload("lattigo", "compiled", params, tally, galois_keys=len(m.galois_steps),
                    relin=any(s.op == "mul" for s in m.steps), plaintexts=plaintexts, plaintext_bytes=plain_bytes,
                    live_ciphertexts=peak, samples=m.samples_per_ciphertext, bootstraps=bootstraps,
                    boot_spec=bootstrap_spec(m), counters=counters)
