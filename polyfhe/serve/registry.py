"""The programs a server offers: one verified CKKS or Concrete ML program per subfolder, plus a model card each."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyfhe.program.ckks_kind import estimated_sizes
from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.program.engines import kind_of, load_served_program, max_context_bytes
from polyfhe.program.manifest import ProgramError
from polyfhe.runtime.plaintexts import DEFAULT_PLAINTEXT_BYTES, store_with_budget

__all__ = ["CARD_FILE", "Model", "Registry", "RegistryError", "estimated_sizes"]

log = logging.getLogger(__name__)

CARD_FILE = "card.json"  # optional, beside manifest.json: {"accuracy": 0.89, "dataset": "fashion-mnist", ...}
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def list_of_names(value) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int)) for v in value):
        raise TypeError("expected a list of class names")
    return [str(v) for v in value]


# class_names: what the web page shows for each output; input_mean/std: the page feeds (intensity - mean) / std
CARD_KEYS = {"accuracy": float, "dataset": str, "description": str, "test_images": int, "class_names": list_of_names,
             "input_mean": float, "input_std": float}


class RegistryError(ValueError):
    """The programs folder is missing or holds no usable program."""


def _read_card(folder: Path) -> dict[str, Any]:
    """The optional ``card.json``: known keys with the right types; anything else is ignored with a warning."""
    path = folder / CARD_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: not readable JSON (%s)", path, exc)
        return {}
    if not isinstance(raw, dict):
        log.warning("ignoring %s: expected a JSON object", path)
        return {}
    card = {}
    for key, kind in CARD_KEYS.items():
        if key in raw:
            try:
                card[key] = kind(raw[key])
            except (TypeError, ValueError):
                log.warning("ignoring %s in %s: expected %s", key, path, getattr(kind, "__name__", kind))
    return card


@dataclass
class Model:
    """A loaded program and what ``/v1/models`` shows about it."""

    name: str
    program: CKKSProgram
    card: dict[str, Any] = field(default_factory=dict)
    observed_context_bytes: int | None = None  # size of the last public context accepted for it
    folder: Path | None = None  # where it was loaded from
    _context_bound: int | None = field(default=None, repr=False)

    def context_limit(self, server_limit: int) -> int:
        """The most bytes a public context for this model may have: its engine's bound for the program (exact
        sizes of its keys), or the server's limit where the engine gives none or the server's is lower."""
        if self._context_bound is None:
            try:
                bound = max_context_bytes(self.program)
            except Exception as exc:  # noqa: BLE001 - no bound known: the server's limit and the engine's checks
                log.warning("model %s: no exact public-context bound (%s); its uploads get the server's limit",
                            self.name, type(exc).__name__)
                bound = None
            self._context_bound = bound if bound is not None else 0
        return min(server_limit, self._context_bound) if self._context_bound else server_limit

    def describe(self) -> dict[str, Any]:
        """The program's card from its kind (CKKS: ring, keys, sizes; Concrete ML: quantisation), with the model's."""
        out = {"name": self.name, **kind_of(self.program).card(self.program)}
        out["key_sizes"] = {**out.get("key_sizes", {}), "observed_public_context_bytes": self.observed_context_bytes}
        samples = out.pop("samples_per_ciphertext", None)
        out.update({"accuracy": self.card.get("accuracy"), "dataset": self.card.get("dataset"), "card": self.card})
        if samples is not None:
            out["samples_per_ciphertext"] = samples
        return out


class Registry:
    """Loads every program under a folder once, at start-up; a broken one is skipped and named in ``skipped``
    (with the reason), which the caller reports."""

    def __init__(self, root: Path, plaintext_cache_bytes: int | None = None) -> None:
        """``plaintext_cache_bytes``: budget of each program's plaintext store, shared by the sessions of that
        model (``None``: the store's default, half of the machine's memory, split between the programs)."""
        self.root = Path(root)
        self.plaintext_cache_bytes = plaintext_cache_bytes
        self.models: dict[str, Model] = {}
        self.skipped: dict[str, str] = {}
        if not self.root.is_dir():
            raise RegistryError(f"programs folder {self.root} does not exist (export programs into "
                                "subfolders with `polyfhe export MODEL --target ckks --out DIR/NAME`)")
        folders = [self.root] if (self.root / "manifest.json").is_file() else sorted(
            p for p in self.root.iterdir() if p.is_dir() and (p / "manifest.json").is_file())
        for folder in folders:
            self._add(folder)
        ckks = [m.program for m in self.models.values() if m.program.scheme == "ckks"]
        budget = plaintext_cache_bytes if plaintext_cache_bytes is not None else \
            DEFAULT_PLAINTEXT_BYTES // max(1, len(ckks))  # the machine's share, not that much per model
        for program in ckks:
            store_with_budget(program.shared.plaintexts, budget)  # its servers share it
        if ckks:
            log.info("plaintext store: %.0f MiB per model", budget / 2**20)
        if not self.models:
            detail = "; ".join(f"{k}: {v}" for k, v in self.skipped.items()) or "no subfolder holds manifest.json"
            raise RegistryError(f"no usable CKKS program under {self.root} ({detail}); export one with "
                                "`polyfhe export MODEL --target ckks --out DIR/NAME`")

    def _add(self, folder: Path) -> None:
        name = folder.name
        if not NAME_PATTERN.match(name):
            self.skipped[name] = "folder name must be 1-64 letters, digits, '.', '_' or '-'"
            log.info("skipping program folder %r: %s", name, self.skipped[name])  # callers report ``skipped``
            return
        try:
            program = load_served_program(folder)  # by the format its manifest names
        except ProgramError as exc:
            self.skipped[name] = str(exc)
            log.info("skipping program %s: %s", name, exc)  # callers report ``skipped`` (serve prints it once)
            return
        self.models[name] = Model(name, program, _read_card(folder), folder=folder)
        log.info("serving model %s (program %s, %s)", name, program.program_id,
                 kind_of(program).params_text(program.manifest))

    def get(self, name: str) -> Model | None:
        return self.models.get(name)

    def names(self) -> list[str]:
        return sorted(self.models)
