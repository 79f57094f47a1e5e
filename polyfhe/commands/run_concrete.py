"""``polyfhe run DIR`` for a Concrete ML program: keys, encrypt, evaluate, decrypt, and the float model beside it."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["encrypted_run_concrete", "render"]


def encrypted_run_concrete(program: Any, x: np.ndarray) -> dict:
    """One client and one server (each a worker process); every sample is one query. The reference is the float
    ONNX graph the program was compiled from (onnxruntime), so the error shown includes quantisation."""
    from polyfhe.ort_providers import inference_session

    client = program.client()
    try:
        context = client.public_context()
        server = program.server(context)
        try:
            logits, enc_s, eval_s, dec_s, sizes = [], 0.0, 0.0, 0.0, [0, 0]
            for sample in x:
                t0 = time.perf_counter()
                query = client.encrypt(sample)
                t1 = time.perf_counter()
                answer = server.run(query)
                t2 = time.perf_counter()
                logits.append(client.decrypt(answer)[0])
                dec_s += time.perf_counter() - t2
                enc_s, eval_s = enc_s + t1 - t0, eval_s + t2 - t1
                sizes = [len(query), len(answer)]
        finally:
            server.close()
    finally:
        client.close()
    logits = np.asarray(logits)
    session = inference_session(str(program.directory / "model.onnx"))
    plain = session.run(None, {session.get_inputs()[0].name: x.astype(np.float32)})[0].reshape(len(x), -1)
    n = len(x)
    return {
        "program_id": program.program_id, "scheme": program.scheme, "layout": "single",
        "params": f"TFHE, n_bits={program.manifest.n_bits}, {program.manifest.quantization}", "samples": n,
        "classes": logits.argmax(axis=1).tolist(), "plain_classes": plain.argmax(axis=1).tolist(),
        "logits": logits.tolist(), "max_abs_error": float(np.abs(logits - plain).max()),
        "timings": {"keygen": client.keygen_seconds, "encrypt": enc_s / n, "evaluate": eval_s / n,
                    "server_total": eval_s / n, "decrypt": dec_s / n},
        "sizes": {"public_context": len(context), "input_ciphertext": sizes[0], "output_ciphertext": sizes[1]},
        "counts": {}, "plaintext_cache": {}, "keys": {"restored": False},
        "reference": "float ONNX model (the error includes quantisation)",
    }


def render(r: dict) -> None:
    from polyfhe.commands.render import render_run_result

    render_run_result(r)
    from rich.console import Console

    Console(width=140).print(f"(times per sample; error against the {r['reference']})")
