"""Key sizes known before key generation, the limits they must fit, and progress while Concrete works.

Concrete's compiled circuit knows its key set before any key exists: the worker reads it after compiling
(``worker_main.predict_keys``) and the manifest keeps the prediction (``info["keys"]``). Export refuses, or steps its
automatic settings down, when the serialised evaluation keys would pass the server's context limit
(:data:`DEFAULT_MAX_KEYS_BYTES`, the same 4 GiB as ``polyfhe serve --max-context-mb``) or when making them would
need more memory than a fixed key-generation budget (:data:`DEFAULT_KEYGEN_MEMORY_BYTES`: export's choice never
depends on what the export machine has free at that moment); ``program.client()`` checks again, against the memory
free, before it makes keys, so a program compiled elsewhere is refused in seconds too.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from polyfhe.procinfo import available_memory

__all__ = ["DEFAULT_KEYGEN_MEMORY_BYTES", "DEFAULT_MAX_KEYS_BYTES", "ConcreteKeysTooLarge", "available_memory", "check_keys_fit", "describe",
           "keygen_memory_bytes", "progress"]

log = logging.getLogger(__name__)

# the server's default limit on a public context (polyfhe.engines.seal.server.DEFAULT_MAX_CONTEXT_BYTES; serve's
# --max-context-mb): keys past it would be refused after they were made
DEFAULT_MAX_KEYS_BYTES = 4 << 30
# export's fixed budget for key generation (export_concrete's max_keygen_memory_bytes): the memory a client machine is
# assumed to have, fixed so that the automatic settings are a function of the program and the arguments, never of
# what the export machine has free at that moment (program.client() checks the memory free before it makes keys)
DEFAULT_KEYGEN_MEMORY_BYTES = 16 << 30
# what a client worker holds besides its keys (interpreter, torch, Concrete's runtime), measured about 1 GB
WORKER_BASE_BYTES = 1 << 30


class ConcreteKeysTooLarge(ValueError):
    """The keys a program needs would not fit the server's limit or this machine's memory; nothing was made."""


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def keygen_memory_bytes(keys: dict) -> int:
    """What making the keys takes at its peak: the expanded keys Concrete reports, their serialised copy and the
    worker itself."""
    expanded = int(keys.get("bootstrap_keys_bytes_in_memory", 0)) + int(keys.get("keyswitch_keys_bytes_in_memory", 0))
    return expanded + int(keys["evaluation_keys_bytes"]) + WORKER_BASE_BYTES


def check_keys_fit(keys: dict | None, max_keys_bytes: int | None = DEFAULT_MAX_KEYS_BYTES,
                   free_bytes: int | None = -1, settings: str = "", *,
                   memory_budget_bytes: int | None = None) -> None:
    """Raise :class:`ConcreteKeysTooLarge` when the predicted keys pass ``max_keys_bytes`` or the memory making
    them takes passes what there is. ``keys``: the prediction (None: nothing to check). The memory is
    ``memory_budget_bytes`` when given (a fixed budget: export's choice must not depend on the machine's state at
    that moment), else ``free_bytes`` (-1: what this machine has free now, None: do not check)."""
    if not keys or "evaluation_keys_bytes" not in keys:
        return
    size = int(keys["evaluation_keys_bytes"])
    knobs = ("lower rounding_threshold_bits (--rounding-threshold-bits) or n_bits (--n-bits), or leave both to "
             "polyfhe's automatic choice")
    where = f" at {settings}" if settings else ""
    if max_keys_bytes is not None and size > max_keys_bytes:
        raise ConcreteKeysTooLarge(
            f"the evaluation keys{where} would be {_gb(size)} (predicted from the compiled circuit, before any key "
            f"is made), over the server's limit of {_gb(max_keys_bytes)}: {knobs}; or raise the limit on both "
            f"sides (export/client max_keys_bytes=..., `polyfhe serve --max-context-mb "
            f"{-(-size // 2**20) + 1}`)")
    need = keygen_memory_bytes(keys)
    if memory_budget_bytes is not None:
        if need > memory_budget_bytes:
            raise ConcreteKeysTooLarge(
                f"making the keys{where} would take about {_gb(need)} of memory (expanded keys "
                f"{_gb(need - size - WORKER_BASE_BYTES)}, serialised {_gb(size)}, predicted before any key is "
                f"made), over the key-generation memory budget of {_gb(memory_budget_bytes)}: {knobs}, or raise "
                f"the budget (export max_keygen_memory_bytes=...) for a client machine with more memory")
        return
    free = available_memory() if free_bytes == -1 else free_bytes
    if free is not None and need > free:
        raise ConcreteKeysTooLarge(
            f"making the keys{where} would take about {_gb(need)} of memory (expanded keys "
            f"{_gb(need - size - WORKER_BASE_BYTES)}, serialised {_gb(size)}, predicted before any key is made), "
            f"more than the {_gb(free)} this machine has free: {knobs}, or use a machine with more memory")


@contextlib.contextmanager
def _every(period: float, action) -> Iterator[None]:
    """Call ``action()`` every ``period`` seconds on a daemon thread while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period):
            action()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2)


@contextlib.contextmanager
def progress(what: str, detail: str = "") -> Iterator[None]:
    """Show that Concrete is working on ``what``: a spinner with the elapsed time on a terminal, a log line at the
    start and end otherwise (and every minute in between, so a long step is never silent in a log)."""
    t0 = time.perf_counter()
    suffix = f" ({detail})" if detail else ""
    try:
        if sys.stderr.isatty():
            from rich.console import Console

            with Console(stderr=True).status(f"Concrete ML: {what}{suffix}") as status, _every(
                    1.0, lambda: status.update(f"Concrete ML: {what}{suffix} [{time.perf_counter() - t0:.0f} s]")):
                yield
        else:
            log.info("Concrete ML: %s%s ...", what, suffix)
            with _every(60.0, lambda: log.info("Concrete ML: still %s (%.0f s)", what, time.perf_counter() - t0)):
                yield
    finally:
        log.info("Concrete ML: %s took %.1f s", what, time.perf_counter() - t0)


def describe(keys: dict[str, Any]) -> str:
    """One line: the predicted key sizes."""
    return (f"evaluation keys {_gb(keys['evaluation_keys_bytes'])}, key generation about "
            f"{_gb(keygen_memory_bytes(keys))} of memory")
