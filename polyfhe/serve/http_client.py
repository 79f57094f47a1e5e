"""Python client of the demo server: keys stay here, only the public context and ciphertexts travel.

    with ServeClient("http://127.0.0.1:8000") as api, api.open_session("fashion") as session:
        result = session.infer(x)          # encrypt -> POST -> decrypt; result.label, result.logits
        results = session.infer_many(xs)   # as many samples per request as one ciphertext interleaves

``keyed_session`` keeps a session across processes: a client restored from a key folder resumes the session
its keys opened while the server still holds it, and uploads the same public context again only when not.

The client makes its keys from the model's manifest (``GET /v1/models/NAME/manifest``) and refuses a
manifest whose CKKS parameters are below 128-bit security, since a server could otherwise weaken them. A Concrete
ML model's keys come from its ``client.zip`` (``GET /v1/models/NAME/client.zip``), checked against the manifest.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import numpy as np

from polyfhe.program.boundary import InputError
from polyfhe.program.engines import kind_of, manifest_from_dict
from polyfhe.program.manifest import ProgramError, ProgramManifest
from polyfhe.program.params import security_bits_ok

__all__ = ["InferResult", "RemoteSession", "ServeClient", "ServeError", "read_token"]

log = logging.getLogger(__name__)

OCTETS = {"Content-Type": "application/octet-stream"}
KEEPALIVE_S = 4.0
STREAM_CHUNK = 256 << 10
SESSION_GONE = ("unknown_session", "session_expired", "session_lost")  # the server no longer holds its keys

Progress = Callable[[int, int], None]  # (bytes sent so far, bytes in all) while a large body uploads


class ServeError(RuntimeError):
    """The server refused a request (``status``, ``code``, ``detail``) or could not be reached (status 0)."""

    def __init__(self, status: int, code: str, detail: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {code}: {detail}" if status else f"{code}: {detail}")
        self.status, self.code, self.detail, self.retry_after = status, code, detail, retry_after


@dataclass(frozen=True)
class InferResult:
    logits: np.ndarray  # (classes,)
    label: int
    confidence: float  # softmax probability of ``label``
    timings: dict[str, float]  # seconds of the whole request: encrypt, request (round trip), server, decrypt, total
    bytes_sent: int  # the request's ciphertext
    bytes_received: int
    request_samples: int = 1  # samples that shared the request (one ciphertext); timings and bytes are shared too

    def to_dict(self) -> dict[str, Any]:
        return {"logits": self.logits.tolist(), "class": self.label, "confidence": self.confidence,
                "timings": self.timings, "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "request_samples": self.request_samples}


def softmax_confidence(logits: np.ndarray) -> tuple[int, float]:
    z = np.asarray(logits, dtype=np.float64)
    p = np.exp(z - z.max())
    label = int(z.argmax())
    return label, float(p[label] / p.sum())


def _chunks(content: bytes, progress: Progress | None):
    view = memoryview(content)
    for i in range(0, len(content), STREAM_CHUNK):
        yield bytes(view[i: i + STREAM_CHUNK])
        if progress is not None:
            progress(min(i + STREAM_CHUNK, len(content)), len(content))


def _streamed(kwargs: dict, progress: Progress | None = None) -> dict:
    """Large bodies as 256 KiB chunks with a Content-Length: httpx sends one big ``bytes`` body with a copy
    of the remainder per socket write (measured: 90 s for 1 GB on loopback, 8 s in chunks)."""
    content = kwargs.get("content")
    if not isinstance(content, bytes) or len(content) <= STREAM_CHUNK:
        return kwargs
    chunks = _chunks(content, progress)
    headers = {**kwargs.get("headers", {}), "Content-Length": str(len(content))}
    return {**kwargs, "content": chunks, "headers": headers}


def _refusal(response: httpx.Response) -> ServeError:
    try:
        body = response.json()
        code, detail = str(body.get("error", "error")), str(body.get("detail", response.text))
    except ValueError:
        code, detail = "error", response.text[:500]
    retry = response.headers.get("Retry-After")
    return ServeError(response.status_code, code, detail, float(retry) if retry and retry.isdigit() else None)


def _retryable(response: httpx.Response) -> bool:
    """A refusal that clears by itself soon: the server busy (503), or this client's own uploads at their limit
    (429 ``too_many_uploads``; a session quota does not clear by waiting a few seconds)."""
    if response.status_code == 503:
        return True
    if response.status_code != 429:
        return False
    try:
        return response.json().get("error") == "too_many_uploads"
    except ValueError:
        return False


def read_token(path: str | Path) -> str:
    """The first token of a token file (the format ``polyfhe serve --auth-token-file`` reads)."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ServeError(0, "bad_token_file", f"cannot read the token file {path}: {exc}") from None
    tokens = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise ServeError(0, "bad_token_file", f"the token file {path} holds no token")
    return tokens[0]


