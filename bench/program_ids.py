"""Program ids of small deterministic CKKS exports, one per compiler path, and of the legacy program fixtures.

A refactor must leave every program id unchanged. This bench exports a fixed list of small models (seeded
random weights, scikit-learn's digits or seeded random inputs as calibration, one torch thread), each through
one path of the compiler, and prints one row per case: the program id, the ring (N, levels), the levels the
program uses, its bootstraps, a hash of the operation counts in its ``info`` and the export's seconds. Every
program is also saved and loaded again: a different id after the round trip is an error.

With ``--baseline DIR`` the same cases run again in a subprocess with ``PYTHONPATH=DIR`` (a checkout of the
previous main) and both ids are printed side by side; any mismatch or error exits with status 1. Only the
public API is used (``polyfhe.export``, ``polyfhe.create_model``, ``polyfhe.calibrate``,
``polyfhe.load_program``, a program's ``program_id`` and ``manifest``), so the bench runs on both trees while
modules move. One tree takes about a minute on a quiet 2-core machine.

    python bench/program_ids.py                       # this tree
    python bench/program_ids.py --cases seal_single,roundtrip
    python bench/program_ids.py --baseline ../old-main   # side by side; exit 1 on any mismatch
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("polyfhe.bench.program_ids")

ROOT = Path(__file__).resolve().parents[1]
LEGACY = ROOT / "tests" / "program" / "data"  # the fixtures are read from this checkout on both trees
# public context plus three Galois keys of N=8192 as the web page sends them (seeded keys); the free export of
# the upload case takes 8 keys, so the budget cuts them
UPLOAD_BUDGET = 5_639_514
# counts in a program's info that describe its operations (hashed into the ops column)
OP_COUNT_KEYS = ("planned", "products", "linear_maps", "plaintext_diagonals", "rotation_steps", "galois_keys")


# ---------------------------------------------------------------------------------------------------------------
# models (torch is imported only when a case runs)
# ---------------------------------------------------------------------------------------------------------------
def _nn():
    import torch
    from torch import nn

    torch.set_num_threads(1)
    return torch, nn


def _toys() -> Any:
    """bench/toy_models.py, the small models these cases share with the tests (loaded by path: this file is also
    imported by path, and torch only when a case runs)."""
    import importlib.util

    name = "polyfhe_bench_toy_models"  # the name tests/testlib/ckks_testlib.py loads it under
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("toy_models.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _square():
    return _toys().Square()


def _digits(n: int = 64) -> np.ndarray:
    """The first ``n`` scikit-learn digits as (n, 1, 8, 8) float32 in [0, 1]."""
    from sklearn.datasets import load_digits

    return (load_digits().images[:n] / 16.0).reshape(-1, 1, 8, 8).astype(np.float32)


def _seeded(seed: int = 0):
    torch, nn = _nn()
    torch.manual_seed(seed)
    return torch, nn


def _mlp(hidden: int = 16, classes: int = 10, seed: int = 0):
    _, nn = _seeded(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), _square(), nn.Linear(hidden, classes)).eval()


def _deep_mlp():
    """64 -> 16 -> x^2 -> 16 -> x^2 -> 10: too deep for the small ring's three levels, so it bootstraps."""
    _, nn = _seeded()
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), _square(), nn.Linear(16, 16), _square(),
                         nn.Linear(16, 10)).eval()


def _conv8():
    """Depthwise, dilated and strided convolutions, BN, squares, average pooling, a linear head (8x8 input)."""
    _, nn = _seeded()
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), _square(),
        nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4), nn.Conv2d(4, 6, 3, stride=2, padding=1),
        nn.BatchNorm2d(6), _square(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(24, 10)).eval()


def _zoo(name: str, x: np.ndarray, **overrides):
    """A zoo model on 8x8 digits: zero-initialised weights filled with seeded noise, BN statistics recomputed."""
    import polyfhe

    torch, _ = _seeded()
    model = polyfhe.create_model(name, img_size=8, **overrides)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn_like(p) * 0.1)
    polyfhe.calibrate(model, x, onnx_ranges=False)
    return model.eval()


