"""The calibrated cost model against measurement: predicted and measured latency, key bytes and peak memory.

    python bench/cost_model.py                       # every case, both engines
    python bench/cost_model.py --cases digits_mlp --backend seal --warm-runs 3 --out /tmp/cost

Each case is compiled in one fresh process and run in another (client and server in one process, as
``polyfhe run``), so the peak RSS measured is the run's own; each run records its server seconds, its CPU seconds
and the load average (other jobs on a shared machine slow the wall time, not the work), and the server's setup
(Lattigo encodes every diagonal then). Predictions come from this machine's calibration
(``polyfhe.cost.model.calibrated_costs``, cached; made first if missing) and the compiled program's exact
operation counts. Small rings below 128-bit security (``allow_insecure``) keep the zoo cases short and small:
timing does not depend on security. A rich table and ``cost_model.json`` (with machine details) land in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine_info

log = logging.getLogger("bench.cost_model")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _insecure_8192(levels: int) -> dict:
    """A short ring for the zoo cases (timings only): N=8192, 2^35 scale, exactly the levels the model needs."""
    from polyfhe.program.params import CKKSParams

    return {"params": CKKSParams(8192, (50,) + (35,) * levels + (50,), 35, "none"), "allow_insecure": True}


# name -> (zoo model or "digits_mlp", img size, levels of an insecure N=8192 chain or None for the default ring)
CASES = {
    "digits_mlp": ("digits_mlp", 8, None),
    "monet_fhe_bn@8": ("monet_fhe_bn", 8, 9),
    "cpolynext_fhe_bn@8": ("cpolynext_fhe_bn", 8, 11),
}


def _digits_mlp():
    import torch
    from torch import nn

    from polyfhe.data.sources import load_digits

    class Square(nn.Module):
        def forward(self, x):
            return x * x

    data = load_digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), Square(), nn.Linear(32, 10))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    for _ in range(80):
        optim.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optim.step()
    return model.eval(), data.x_train[:256].reshape(-1, 1, 8, 8)


def compile_case(name: str, backend: str, out: str) -> dict:
    """Compile one case and save it (runs in its own process)."""
    logging.basicConfig(level=logging.ERROR)
    from polyfhe.cost.zoo_models import compile_model
    from polyfhe.exporters.ckks import export_ckks

    model, img, levels = CASES[name]
    overrides = _insecure_8192(levels) if levels else {}
    t0 = time.perf_counter()
    if model == "digits_mlp":
        module, x = _digits_mlp()
        prog = export_ckks(module, calibration=x, input_shape=(1, 8, 8), backend=backend, **overrides)
    else:
        prog = compile_model(model, img, backend, **overrides)
    prog.save(out)
    return {"compile_s": time.perf_counter() - t0}


def run_case(path: str, warm_runs: int) -> dict:
    """Keys, a cold and ``warm_runs`` warm evaluations of a saved program (runs in its own process)."""
    logging.basicConfig(level=logging.ERROR)
    from polyfhe.program.ckks_program import load_program

    prog = load_program(path)
    m = prog.manifest
    x = np.random.default_rng(0).random((m.samples_per_ciphertext, *m.input_shape[1:]))
    client = prog.client()
    context = client.public_context()
    t0 = time.perf_counter()
    server = prog.server(context)  # Lattigo: unmarshals the keys and loads the model (encodes every diagonal)
    setup = time.perf_counter() - t0
    evals, cpu = [], []
    for _ in range(1 + warm_runs):
        query = client.encrypt(x)
        c0 = time.process_time()
        client.decrypt(server.run(query))
        cpu.append(time.process_time() - c0)
        evals.append(server.last_run.seconds)
    return {"keygen_s": client.keygen_seconds, "context_bytes": len(context), "setup_s": setup, "cold_s": evals[0],
            "warm_s": statistics.median(evals[1:]) if warm_runs else evals[0],
            "warm_cpu_s": statistics.median(cpu[1:]) if warm_runs else cpu[0], "runs_s": evals,
            "samples": m.samples_per_ciphertext, "load_avg": os.getloadavg(), "peak_rss_bytes": _peak_rss()}


def _peak_rss() -> int:
    """This process's own high-water RSS (``ru_maxrss`` would carry the parent's across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _isolated(fn, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def measure(name: str, backend: str, warm_runs: int) -> dict:
    from polyfhe.cost.zoo_models import program_cost
    from polyfhe.program.ckks_program import load_program

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "prog")
        compiled = _isolated(compile_case, name, backend, out)
        measured = _isolated(run_case, out, warm_runs)
        report = program_cost(load_program(out))
        prog = load_program(out)
    p = report.prediction
    return {"case": name, "backend": backend, "params": prog.params.describe(), **compiled, **measured,
            "counters": p.counters, "predicted": p.to_dict()}