class ServeClient:
    """HTTP access to one server; ``retries`` re-sends a 503 after its Retry-After (at most 30 s each).

    ``token``: a bearer token for servers started with ``--auth-token-file``; ``ca_file``: the certificate
    authority (PEM) that signed an HTTPS server's certificate (e.g. a self-signed one), instead of the system's."""

    def __init__(self, url: str, timeout: float = 900.0, retries: int = 3,
                 transport: httpx.BaseTransport | None = None, token: str | None = None,
                 ca_file: str | Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        verify: Any = True
        if ca_file is not None:
            try:
                verify = ssl.create_default_context(cafile=str(ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise ServeError(0, "bad_ca_file", f"cannot use {ca_file} as a certificate authority: {exc}") from None
        # Idle connections are dropped here well before the server's keep-alive ends (30 s for
        # `polyfhe serve`), so a request never goes out on a connection the server is closing.
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=10.0),
                                  limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S), transport=transport,
                                  headers=headers, verify=verify)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, progress: Progress | None = None, **kwargs: Any) -> httpx.Response:
        """One request with 503 retries; :class:`ServeError` for any refusal or connection failure.
        ``progress(sent, total)`` follows a large body's upload."""
        attempt = 0
        while True:
            response = self._send(method, path, kwargs, progress)
            if _retryable(response) and attempt < self.retries:
                attempt += 1
                wait = min(30.0, float(response.headers.get("Retry-After", "1") or 1))
                log.info("server busy (%d); retrying in %.0f s", response.status_code, wait)
                time.sleep(wait)
                continue
            if response.status_code >= 400:
                raise _refusal(response)
            return response

    def _send(self, method: str, path: str, kwargs: dict, progress: Progress | None = None) -> httpx.Response:
        try:
            try:
                return self._http.request(method, path, **_streamed(kwargs, progress))
            except httpx.RemoteProtocolError:
                # A kept-alive connection the server closed just before our request: it never reached the
                # application, so sending it once more on a fresh connection is safe.
                log.info("%s %s: connection closed before a response; sending once more", method, path)
                return self._http.request(method, path, **_streamed(kwargs, progress))
        except httpx.ConnectError as exc:
            raise ServeError(0, "unreachable", f"{method} {self.url}{path} failed: {exc}; is the server running "
                             f"and listening at {self.url}? (start one with `polyfhe serve --programs DIR`, or name "
                             "another with --server URL)") from exc
        except httpx.TimeoutException as exc:
            raise ServeError(0, "unreachable", f"{method} {self.url}{path} timed out: {exc}; the server may be "
                             "overloaded or unreachable (`client infer --timeout S` waits longer)") from exc
        except httpx.HTTPError as exc:
            raise ServeError(0, "unreachable", f"{method} {self.url}{path} failed: {exc}") from exc

    def health(self) -> dict:
        return self.request("GET", "/healthz").json()

    def models(self) -> list[dict]:
        return self.request("GET", "/v1/models").json()["models"]

    def manifest(self, model: str, allow_insecure: bool = False) -> Any:
        """The model's manifest: a CKKS :class:`ProgramManifest` (checked for 128-bit parameters) or a
        Concrete ML one (its security is Concrete's own 128-bit default, fixed when it compiled)."""
        raw = self.request("GET", f"/v1/models/{model}/manifest").json()
        try:
            manifest = manifest_from_dict(raw)  # by the format it names
        except ProgramError as exc:
            raise ServeError(0, "bad_manifest", f"the server sent an unusable manifest: {exc}") from exc
        if not isinstance(manifest, ProgramManifest):  # another scheme's: its security was fixed when it compiled
            return manifest
        if not allow_insecure and (manifest.params.security != "tc128" or not security_bits_ok(manifest.params)):
            raise ServeError(0, "insecure_parameters", f"model {model} uses {manifest.params.describe()}, below "
                             "128-bit security; refusing to make keys for it")
        return manifest

    def open_session(self, model: str, keys: Any = None, allow_insecure: bool = False,
                     progress: Progress | None = None) -> RemoteSession:
        """Make keys (or use ``keys``, a client for this model) and upload the public context once."""
        if keys is None:
            manifest = self.manifest(model, allow_insecure)
            keys = self.make_keys(model, manifest)
        context = keys.public_context()
        t0 = time.perf_counter()
        info = self.request("POST", "/v1/sessions", params={"model": model}, content=context,
                            headers=OCTETS, progress=progress).json()
        upload_s = time.perf_counter() - t0
        log.info("session for model %s opened: %d bytes of public keys in %.2f s", model, len(context), upload_s)
        return RemoteSession(self, str(info["session_id"]), model, keys, len(context), upload_s, info,
                             reopen=lambda: self.open_session(model, keys, progress=progress))

    def make_keys(self, model: str, manifest: Any) -> Any:
        """A key holder for the model, from the client its kind names: a CKKS engine's from the manifest alone;
        Concrete ML's from the model's ``client.zip`` too (fetched, and checked against the manifest's hash)."""
        kind = kind_of(manifest)
        if not kind.client_files:
            return kind.client(manifest)
        import hashlib
        import tempfile

        folder = tempfile.TemporaryDirectory(prefix=f"polyfhe-{kind.engine(manifest)}-client-")
        for name in kind.client_files:
            data = self.request("GET", f"/v1/models/{model}/{name}").content
            if hashlib.sha256(data).hexdigest() != manifest.files.get(name):
                folder.cleanup()
                raise ServeError(0, f"bad_{name.replace('.', '_')}", f"the {name} of {model} does not match its "
                                 "manifest")
            (Path(folder.name) / name).write_bytes(data)
        return kind.client(manifest, folder)

    def keyed_session(self, model: str, keys: Any, session_id: str | None = None,
                      on_open: Callable[[str], None] | None = None, progress: Progress | None = None) -> RemoteSession:
        """A session that outlives this process, for keys restored from a key folder: ``session_id`` (the one
        these keys opened before) is used while the server holds it; otherwise (none given, or the server answers
        404/410 for it) ``keys.public_context()`` is uploaded once and ``on_open(new_id)`` records the new session.
        Closing it leaves it on the server, where it expires after its TTL."""
        def reopen() -> RemoteSession:
            fresh = self.open_session(model, keys, progress=progress)
            if on_open is not None:
                on_open(fresh.id)
            return fresh

        if session_id is None or not self._session_alive(session_id, keys):
            session = reopen()
            session.keep = True
            return session
        return RemoteSession(self, session_id, model, keys, 0, 0.0, {"resumed": True}, keep=True, reopen=reopen,
                             uploads=0)


    def _session_alive(self, session_id: str, keys: Any) -> bool:
        """Whether the server still holds ``session_id`` for these keys' program (GET /v1/sessions/ID)."""
        try:
            info = self.request("GET", f"/v1/sessions/{session_id}").json()
        except ServeError as exc:
            if exc.status in (404, 410):
                return False
            raise
        return info.get("program_id") == keys.manifest.program_id


