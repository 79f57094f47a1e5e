"""CKKS (SEAL, Lattigo) and TFHE (Concrete ML) side by side on the same small models, in one run.

For each case (a model trained once, in a process of its own, on scikit-learn digits) and each scheme, a fresh
process compiles the model, makes keys, and runs test images encrypted:

* accuracy: the float model on the whole test split; the quantised model (Concrete only: its clear integer
  model and its FHE simulation, as ``polyfhe.export(target="concrete", eval_data=...)`` measures them); and the
  encrypted images (``--ckks-samples``, ``--concrete-samples`` of the test split), with their argmax agreement
  with the float model;
* latency: CKKS holds ``samples_per_ciphertext`` images in one query, so the per-sample figure is the warm query
  (median of the queries after the first; the first is reported as cold) divided by that; Concrete takes one
  image per query, the per-sample figure is the mean server evaluation over the images after the first;
* key generation time, public key bytes (what a server receives), compile time;
* peak RSS (VmHWM) of the case's process and of the Concrete ML worker processes it starts (compiler, client
  key holder, server), which the process's own ``ru_maxrss`` does not count.

Cases: ``digits_mlp`` (64 -> 32 -> x^2 -> 10), ``digits_relu_mlp`` (the same with ReLU: CKKS refuses it, TFHE
takes it), the FHE-sized zoo recipes at 8x8 (``monet_fhe_bn`` by default, ``cpolynext_fhe_bn`` on request) and,
behind ``--fmnist``, 28x28 Fashion-MNIST ones. Schemes: ``ckks-seal``, ``ckks-lattigo`` and ``concrete``.

Concrete's quantisation is the library's (``export(target="concrete", quantization=...)``): ``auto`` compiles
post-training, and when that loses more than ``--qat-tolerance`` it fine-tunes with ``polyfhe.exporters.concrete.qat`` and
compiles again, keeping the fine-tuned program only when Concrete's quantised accuracy improved.

A scheme run that passes ``--time-cap`` seconds, or leaves the machine less than ``--min-free-gb`` of available
memory, is stopped (its processes killed by pid) and recorded with the stage it was in and what it had measured.
Writes ``schemes.json`` and ``schemes.png`` to ``--out``.

    python bench/schemes.py --quick                       # digits MLP only, few samples (about 1.5 min)
    python bench/schemes.py --out runs/schemes            # the default cases and schemes (about 15 min)
    python bench/schemes.py --cases digits_mlp cpolynext_fhe_bn --schemes ckks-seal concrete
    python bench/schemes.py --fmnist                      # adds 28x28 Fashion-MNIST cases (slow)
    python bench/schemes.py --report runs/a/schemes.json runs/b/schemes.json --out runs/all   # merge
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import multiprocessing
import os
import re
import resource
import signal
import statistics
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from machine_info import machine_info

log = logging.getLogger("bench.schemes")

SCHEMES = ("ckks-seal", "ckks-lattigo", "concrete")
# name -> (dataset, zoo model or None, epochs, lr); digits cases train with tests/ckks_testlib.train
CASES: dict[str, tuple[str, str | None, int, float]] = {
    "digits_mlp": ("digits", None, 30, 0.01),
    "digits_relu_mlp": ("digits", "relu", 30, 0.01),  # not polynomial: CKKS refuses it, TFHE takes it
    "monet_fhe_bn": ("digits", "monet_fhe_bn", 15, 0.002),
    "cpolynext_fhe_bn": ("digits", "cpolynext_fhe_bn", 15, 0.002),
    "fmnist_mlp": ("fashion-mnist", None, 3, 0.003),
    "fmnist_monet_fhe_bn": ("fashion-mnist", "monet_fhe_bn", 2, 0.003),
}
DEFAULT_CASES = ("digits_mlp", "digits_relu_mlp", "monet_fhe_bn")
FMNIST_CASES = ("fmnist_mlp", "fmnist_monet_fhe_bn")
SCHEME_LABEL = {"ckks-seal": "CKKS / SEAL", "ckks-lattigo": "CKKS / Lattigo", "concrete": "TFHE / Concrete ML",}


# ------------------------------------------------------------------------------------------------- data, models
def load_case_data(case: str, args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    dataset = CASES[case][0]
    if dataset == "digits":
        from toy_models import digits

        return digits()
    from polyfhe.data.sources import load_fashion_mnist

    data = load_fashion_mnist()
    n = args.fmnist_train
    return (data.x_train[:n].astype(np.float64), data.y_train[:n], data.x_test.astype(np.float64), data.y_test)


def build_model(case: str):
    import torch
    from torch import nn
    from toy_models import Square

    dataset, zoo, _, _ = CASES[case]
    side = 8 if dataset == "digits" else 28
    torch.manual_seed(0)
    if zoo is None:
        return nn.Sequential(nn.Flatten(), nn.Linear(side * side, 32), Square(), nn.Linear(32, 10))
    if zoo == "relu":
        return nn.Sequential(nn.Flatten(), nn.Linear(side * side, 32), nn.ReLU(), nn.Linear(32, 10))
    from polyfhe.models.registry import create_model

    return create_model(zoo, img_size=side, in_chans=1, num_classes=10)


def float64_logits(model, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        m = copy.deepcopy(model).double().eval()
        return np.concatenate([m(torch.from_numpy(np.asarray(x[i:i + 512], dtype=np.float64))).numpy()
                               for i in range(0, len(x), 512)])


# ------------------------------------------------------------------------------------------------- memory
def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _status_kb_meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 1 << 62


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc's parent links)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out.extend(kids)
        todo.extend(kids)
    return out


class ChildMemory:
    """Samples the peak RSS (VmHWM) of this process's descendants; each pid is charged to the stage it was first
    seen in (Concrete: the compiler worker in "compile", the client's in "keygen", the server's in "server")."""

    def __init__(self, progress: Progress | None = None, period: float = 0.2) -> None:
        self.stage = "start"
        self.peaks: dict[int, int] = {}
        self.born: dict[int, str] = {}
        self.progress = progress  # the peaks so far go there every few seconds (a stopped run keeps them)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period,), daemon=True)
        self._thread.start()

    def _loop(self, period: float) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            self.sample()
            if self.progress is not None and time.monotonic() - last > 5:
                self.progress.note(worker_peaks=self.by_stage(), peak_rss_bytes=self_peak_bytes())
                last = time.monotonic()
            self._stop.wait(period)

    def by_stage(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pid, peak in list(self.peaks.items()):
            role = {"keygen": "client"}.get(self.born[pid], self.born[pid])
            out[role] = max(out.get(role, 0), peak)
        return out

    def sample(self) -> None:
        for pid in descendants(os.getpid()):
            hwm = _status_kb(pid, "VmHWM") * 1024
            if hwm:
                self.born.setdefault(pid, self.stage)
                self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.by_stage()


def self_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------------------- children
class Progress:
    """What a child has measured so far, on disk after every step: a run stopped at the time cap keeps it."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {"stage": "start", "stage_started": time.time()}
        self._lock = threading.Lock()

    def note(self, **kw: Any) -> None:
        with self._lock:
            if "stage" in kw:
                kw["stage_started"] = time.time()
            self.data.update(kw)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, default=float))
            tmp.replace(self.path)