def _linear_attention(tokens: int = 24, width: int = 8, offset: float = 0.2):
    """(D Q K^T + c) V: two ct x ct MatMuls the compiler reassociates to Q (K^T V) and prices per algorithm."""
    _seeded()
    return _toys().LinearAttention(tokens, width, offset).eval()


def _stem_net(width: int = 64):
    """A 7x7 stride-4 stem on 16x16 (overlapping windows: the input is replicated), a gated depthwise branch."""
    _seeded()
    return _toys().StemNet(width).eval()


def _consolidation(width: int = 32):
    """1x1 expansion, x^2, depthwise 3x3, BN, 1x1 projection: computing the depthwise map alone saves diagonals."""
    torch, nn = _seeded()

    class Consolidation(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(1, width, 2, stride=2)
            self.expand = nn.Conv2d(width, width, 1)
            self.square = _square()
            self.depthwise = nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False)
            self.bn = nn.BatchNorm2d(width)
            self.project = nn.Conv2d(width, width, 1)
            self.head = nn.Linear(width * 16, 10)

        def forward(self, x):
            h = self.square(self.expand(self.stem(x)))
            h = self.project(self.bn(self.depthwise(h)))
            return self.head(torch.flatten(self.square(h), 1))

    return Consolidation().eval()


def _shift_blocks(blocks: int = 2, width: int = 16):
    """MONet-style blocks ``x + C(shift(U1 x) * U3(shift(U2 x)))`` with a slice-and-concat spatial shift."""
    _seeded()
    return _toys().ShiftBlocks(blocks, width).eval()


def _deep_residual(width: int = 32):
    """64 -> 32, three residual square blocks, -> 10: 8 levels, skip registers live across the bootstraps."""
    _seeded()
    return _toys().DeepResidual(width).eval()


def _small_ring() -> Any:
    """N=4096 with three 40-bit levels, INSECURE on purpose (``allow_insecure``): bootstraps in seconds."""
    import importlib

    for module in ("polyfhe.program.params", "polyfhe.exporters.ckks"):  # the exporter re-exports CKKSParams
        try:
            params = importlib.import_module(module).CKKSParams
            break
        except (ImportError, AttributeError):
            continue
    else:
        raise ImportError("CKKSParams is in neither polyfhe.program.params nor polyfhe.exporters.ckks")
    return params(4096, (60, 40, 40, 40, 60), 40, security="none")


# ---------------------------------------------------------------------------------------------------------------
# cases: each returns the program whose id is reported
# ---------------------------------------------------------------------------------------------------------------
def _export(model: Any, calibration: np.ndarray, **kwargs: Any) -> Any:
    import polyfhe

    kwargs.setdefault("input_shape", tuple(calibration.shape[1:]))
    return polyfhe.export(model, target="ckks", calibration=calibration, **kwargs)


def _bootstrapping(model: Any, calibration: np.ndarray, **kwargs: Any) -> Any:
    # an explicit key-memory budget: the default is a share of this machine's memory
    kwargs = {"backend": "lattigo", "params": _small_ring(), "allow_insecure": True, "bootstrap_memory": 10**12,
              **kwargs}
    program = _export(model, calibration, **kwargs)
    if not _bootstraps(program):
        raise AssertionError("the bootstrapping case compiled without a bootstrap")
    return program


def _memory_spend() -> Any:
    """ShiftBlocks bootstrapped, then again with a server memory budget one byte under the merged plan's peak:
    the compiler computes the shifts on their own (``info["memory_spend"]``)."""
    x = _digits(32)
    merged = _bootstrapping(_shift_blocks(), x)
    peak = merged.manifest.info["bootstrap"]["server_memory"]["peak_bytes"]
    program = _bootstrapping(_shift_blocks(), x, bootstrap_memory=peak - 1)
    if "memory_spend" not in program.manifest.info:
        raise AssertionError("the memory budget did not make the compiler spend levels")
    return program


def _level_spend() -> Any:
    program = _export(_consolidation(), _digits())
    if not program.manifest.info.get("level_spend", {}).get("spent"):
        raise AssertionError("no level was spent")
    return program


def _replicate() -> Any:
    x = np.random.default_rng(1).uniform(0.0, 1.0, size=(32, 1, 16, 16)).astype(np.float32)
    program = _export(_stem_net(), x)
    if not program.manifest.input_gather:
        raise AssertionError("the input was not replicated")
    return program