def ratio(pred: float, meas: float) -> float:
    return pred / meas if meas else float("nan")


def rows(results: list[dict]) -> list[tuple]:
    out = []
    for r in results:
        p = r["predicted"]
        out.append((r["case"], r["backend"], f"N={r['params'].split()[0][2:]}",
                    r["warm_s"], p["eval_seconds"], r["cold_s"], p["cold_seconds"], r["setup_s"], p["setup_seconds"],
                    r["context_bytes"], p["key_bytes"], r["peak_rss_bytes"], p["peak_bytes"], r["load_avg"][0]))
    return out


def render(info: dict, results: list[dict]) -> str:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200, record=True)
    console.print("[bold]machine[/]: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    table = Table(title="cost model: predicted vs measured (ratio = predicted / measured)")
    for col in ("case", "engine", "ring", "load", "warm eval meas.", "pred.", "ratio", "cold meas.", "pred.", "ratio",
                "setup meas.", "pred.", "context meas.", "pred.", "ratio", "peak RSS meas.", "pred.", "ratio"):
        table.add_column(col, justify="left" if col in ("case", "engine", "ring") else "right")
    markdown = [("| case | engine | ring | load | warm eval measured | predicted | ratio | cold measured | predicted | "
                 "ratio | setup measured | predicted | public context measured | predicted | ratio | "
                 "peak RSS measured | predicted | ratio |"),
                "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case, engine, ring, wm, wp, cm, cp, sm, sp, km, kp, rm, rp, load in rows(results):
        cells = [case, engine, ring, f"{load:.1f}", f"{wm:.3f} s", f"{wp:.3f} s", f"{ratio(wp, wm):.2f}", f"{cm:.3f} s",
                 f"{cp:.3f} s", f"{ratio(cp, cm):.2f}", f"{sm:.2f} s", f"{sp:.2f} s" if sp else "-",
                 f"{km / 1e6:.1f} MB", f"{kp / 1e6:.1f} MB",
                 f"{ratio(kp, km):.2f}", f"{rm / 1e9:.2f} GB", f"{rp / 1e9:.2f} GB", f"{ratio(rp, rm):.2f}"]
        table.add_row(*cells)
        markdown.append("| " + " | ".join(cells) + " |")
    console.print(table)
    return "\n".join(markdown)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--backend", nargs="+", choices=("seal", "lattigo"), default=["seal", "lattigo"])
    p.add_argument("--warm-runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from polyfhe.cost.model import calibrated_costs

    for backend in args.backend:
        t0 = time.perf_counter()
        calibrated_costs(backend)
        print(f"{backend}: calibration ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    info = machine_info()
    results = []
    for name in args.cases:
        for backend in args.backend:
            t0 = time.perf_counter()
            results.append(measure(name, backend, args.warm_runs))
            print(f"{name} on {backend}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    markdown = render(info, results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost_model.json").write_text(json.dumps({"machine": info, "results": results}, indent=1,
                                                         default=str))
    (args.out / "cost_model.md").write_text(markdown + "\n")
    print(f"wrote {args.out / 'cost_model.json'} and cost_model.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
