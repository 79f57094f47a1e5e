"""Lattigo through the orion-v2 wheels: client primitives, the hoisted-BSGS evaluator, bootstrapping keys.

``FACTS`` is what the registry (:mod:`polyfhe.program.engines`) reads without loading the engine; the record
itself is ``engine.BACKEND``. Its process start sets Go's collector before Go starts (``go_env.py``)."""

from polyfhe.program.engine_api import EngineFacts
from polyfhe.program.program_formats import CKKS_PROGRAMS

FACTS = EngineFacts(
    name="lattigo", scheme="ckks", program_format=CKKS_PROGRAMS, kind="polyfhe.program.ckks_kind:KIND",
    record="polyfhe.engines.lattigo.engine:BACKEND",
    process_start="polyfhe.engines.lattigo.go_env:restart_with_go_env",
    cli_only="CLI only: Lattigo programs need Lattigo's own client, and no WebAssembly build of it installs "
             "from the package registries this project uses",
)
