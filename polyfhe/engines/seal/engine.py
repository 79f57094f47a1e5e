"""Microsoft SEAL through TenSEAL's ``sealapi``: both layouts, keys compressed with zstd, no hoisting."""

from __future__ import annotations

import os

from polyfhe.program.engine_api import Backend, BackendUnavailable, CostTraits

__all__ = ["BACKEND", "COST", "SERVER_IMPORTS", "eval_threads"]

# what a fresh server process loads before any key: its resident memory is the server's base
SERVER_IMPORTS = "import polyfhe.engines.seal.server, polyfhe.engines.seal.context as s; s.require_tenseal()"


def _available() -> None:
    try:
        import tenseal.sealapi  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable("the SEAL backend needs TenSEAL: pip install 'tenseal==0.3.18'") from exc


def _prepare(program):
    return program  # the plan is SEAL's own format


def _client(manifest, **kwargs):
    from polyfhe.engines.seal.client import CKKSClient

    return CKKSClient(manifest, **kwargs)


def _restore(manifest, secret_context: bytes, public_context: bytes | None = None):
    from polyfhe.engines.seal.client import CKKSClient

    return CKKSClient.load(manifest, secret_context, public_context)


def _decoded_context_bytes(program, upload: int) -> int:
    """The keys' size once inflated: exact, since the server refuses anything that inflates further."""
    from polyfhe.engines.seal.sealbytes import decoded_context_bytes
    from polyfhe.program.boundary import galois_element

    n = program.params.poly_modulus_degree
    elements = {galois_element(step, n) for step in program.manifest.galois_steps}
    return max(upload, decoded_context_bytes(n, len(program.params.coeff_mod_bits), len(elements)))


def _max_context_bytes(program) -> int:
    """The most bytes a valid public context can have on the wire: its SEAL objects uncompressed (a client may
    send them so), plus zstd's or zlib's worst-case growth on incompressible bytes (at most 1/256 of the input and
    a frame's fixed overhead per object), plus the container's prefix and the largest header it may carry."""
    from polyfhe.program.wire import MAGIC, MAX_HEADER

    decoded = _decoded_context_bytes(program, 0)
    objects = 3  # public key, relinearisation keys, Galois keys
    return len(MAGIC) + 5 + MAX_HEADER + decoded + decoded // 256 + objects * 1024


def _context_bytes(params, galois_steps) -> int:
    from polyfhe.engines.seal.wiresize import public_context_bytes

    return public_context_bytes(params, galois_steps)


# a serialised Galois key's bytes after zstd, a share of its uncompressed size (what the planner's key budget counts)
KEY_COMPRESSION = 0.75


def _galois_key_bytes(params) -> int:
    """Serialized size of one Galois key (zstd-compressed, as SEAL writes it)."""
    from polyfhe.program.sizes import key_switching_key_bytes

    primes = len(params.coeff_mod_bits)
    return int(key_switching_key_bytes(params.poly_modulus_degree, primes - 1, primes) * KEY_COMPRESSION)


def _server(program, public_context: bytes, **kwargs):
    from polyfhe.engines.seal.server import CKKSServer

    return CKKSServer(program, public_context, **kwargs)


def eval_threads() -> int:
    """Threads a SEAL evaluation on this machine keeps busy: the executor's (``POLYFHE_THREADS``, at most the
    cores) when SEAL's kernels run without the GIL, else one."""
    from polyfhe.engines.seal.native import native_available
    from polyfhe.runtime.execute import default_threads

    return max(1, min(default_threads(), os.cpu_count() or 1)) if native_available() else 1


# What SEAL runs without the GIL (``native.py``), spread over the executor's threads, and what each thread past the
# first adds (docs/benchmarks.md: a 1.86x speedup on two threads). The server keeps the public context bytes and
# the decoded keys twice (the client's and the server's).
COST = CostTraits(public_key_in_context=True, encodes_at_load=False,
                  parallel_ops=frozenset({"rotation", "plain_product", "add"}), thread_efficiency=0.86,
                  key_copies=1.0, decoded_key_copies=2.0, threads=eval_threads)


def _workload(program):
    from polyfhe.engines.seal.tally import compiled_workload

    return compiled_workload(program)


def _probes():
    from polyfhe.engines.seal.probes import seal_probes

    return seal_probes()


def _warm_plaintexts(program):
    from polyfhe.engines.seal.prewarm import warm_plaintexts

    return warm_plaintexts(program)


def _build_notes() -> str:
    from polyfhe.engines.seal.hoist import hoisting_available
    from polyfhe.engines.seal.native import dot_available

    return f"dot-kernel={'on' if dot_available() else 'off'},hoisting={'on' if hoisting_available() else 'off'}"


BACKEND = Backend("seal", "Microsoft SEAL 4.x through TenSEAL's sealapi", ("single", "batch"), _available, _prepare,
                  _client, _server, restore=_restore, decoded_context_bytes=_decoded_context_bytes,
                  context_bytes=_context_bytes, max_context_bytes=_max_context_bytes,
                  distributions=("tenseal",), build_notes=_build_notes, workload=_workload, probes=_probes,
                  server_imports=SERVER_IMPORTS, cost=COST, warm_plaintexts=_warm_plaintexts,
                  galois_key_bytes=_galois_key_bytes, web_client=True)
