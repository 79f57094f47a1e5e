"""Encrypted-inference demo server (``polyfhe serve``) and its HTTP client (``polyfhe client``).

The server holds CKKS programs and, per session, a client's *public* context; it turns input ciphertexts
into output ciphertexts and never sees a secret key or a plaintext. See ``docs/serve.md``.
"""

from __future__ import annotations

__all__ = ["ServeClient", "ServeConfig", "ServeError", "create_app"]


def __getattr__(name: str):
    # Lazy: the client side must not import FastAPI, the server side must not import httpx.
    if name == "ServeConfig":
        from polyfhe.serve.config import ServeConfig

        return ServeConfig
    if name == "create_app":
        from polyfhe.serve.app import create_app

        return create_app
    if name in ("ServeClient", "ServeError"):
        from polyfhe.serve import http_client

        return getattr(http_client, name)
    raise AttributeError(f"module 'polyfhe.serve' has no attribute {name!r}")
