"""CKKS engines behind one protocol, and the registry that picks one by name.

Every engine module provides a :class:`~polyfhe.program.engine_api.Backend`: what the client needs
(parameters, key generation, encode/encrypt/decrypt, the public key bytes a server gets) and what a server runs
(a compiled program on one client's public keys). The planner hands every engine the same
:class:`~polyfhe.runtime.program.CKKSProgram`: per step the diagonals (or sparse rows), the ct x ct products and the
levels; an engine may lower it further (Lattigo's evaluator takes its own model container). Nothing outside an
engine's module imports the engine's package, so the registry and this protocol load without either installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from polyfhe.program.engine_api import Backend, BackendUnavailable, KeySetTooLarge

__all__ = ["BACKEND_NAMES", "DEFAULT_BACKEND", "Backend", "BackendUnavailable", "KeySetTooLarge",
           "bootstrapping_engines", "client_for",
           "get_backend", "list_backends", "max_context_bytes", "prepare_process", "public_context_bytes", "restore_client",
           "warm_plaintexts"]

# name -> module defining ``BACKEND``; imported on first use so a missing engine only fails when it is asked for
_MODULES = {"seal": "polyfhe.engines.seal.engine", "lattigo": "polyfhe.engines.lattigo.engine"}
BACKEND_NAMES = tuple(_MODULES)
DEFAULT_BACKEND = "seal"  # see docs/ckks.md ("Engines") for the measurement behind this choice
_LOADED: dict[str, Backend] = {}
# name -> (module, function) a command-line entry point runs before any engine loads: settings an engine's native
# libraries read only when the process starts (Lattigo: Go's collector); small modules, apart from the records
_PROCESS_START = {"lattigo": ("polyfhe.engines.lattigo.go_env", "restart_with_go_env")}


def get_backend(name: str) -> Backend:
    """The engine registered as ``name``; raises ``ValueError`` listing the accepted names."""
    if name not in _MODULES:
        raise ValueError(f"unknown CKKS backend {name!r}; accepted: {list(BACKEND_NAMES)}")
    if name not in _LOADED:
        _LOADED[name] = importlib.import_module(_MODULES[name]).BACKEND
    return _LOADED[name]


def bootstrapping_engines() -> list[str]:
    """The engines that bootstrap (their record has a ``bootstrapping`` part), in registry order: what the
    compiler names before the caller has chosen one."""
    return [name for name in BACKEND_NAMES if get_backend(name).bootstrapping is not None]


def prepare_process() -> None:
    """Each engine's process-start step (it may restart the process with settings added, once)."""
    for module_name, function in _PROCESS_START.values():
        getattr(importlib.import_module(module_name), function)()


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


# engines whose saved programs are not CKKS manifests: name -> (module, recogniser, loader); imported on first use
OTHER_PROGRAM_FORMATS = {"concrete": ("polyfhe.engines.concrete.program", "is_concrete_program",
                                      "load_concrete_program")}


def load_other_format(directory) -> Any | None:
    """The program saved in ``directory`` by an engine with a format of its own, or None when none claims it."""
    for module_name, recognise, load in OTHER_PROGRAM_FORMATS.values():
        module = importlib.import_module(module_name)
        if getattr(module, recognise)(directory):
            return getattr(module, load)(directory)
    return None


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
