"""Microsoft SEAL through TenSEAL's ``sealapi``: both layouts, keys compressed with zstd, no hoisting."""

from __future__ import annotations

from polyfhe.fhe.backends.base import Backend, BackendUnavailable

__all__ = ["BACKEND"]


def _available() -> None:
    try:
        import tenseal.sealapi  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable("the SEAL backend needs TenSEAL: pip install 'tenseal==0.3.18'") from exc


def _prepare(program):
    return program  # the plan is SEAL's own format


def _client(manifest, **kwargs):
    from polyfhe.fhe.client import CKKSClient

    return CKKSClient(manifest, **kwargs)


def _server(program, public_context: bytes, **kwargs):
    from polyfhe.fhe.server import CKKSServer

    return CKKSServer(program, public_context, **kwargs)


BACKEND = Backend("seal", "Microsoft SEAL 4.x through TenSEAL's sealapi", ("single", "batch"), _available, _prepare,
                  _client, _server)