@dataclass
class RemoteSession:
    """One uploaded public context; ``infer`` encrypts here, evaluates there and decrypts here."""

    api: ServeClient
    id: str
    model: str
    keys: Any  # polyfhe.engines.seal.client.CKKSClient: holds the secret key, never sent
    context_bytes: int
    upload_seconds: float
    info: dict = field(default_factory=dict)
    closed: bool = False
    keep: bool = False  # close() leaves the session on the server (a key folder resumes it later)
    reopen: Callable[[], RemoteSession] | None = None  # the server forgot the session: open a new one (once per request)
    uploads: int = 1  # public contexts this object uploaded (0: a resumed session still held by the server)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def keygen_seconds(self) -> float:
        return float(self.keys.keygen_seconds)

    def infer(self, x: np.ndarray, clip: bool = False) -> InferResult:
        """Logits of one sample (any shape with the model's input size); ``clip`` as in :meth:`infer_many`."""
        per_sample = self.keys.manifest.input_size
        if np.size(x) != per_sample:
            raise InputError(f"infer takes one sample of {per_sample} values, got shape {np.shape(x)}; "
                             "use infer_many for a stack")
        return self.infer_many(np.asarray(x).reshape(1, per_sample), clip)[0]

    def infer_many(self, x: np.ndarray, clip: bool = False) -> list[InferResult]:
        """Logits of a stack ``(n, ...)`` of any size, sent ``samples_per_query`` at a time: a program that
        interleaves k samples per ciphertext answers k of them for the cost of one request. Values outside the
        calibrated range are refused (``InputError``) unless ``clip`` (clipped, with a warning)."""
        manifest = self.keys.manifest
        arr = np.asarray(x)
        if arr.ndim < 2 or len(arr) == 0 or arr[0].size != manifest.input_size:
            raise InputError(f"infer_many takes a non-empty stack (n, ...) of samples of {manifest.input_size} "
                             f"values, got shape {arr.shape}")
        if manifest.scheme == "ckks":  # checked (and clipped) once, before the first request
            from polyfhe.program.boundary import check_samples

            arr = check_samples(manifest, arr, clip)
        step = manifest.samples_per_query
        return [result for start in range(0, len(arr), step) for result in self._request(arr[start:start + step])]

    def _request(self, x: np.ndarray) -> list[InferResult]:
        """One encrypted request for the samples of ``x`` (at most one ciphertext's worth)."""
        t0 = time.perf_counter()
        query = self.keys.encrypt(x)
        t1 = time.perf_counter()
        response = self._post(query)
        t2 = time.perf_counter()
        logits = self.keys.decrypt(response.content)
        t3 = time.perf_counter()
        server_s = float(response.headers.get("X-Polyfhe-Server-Seconds", "nan"))
        timings = {"encrypt": t1 - t0, "request": t2 - t1, "server": server_s, "decrypt": t3 - t2,
                   "total": t3 - t0}
        return [InferResult(row, *softmax_confidence(row), timings, len(query), len(response.content), len(logits))
                for row in logits]

    def _post(self, query: bytes) -> httpx.Response:
        """The infer request; a resumed session the server no longer holds is opened again (one upload) and the
        same ciphertext sent once more."""
        try:
            return self.api.request("POST", f"/v1/sessions/{self.id}/infer", content=query, headers=OCTETS)
        except ServeError as exc:
            if exc.code not in SESSION_GONE or self.reopen is None:
                raise
            log.info("the server no longer holds session %s (%s); uploading the public context again",
                     self.id[:8], exc.code)
        fresh = self.reopen()
        self.id, self.context_bytes, self.upload_seconds, self.info = (fresh.id, fresh.context_bytes,
                                                                       fresh.upload_seconds, fresh.info)
        self.uploads += 1
        return self.api.request("POST", f"/v1/sessions/{self.id}/infer", content=query, headers=OCTETS)

    def close(self) -> None:
        """Delete the session on the server (frees its keys there), unless ``keep``; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.keep:
            return
        try:
            self.api.request("DELETE", f"/v1/sessions/{self.id}")
        except ServeError as exc:
            if exc.status not in (404, 410):
                raise
