"""The naive baseline for bench/ckks.py: the same network on TenSEAL's own ops (``CKKSVector.mm``/``square``).

``CKKSVector.mm`` needs its input replicated over all slots, and a plain bias added after ``mm`` breaks that
replication for the next ``mm`` (docs: ckks.md 1.2). So biases ride in a constant-1 channel: the input is
``[x, 1]``, hidden layers use ``[[W^T, 0], [b, 1]]`` (the square of 1 stays 1), the last one ``[[W^T], [b]]``.
Models that are not Linear/square stacks get an *estimate* instead: TenSEAL's measured cost per input row of
``mm`` times the rows of every linear map of the compiled program, plus measured squares for the products.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
from torch import nn


class Square(nn.Module):
    """x -> x * x, the activation of the digits MLP."""

    def forward(self, x):
        return x * x


def augmented_layers(model: nn.Module) -> list[tuple[str, np.ndarray | None]] | None:
    """("mm", matrix) / ("square", None) ops with the constant-1 bias channel; None for other models."""
    mods = [m for m in model.modules() if not isinstance(m, (nn.Sequential, nn.Flatten))]
    if not mods or not isinstance(mods[-1], nn.Linear):
        return None
    if not all(isinstance(m, (nn.Linear, Square)) for m in mods):
        return None
    ops: list[tuple[str, np.ndarray | None]] = []
    for i, m in enumerate(mods):
        if isinstance(m, Square):
            ops.append(("square", None))
            continue
        w = m.weight.detach().double().numpy().T
        b = m.bias.detach().double().numpy() if m.bias is not None else np.zeros(w.shape[1])
        if i == len(mods) - 1:
            ops.append(("mm", np.vstack([w, b])))
        else:
            a = np.zeros((w.shape[0] + 1, w.shape[1] + 1))
            a[:-1, :-1], a[-1, :-1], a[-1, -1] = w, b, 1.0
            ops.append(("mm", a))
    return ops


def _context(params: Any):
    import tenseal as ts

    t0 = time.perf_counter()
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, params.poly_modulus_degree,
                     coeff_mod_bit_sizes=list(params.coeff_mod_bits))
    ctx.global_scale = 2.0**params.scale_bits
    ctx.generate_galois_keys()  # SEAL's default power-of-two set: what CKKSVector.mm rotates with
    return ctx, time.perf_counter() - t0


def run_naive(model: nn.Module, params: Any, x: np.ndarray, reference: np.ndarray, runs: int = 2) -> dict | None:
    """Encrypted inference with TenSEAL ops on one flattened sample ``x``; per-layer wall times.

    Runs ``runs`` times on one context: the first is the *cold* run (``latency_cold_s``, ``layers``), the median of
    the later ones the *warm* latency (``latency_warm_s``, ``layers_warm``: the same ops after a first pass, as our
    warm median is), so speedups compare like with like. ``latency_s`` is the cold latency."""
    import tenseal as ts

    ops = augmented_layers(model)
    if ops is None:
        return None
    ctx, keygen = _context(params)
    passes = []
    for _ in range(max(1, runs)):
        t0 = time.perf_counter()
        enc = ts.ckks_vector(ctx, np.append(x.ravel(), 1.0).tolist())
        encrypt = time.perf_counter() - t0
        query = len(enc.serialize())
        layers = []
        for name, matrix in ops:
            t0 = time.perf_counter()
            enc = enc.mm(matrix.tolist()) if name == "mm" else enc.square()
            label = f"mm {matrix.shape[0]}x{matrix.shape[1]}" if name == "mm" else "square"
            layers.append({"op": label, "seconds": time.perf_counter() - t0})
        passes.append((encrypt, layers))
    t0 = time.perf_counter()
    y = np.asarray(enc.decrypt())
    decrypt = time.perf_counter() - t0
    latencies = [sum(layer["seconds"] for layer in layers) for _, layers in passes]
    warm = statistics.median(latencies[1:]) if len(latencies) > 1 else None
    return {
        "kind": "measured", "keygen_s": keygen, "encrypt_s": passes[0][0], "decrypt_s": decrypt,
        "layers": passes[0][1], "layers_warm": passes[-1][1] if len(passes) > 1 else None,
        "latency_s": latencies[0], "latency_cold_s": latencies[0], "latency_warm_s": warm,
        "public_context_bytes": len(ctx.serialize(save_secret_key=False)), "input_bytes": query,
        "output_bytes": len(enc.serialize()),
        "max_error": float(np.abs(y[: reference.size] - reference.ravel()).max()),
    }


def _map_rows(program: Any) -> list[int]:
    """Input rows per linear map of a compiled program (the rotations ``mm`` would spend on it)."""
    sizes = {0: program.manifest.input_size}
    rows = []
    for step in program.manifest.steps:
        sizes[step.out] = step.size
        if step.op == "linear":
            rows.append(sum(sizes[t.input] for t in step.terms))
    return rows


def estimate_naive(program: Any, params: Any, probe_rows: int = 64) -> dict:
    """Naive latency from TenSEAL ``mm``/``square`` timed on a ``probe_rows``-row matrix at ``params``."""
    import tenseal as ts

    ctx, keygen = _context(params)
    rng = np.random.default_rng(0)
    enc = ts.ckks_vector(ctx, rng.random(probe_rows).tolist())
    matrix = rng.normal(size=(probe_rows, probe_rows)).tolist()
    probes = []  # (seconds per row, seconds per square): the first probe cold, the second warm
    for _ in range(2):
        t0 = time.perf_counter()
        out = enc.mm(matrix)
        per_row = (time.perf_counter() - t0) / probe_rows
        t0 = time.perf_counter()
        out.square()
        probes.append((per_row, time.perf_counter() - t0))
    rows = _map_rows(program)
    products = sum(1 for s in program.manifest.steps if s.op in ("mul", "matmul"))

    def layers_at(per_row: float, square: float) -> list[dict]:
        out = [{"op": f"mm {r} rows (est.)", "seconds": r * per_row} for r in rows]
        return out + ([{"op": f"square x{products} (est.)", "seconds": products * square}] if products else [])

    layers, layers_warm = layers_at(*probes[0]), layers_at(*probes[1])
    cold = sum(layer["seconds"] for layer in layers)
    return {
        "kind": "estimated", "keygen_s": keygen, "per_row_s": probes[0][0], "square_s": probes[0][1],
        "layers": layers, "layers_warm": layers_warm, "latency_s": cold, "latency_cold_s": cold,
        "latency_warm_s": sum(layer["seconds"] for layer in layers_warm),
        "public_context_bytes": len(ctx.serialize(save_secret_key=False)),
        "input_bytes": len(enc.serialize()), "output_bytes": None, "max_error": None,
    }
