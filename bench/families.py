"""Polynomial families side by side: Fashion-MNIST accuracy vs CKKS levels vs encrypted latency.

LPNN, TaylorNet, Taylor-Mixer and polynomial ResMLP (issue 17) beside our two FHE recipes, every model trained
with the same budget by ``levels_vs_accuracy``'s recipe (AdamW, warm-up + cosine, label smoothing, flips), then
folded, analysed (degree, ct x ct depth, levels) and compiled for CKKS in the single layout on the chosen engine.
Each model runs in a process of its own, so its peak RSS is its own and one model's memory is not carried into the
next. Encrypted latency is the server's evaluation of one query, which holds as many images as the program interleaves
in a ciphertext (``samples_per_ciphertext``): the first query (cold: plaintexts encoded on first use) and the median
of the next ``--warm-runs`` (warm), also divided by the images per query; argmax agreement and the largest logit
error are measured on ``--encrypted`` test images against the float64 plaintext model. Writes results.md, results.json and
families.png to ``--out``.

    python bench/families.py --epochs 3 --out runs/families
    python bench/families.py --limit 2000 --epochs 1 --encrypted 2 --models lpnn_bn resmlp_poly  # smoke run
    python bench/families.py --report runs/a/results.json runs/b/results.json --out runs/families  # one table
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import multiprocessing
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from levels_vs_accuracy import TrainConfig, load_data, train
from machine_info import machine_info

log = logging.getLogger("families")

MODELS = ("lpnn_bn", "taylornet", "taylor_mixer", "resmlp_poly", "monet_fhe_bn", "cpolynext_fhe_bn")


@dataclass(frozen=True)
class Row:
    model: str
    family: str
    params: int
    degree: int | None
    mult_depth: int | None
    levels: int | None
    test_accuracy: float
    train_seconds: float
    ring: int
    program_levels: int
    diagonals: int | None
    compile_s: float
    keygen_s: float
    key_bytes: int
    cold_s: float
    warm_s: float
    images_per_query: int
    encrypted_images: int
    argmax_agreement: float
    max_logit_error: float
    peak_rss_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _float64_logits(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return copy.deepcopy(model).double()(torch.from_numpy(np.asarray(x, dtype=np.float64))).numpy()


def encrypted_numbers(model: torch.nn.Module, x_cal: np.ndarray, x_test: np.ndarray, backend: str,
                      warm_runs: int) -> dict[str, Any]:
    """Compile, key, and run ``x_test`` image by image; the first run is cold, the next ``warm_runs`` warm."""
    from polyfhe.exporters.ckks import export_ckks

    shape = tuple(model.input_shape)
    t0 = time.perf_counter()
    prog = export_ckks(model, calibration=x_cal, layout="single", input_shape=shape, backend=backend)
    compile_s = time.perf_counter() - t0
    client = prog.client()
    context = client.public_context()
    server = prog.server(context)
    lanes = prog.manifest.samples_per_ciphertext  # images interleaved in one query
    queries = [x_test[i:i + lanes] for i in range(0, len(x_test), lanes)]
    evals, logits = [], []
    for i in range(max(len(queries), 1 + warm_runs)):
        answer = client.decrypt(server.run(client.encrypt(queries[i % len(queries)])))
        if i < len(queries):
            logits.append(answer)
        evals.append(server.last_run.seconds)
    enc = np.concatenate(logits)
    plain = _float64_logits(model, x_test)
    return {
        "ring": prog.params.poly_modulus_degree, "program_levels": prog.params.levels,
        "diagonals": prog.manifest.info.get("plaintext_diagonals"), "compile_s": compile_s,
        "keygen_s": client.keygen_seconds, "key_bytes": len(context), "cold_s": evals[0],
        "warm_s": statistics.median(evals[1: 1 + warm_runs]) if warm_runs else evals[0],
        "images_per_query": lanes, "encrypted_images": len(x_test),
        "argmax_agreement": float(np.mean(enc.argmax(1) == plain.argmax(1))),
        "max_logit_error": float(np.abs(enc - plain).max()),
    }


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train, analyse, compile and run one model (in a child process of its own)."""
    import polyfhe
    from polyfhe.exporters.onnx import STRUCTURAL_CHECK_RTOL, export_onnx

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    data = load_data(args)
    cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    torch.manual_seed(cfg.seed)
    c, h, _ = data.input_shape
    model = polyfhe.create_model(name, img_size=h, in_chans=c, num_classes=data.num_classes)
    params = sum(p.numel() for p in model.parameters())
    acc, seconds = train(model, data, cfg, torch.device("cpu"))
    model = model.eval()
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        report = export_onnx(model, Path(tmp) / "model.onnx", rtol=STRUCTURAL_CHECK_RTOL,
                             allow_nonfinite=True).analysis
    folded = polyfhe.fold(model)
    numbers = encrypted_numbers(folded, data.x_train[:args.calibration], data.x_test[:args.encrypted],
                                args.backend, args.warm_runs)
    row = Row(name, polyfhe.model_entry(name).family, params, report.degree, report.mult_depth, report.levels,
              acc, seconds, **numbers,
              peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    log.info("%s: acc %.4f, %s levels, warm %.2f s, agreement %.2f", name, acc, report.levels, row.warm_s,
             row.argmax_agreement)
    return row.to_dict()


def run_isolated(name: str, args: argparse.Namespace) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_model, (name, args))


