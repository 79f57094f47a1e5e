"""CKKS engines behind one protocol, and the registry that picks one by name.

Every engine module provides a :class:`~polyfhe.program.engine_api.Backend`: what the client needs
(parameters, key generation, encode/encrypt/decrypt, the public key bytes a server gets) and what a server runs
(a compiled program on one client's public keys). The planner hands every engine the same
:class:`~polyfhe.program.ckks_program.CKKSProgram`: per step the diagonals (or sparse rows), the ct x ct products and the
levels; an engine may lower it further (Lattigo's evaluator takes its own model container). Nothing outside an
engine's module imports the engine's package, so the registry and this protocol load without either installed.

The registry holds one line per engine folder (:data:`ENGINES`); the folder's ``__init__.py`` declares its light
facts (:class:`~polyfhe.program.engine_api.EngineFacts`: scheme, program format, process start, the page's client,
where its record lies), read here without loading the engine. Engines with a program format of their own
(Concrete ML) have no CKKS record: their programs carry their client and server, and their ``ProgramKind``
says what a server and its clients do differently for them (:func:`kind_of`).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from polyfhe.program.engine_api import Backend, BackendUnavailable, EngineFacts, KeySetTooLarge, ProgramKind

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_BACKEND",
    "Backend",
    "BackendUnavailable",
    "KeySetTooLarge",
    "bootstrapping_engines",
    "client_for",
    "engine_facts",
    "engine_names",
    "get_backend",
    "kind_of",
    "list_backends",
    "load_other_format",
    "load_served_program",
    "manifest_from_dict",
    "max_context_bytes",
    "new_plaintext_store",
    "plain_executor",
    "prepare_process",
    "process_starts",
    "program_engine",
    "public_context_bytes",
    "resolve",
    "restore_client",
    "warm_plaintexts",
]

# name -> (engine folder, scheme): one line per engine. The folder's ``__init__.py`` declares ``FACTS``
# (EngineFacts): program format, process start, the page's client, where its record lies; read on first use. The
# scheme stands here too, so the CKKS engines' names are known without importing any engine folder (a command
# line's choices and ``--help`` list them)
ENGINES = {
    "seal": ("polyfhe.engines.seal", "ckks"),
    "lattigo": ("polyfhe.engines.lattigo", "ckks"),
    "concrete": ("polyfhe.engines.concrete", "concrete"),
}
# the CKKS engines: those with a Backend record (a manifest's ``backend`` names one of them)
BACKEND_NAMES = tuple(name for name, (_, scheme) in ENGINES.items() if scheme == "ckks")
DEFAULT_BACKEND = "seal"  # see docs/ckks.md ("Engines") for the measurement behind this choice
_LOADED: dict[str, Backend] = {}
_FACTS: dict[str, EngineFacts] = {}


def process_starts() -> dict[str, str]:
    """name -> ``"module:function"`` a command-line entry point runs before any engine loads: settings an engine's
    native libraries read only when the process starts (Lattigo: Go's collector); read from the engines' facts when
    asked (a command that loads no engine never reads them)."""
    return {name: engine_facts(name).process_start for name in ENGINES if engine_facts(name).process_start}


def resolve(reference: str) -> Any:
    """The object a ``"module:attribute"`` reference of an engine's facts names (imported now)."""
    module_name, _, path = reference.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in path.split("."):
        value = getattr(value, part)
    return value


def engine_names() -> list[str]:
    """Every registered engine, CKKS or not, in registry order."""
    return list(ENGINES)


def engine_facts(name: str) -> EngineFacts:
    """The light facts of engine ``name`` (its folder's ``__init__.py``, no engine module); ``ValueError`` listing
    the names."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; accepted: {engine_names()}")
    if name not in _FACTS:
        _FACTS[name] = importlib.import_module(ENGINES[name][0]).FACTS
    return _FACTS[name]


def _every_facts() -> list[EngineFacts]:
    return [engine_facts(name) for name in ENGINES]


# the runtime sits above this package: a program reaches its plain executor and its plaintext store by module name
_RUNTIME = {"plain_executor": ("polyfhe.runtime.execute", "run_plain"),
            "plaintext_store": ("polyfhe.runtime.plaintexts", "PlaintextStore")}


def _runtime(name: str) -> Any:
    module_name, attribute = _RUNTIME[name]
    return getattr(importlib.import_module(module_name), attribute)


def plain_executor():
    """``run_plain(manifest, arrays, x)``: the engine-neutral executor on plain slot vectors."""
    return _runtime("plain_executor")


def new_plaintext_store():
    """An empty plaintext store with the default budget (one per program, shared by its servers)."""
    return _runtime("plaintext_store")()


def get_backend(name: str) -> Backend:
    """The engine registered as ``name``; raises ``ValueError`` listing the accepted names."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown CKKS backend {name!r}; accepted: {list(BACKEND_NAMES)}")
    if name not in _LOADED:
        _LOADED[name] = resolve(engine_facts(name).record)
    return _LOADED[name]


def bootstrapping_engines() -> list[str]:
    """The engines that bootstrap (their record has a ``bootstrapping`` part), in registry order: what the
    compiler names before the caller has chosen one."""
    return [name for name in BACKEND_NAMES if get_backend(name).bootstrapping is not None]


