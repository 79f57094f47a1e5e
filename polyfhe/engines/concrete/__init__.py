"""Concrete ML (TFHE) beside CKKS: ``polyfhe.export(model, target="concrete", calibration=X, n_bits=...)``.

Concrete ML runs in its own environment (``polyfhe setup concrete``) and is reached through worker processes, so
polyfhe's environment never imports it. The program object mirrors the CKKS one: ``save``, ``client()``,
``server(public_keys)``, ``client.encrypt/decrypt``, ``server.run`` with bytes at the boundary.

``FACTS`` is what the registry (:mod:`polyfhe.program.engines`) reads without loading the engine: its programs
have a format of their own (``program.py``) and carry their own client and server, so it has no CKKS record.
The names below load on first use, so reading ``FACTS`` imports nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

from polyfhe.program.engine_api import EngineFacts, ProgramFormat

FORMAT = "polyfhe-concrete/1"  # a Concrete program's manifest.json says so

FACTS = EngineFacts(
    name="concrete", scheme="concrete",
    program_format=ProgramFormat(format=FORMAT, load="polyfhe.engines.concrete.program:load_concrete_program",
                                 manifest="polyfhe.engines.concrete.program:ConcreteManifest.from_dict",
                                 serve="polyfhe.engines.concrete.program:load_for_serving"),
    kind="polyfhe.engines.concrete.kind:KIND",
    cli_only="CLI only: Concrete ML (TFHE) keys are made by Concrete ML's Python client",
)

# public name -> the module of this folder that defines it
_NAMES = {
    "ConcreteEnvMissing": "env", "default_env_dir": "env", "find_env": "env", "setup_env": "env",
    "ConcreteKeysTooLarge": "keys",
    "ConcreteClient": "program", "ConcreteProgram": "program", "ConcreteProgramError": "program",
    "ConcreteServer": "program", "is_concrete_program": "program", "load_concrete_program": "program",
    "ConcreteCallError": "worker", "ConcreteWorkerDied": "worker",
}

__all__ = ["FACTS", "FORMAT", "ConcreteCallError", "ConcreteClient", "ConcreteEnvMissing", "ConcreteKeysTooLarge",
           "ConcreteProgram", "ConcreteProgramError", "ConcreteServer", "ConcreteWorkerDied", "default_env_dir",
           "find_env", "is_concrete_program", "load_concrete_program", "setup_env"]


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    globals()[name] = value
    return value
