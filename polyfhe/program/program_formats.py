"""The program format CKKS engines share: a ``polyfhe-ckks`` manifest naming its engine as ``backend``.

Kept apart from :mod:`polyfhe.program.manifest` (numpy, steps) so that an engine folder's facts, read when the
registry loads, stay cheap."""

from __future__ import annotations

from polyfhe.program.engine_api import ProgramFormat

__all__ = ["CKKS_FORMAT", "CKKS_PROGRAMS", "LEGACY_BACKEND"]

CKKS_FORMAT = "polyfhe-ckks/1"  # polyfhe.program.manifest.FORMAT
LEGACY_BACKEND = "seal"  # what a manifest that names no engine was made for (manifests before Lattigo)


# claimed by each CKKS engine for the folders whose manifest names it as ``backend``
CKKS_PROGRAMS = ProgramFormat(format=CKKS_FORMAT, load="polyfhe.program.ckks_program:load_program",
                              manifest="polyfhe.program.manifest:ProgramManifest.from_dict",
                              engine_field="backend", engine_default=LEGACY_BACKEND)
