"""The engine protocol: what the compiler hands over, what a client and a server get from an engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Backend", "BackendUnavailable", "BootstrapModel", "ClientProtocol", "CostTraits", "EngineFacts",
           "EngineRefusal", "KeySetTooLarge", "ProgramFormat", "ProgramKind", "ServerProtocol"]


class EngineRefusal(RuntimeError):
    """An engine refused an operation on these values (which may be a client's: keys, ciphertexts); a server
    answers it as a refused evaluation, not as its own bug. ``operation``: what was refused; ``reason``: why."""

    def __init__(self, message: str, operation: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.operation, self.reason = operation, reason


class BackendUnavailable(ImportError):
    """The engine's package is not installed; the message says how to install it."""


class KeySetTooLarge(ValueError):
    """The program's evaluation keys would exceed what a server accepts on these parameters; a smaller ring
    (bootstrapping, on engines that can) may still fit."""


class ClientProtocol(Protocol):
    """The key holder: keys for one program; bytes in and out, the secret key never leaves it."""

    manifest: Any
    keygen_seconds: float

    def public_context(self) -> bytes: ...  # what a server gets: public, relinearisation and Galois keys
    def secret_context(self) -> bytes: ...  # the private backup (secret key): stays with the client
    def encrypt(self, x) -> bytes: ...  # one sample or a batch -> a ciphertext container
    def decrypt(self, data: bytes) -> Any: ...  # a result container -> (samples, output_size) logits


class ServerProtocol(Protocol):
    """Runs one program on one client's public keys; never holds a secret key or a plaintext."""

    program: Any
    context_bytes: int
    last_run: Any  # polyfhe.engines.seal.server.RunStats

    def run(self, data: bytes) -> bytes: ...


@dataclass(frozen=True)
class CostTraits:
    """How an engine runs a program, as far as :mod:`polyfhe.cost.model` prices it (the costs are one thread's)."""

    public_key_in_context: bool = False  # the public context carries a public key beside the key-switching keys
    # the server encodes every plaintext when it loads a program; otherwise a plaintext store encodes each on
    # first use (the first query pays) and holds what fits its budget (the rest is encoded again every query)
    encodes_at_load: bool = False
    special_primes_in_plaintexts: int = 0  # primes a held plaintext spans beyond its level's
    parallel_ops: frozenset[str] = frozenset()  # operations an evaluation spreads over its threads
    threads: Callable[[], int] | None = None  # threads an evaluation keeps busy here; None: one
    thread_efficiency: float = 0.0  # what each thread past the first adds to ``parallel_ops``' speed
    key_copies: float = 1.0  # copies of the serialized key set a running server holds
    decoded_key_copies: float = 0.0  # copies of the decoded (uncompressed) public context it holds
    container_copies: float = 0.0  # copies of every weight as float64 (a model container) it holds
    # the tally of one estimated linear map (ring, primes, products, giant, baby rotations, input and output
    # ciphertexts) when the engine runs it its own way; None: the executor's diagonal method
    traced_linear: Callable[..., dict] | None = None


@dataclass(frozen=True)
class BootstrapModel:
    """What an engine that bootstraps tells the compiler, the cost model and the runtime (the values that cross are
    :mod:`polyfhe.program.bootstrapping`'s; ``params``: a residual chain's ``CKKSParams``, ``spec``: a
    ``BootstrapSpec``): everything they decide about bootstrapping comes from here, none of it from the engine's
    name."""

    ring: int  # the ring a 128-bit bootstrap runs on
    circuit_primes: int  # primes the bootstrapping circuit appends to the residual chain
    modulus_bits: Callable[..., int]  # (params, spec) -> planned bits of the bootstrapping keys' modulus
    key_bytes: Callable[..., int]  # (params, spec) -> bytes of the bootstrapping keys
    keygen_peak_bytes: Callable[[int], int]  # bootstrapping key bytes -> resident peak of generating them
    # (plaintext, bootstrapping key, Galois key bytes) -> a server's resident bytes (while loading, while serving)
    server_peak_bytes: Callable[[int, int, int], tuple[int, int]]
    server_key_copies: float  # copies of the bootstrapping keys a running server holds (the cost model's memory)
    # (params, spec, residual_q=None, secret_weight=None) -> BootstrapSecurity, on the real primes
    security: Callable[..., Any]
    # (depth, slots, *, scale_bits=None, ...) -> [BootstrapChoice]: every secure residual chain, cheapest first
    candidates: Callable[..., list]
    # (depth, slots, *, scale_bits=None, memory_bytes=None) -> (params, spec): the cheapest whose keys fit memory
    choose: Callable[..., tuple]
    default_spec: Callable[..., Any]  # (params, slots) -> the BootstrapSpec refreshing that many slots
    max_refresh_log_slots: Callable[..., int]  # (params, spec, memory_bytes) -> most slots (log2) keys fit for
    key_switches: Callable[[int, int], float]  # (log_slots, logn) -> one bootstrap's price in key switches
    start_bootstraps: float = 0.0  # bootstraps' worth of time the first bootstrap of a process adds


@dataclass(frozen=True)
class Backend:
    """One CKKS engine.

    ``prepare(program)`` is called at export: it may check the parameters against the engine (security is
    checked by polyfhe, not the engine) and returns the program the engine runs (same steps; engine-specific
    rotation keys and facts in ``manifest.info[name]``). ``client(manifest)`` and ``server(program, context)``
    build the two sides. ``available()`` raises :class:`BackendUnavailable` with an install hint.
    ``composes_rotations``: the engine builds a rotation without a key of its own from power-of-two keys
    (SEAL), so the planner may keep the key set within a budget; an engine that plans its own keys in
    ``prepare`` (Lattigo) gets the plan without a budget, and no composed-rotation fallback.
    ``bootstrapping``: the engine runs a program's ``bootstrap`` steps, so a circuit deeper than any leveled ring
    can be exported for it (``export/ckks/bootstrap.py``); its :class:`BootstrapModel` says how (None: it cannot).
    ``restore(manifest, secret_context, public_context=None)``: the client again from its private backup
    (``client.secret_context()``, and the public context saved with it); ``None``: the client class's ``load``.
    """

    name: str
    description: str
    layouts: tuple[str, ...]
    available: Callable[[], None]
    prepare: Callable[..., Any]
    client: Callable[..., ClientProtocol]
    server: Callable[..., ServerProtocol]
    composes_rotations: bool = True
    bootstrapping: BootstrapModel | None = None
    restore: Callable[..., ClientProtocol] | None = None
    # bytes a valid public context of ``upload`` bytes takes once decoded (compressed keys inflate): what a
    # server's key budget must count; ``None``: the upload size (the engine's keys travel uncompressed)
    decoded_context_bytes: Callable[[Any, int], int] | None = None
    # (params, Galois steps) -> bytes of the public context as the engine's client serialises it: what an upload
    # costs; ``None``: the uncompressed estimate (``polyfhe.program.params.estimated_sizes``)
    context_bytes: Callable[[Any, Any], int] | None = None
    # program -> the most bytes a valid public context for it can have on the wire, container header included: a
    # server refuses a declared length above it before reading a byte; ``None``: no bound known (the server's limit)
    max_context_bytes: Callable[[Any], int] | None = None
    # the Python distributions that carry the engine (their versions key the cached operation costs), and what
    # else changes its speed on this build (e.g. SEAL's dot kernel on or off), as "name=value" text
    distributions: tuple[str, ...] = ()
    build_notes: Callable[[], str] | None = None
    # bits kept free below the 128-bit bound when the compiler picks primes (the engine's primes may lie above
    # 2^bits)
    reserve_bits: int = 0
    # compiled program -> its Workload (polyfhe.runtime.workload_types), counted as this engine runs it
    workload: Callable[[Any], Any] | None = None
    # the calibration microbenchmarks: () -> (probes, key observations) (polyfhe.runtime.opcosts)
    probes: Callable[[], tuple[list, list]] | None = None
    # Python statements that load the engine's server side: a fresh process running them measures its base memory
    server_imports: str = ""
    cost: CostTraits = CostTraits()
    # encode a program's plaintexts before its first query (returns stats with encoded, seconds, bytes); None:
    # the engine encodes them when it loads the program
    warm_plaintexts: Callable[[Any], Any] | None = None
    # the most registers (ciphertexts) one ct x ct MatMul of the single layout may be spread over; None: any
    matmul_registers: int | None = None
    # runs a linear step's rotate-and-add windows (``pre_sums``/``post_sums``): the planner may then sum blocks
    # broadcast over themselves with a few rotations (``plan.BlockSums``) instead of their diagonals
    rotate_sums: bool = True
    # (params) -> bytes of one Galois key as the engine's client serialises it: what the planner's Galois key budget
    # counts on an engine that ``composes_rotations``; None: uncompressed (``polyfhe.program.sizes``)
    galois_key_bytes: Callable[[Any], int] | None = None
    # a web page is a client of the engine's programs (it sends its keys seeded; ``upload_budget`` sizes that upload)
    web_client: bool = False

    @property
    def bootstraps(self) -> bool:
        """The engine runs ``bootstrap`` steps (it has a :class:`BootstrapModel`)."""
        return self.bootstrapping is not None


@dataclass(frozen=True)
class ProgramFormat:
    """How a saved program folder is recognised and loaded: its ``manifest.json``'s ``format`` (and, where
    engines share a format, the field naming the engine) and its loaders, ``"module:function"`` names imported on
    first use (so recognising a folder loads no engine)."""

    format: str  # the manifest's "format" value
    load: str  # directory -> the verified program (ProgramError when it is not one)
    manifest: str  # a manifest dict (as a server sends it) -> the manifest a client makes keys from
    serve: str = ""  # directory -> the program, checked that this machine can serve it; "": ``load``
    engine_field: str = ""  # the manifest field naming the engine, where several engines share the format
    engine_default: str = ""  # its value where the manifest leaves it out

    def claims(self, manifest: dict, engine: str) -> bool:
        """Whether a manifest (as read from ``manifest.json``) is a program of ``engine`` in this format."""
        if manifest.get("format") != self.format:
            return False
        return not self.engine_field or manifest.get(self.engine_field, self.engine_default) == engine


@dataclass(frozen=True)
class EngineFacts:
    """What the registry knows of an engine without loading it, declared by its folder's ``__init__.py``
    (``FACTS``): the parts a command line or a server needs before, or instead of, the engine record.
    References are ``"module:attribute"`` names, imported on first use."""

    name: str
    scheme: str  # "ckks", or the scheme of an engine with a program format of its own
    program_format: ProgramFormat
    kind: str  # its ProgramKind: what a server and its clients do differently for its programs
    record: str = ""  # its CKKS Backend record; "": not a CKKS engine (its programs carry their own client/server)
    process_start: str = ""  # run by a command-line entry point before any engine loads (settings read at start)
    browser_client: str = ""  # the library the web page makes its keys with; "": the page cannot be its client
    cli_only: str = ""  # why the page cannot be its client


class ProgramKind(Protocol):
    """What differs between kinds of program (CKKS manifests, Concrete ML's) for a server and its clients: asked
    of the kind (``polyfhe.program.engines.kind_of``) instead of branching on a program's scheme."""

    client_files: tuple[str, ...]  # files of the model a client fetches beside its manifest to make keys
    key_folders: str  # "": its keys can be kept in a key folder (``client --keys``); otherwise why not

    def engine(self, manifest: Any) -> str: ...  # the engine (registry name) whose client makes the keys
    def params_text(self, manifest: Any) -> str: ...  # one line: the scheme and its parameters
    def card(self, program: Any) -> dict: ...  # what ``/v1/models`` shows of the program (no model card)
    def wrong_parameters(self, program: Any, what: str) -> tuple[str, dict]: ...  # a 422's detail and extra
    def client(self, manifest: Any, files: Any = None) -> ClientProtocol: ...  # keys; files: client_files' folder