# ------------------------------------------------------------------------------------------------- output
def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        ("| model | params | degree | ct x ct depth | levels (analyzer) | ring N / levels | diagonals "
         "| test accuracy | compile (s) | keygen (s) | public keys (MB) | images per query | cold (s) | warm (s) "
         "| warm per image (s) | agreement | max logit error | peak RSS (GB) |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params']:,} | {r['degree']} | {r['mult_depth']} | {r['levels']} "
            f"| {r['ring']} / {r['program_levels']} | {r['diagonals'] or '-'} | {100 * r['test_accuracy']:.2f}% "
            f"| {r['compile_s']:.1f} | {r['keygen_s']:.1f} | {r['key_bytes'] / 1e6:.0f} | {r['images_per_query']} "
            f"| {r['cold_s']:.2f} | {r['warm_s']:.2f} | {r['warm_s'] / r['images_per_query']:.3f} | {100 * r['argmax_agreement']:.0f}% ({r['encrypted_images']}) "
            f"| {r['max_logit_error']:.2e} | {r['peak_rss_bytes'] / 1e9:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows:
        for ax, x in ((left, r["levels"] or 0), (right, r["warm_s"] / r["images_per_query"])):
            ax.scatter([x], [100 * r["test_accuracy"]])
            ax.annotate(r["model"], (x, 100 * r["test_accuracy"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    left.set_xlabel("CKKS levels (folded, analyzer)")
    right.set_xlabel("encrypted time per image, warm, amortised over a query (s)")
    right.set_xscale("log")
    for ax in (left, right):
        ax.set_ylabel("Fashion-MNIST test accuracy (%)")
        ax.margins(x=0.25, y=0.15)
    fig.suptitle("Polynomial families: accuracy vs levels vs encrypted latency")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--limit", type=int, default=0, help="train on this many samples (test on limit/5); 0: all")
    p.add_argument("--dataset", default="fashion-mnist", help="a polyfhe.data.sources name")
    p.add_argument("--data-dir", default=None, help="folder with Fashion-MNIST IDX files (overrides --dataset)")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="seal", choices=("seal", "lattigo"))
    p.add_argument("--calibration", type=int, default=256, help="training images for the range calibration")
    p.add_argument("--encrypted", type=int, default=8, help="test images run encrypted per model")
    p.add_argument("--warm-runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=Path("runs/families"))
    p.add_argument("--report", nargs="+", type=Path, default=None, metavar="RESULTS_JSON",
                   help="run nothing: write one table and plot from the rows of earlier runs' results.json")
    return p.parse_args(argv)


def report(paths: list[Path], out: Path) -> str:
    """One table and plot from earlier runs (a model measured again replaces its earlier row)."""
    rows: dict[str, dict[str, Any]] = {}
    headers = []
    for path in paths:
        saved = json.loads(path.read_text())
        rows.update({r["model"]: r for r in saved["rows"]})
        m, a = saved["machine"], saved["args"]
        headers.append(f"{path.parent.name}: {', '.join(r['model'] for r in saved['rows'])} ({a['dataset']}, "
                       f"{a['epochs']} epochs, engine {a['backend']}; {m['cpu']}, {m['usable_cores']} cores, "
                       f"load {m['load_avg_1m']:.1f} at the start)")
    text = "Runs merged:\n" + "\n".join(f"- {h}" for h in headers) + "\n\n" + markdown_table(list(rows.values()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    plot(list(rows.values()), out / "families.png")
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.report:
        print(report(args.report, args.out))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    header = (f"{args.dataset}, {args.epochs} epochs{f' on {args.limit} samples' if args.limit else ''}, "
              f"CKKS engine {args.backend}, single layout; machine: {machine['cpu']}, "
              f"{machine['usable_cores']} cores, Python {machine['python']}\n\n")
    rows: list[dict[str, Any]] = []
    for name in args.models:
        rows.append(run_isolated(name, args))
        (args.out / "results.md").write_text(header + markdown_table(rows))  # kept when a run is cut off
        (args.out / "results.json").write_text(json.dumps(
            {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
        plot(rows, args.out / "families.png")
    print(header + markdown_table(rows))  # a bench script prints its table
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
