"""Concrete ML (TFHE) beside CKKS: ``polyfhe.export(model, target="concrete", calibration=X, n_bits=...)``.

Concrete ML runs in its own environment (``polyfhe setup concrete``) and is reached through worker processes, so
polyfhe's environment never imports it. The program object mirrors the CKKS one: ``save``, ``client()``,
``server(public_keys)``, ``client.encrypt/decrypt``, ``server.run`` with bytes at the boundary.
"""

from __future__ import annotations

from polyfhe.engines.concrete.env import ConcreteEnvMissing, default_env_dir, find_env, setup_env
from polyfhe.engines.concrete.keys import ConcreteKeysTooLarge
from polyfhe.engines.concrete.program import (
    ConcreteClient,
    ConcreteProgram,
    ConcreteProgramError,
    ConcreteServer,
    is_concrete_program,
    load_concrete_program,
)
from polyfhe.engines.concrete.worker import ConcreteCallError, ConcreteWorkerDied

__all__ = ["ConcreteCallError", "ConcreteClient", "ConcreteEnvMissing", "ConcreteKeysTooLarge",
           "ConcreteProgram",
           "ConcreteProgramError", "ConcreteServer", "ConcreteWorkerDied", "default_env_dir", "find_env", "is_concrete_program", "load_concrete_program", "setup_env"]
