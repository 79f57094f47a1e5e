"""CKKS exporter: nn.Module or polynomial ONNX -> :class:`~polyfhe.program.ckks_program.CKKSProgram`.

The compiler is a named list of passes (``pipeline.py``'s ``PASSES``, one module each under ``passes/``) over one
compile state (``state.py``), in this order: ``onnx`` (fold + ONNX export, modules only) -> ``analyze`` (refuses
non-polynomial graphs, naming the nodes) -> ``lower`` (a :class:`Circuit` of merged affine maps and products) ->
``expand_matmuls`` -> ``replicate`` -> ``ranges`` (calibrated value ranges) -> ``spend_levels`` -> ``parameters``
(smallest secure ring and largest scale that fit the levels; past every leveled ring, a residual chain with
bootstraps on engines that have them) -> ``plan`` (per-layout plan) -> ``bootstrap`` (placement) -> ``counters``
-> ``server_memory`` -> ``program``. ``tests/export/ckks/test_exporter_docstring.py`` checks this list against ``PASSES``.
"""

from __future__ import annotations

from typing import Any

from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.circuit import Circuit
from polyfhe.exporters.ckks.passes.onnx import to_onnx_model
from polyfhe.exporters.ckks.pipeline import PASSES, compile_model
from polyfhe.exporters.ckks.state import (
    BATCH_MEMORY_BUDGET,
    BOOTSTRAP_MODES,
    GALOIS_KEY_BUDGET,
    CKKSExportError,
    CompileOptions,
)
from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.program.engines import DEFAULT_BACKEND
from polyfhe.program.params import CKKSParams

__all__ = ["BATCH_MEMORY_BUDGET", "BOOTSTRAP_MODES", "GALOIS_KEY_BUDGET", "PASSES",
           "CKKSExportError", "Circuit", "CompileOptions", "LoweringError", "export_ckks", "to_onnx_model"]


def export_ckks(
    model: Any,
    *,
    calibration: Any = None,
    layout: str = "single",
    input_shape: tuple[int, ...] | None = None,
    params: CKKSParams | None = None,
    poly_modulus_degree: int | None = None,
    scale_bits: int | None = None,
    allow_insecure: bool = False,
    batch_memory_budget: int = BATCH_MEMORY_BUDGET,
    galois_key_budget: int = GALOIS_KEY_BUDGET,
    samples_per_ciphertext: int | None = None,
    backend: str = DEFAULT_BACKEND,
    spend_levels: bool = True,
    bootstrap: str = "auto",
    bootstrap_memory: int | None = None,
    pack_bootstraps: bool = True,
    replicate_input: bool = True,
    compile_memory: int | None = None,
    upload_budget: int | None = None,
) -> CKKSProgram:
    """Compile ``model`` (module or ONNX) into a CKKS program for ``layout`` ("single" or "batch").

    ``calibration``: representative inputs (N, C, H, W) as a numpy array, torch tensor, TensorDataset, DataLoader
    or list of samples (``samples.py``), or a CalibrationResult; sets the output headroom, and a module's input
    shape when neither ``input_shape`` nor the module's ``input_shape`` attribute gives it.
    ``params`` / ``poly_modulus_degree`` / ``scale_bits``: overrides (insecure ones need ``allow_insecure``).
    ``galois_key_budget`` (SEAL; Lattigo plans its own keys): bytes of rotation keys in the public context;
    past it, rare rotations are composed from power-of-two keys (slower, smaller upload).
    ``samples_per_ciphertext`` (single layout): interleave this many samples per ciphertext at the cost of
    one; None takes as many as the widest tensor leaves room for (1 when it needs every slot).
    ``backend``: the engine that makes the keys and runs the program ("seal" or "lattigo"; the manifest names it).
    ``spend_levels`` (single layout): compute depthwise convolutions on their own, a level each, when the ring
    has levels to spare at a scale of at least 2^27 and that is estimated clearly cheaper (``spend.py``);
    ``False`` keeps every map merged at the analyzer's level bound (the most precise plan).
    ``bootstrap`` ("auto" or "off"; single layout, engines that bootstrap: Lattigo): when the circuit needs more
    levels than a leveled ring offers (or than ``params`` holds), run it on a residual chain and place bootstraps
    where they cost least (``bootstrap.py``); ``calibration`` samples set each bootstrap's input range.
    ``bootstrap_memory``: bytes the bootstrapping key generation may peak at (None: 75% of this machine's RAM);
    cheaper residual chains whose keys would not fit are passed over, and said so in the log. A leveled ring
    the engine cannot serve (Lattigo: its Galois keys alone over a server's context limit) is given up for a
    bootstrapped residual ring when bootstrapping is allowed.
    ``pack_bootstraps``: where a cut refreshes several narrow registers, place each in its own block of slots and
    refresh them with one bootstrap (``pack.py``: no level spent); ``False`` bootstraps each register alone.
    ``replicate_input`` (single layout): let the client pack each token's input window im2col-style (pixels
    written to several slots) when that cuts the diagonals of the maps reading the input (``replicate.py``:
    overlapping strided stems); ``False`` packs every input value once.
    ``upload_budget`` (SEAL): bytes the whole public context may take as the web page sends it (seeded keys, about
    half the uncompressed size; ``polyfhe.program.params.BROWSER_UPLOAD_BUDGET`` is the page's 150 MB); the
    Galois keys are cut to what fits, down to the fewest that still compose every rotation the program makes
    (``rotations.lattice_base``), and an export whose fewest keys do not fit is refused with the sizes.
    ``compile_memory``: bytes the lowering's affine terms may hold (None: half of this machine's memory); an
    export that would pass it stops with an error naming the node, before the memory is taken.
    """
    options = CompileOptions(
        calibration=calibration, layout=layout, input_shape=input_shape, params=params,
        poly_modulus_degree=poly_modulus_degree, scale_bits=scale_bits, allow_insecure=allow_insecure,
        batch_memory_budget=batch_memory_budget, galois_key_budget=galois_key_budget,
        samples_per_ciphertext=samples_per_ciphertext, backend=backend, spend_levels=spend_levels,
        bootstrap=bootstrap, bootstrap_memory=bootstrap_memory, pack_bootstraps=pack_bootstraps,
        replicate_input=replicate_input,
        compile_memory=compile_memory, upload_budget=upload_budget)
    return compile_model(model, options)
