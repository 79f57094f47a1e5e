"""Microsoft SEAL through TenSEAL: client, server, native kernels, byte walkers.

``FACTS`` is what the registry (:mod:`polyfhe.program.engines`) reads without loading the engine; the record
itself is ``engine.BACKEND``."""

from polyfhe.program.engine_api import EngineFacts
from polyfhe.program.program_formats import CKKS_PROGRAMS

FACTS = EngineFacts(
    name="seal", scheme="ckks", program_format=CKKS_PROGRAMS, kind="polyfhe.program.ckks_kind:KIND",
    record="polyfhe.engines.seal.engine:BACKEND",
    browser_client="node-seal 7.0.0 (Microsoft SEAL 4.1.2, WebAssembly)",
)