def train_case(case: str, args: argparse.Namespace, state_path: str, progress_path: str) -> None:
    """Train the case's model once; its weights go to ``state_path`` for every scheme's process."""
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    prog = Progress(Path(progress_path))
    x_tr, y_tr, x_te, y_te = load_case_data(case, args)
    model = build_model(case)
    _, _, epochs, lr = CASES[case]
    epochs = args.epochs if args.epochs else epochs
    prog.note(stage="train", epochs=epochs, lr=lr)
    t0 = time.perf_counter()
    from toy_models import train

    model = train(model, epochs=epochs, lr=lr, data=(x_tr, y_tr))  # digits, or the case's own images
    train_s = time.perf_counter() - t0
    torch.save(model.state_dict(), state_path)
    acc = float((float64_logits(model, x_te).argmax(1) == y_te).mean())
    prog.note(stage="done", ok=True, train_s=train_s, float_accuracy=acc, test_samples=len(y_te),
              params=int(sum(p.numel() for p in model.parameters())), train_samples=len(y_tr))


def _load_model(case: str, state_path: str):
    import torch

    model = build_model(case)
    model.load_state_dict(torch.load(state_path, weights_only=True))
    return model.eval()


def run_ckks(case: str, backend: str, args: argparse.Namespace, state_path: str, progress_path: str) -> None:
    import polyfhe

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    prog = Progress(Path(progress_path))
    x_tr, _, x_te, y_te = load_case_data(case, args)
    model = _load_model(case, state_path)
    shape = tuple(x_te.shape[1:])
    prog.note(stage="compile")
    t0 = time.perf_counter()
    try:
        program = polyfhe.export(model, target="ckks", calibration=x_tr[:args.calibration], input_shape=shape,
                                 layout="single", backend=backend)
    except Exception as exc:  # noqa: BLE001 - a model CKKS cannot take (ReLU), or an engine that does not load
        prog.note(stage="done", ok=False, status=f"does not compile: {type(exc).__name__}: {str(exc)[:400]}",
                  compile_s=time.perf_counter() - t0, peak_rss_bytes=self_peak_bytes())
        return
    prog.note(stage="keygen", compile_s=time.perf_counter() - t0, ring=program.params.poly_modulus_degree,
              levels=program.params.levels, samples_per_query=program.manifest.samples_per_ciphertext)
    client = program.client()
    context = client.public_context()
    prog.note(stage="server", keygen_s=client.keygen_seconds, key_bytes=len(context))
    server = program.server(context)
    lanes = program.manifest.samples_per_ciphertext
    xs, ys = x_te[:args.ckks_samples], y_te[:args.ckks_samples]
    queries = [xs[i:i + lanes] for i in range(0, len(xs), lanes)]
    query_s, client_s, logits = [], [], []
    prog.note(stage="queries")
    for i in range(max(len(queries), 1 + args.warm_runs)):
        t0 = time.perf_counter()
        answer = client.decrypt(server.run(client.encrypt(queries[i % len(queries)])))
        total = time.perf_counter() - t0
        query_s.append(server.last_run.seconds)
        client_s.append(total - server.last_run.seconds)
        if i < len(queries):
            logits.append(answer)
        prog.note(query_s=query_s, client_s=client_s)
    enc = np.concatenate(logits)[:len(xs)]
    plain = float64_logits(model, xs)
    warm = statistics.median(query_s[1:]) if len(query_s) > 1 else query_s[0]
    prog.note(stage="done", ok=True, encrypted_samples=len(xs),
              encrypted_accuracy=float((enc.argmax(1) == ys).mean()),
              plain_accuracy_same_samples=float((plain.argmax(1) == ys).mean()),
              agreement=float((enc.argmax(1) == plain.argmax(1)).mean()),
              max_logit_error=float(np.abs(enc - plain).max()),
              cold_query_s=query_s[0], warm_query_s=warm, per_sample_s=warm / lanes,
              per_sample_first_s=query_s[0] / lanes, peak_rss_bytes=self_peak_bytes(), worker_peaks={})


