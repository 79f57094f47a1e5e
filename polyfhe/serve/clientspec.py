"""What the web page needs to be a client of one program: its ring, keys, input packing and class names.

The page (``static/fheclient.js``) makes keys with node-seal and encodes images exactly as the Python client
does (:func:`polyfhe.program.slot_layout.pack_single`); everything it needs for that is here, public, and tied to
the program by its id and its parameters' fingerprint (the page recomputes the fingerprint and refuses a spec
whose parameters do not hash to it). No weights: the manifest's steps stay on the server.
"""

from __future__ import annotations

from typing import Any

from polyfhe.program.boundary import identity_header
from polyfhe.program.engines import engine_facts, engine_names, kind_of
from polyfhe.program.params import BROWSER_UPLOAD_BUDGET, estimated_sizes, seeded_sizes
from polyfhe.serve.registry import Model

__all__ = ["BROWSER_ENGINES", "SPEC_FORMAT", "browser_support", "client_spec"]

SPEC_FORMAT = "polyfhe-client-spec/1"


def _browser_engines() -> dict[str, str]:
    return {name: engine_facts(name).browser_client for name in engine_names() if engine_facts(name).browser_client}


# engines whose keys and ciphertexts the page can make (their facts name the library: SEAL's node-seal 7.0.0)
BROWSER_ENGINES = _browser_engines()


def browser_support(model: Model) -> tuple[bool, str]:
    """(can the page be this program's client, why not / which library it uses), from its engine's facts."""
    program = model.program
    engine = kind_of(program).engine(program.manifest)
    facts = engine_facts(engine) if engine in engine_names() else None
    if facts is not None and facts.browser_client:
        return True, facts.browser_client
    why = facts.cli_only if facts is not None else ""
    return False, why or f"CLI only: the page has no client for the {engine!r} engine"


def _class_names(model: Model, classes: int) -> list[str]:
    names = model.card.get("class_names")
    if isinstance(names, list) and len(names) == classes:
        return [str(n) for n in names]
    return [f"class {i}" for i in range(classes)]


def client_spec(model: Model) -> dict[str, Any]:
    """The page's view of ``model`` (a CKKS program of an engine in :data:`BROWSER_ENGINES`)."""
    program = model.program
    supported, library = browser_support(model)
    if not supported:
        return {"format": SPEC_FORMAT, "model": model.name, "program_id": program.manifest.program_id,
                "browser": False, "reason": library}
    m, params = program.manifest, program.params
    shape = [int(d) for d in m.input_shape]
    image = list(shape)
    while len(image) > 3 and image[0] == 1:  # a leading batch dimension of one
        image = image[1:]
    channels, height, width = ([1] * (3 - len(image)) + image) if len(image) <= 3 else (None, None, None)
    sizes = estimated_sizes(params, len(m.galois_steps))
    upload = seeded_sizes(params, len(m.galois_steps))["public_context"]  # the page sends its keys seeded
    single = m.layout == "single"
    return {
        "format": SPEC_FORMAT, "model": model.name, "program_id": m.program_id, "browser": True,
        "library": library, "identity": identity_header(m), "params": params.to_dict(),
        "ring": {"poly_modulus_degree": params.poly_modulus_degree, "coeff_mod_bits": list(params.coeff_mod_bits),
                 "scale": params.scale, "security": params.security, "slots": params.slots},
        "galois_steps": [int(s) for s in m.galois_steps],
        "layout": m.layout,
        "input": {"shape": shape, "size": m.input_size, "channels": channels, "height": height, "width": width,
                  "range": list(m.input_range), "mean": float(model.card.get("input_mean", 0.0)),
                  "std": float(model.card.get("input_std", 1.0)),
                  "pixels": "grayscale (or RGB) intensity in [0, 1], ink bright on a dark ground; "
                            "value = (intensity - mean) / std"},
        # level 0: the top of the modulus chain (encrypt at the context's first parms_id), at the program scale
        "encrypt": {"level": 0, "scale": params.scale, "ciphertexts": 1 if single else m.input_size},
        "packing": ({"samples_per_ciphertext": m.samples_per_ciphertext, "virtual_slots": m.virtual_slots,
                     "period": m.input_period, "input_slots": [int(s) for s in m.input_slots],
                     "input_gather": [int(i) for i in m.input_gather]} if single else
                    {"samples_per_ciphertext": 1, "slot": 0}),
        "output": {"size": m.output_size, "slots": [int(s) for s in m.output_slots] if single else [],
                   "ciphertexts": 1 if single else m.output_size},
        "classes": _class_names(model, m.output_size),
        "upload": {"public_context_bytes": upload, "galois_keys": len(m.galois_steps),
                   "budget_bytes": BROWSER_UPLOAD_BUDGET, "within_budget": upload <= BROWSER_UPLOAD_BUDGET,
                   "ciphertext_bytes": sizes["ciphertext"] * (1 if single else m.input_size)},
        "accuracy": model.card.get("accuracy"), "dataset": model.card.get("dataset"),
    }