def _upload_budget() -> Any:
    x = np.random.default_rng(0).random((64, 1, 8, 8)).astype(np.float32)
    program = _export(_mlp(12, 4, seed=3), x, upload_budget=UPLOAD_BUDGET)
    if not 1 <= len(program.manifest.galois_steps) <= 3:
        raise AssertionError(f"{len(program.manifest.galois_steps)} Galois keys under a budget for three")
    return program


def _attention() -> Any:
    x = np.random.default_rng(0).normal(size=(8, 24, 8)).astype(np.float32)
    return _export(_linear_attention(), x)


def _roundtrip() -> Any:
    """The single-layout MLP saved and loaded: the loaded program's id is reported (it must be the export's)."""
    import polyfhe

    program = _export(_mlp(32), _digits())
    with tempfile.TemporaryDirectory(prefix="polyfhe-ids-") as tmp:
        program.save(tmp)
        loaded = polyfhe.load_program(tmp)
    if loaded.program_id != program.program_id:
        raise AssertionError(f"exported {program.program_id}, loaded {loaded.program_id}")
    return loaded


def _legacy(name: str) -> Callable[[], Any]:
    def load() -> Any:
        import polyfhe

        return polyfhe.load_program(LEGACY / name)

    load.__doc__ = f"tests/program/data/{name}, loaded"
    return load


CASES: dict[str, Callable[[], Any]] = {
    "seal_single": lambda: _export(_mlp(), _digits()),
    "seal_batch": lambda: _export(_mlp(), _digits(), layout="batch"),
    "lattigo": lambda: _export(_mlp(), _digits(), backend="lattigo"),
    "conv8": lambda: _export(_conv8(), _digits()),
    "monet_zoo": lambda: _export(_zoo("monet_fhe_bn", _digits(), dims=(16,)), _digits()),
    "apolynext_zoo": lambda: _export(_zoo("apolynext_fhe_bn", _digits(), channels=64), _digits()),
    "matmul_attention": _attention,
    "replicate_stem": _replicate,
    "level_spend": _level_spend,
    "memory_spend": _memory_spend,
    "upload_budget": _upload_budget,
    "bootstrap_insecure": lambda: _bootstrapping(_deep_mlp(), _digits(32)),
    "bootstrap_packed": lambda: _bootstrapping(_deep_residual(), _digits(), pack_bootstraps=True),
    "bootstrap_unpacked": lambda: _bootstrapping(_deep_residual(), _digits(), pack_bootstraps=False),
    "roundtrip": _roundtrip,
    "legacy_program": _legacy("legacy_program"),
    "legacy_batch_program": _legacy("legacy_batch_program"),
}


def build(name: str) -> Any:
    """The program of case ``name``."""
    return CASES[name]()


# ---------------------------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------------------------
def _bootstraps(program: Any) -> int:
    return sum(1 for step in program.manifest.steps if step.op == "bootstrap")


def ops_hash(info: dict) -> str:
    """Eight hex digits of the operation counts in a program's info."""
    counts = {k: info.get(k) for k in OP_COUNT_KEYS}
    text = json.dumps(counts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def run_case(name: str) -> dict:
    """One row: the case's program id and shape, or the error it raised."""
    import polyfhe

    start = time.perf_counter()
    row: dict[str, Any] = {"case": name}
    try:
        program = build(name)
        seconds = time.perf_counter() - start
        m = program.manifest
        row.update(id=program.program_id, N=m.params.poly_modulus_degree, levels=m.params.levels, depth=m.depth,
                   boots=_bootstraps(program), ops=ops_hash(m.info), backend=m.backend, layout=m.layout)
        with tempfile.TemporaryDirectory(prefix="polyfhe-ids-") as tmp:
            program.save(tmp)
            reloaded = polyfhe.load_program(tmp).program_id
        if reloaded != program.program_id:
            row["error"] = f"id {reloaded} after save and load"
    except Exception as exc:  # noqa: BLE001 - a case's failure is a row, not the end of the run
        seconds = time.perf_counter() - start
        row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        log.debug("case %s failed:\n%s", name, traceback.format_exc())
    row["seconds"] = round(seconds, 2)
    return row


def run_cases(names: list[str]) -> dict:
    """Every case in ``names``, in this process; also says which polyfhe ran them."""
    import polyfhe

    rows = []
    for name in names:
        rows.append(run_case(name))
        log.info("%s done in %.1f s", name, rows[-1]["seconds"])
    return {"polyfhe": str(Path(polyfhe.__file__).resolve().parent), "rows": rows}


def _table(header: list[str], lines: list[list[Any]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in line] for line in lines]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells)