def run_concrete(case: str, args: argparse.Namespace, state_path: str, progress_path: str) -> None:
    import polyfhe
    from polyfhe.engines.concrete import ConcreteWorkerDied, find_env
    from polyfhe.exporters.concrete import ConcreteExportError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    prog = Progress(Path(progress_path))
    find_env()  # ConcreteEnvMissing: the parent checked already; a child says it again
    x_tr, y_tr, x_te, y_te = load_case_data(case, args)
    model = _load_model(case, state_path)
    memory = ChildMemory(prog)
    memory.stage = "compile"
    prog.note(stage="compile")
    t0 = time.perf_counter()

    try:
        program = polyfhe.export(model, target="concrete", calibration=x_tr[:args.calibration], n_bits=args.n_bits,
                                 rounding_threshold_bits=args.rounding_threshold_bits, eval_data=(x_te, y_te),
                                 train_data=(x_tr, y_tr), quantization=args.quantization,
                                 qat_epochs=args.qat_epochs, qat_tolerance=args.qat_tolerance)
    except ConcreteExportError as exc:
        prog.note(stage="done", ok=False, status=f"does not compile: {exc}", compile_s=time.perf_counter() - t0,
                  peak_rss_bytes=self_peak_bytes(), worker_peaks=memory.stop())
        return
    info = program.manifest.info
    acc = info.get("accuracy", {})
    used = program.manifest.quantization
    qat = info.get("qat")
    if qat and not qat.get("kept"):
        used += f" (QAT reached quantised {100 * qat.get('accuracy', {}).get('quantized', 0):.1f}%)"
    ptq_acc = info.get("post_training", {}).get("accuracy") if qat and qat.get("kept") else None
    prog.note(stage="keygen", compile_s=time.perf_counter() - t0, quantization=used,
              float_accuracy_concrete=acc.get("float"), quantized_accuracy=acc.get("quantized"),
              simulated_accuracy=acc.get("simulated"), accuracy_samples=acc.get("samples"),
              ptq_quantized_accuracy=(ptq_acc or {}).get("quantized"), max_bit_width=info.get("max_bit_width"),
              pbs=info.get("statistics", {}).get("programmable_bootstrap_count"),
              n_bits=args.n_bits, rounding_threshold_bits=args.rounding_threshold_bits,
              concrete_versions=program.manifest.versions)
    memory.stage = "keygen"
    try:
        client = program.client()
    except ConcreteWorkerDied as exc:  # the library's memory watchdog, or a crash: recorded, not raised
        prog.note(stage="done", ok=False, status=f"key generation stopped: {exc}", peak_rss_bytes=self_peak_bytes(),
                  worker_peaks=memory.stop())
        return
    context = client.public_context()
    prog.note(stage="server", keygen_s=client.keygen_seconds, key_bytes=len(context))
    memory.stage = "server"
    server = program.server(context)
    xs, ys = x_te[:args.concrete_samples], y_te[:args.concrete_samples]
    plain = float64_logits(model, xs)
    query_s, client_s, preds = [], [], []
    prog.note(stage="queries", samples_per_query=1)
    for x in xs:
        t0 = time.perf_counter()
        answer = client.decrypt(server.run(client.encrypt(x)))
        total = time.perf_counter() - t0
        query_s.append(server.last_run.seconds)
        client_s.append(total - server.last_run.seconds)
        preds.append(int(np.argmax(answer)))
        n = len(preds)
        prog.note(query_s=query_s, client_s=client_s, encrypted_samples=n,
                  encrypted_accuracy=float(np.mean(np.array(preds) == ys[:n])),
                  plain_accuracy_same_samples=float((plain[:n].argmax(1) == ys[:n]).mean()),
                  agreement=float(np.mean(np.array(preds) == plain[:n].argmax(1))))
    memory.sample()
    workers = memory.stop()
    for role, worker in (("client", client._worker), ("server", server._worker)):  # exact, before they end
        if worker._proc is not None:
            workers[role] = max(workers.get(role, 0), _status_kb(worker._proc.pid, "VmHWM") * 1024)
    client.close()
    server.close()
    rest = query_s[1:] or query_s
    prog.note(stage="done", ok=True, cold_query_s=query_s[0], warm_query_s=statistics.mean(rest),
              per_sample_s=statistics.mean(rest), per_sample_first_s=query_s[0],
              peak_rss_bytes=self_peak_bytes(), worker_peaks=workers)


