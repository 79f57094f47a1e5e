"""``polyfhe export MODEL --target onnx|ckks --out DIR``: zoo model, checkpoint or ONNX file -> ONNX or CKKS.

MODEL is a zoo name, a checkpoint folder (``config.json`` + ``model.safetensors``) or an ``.onnx`` file.
For ``--target ckks`` the compiled program (``manifest.json`` + ``arrays.npz``) is written to DIR and
``polyfhe run DIR --input FILE`` runs it encrypted. Calibration data fix the CKKS value ranges (and, for an
untrained zoo model, its BatchNorm statistics): a dataset name (``digits``, ``fashion-mnist``, ...), a
dataset path, or an ``.npy``/``.npz`` file of images shaped like the model input.

Exit codes: 0 exported; 1 the model cannot be exported (not polynomial, no CKKS parameters fit);
2 bad input (missing file, unknown model, calibration data of the wrong shape).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyfhe import EXPORT_TARGETS
from polyfhe.commands.arguments import (
    add_threads_argument,
    apply_threads,
    positive_float,
    positive_int,
    power_of_two,
)
from polyfhe.commands.ckks_options import add_ckks_parameter_arguments, ckks_parameter_options
from polyfhe.commands.errors import ExportInputError

if TYPE_CHECKING:  # numpy is imported by the functions that read arrays, not by the parser
    import numpy as np

__all__ = ["EXIT_BAD_INPUT", "EXIT_NOT_EXPORTABLE", "ExportInputError", "add_parser", "load_calibration",
           "read_array", "resolve_model", "run"]

log = logging.getLogger(__name__)

EXIT_NOT_EXPORTABLE = 1
EXIT_BAD_INPUT = 2
DEFAULT_SAMPLES = 256
# Calibration source used when none is given, by model input shape (C, H, W).
DEFAULT_CALIBRATION: dict[tuple[int, ...], str] = {(1, 8, 8): "digits", (1, 28, 28): "fashion-mnist"}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("export", description=__doc__,
                              help="export a zoo model, checkpoint or ONNX file to ONNX or a CKKS program",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL_OR_ONNX", help="zoo name, checkpoint folder or .onnx file")
    p.add_argument("--target", choices=tuple(EXPORT_TARGETS), default="ckks",
                   help="what to produce (default ckks; concrete: a Concrete ML TFHE program, needs "
                        "`polyfhe setup concrete` once)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    p.add_argument("--layout", choices=("single", "batch"), default="single",
                   help="ckks: one sample per ciphertext (low latency) or one sample per slot (throughput)")
    from polyfhe.program.engines import BACKEND_NAMES, DEFAULT_BACKEND

    p.add_argument("--backend", choices=BACKEND_NAMES, default=DEFAULT_BACKEND,
                   help="ckks: the engine that makes the keys and runs the program (lattigo: single layout, "
                        "hoisted rotations)")
    p.add_argument("--no-spend-levels", dest="spend_levels", action="store_false",
                   help="single layout: keep every map merged at the analyzer's level bound (most precise) instead "
                        "of computing depthwise convolutions on their own when levels are spare and it is clearly "
                        "cheaper")
    p.add_argument("--no-replicate-input", dest="replicate_input", action="store_false",
                   help="single layout: pack every input value once instead of letting the client lay out each "
                        "token's window im2col-style when that needs fewer diagonals (overlapping strided stems)")
    p.add_argument("--bootstrap", choices=("auto", "off"), default="auto",
                   help="ckks, single layout, lattigo: bootstrap when the model needs more levels than a leveled "
                        "ring offers (auto), or refuse such a model (off)")
    p.add_argument("--bootstrap-memory", type=float, metavar="GB",
                   help="bootstrapping: memory the key generation may peak at (default: 75%% of this machine's "
                        "RAM); residual chains whose bootstrapping keys would not fit are passed over")
    p.add_argument("--no-pack-bootstraps", dest="pack_bootstraps", action="store_false",
                   help="bootstrapping: refresh every register with a bootstrap of its own, instead of letting a "
                        "cut's narrow registers share one (each in its own block of slots: fewer bootstraps, more "
                        "diagonals)")
    p.add_argument("--compile-memory", type=positive_float, metavar="GB",
                   help="ckks: memory the compiler's lowering may hold (default: half of this machine's RAM); an "
                        "export that would need more stops with an error naming the node")
    p.add_argument("--samples-per-ciphertext", type=power_of_two, metavar="K",
                   help="single layout: interleave K samples per ciphertext (a power of two; default: as many "
                        "as fit beside the widest tensor)")
    p.add_argument("--calibration", metavar="SOURCE_OR_NPY",
                   help="dataset name/path or .npy/.npz images "
                        "(default: digits for 1x8x8, fashion-mnist for 1x28x28)")
    p.add_argument("--samples", type=positive_int, default=DEFAULT_SAMPLES, metavar="N",
                   help=f"calibration samples to use (default {DEFAULT_SAMPLES})")
    p.add_argument("--img-size", type=positive_int, metavar="S", help="zoo models: input resolution")
    p.add_argument("--in-chans", type=positive_int, metavar="C", help="zoo models: input channels")
    p.add_argument("--num-classes", type=positive_int, metavar="K", help="zoo models: classifier outputs")
    p.add_argument("--checkpoint", type=Path, metavar="DIR",
                   help="load trained weights for the zoo model MODEL")
    add_ckks_parameter_arguments(p)
    concrete = p.add_argument_group("concrete target (Concrete ML, TFHE)")
    concrete.add_argument("--n-bits", type=positive_int, default=None, metavar="B",
                          help="quantisation bits of op inputs and weights (default: chosen with the rounding from a "
                               "small grid scored on the calibration inputs, recorded in the manifest)")
    concrete.add_argument("--rounding-threshold-bits", type=positive_int, metavar="B",
                          help="round accumulators to B bits before each table lookup (lets larger n_bits fit)")
    concrete.add_argument("--p-error", type=float, metavar="P",
                          help="error probability of one programmable bootstrap (Concrete ML's default if unset)")
    concrete.add_argument("--concrete-env", type=Path, metavar="DIR",
                          help="Concrete ML's environment (default: the one `polyfhe setup concrete` made)")
    add_threads_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from polyfhe.engines.concrete import ConcreteEnvMissing
    from polyfhe.exporters.ckks import CKKSExportError
    from polyfhe.exporters.concrete import ConcreteExportError

    console = Console(width=140)
    apply_threads(args)
    try:
        model, name, trained = resolve_model(args)
        shape = _input_shape(model)
        calibration = _calibration_for(args, shape, needs_data=not trained)
        if not trained:
            from polyfhe.calibration import recompute_from_array

            recompute_from_array(model, calibration)
            console.print(f"[yellow]warning:[/] {name} is an untrained zoo model: its predictions are chance "
                          "level (train it with `polyfhe train` and pass the checkpoint folder)")
        return _TARGET_RUNS[args.target](console, model, name, shape, calibration, args)
    except ExportInputError as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    except (CKKSExportError, ConcreteExportError, ConcreteEnvMissing) as exc:
        return _fail(str(exc), EXIT_NOT_EXPORTABLE)


# ----------------------------------------------------------------------------------------------------------
# model and calibration data
# ----------------------------------------------------------------------------------------------------------
def resolve_model(args: argparse.Namespace) -> tuple[Any, str, bool]:
    """(nn.Module or .onnx path, display name, trained?) for MODEL_OR_ONNX and ``--checkpoint``."""
    target = str(args.model)
    path = Path(target)
    overrides = {k: v for k, v in (("img_size", args.img_size), ("in_chans", args.in_chans),
                                   ("num_classes", args.num_classes)) if v is not None}
    if path.suffix.lower() == ".onnx":
        if not path.is_file():
            raise ExportInputError(f"ONNX file {path} does not exist")
        if overrides or args.checkpoint:
            raise ExportInputError("--img-size/--in-chans/--num-classes/--checkpoint apply to zoo models, "
                                   f"not to the ONNX file {path}")
        return path, path.stem, True
    if path.is_dir() or args.checkpoint is not None:
        return _from_checkpoint(args.checkpoint or path, None if path.is_dir() else target, overrides)
    from polyfhe.models.registry import create_model

    try:
        model = create_model(target, **overrides)
    except KeyError as exc:
        raise ExportInputError(f"{target!r} is not a file, a checkpoint folder or a zoo model: "
                               f"{exc.args[0]}") from None
    except (TypeError, ValueError) as exc:
        raise ExportInputError(f"cannot build zoo model {target!r} with {overrides}: {exc}") from exc
    return model.eval(), target, False


def _from_checkpoint(directory: Path, expect: str | None, overrides: dict) -> tuple[Any, str, bool]:
    try:
        from polyfhe.training.checkpoint import CheckpointError, fold_input_normalization, load_checkpoint
    except ImportError as exc:  # the checkpoint module lands with training
        raise ExportInputError(f"checkpoint folders need polyfhe.training.checkpoint ({exc})") from exc
    try:
        model, info = load_checkpoint(directory, expect_model=expect)
    except CheckpointError as exc:
        raise ExportInputError(str(exc)) from exc
    from polyfhe.models.registry import model_entry

    built = {**model_entry(info.model_name).default_cfg, **info.model_kwargs}
    clash = {k: v for k, v in overrides.items() if built.get(k) != v}
    if clash:
        raise ExportInputError(f"checkpoint {directory} was built with "
                               f"{ {k: built.get(k) for k in clash} }; the overrides {clash} do not fit it")
    return fold_input_normalization(model, info).eval(), info.model_name, True


def _input_shape(model: Any) -> tuple[int, ...] | None:
    """(C, H, W) of a module or ONNX file; None when the graph leaves it symbolic."""
    if not isinstance(model, Path):
        shape = getattr(model, "input_shape", None)
        return tuple(int(s) for s in shape) if shape is not None else None
    from polyfhe.analysis.loader import ModelLoadError, input_dims

    try:
        dims = input_dims(model)
    except ModelLoadError as exc:
        raise ExportInputError(str(exc)) from exc
    return tuple(dims[1:]) if dims and all(d for d in dims[1:]) else None


def read_array(path: Path) -> np.ndarray:
    """An .npy array, or array ``x`` (or the only array) of an .npz; never unpickles."""
    import numpy as np

    data = np.load(path, allow_pickle=False)
    if isinstance(data, np.ndarray):
        return data
    with data:
        if "x" not in data.files and len(data.files) != 1:
            raise ValueError(f"{path} holds arrays {data.files}; expected one named 'x'")
        return data["x" if "x" in data.files else data.files[0]]


def load_calibration(spec: str, samples: int) -> np.ndarray:
    """First ``samples`` images of a dataset (train split) or of an .npy/.npz file, as float32."""
    import numpy as np

    path = Path(spec).expanduser()
    if path.suffix.lower() in (".npy", ".npz"):
        if not path.is_file():
            raise ExportInputError(f"calibration file {path} does not exist")
        try:
            x = read_array(path)
        except (ValueError, OSError) as exc:
            raise ExportInputError(f"cannot read calibration file {path}: {exc}") from exc
    else:
        from polyfhe.data.sources import open_dataset

        try:
            x = open_dataset(spec).x_train
        except (FileNotFoundError, ValueError) as exc:
            raise ExportInputError(f"calibration data {spec!r}: {exc}") from exc
    x = np.asarray(x)
    if x.dtype.kind not in "fiu" or x.size == 0:
        raise ExportInputError(f"calibration data {spec!r} must be a non-empty numeric array, got {x.dtype}")
    return x[:samples].astype(np.float32)


def _calibration_for(args: argparse.Namespace, shape: tuple[int, ...] | None,
                     needs_data: bool) -> np.ndarray | None:
    """The calibration images reshaped to ``shape``; an untrained model needs them for its BatchNorm."""
    import numpy as np

    spec = args.calibration
    if spec is None:
        spec = DEFAULT_CALIBRATION.get(tuple(shape or ()))
        if spec is None:
            if needs_data:
                raise ExportInputError(f"no default calibration data for input shape {shape}; pass "
                                       "--calibration (a dataset name or an .npy/.npz of images)")
            return None
        log.info("calibrating on %s (the default for input shape %s)", spec, shape)
    x = load_calibration(spec, args.samples)
    if shape is None:
        return x
    per_sample = int(np.prod(shape))
    if x.ndim >= 2 and int(np.prod(x.shape[1:])) == per_sample:
        return x.reshape((-1, *shape))
    raise ExportInputError(f"calibration samples of shape {tuple(x.shape[1:])} do not fit the model input "
                           f"{tuple(shape)}; use data of that shape "
                           "(or --img-size/--in-chans for zoo models)")


# ----------------------------------------------------------------------------------------------------------
# targets
# ----------------------------------------------------------------------------------------------------------
def _export_onnx(console: Any, model: Any, name: str, shape: tuple[int, ...] | None, out: Path) -> int:
    if isinstance(model, Path):
        raise ExportInputError(f"{model} is already ONNX; use --target ckks to compile it")
    from polyfhe.exporters.onnx import ExportError, export_onnx

    try:
        result = export_onnx(model, out / f"{name}.onnx", shape)
    except ExportError as exc:
        return _fail(str(exc), EXIT_NOT_EXPORTABLE)
    rep = result.analysis
    console.print(f"[green]wrote[/] {result.path}: opset {result.opset}, input {result.input_shape}, "
                  f"onnxruntime vs torch max relative error {result.max_rel_error:.1e}")
    console.print(f"polynomial={rep.polynomial}, degree {rep.degree}, ct x ct depth {rep.mult_depth}, "
                  f"CKKS levels {rep.levels}")
    return 0


def _export_ckks(console: Any, model: Any, name: str, shape: tuple[int, ...] | None,
                 calibration: np.ndarray | None, args: argparse.Namespace) -> int:
    from polyfhe.exporters.ckks import export_ckks

    kwargs = {} if isinstance(model, Path) else {"input_shape": shape}
    try:
        kwargs.update(ckks_parameter_options(args))
    except ValueError as exc:
        raise ExportInputError(str(exc)) from None
    program = export_ckks(model, calibration=calibration, layout=args.layout,
                          samples_per_ciphertext=args.samples_per_ciphertext, backend=args.backend,
                          spend_levels=args.spend_levels, replicate_input=args.replicate_input, bootstrap=args.bootstrap,
                          bootstrap_memory=None if args.bootstrap_memory is None else int(args.bootstrap_memory * 1e9),
                          pack_bootstraps=args.pack_bootstraps,
                          compile_memory=None if args.compile_memory is None else int(args.compile_memory * 1e9),
                          **kwargs)
    program.save(args.out)
    _card_from_checkpoint(args, Path(args.out))
    console.print(summary_table(program, args.out, name))
    console.print(f"[green]saved[/] CKKS program to {args.out}; run it with "
                  f"`polyfhe run {args.out} --input IMAGE.png|X.npy`")
    return 0


def _card_from_checkpoint(args: argparse.Namespace, out: Path) -> None:
    """A ``card.json`` beside a program exported from a ``polyfhe train`` checkpoint (unless one is there): its
    class names, data set and test accuracy, which ``polyfhe serve`` and its web page show."""
    import json

    folder = Path(args.checkpoint or args.model)
    config = folder / "config.json"
    card = out / "card.json"
    if card.exists() or not config.is_file():
        return
    try:
        extra = json.loads(config.read_text()).get("extra") or {}
    except (OSError, ValueError):
        return
    fields = {"class_names": extra.get("classes"), "dataset": extra.get("data"),
              "accuracy": extra.get("test_accuracy")}
    fields = {k: v for k, v in fields.items() if v is not None}
    if fields:
        card.write_text(json.dumps(fields) + "\n")


def _packing(m: Any) -> str:
    """How the client lays out the input (``export/ckks/replicate.py``)."""
    if m.layout != "single":
        return "one ciphertext per value"
    if not m.input_gather:
        return f"each of the {m.input_size} values once"
    return (f"replicated (im2col): {len(m.input_gather)} slots for {m.input_size} values, each token's window "
            "in its own block")


def _spent(spend: dict | None) -> str:
    """What spending levels decided (``export/ckks/spend.py``)."""
    if not spend:
        return "not considered"
    if not spend["spent"]:
        return f"none (budget {spend['budget']} levels; estimated cost {spend['estimated_cost'] or 'no sites'})"
    return (f"{spend['spent']} on {len(spend['factored'])} depthwise convolutions computed on their own "
            f"(estimated cost {spend['estimated_cost']})")


def _bootstraps(boot: dict | None) -> str:
    """Where the program bootstraps (``export/ckks/bootstrap.py``)."""
    if not boot:
        return "none"
    packed = sum(boot.get("packed", ()))
    shared = f"; {packed} cut(s) packed into one bootstrap" if packed else ""
    return (f"{boot['count']} of {boot['slots']} slots after levels {boot['cuts_after_level']}{shared} "
            f"({boot['levels_needed']} levels in segments of {boot['levels_per_segment']}; levels left per segment "
            f"{boot['levels_left_after_segment']}; bootstrapping keys {boot.get('key_bytes', 0) / 1e9:.1f} GB over "
            f"{boot['modulus_bits']} bits)")


def _engine_rows(backend: str, facts: dict | None) -> list[tuple[str, Any]]:
    """What the engine's own lowering does per query (Lattigo: hoisted baby steps, full giant steps)."""
    if not facts:
        return []
    work = (f"{facts.get('linear_transforms', 0)} linear transforms, {facts.get('giant_rotations', 0)} giant + "
            f"{facts.get('output_rotations', 0)} replication rotations, {facts.get('baby_rotations', 0)} hoisted "
            f"baby steps, {facts.get('products', 0)} ct x ct products")
    return [(f"{backend} per query", work),
            (f"{backend} modulus", f"{facts.get('modulus_bits', '-')} bits (the engine's own primes)")]