def single_table(result: dict) -> str:
    header = ["case", "program id", "N", "levels", "depth", "boots", "ops", "seconds"]
    lines = []
    for r in result["rows"]:
        if "id" in r:
            lines.append([r["case"], r["id"], r["N"], r["levels"], r["depth"], r["boots"], r["ops"], r["seconds"]])
        if "error" in r:
            lines.append([r["case"], "ERROR " + r["error"], "", "", "", "", "", r["seconds"]])
    return _table(header, lines)


def compare(base: dict, ours: dict) -> tuple[str, int]:
    """The side-by-side table and the number of cases whose ids differ (an error on either side counts)."""
    by_case = {r["case"]: r for r in base["rows"]}
    header = ["case", "baseline id", "this tree id", "match", "ops", "N", "levels", "boots", "base s", "this s"]
    lines, bad, errors = [], 0, []
    for r in ours["rows"]:
        b = by_case.get(r["case"], {"error": "not run"})
        same = "error" not in r and "error" not in b and r.get("id") == b.get("id")
        bad += not same
        lines.append([r["case"], b.get("id", "ERROR"), r.get("id", "ERROR"), "yes" if same else "NO",
                      "same" if r.get("ops") == b.get("ops") and "ops" in r else "diff",
                      _pair(b, r, "N"), _pair(b, r, "levels"), _pair(b, r, "boots"),
                      b.get("seconds", ""), r.get("seconds", "")])
        errors += [f"  {side} {r['case']}: {x['error']}" for side, x in (("baseline", b), ("this tree", r))
                   if "error" in x]
    text = _table(header, lines)
    if errors:
        text += "\nerrors:\n" + "\n".join(errors)
    return text, bad


def _pair(b: dict, r: dict, key: str) -> str:
    x, y = b.get(key, "-"), r.get(key, "-")
    return str(y) if x == y else f"{x}->{y}"


def run_baseline(directory: Path, names: list[str], timeout: float) -> dict:
    """The cases run by this script in a subprocess on the checkout ``directory`` (``PYTHONPATH``)."""
    with tempfile.TemporaryDirectory(prefix="polyfhe-ids-base-") as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "PYTHONPATH": str(directory)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--cases", ",".join(names), "--json", str(out)]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if not out.exists():
            raise RuntimeError(f"the baseline run wrote no rows (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
    ran = Path(result["polyfhe"])
    if not ran.is_relative_to(directory.resolve()):
        raise RuntimeError(f"the baseline run imported polyfhe from {ran}, not from {directory}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help=f"comma-separated cases (default: all): {', '.join(CASES)}")
    parser.add_argument("--baseline", type=Path, help="a checkout of the previous main, run with PYTHONPATH=DIR")
    parser.add_argument("--json", type=Path, help="write the rows to this file as JSON")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds the baseline subprocess may take")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each case and the compiler's warnings")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(message)s")
    names = list(CASES) if not args.cases else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    ours = run_cases(names)
    if args.json:
        args.json.write_text(json.dumps(ours, indent=1))
    if args.baseline is None:
        print(f"polyfhe from {ours['polyfhe']}")
        print(single_table(ours))
        print(f"total {sum(r['seconds'] for r in ours['rows']):.1f} s")
        return int(any("error" in r for r in ours["rows"]))
    base = run_baseline(args.baseline, names, args.timeout)
    text, bad = compare(base, ours)
    print(f"baseline polyfhe from {base['polyfhe']}; this tree's from {ours['polyfhe']}")
    print(text)
    print(f"{len(names) - bad}/{len(names)} ids match; total {sum(r['seconds'] for r in base['rows']):.1f} s "
          f"baseline, {sum(r['seconds'] for r in ours['rows']):.1f} s this tree")
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