def _kill_tree(pid: int) -> None:
    """Kill a stopped child and everything it started, one pid at a time (deepest first)."""
    for p in reversed([pid, *descendants(pid)]):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def isolated(target, name: str, case: str, args: argparse.Namespace, *extra: Any) -> dict[str, Any]:
    """Run ``target`` in a spawned process of its own, at most ``--time-cap`` seconds; returns its progress."""
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    progress = work / f"{case}.{name}.progress.json"
    progress.unlink(missing_ok=True)
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=target, args=(case, *extra, args, str(work / f"{case}.pt"), str(progress)))
    t0 = time.perf_counter()
    proc.start()
    low_memory = False
    while proc.is_alive() and time.perf_counter() - t0 < args.time_cap:
        proc.join(1.0)
        if proc.is_alive() and _status_kb_meminfo("MemAvailable") < args.min_free_gb * 1e9 / 1024:
            low_memory = True  # other jobs share this machine: stop before the kernel picks a victim
            break
    wall = time.perf_counter() - t0
    timed_out = proc.is_alive()
    if timed_out:
        _kill_tree(proc.pid)
        proc.join()
    data = json.loads(progress.read_text()) if progress.is_file() else {"stage": "start"}
    data["wall_s"] = wall
    if data.get("stage") != "done":
        stage = data.get("stage", "start")
        in_stage = time.time() - data.get("stage_started", time.time())
        if timed_out and low_memory:
            data["status"] = (f"stopped during {stage} ({in_stage:.0f} s into it): the machine's available memory "
                              f"fell below {args.min_free_gb:g} GB")
        elif timed_out:
            data["status"] = (f"stopped at the {args.time_cap:.0f} s cap during {stage} "
                              f"({in_stage:.0f} s into it)")
        else:
            data["status"] = f"failed during {stage} (exit code {proc.exitcode}); see the log above"
        data["ok"] = False
    data.setdefault("status", "ok")
    return data


