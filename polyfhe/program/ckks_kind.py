"""What a server and its clients do for a CKKS program (every CKKS engine's ``ProgramKind``): the card
``/v1/models`` shows, the parameters a refused upload names, keys from the engine the manifest names."""

from __future__ import annotations

from typing import Any

from polyfhe.program.engine_api import ClientProtocol

__all__ = ["KIND", "CKKSKind", "estimated_sizes"]


def estimated_sizes(program: Any) -> dict[str, int]:
    """Uncompressed sizes in bytes of a CKKS program's keys and input ciphertexts."""
    from polyfhe.program.params import estimated_sizes as params_sizes

    m = program.manifest
    sizes = params_sizes(program.params, len(m.galois_steps))
    return {**sizes, "input_ciphertext": sizes["ciphertext"] * (1 if m.layout == "single" else m.input_size)}


class CKKSKind:
    """A CKKS manifest's keys come from its engine's client alone (nothing beyond the manifest) and may be kept
    in a key folder."""

    client_files: tuple[str, ...] = ()
    key_folders = ""

    def engine(self, manifest: Any) -> str:
        return manifest.backend

    def params_text(self, manifest: Any) -> str:
        return manifest.params.describe()

    def card(self, program: Any) -> dict:
        from polyfhe.program.engines import public_context_bytes

        m, p = program.manifest, program.params
        sizes = estimated_sizes(program)
        out = {
            "scheme": "ckks", "engine": m.backend, "program_id": m.program_id, "model_name": m.model_name,
            "layout": m.layout, "input_shape": list(m.input_shape), "classes": m.output_size,
            "degree": m.degree, "depth": m.depth, "levels": p.levels,
            "params": p.to_dict(), "params_text": p.describe(), "galois_keys": len(m.galois_steps),
            "input_range": list(m.input_range),
            "key_sizes": {"estimated_public_context_bytes": public_context_bytes(m),
                          "estimated_decoded_public_context_bytes": sizes["public_context"],
                          "estimated_galois_keys_bytes": sizes["galois_keys"],
                          "estimated_relin_keys_bytes": sizes["relin_keys"]},
            "estimated_ciphertext_bytes": sizes["input_ciphertext"],
        }
        lanes = getattr(m, "samples_per_ciphertext", None)
        if lanes is not None:
            out["samples_per_ciphertext"] = int(lanes)
        return out

    def wrong_parameters(self, program: Any, what: str) -> tuple[str, dict]:
        return (f"the {what} uses other CKKS parameters than this model's: {program.params.describe()}",
                {"params": program.params.to_dict()})

    def client(self, manifest: Any, files: Any = None) -> ClientProtocol:
        from polyfhe.program.engines import client_for

        return client_for(manifest)


KIND = CKKSKind()
