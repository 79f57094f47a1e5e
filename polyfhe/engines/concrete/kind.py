"""What a server and its clients do for a Concrete ML (TFHE) program (its ``ProgramKind``): integers of a few
bits, one sample per query, no CKKS ring; keys made from the model's ``client.zip``, anew for each run."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from polyfhe.engines.concrete.program import ConcreteClient, ConcreteManifest, ConcreteProgram

__all__ = ["KIND", "ConcreteKind"]


class ConcreteKind:
    client_files: tuple[str, ...] = ("client.zip",)
    key_folders = "--keys folders hold CKKS keys; a Concrete ML model makes its keys for each run"

    def engine(self, manifest: Any) -> str:
        return "concrete"

    def params_text(self, manifest: ConcreteManifest) -> str:
        return f"TFHE via Concrete ML, {manifest.quantization} quantisation at n_bits={manifest.n_bits}"

    def card(self, program: ConcreteProgram) -> dict:
        m = program.manifest
        info = m.info
        return {
            "scheme": "tfhe", "engine": f"concrete-ml {m.versions.get('concrete_ml', '?')}",
            "program_id": m.program_id, "model_name": info.get("model_name"), "layout": m.layout,
            "input_shape": list(m.input_shape), "classes": m.output_size, "degree": info.get("degree"),
            "quantization": m.quantization, "n_bits": m.n_bits, "max_bit_width": info.get("max_bit_width"),
            "params_text": self.params_text(m), "samples_per_ciphertext": 1, "key_sizes": {},
        }

    def wrong_parameters(self, program: ConcreteProgram, what: str) -> tuple[str, dict]:
        return f"the {what} was not made for this model's Concrete ML program", {}

    def client(self, manifest: ConcreteManifest, files: Any = None) -> ConcreteClient:
        """Keys from ``files`` (a folder holding the model's ``client.zip``, or a TemporaryDirectory this client
        then owns)."""
        owned = files if isinstance(files, tempfile.TemporaryDirectory) else None
        folder = Path(files.name if owned is not None else files)
        return ConcreteClient(ConcreteProgram(manifest, folder, owned=owned))


KIND = ConcreteKind()