def summary_table(program: Any, out: Path, name: str) -> Any:
    from rich.table import Table

    m = program.manifest
    info, p = m.info, m.params
    from polyfhe.program.engines import public_context_bytes
    from polyfhe.program.params import estimated_sizes

    sizes = estimated_sizes(p, len(m.galois_steps))
    ciphertexts = 1 if m.layout == "single" else m.input_size
    disk = sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file())
    rows = [
        ("model", name), ("program id", m.program_id), ("backend", m.backend), ("layout", m.layout),
        ("input shape", " x ".join(map(str, m.input_shape))), ("outputs", m.output_size),
        ("ring N", p.poly_modulus_degree), ("slots", p.slots),
        ("samples per ciphertext", m.samples_per_ciphertext if m.layout == "single" else f"up to {p.slots}"),
        ("modulus chain (bits)", f"{list(p.coeff_mod_bits)} = {p.total_bits} (security {p.security})"),
        ("scale", f"2^{p.scale_bits}"), ("levels used / available", f"{m.depth} / {p.levels}"),
        ("levels: analyzer's lower bound", info.get("analyzer", {}).get("levels", "-")),
        ("input packing", _packing(m)), ("levels spent", _spent(info.get("level_spend"))), ("bootstraps", _bootstraps(info.get("bootstrap"))),
        ("degree", info.get("degree", "-")), ("linear maps / ct x ct products",
                                             f"{info.get('linear_maps', '-')} / {info.get('products', '-')}"),
        ("plaintext diagonals", info.get("plaintext_diagonals", "-")), ("Galois keys", len(m.galois_steps)),
        ("planned per query", _planned(info.get("planned"))),
        ("fallbacks", "; ".join(info.get("fallbacks", [])) or "none"),
        *_engine_rows(m.backend, info.get(m.backend)),
        ("calibration", f"{info.get('samples', 0)} samples, inputs in "
         f"[{m.input_range[0]:.3g}, {m.input_range[1]:.3g}]" if info.get("calibrated")
         else "none (assumed inputs in [0, 1])"),
        ("program on disk", _mb(disk)),
        ("public context (est.)", f"~{_mb(public_context_bytes(m))} as uploaded, {_mb(sizes['public_context'])} in memory"),
        ("input ciphertexts (est.)", f"~{_mb(sizes['ciphertext'] * ciphertexts)}"),
    ]
    table = Table(title="CKKS program", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in rows:
        table.add_row(key, str(value))
    return table


def _planned(planned: dict | None) -> str:
    if not planned:
        return "-"
    return (f"{planned['rotations']} rotations, {planned['key_switches']} key switches, "
            f"{planned['plain_products']} plaintext products, {_mb(planned['plaintext_bytes'])} of plaintexts")


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _export_concrete(console: Any, model: Any, name: str, shape: tuple[int, ...] | None, calibration: Any,
                     args: argparse.Namespace) -> int:
    from polyfhe.commands.export_concrete import export_concrete_program

    return export_concrete_program(console, model, name, shape, calibration, args)


# --target -> what the command does for it (polyfhe.EXPORT_TARGETS names the targets)
_TARGET_RUNS: dict[str, Any] = {
    "onnx": lambda console, model, name, shape, calibration, args: _export_onnx(console, model, name, shape,
                                                                                args.out),
    "ckks": _export_ckks,
    "concrete": _export_concrete,
}
