"""Microsoft SEAL through TenSEAL's ``sealapi``: both layouts, keys compressed with zstd, no hoisting."""

from __future__ import annotations

from polyfhe.program.engine_api import Backend, BackendUnavailable

__all__ = ["BACKEND"]


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


def _server(program, public_context: bytes, **kwargs):
    from polyfhe.engines.seal.server import CKKSServer

    return CKKSServer(program, public_context, **kwargs)


def _build_notes() -> str:
    from polyfhe.engines.seal.native import dot_available

    return f"dot-kernel={'on' if dot_available() else 'off'}"


BACKEND = Backend("seal", "Microsoft SEAL 4.x through TenSEAL's sealapi", ("single", "batch"), _available, _prepare,
                  _client, _server, restore=_restore, decoded_context_bytes=_decoded_context_bytes,
                  distributions=("tenseal",), build_notes=_build_notes)