# ------------------------------------------------------------------------------------------------- the run
def run_case(case: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    log.info("case %s: training", case)
    trained = isolated(train_case, "train", case, args)
    if not trained.get("ok"):
        return [{"case": case, "scheme": s, "ok": False, "status": f"training {trained['status']}"}
                for s in args.schemes]
    log.info("case %s: float accuracy %.4f (%d test samples, %d params, %.1f s training)", case,
             trained["float_accuracy"], trained["test_samples"], trained["params"], trained["train_s"])
    rows = []
    for scheme in args.schemes:
        log.info("case %s: %s", case, scheme)
        if scheme.startswith("concrete"):
            row = isolated(run_concrete, scheme, case, args)
        else:
            row = isolated(run_ckks, scheme, case, args, scheme.split("-", 1)[1])
        row.update(case=case, scheme=scheme, float_accuracy=trained["float_accuracy"],
                   test_samples=trained["test_samples"], params=trained["params"], train_s=trained["train_s"],
                   epochs=trained.get("epochs"))
        log.info("case %s, %s: %s (%.0f s)", case, scheme, row["status"], row["wall_s"])
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------- output
def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _num(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _latency(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{1000 * s:.1f} ms" if s < 1 else f"{s:.2f} s"


def table_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    rows = [r for r in rows if not r.get("skipped")]
    head = ["case", "scheme", "float acc (test)", "quantised acc", "encrypted acc / agreement (n)",
            "compile (s)", "keygen (s)", "public keys (MB)", "samples / query", "query cold / warm",
            "per sample", "peak RSS (GB): process / workers", "notes"]
    out = []
    for r in rows:
        workers = r.get("worker_peaks") or {}
        worker_txt = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(workers.items()) if k != "start")
        rss = "-" if r.get("peak_rss_bytes") is None else f"{r['peak_rss_bytes'] / 1e9:.2f}"
        if worker_txt:
            rss += f" / {worker_txt}"
        if r["scheme"].startswith("concrete"):
            quant = (f"{_pct(r.get('quantized_accuracy'))} (sim {_pct(r.get('simulated_accuracy'))})"
                     if r.get("quantized_accuracy") is not None else "-")
            if r.get("ptq_quantized_accuracy") is not None:
                quant += (f"; before QAT {_pct(r['ptq_quantized_accuracy'])}; tuned float model "
                          f"{_pct(r.get('float_accuracy_concrete'))}")
            notes = (f"{r.get('quantization', '')}; n_bits {r.get('n_bits')}, rounding "
                     f"{r.get('rounding_threshold_bits')}; max bit width {r.get('max_bit_width')}; "
                     f"{r.get('pbs')} PBS" if r.get("quantization") else "")
        else:
            quant = "none (approx. reals)" if r.get("ok") else "-"
            err = _num(r.get("max_logit_error"), "{:.1e}")
            notes = f"N={r['ring']}, {r['levels']} levels; max logit err {err}" if r.get("ring") else ""
        if not r.get("ok"):
            notes = r.get("status", "failed")[:300] + (f"; {notes}" if notes else "")
        enc = "-"
        if r.get("encrypted_samples"):
            enc = (f"{_pct(r.get('encrypted_accuracy'))} / {_pct(r.get('agreement'))} ({r['encrypted_samples']}; "
                   f"plain {_pct(r.get('plain_accuracy_same_samples'))})")
        cold_warm = "-"
        if r.get("cold_query_s") is not None:
            cold_warm = f"{_latency(r['cold_query_s'])} / {_latency(r['warm_query_s'])}"
        if r.get("cold_query_s") is None and r.get("query_s"):
            cold_warm = "partial: " + ", ".join(_latency(s) for s in r["query_s"])
        float_acc = f"{_pct(r.get('float_accuracy'))} ({r.get('test_samples', '-')})"
        out.append([r["case"], SCHEME_LABEL[r["scheme"]], float_acc, quant, enc,
                    _num(r.get("compile_s"), "{:.1f}"), _num(r.get("keygen_s"), "{:.2f}"),
                    _num(None if r.get("key_bytes") is None else r["key_bytes"] / 1e6, "{:.1f}"),
                    str(r.get("samples_per_query", "-")), cold_warm, _latency(r.get("per_sample_s")), rss, notes])
    return head, out


def machine_line(machine: dict[str, Any]) -> str:
    v = machine.get("versions", {})
    return (f"{machine['cpu']}, {machine['usable_cores']} of {machine['cores']} cores, load "
            f"{machine['load_avg_1m']:.2f} at the start, Python {machine['python']}, {machine['platform']}; "
            + ", ".join(f"{k} {val}" for k, val in v.items()))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head, body = table_rows(rows)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def print_table(rows: list[dict[str, Any]], machine: dict[str, Any], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)
    console.print("[bold]machine[/]: " + machine_line(machine))
    head, body = table_rows(rows)
    table = Table(title=title, show_lines=True)
    for h in head:
        table.add_column(h, overflow="fold")
    for row in body:
        table.add_row(*row)
    console.print(table)


SHORT_LABEL = {"ckks-seal": "CKKS\nSEAL", "ckks-lattigo": "CKKS\nLattigo", "concrete": "TFHE\nConcrete ML"}


def short_status(r: dict[str, Any]) -> str:
    """Why a row has no number, in a few words for the plot."""
    status = r.get("status", "not run")
    if "not polynomial" in status:
        return "not polynomial:\nCKKS refuses ReLU"
    if "dilation" in status:
        return "does not compile:\nConcrete has no\ndilated convolution"
    if status.startswith("does not compile"):
        return "does not compile\n(" + status.split("(", 1)[-1].split(":")[0][:24] + ")"
    if status.startswith("stopped"):
        return status.split("(")[0].replace(" during", "\nduring").strip()
    if status.startswith("key generation stopped"):
        peak = re.search(r"passed ([\d.]+ GB)", status)
        return "key generation stopped:\nmemory" + (f" passed {peak[1]}" if peak else "")
    return status[:40]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("skipped")]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    colors = {"ckks-seal": "#4C72B0", "ckks-lattigo": "#55A868", "concrete": "#C44E52"}
    latencies = [r[k] for r in rows for k in ("per_sample_s", "per_sample_first_s") if r.get(k)]
    lo = 10 ** math.floor(math.log10(min(latencies))) if latencies else 1e-4
    hi = 10 ** math.ceil(math.log10(max(latencies)) + 0.3) if latencies else 1e2
    fig, axes = plt.subplots(len(cases), 2, figsize=(12, 3.4 * len(cases)), squeeze=False)
    for (lat_ax, acc_ax), case in zip(axes, cases):
        by = {r["scheme"]: r for r in rows if r["case"] == case}
        schemes = [s for s in SCHEMES if s in by]
        for i, s in enumerate(schemes):
            r = by[s]
            v = r.get("per_sample_s")
            if v:
                lat_ax.bar(i, v, color=colors[s], width=0.6)
                first = r.get("per_sample_first_s")
                if first and abs(first - v) > 1e-9:
                    lat_ax.plot([i - 0.3, i + 0.3], [first, first], color="black", lw=1.5)
                per_query = r.get("samples_per_query", 1)
                note = _latency(v) + (f"\n({per_query} per query)" if per_query and per_query > 1 else "")
                lat_ax.annotate(note, (i, max(v, first or 0)), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                                textcoords="offset points")
            else:
                lat_ax.annotate(short_status(r), (i, 0.5), xycoords=("data", "axes fraction"), ha="center",
                                va="center", fontsize=7, color="gray")
        lat_ax.set_yscale("log")
        lat_ax.set_ylim(lo, hi)
        lat_ax.set_xticks(range(len(schemes)), [SHORT_LABEL[s] for s in schemes], fontsize=8)
        lat_ax.set_xlim(-0.6, len(schemes) - 0.4)
        lat_ax.set_ylabel("server time per sample (s)")
        lat_ax.set_title(f"{case}: time per sample (bar: warm; line: first query)", fontsize=9)
        kinds = (("float", "float_accuracy", "#999999"), ("quantised", "quantized_accuracy", "#E1A95F"),
                 ("encrypted", "encrypted_accuracy", "#333333"))
        width = 0.26
        for k, (label, key, color) in enumerate(kinds):
            xs, hs = [], []
            for i, s in enumerate(schemes):
                val = by[s].get(key)
                if val is not None:
                    xs.append(i + (k - 1) * width)
                    hs.append(100 * val)
            bars = acc_ax.bar(xs, hs, width, color=color, label=label)
            for bar, h in zip(bars, hs):
                acc_ax.annotate(f"{h:.0f}", (bar.get_x() + bar.get_width() / 2, h), ha="center", va="bottom",
                                fontsize=7)
        for i, s in enumerate(schemes):
            r = by[s]
            if r.get("encrypted_samples"):
                acc_ax.annotate(f"n={r['encrypted_samples']}", (i + width, 2), ha="center", fontsize=6,
                                color="white", rotation=90, va="bottom")
            if s.startswith("ckks") and r.get("ok"):
                acc_ax.annotate("no\nquant.", (i, 2), ha="center", va="bottom", fontsize=6, color="gray")
            if not r.get("ok"):
                acc_ax.annotate(short_status(r), (i + width, 50), ha="center", va="center", fontsize=6,
                                color="gray", rotation=90)
        acc_ax.set_ylim(0, 128)
        acc_ax.set_xlim(-0.6, len(schemes) - 0.4)
        acc_ax.set_xticks(range(len(schemes)), [SHORT_LABEL[s] for s in schemes], fontsize=8)
        acc_ax.set_ylabel("test accuracy (%)")
        acc_ax.set_title(f"{case}: accuracy (float, quantised: whole test split; encrypted: n samples)",
                         fontsize=9)
        acc_ax.legend(fontsize=7, loc="upper center", ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "tenseal", "orion-v2-evaluator", "orion-v2-lattigo"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def write(rows: list[dict[str, Any]], machine: dict[str, Any], args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "schemes.json").write_text(json.dumps(
        {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1,
        default=float))
    plot(rows, args.out / "schemes.png")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=None, choices=sorted(CASES),
                   help=f"default: {' '.join(DEFAULT_CASES)}")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--quick", action="store_true", help="digits_mlp only, 8 CKKS and 2 Concrete samples")
    p.add_argument("--fmnist", action="store_true", help=f"add the 28x28 Fashion-MNIST cases {FMNIST_CASES}")
    p.add_argument("--fmnist-train", type=int, default=10000, help="Fashion-MNIST training images used")
    p.add_argument("--epochs", type=int, default=0, help="override every case's training epochs (0: the case's)")
    p.add_argument("--ckks-samples", type=int, default=20, help="test images run encrypted under CKKS")
    p.add_argument("--concrete-samples", type=int, default=5, help="test images run encrypted under Concrete")
    p.add_argument("--warm-runs", type=int, default=2, help="CKKS queries after the first (at least)")
    p.add_argument("--calibration", type=int, default=512, help="training images for calibration")
    p.add_argument("--n-bits", type=int, default=4)
    p.add_argument("--rounding-threshold-bits", type=int, default=6)
    p.add_argument("--quantization", default="auto", choices=("auto", "post-training", "quantization-aware"),
                   help="auto: fine-tune (QAT) when post-training quantisation loses more than --qat-tolerance")
    p.add_argument("--qat-epochs", type=int, default=3)
    p.add_argument("--qat-tolerance", type=float, default=0.01)
    p.add_argument("--time-cap", type=float, default=600, help="seconds one scheme run of one case may take")
    p.add_argument("--min-free-gb", type=float, default=2.0,
                   help="stop a scheme run when the machine's available memory falls below this")
    p.add_argument("--out", type=Path, default=Path("runs/schemes"))
    p.add_argument("--report", nargs="+", type=Path, default=None, metavar="SCHEMES_JSON",
                   help="run nothing: one table and plot from earlier runs (later rows replace earlier ones)")
    args = p.parse_args(argv)
    if args.quick:
        args.cases = args.cases or ["digits_mlp"]
        args.ckks_samples, args.concrete_samples, args.warm_runs = min(args.ckks_samples, 8), 2, 1
    args.cases = list(args.cases or DEFAULT_CASES) + (list(FMNIST_CASES) if args.fmnist else [])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.report:
        merged: dict[tuple[str, str], dict] = {}
        machine = {}
        for path in args.report:
            saved = json.loads(path.read_text())
            machine = saved["machine"]
            merged.update({(r["case"], r["scheme"]): r for r in saved["rows"]})
        rows = list(merged.values())
        write(rows, machine, args)
        print_table(rows, machine, "merged runs")
        print(markdown_table(rows))
        return 0
    if any(s.startswith("concrete") for s in args.schemes):
        from polyfhe.engines.concrete import ConcreteEnvMissing, find_env

        try:
            find_env()
        except ConcreteEnvMissing as exc:
            print(f"Concrete ML is not set up: {exc}", file=sys.stderr)
            return 2
    os.environ.setdefault("GOGC", "25")  # Lattigo's Go runtime reads it at process start (children inherit it)
    machine = {**machine_info(), "versions": versions()}
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for case in args.cases:
        rows.extend(run_case(case, args))
        write(rows, machine, args)  # kept when the run is cut off
    concrete_versions = next((r["concrete_versions"] for r in rows if r.get("concrete_versions")), None)
    if concrete_versions:
        machine["versions"].update({f"concrete: {k}": v for k, v in concrete_versions.items()})
    machine["total_wall_s"] = time.perf_counter() - t_start
    write(rows, machine, args)
    print_table(rows, machine, f"CKKS vs TFHE on small polynomial models ({machine['total_wall_s']:.0f} s)")
    print(markdown_table(rows))
    print(f"wrote {args.out / 'schemes.json'} and {args.out / 'schemes.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