def prepare_process() -> None:
    """Each engine's process-start step (it may restart the process with settings added, once)."""
    for start in process_starts().values():
        resolve(start)()


def client_for(manifest, **kwargs):
    """The key holder for a program's manifest, from the engine the manifest names."""
    return get_backend(manifest.backend).client(manifest, **kwargs)


def restore_client(manifest, secret_context: bytes, public_context: bytes | None = None):
    """The key holder restored from its private backup (``client.secret_context()``) and, when given, the public
    context saved with it (``public_context()`` then returns those bytes), from the engine the manifest names."""
    engine = get_backend(manifest.backend)
    restore = engine.restore or getattr(engine.client, "load", None)
    if restore is None:
        raise ValueError(f"backend {manifest.backend!r} cannot restore a client from its private backup")
    return restore(manifest, secret_context, public_context)


def _manifest_of(directory) -> dict | None:
    """``manifest.json`` of a program folder as JSON, or None where there is none readable."""
    path = Path(directory) / "manifest.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def program_engine(directory) -> str | None:
    """The engine whose program format claims the folder (a look at its manifest only), or None."""
    raw = _manifest_of(directory)
    if raw is None:
        return None
    return next((f.name for f in _every_facts() if f.program_format.claims(raw, f.name)), None)


def load_other_format(directory) -> Any | None:
    """The program saved in ``directory`` by an engine with a format of its own (not CKKS's), or None when none
    claims it."""
    engine = program_engine(directory)
    if engine is None or engine_facts(engine).scheme == "ckks":
        return None
    return resolve(engine_facts(engine).program_format.load)(directory)


def load_served_program(directory) -> Any:
    """The program in ``directory`` as a server offers it, by the format that claims it (a CKKS one where none
    does: its loader names what is wrong): ``ProgramError`` when it is not one, or this machine cannot serve it."""
    fmt = engine_facts(program_engine(directory) or DEFAULT_BACKEND).program_format
    return resolve(fmt.serve or fmt.load)(directory)


def manifest_from_dict(raw: Any) -> Any:
    """The manifest a server sent (``/v1/models/NAME/manifest``), read by the format its ``format`` names (CKKS's
    where none does: its reader names what is wrong); ``ProgramError`` when it is not one."""
    found = raw.get("format") if isinstance(raw, dict) else None
    fmt = next((f.program_format for f in _every_facts() if f.program_format.format == found),
               engine_facts(DEFAULT_BACKEND).program_format)
    return resolve(fmt.manifest)(raw)


def kind_of(program_or_manifest) -> ProgramKind:
    """What a server and its clients do differently for this program (or manifest): the kind its scheme's engines
    declare (CKKS engines share theirs)."""
    scheme = program_or_manifest.scheme
    engine = next((name for name, (_, runs) in ENGINES.items() if runs == scheme), None)
    if engine is None:
        raise ValueError(f"no engine runs {scheme!r} programs; registered: {engine_names()}")
    return resolve(engine_facts(engine).kind)


def list_backends() -> list[str]:
    return list(BACKEND_NAMES)


def decoded_context_bytes(program, upload: int) -> int:
    """Bytes a valid public context of ``upload`` bytes for ``program`` holds once its engine decodes it: what a
    server's key budget counts (SEAL's keys travel compressed; the decoder refuses any that inflate further). A
    program of another format says what a session costs where it can (Concrete: the keys, expanded, in a worker
    process of their own: ``session_memory_bytes``); never less than the upload."""
    if program.scheme != "ckks":
        cost = getattr(program, "session_memory_bytes", None)
        return upload if cost is None else max(upload, int(cost(upload)))
    measure = get_backend(program.manifest.backend).decoded_context_bytes
    return upload if measure is None else measure(program, upload)


def max_context_bytes(program) -> int | None:
    """The most bytes a valid public context for ``program`` can have as uploaded (its engine's exact bound), or
    None where the engine gives none: a server refuses a longer upload at once, before reserving anything."""
    if program.scheme != "ckks":  # a program of another format carries its own bound
        bound_of = getattr(program, "max_context_bytes", None)
        return None if bound_of is None else bound_of()
    bound = get_backend(program.manifest.backend).max_context_bytes
    return None if bound is None else int(bound(program))


def public_context_bytes(manifest) -> int:
    """Estimated bytes of a public context for a CKKS program's manifest as its engine's client serialises it
    (SEAL compresses its keys); the uncompressed size where the engine gives no estimate of its own."""
    from polyfhe.program.params import estimated_sizes

    measure = get_backend(manifest.backend).context_bytes
    if measure is None:
        return estimated_sizes(manifest.params, len(manifest.galois_steps))["public_context"]
    return measure(manifest.params, manifest.galois_steps)


def warm_plaintexts(program) -> tuple[int, float, int]:
    """Encode a CKKS program's plaintexts before its first query where its engine encodes them on first use:
    (plaintexts encoded, seconds, bytes held); (0, 0.0, 0) where the engine encodes them as it loads the program."""
    warm = get_backend(program.manifest.backend).warm_plaintexts
    if warm is None:
        return 0, 0.0, 0
    stats = warm(program)
    return stats.encoded, stats.seconds, stats.bytes
