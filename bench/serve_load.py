"""Load test of ``polyfhe serve`` on loopback: K concurrent clients x M encrypted requests each, for some K.

    python bench/serve_load.py                                    # digits-sized MLP, K = 8 and 32, M = 8
    python bench/serve_load.py --clients 8 --requests 20          # one K, heavier
    python bench/serve_load.py --baseline-tree ../polyfhe-main    # also the server of another checkout
    python bench/serve_load.py --programs DIR --model NAME        # serve your own programs folder
    python bench/serve_load.py --server URL --model NAME          # an already running server
    python bench/serve_load.py -k 32 --attacker --isolation process thread --baseline-tree ../polyfhe-prev
                                                                  # one attacker beside 32 honest clients
    python bench/serve_load.py -k 8 --attacker --slow-uploads 2 --baseline-tree ../polyfhe-prev
                                                                  # trickling uploads beside 8 honest clients
    python bench/serve_load.py --ray 1 2 --failover               # also `polyfhe serve --ray` with 1 and 2
                                                                  # replicas, then a replica killed under load

Each client makes its own keys and opens one session (key generation, upload and load: "session setup"), then
all clients start together and send their requests in their session, one after another: encrypt -> POST ->
decrypt. The first request of every client is reported apart ("first", on a fresh server: the plaintext
store is empty, so it pays the encodes: cold); the other M - 1 make the latency percentiles and the throughput
(warm).
A fresh server is started for every K (and every server tree), so runs are cold against cold and warm against
warm. Every answer is checked against the program's ``run_plain``; a wrong answer or a refusal is an error
(503s are retried after their Retry-After, up to ``--retries`` times).

``--baseline-tree DIR`` runs the same load, with the same clients, against the server of another checkout of
polyfhe (``PYTHONPATH=DIR python -m polyfhe.cli serve``), e.g. a git worktree of the last release.
``--isolation process thread`` runs this tree's server once per isolation mode (sessions in worker processes, or
in the server's own process): the difference is what isolation costs per query.
``--attacker`` adds one client that, from the moment the honest ones start until they finish, loops the crafted
requests of ``serve_attacks.py`` (Galois keys with a zero random part and a single-residue ciphertext in the
session they open, a 100,000-deep header, random bytes); its answers are counted by status (0: no answer), and
whether the server was still alive at the end is reported. ``--slow-uploads N`` keeps N session uploads that
declare 4 GiB and N that declare the model's largest possible context open meanwhile (``slow_uploads.py``), each
sending a byte a second from a loopback address of its own (127.0.0.2 and up) and opened again when answered;
their answers are counted by status (-1: closed unanswered).

``--ray R [R ...]`` runs the same load, in the same run, against ``polyfhe serve --ray --replicas R:R`` (a local Ray
cluster on loopback with ``--ray-cpus`` CPUs, a key store in a temporary folder) for each R, and reports each
key-holding replica's peak RSS. ``--failover`` adds one run on ``max(R)`` replicas whose first replica is killed
(SIGKILL) once half of the requests have been answered: the requests that failed (after the client's retries), the
503s the server answered, and the recovery time (from the kill until every client had an answer again).

Printed: the machine (CPU, cores, load average at the start), a markdown table, and written: ``--out/
serve_load.json`` and a plot of latency and throughput against K (``--plot``, PNG). Peak server RSS is the sum of
the VmHWM (``/proc``) of the server process and its worker processes when it was started here, else
``/metrics``. Exit status 1 if any honest request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine_info
from serve_attacks import attack_requests
from slow_uploads import SlowUploads
from square_mlp import square_mlp_program

from polyfhe.procinfo import proc_bytes
from polyfhe.serve.http_client import ServeClient, ServeError

OCTETS = {"Content-Type": "application/octet-stream"}
STARTUP_S = 300.0  # a loaded machine (a test run beside the bench) starts worker processes slowly

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"
DEFAULT_PLOT = HERE.parent / "docs" / "images" / "serve_load_cpu.png"
DEFAULT_MODEL = "digits_mlp"


def build_program(folder: Path) -> Path:
    """An untrained 64->32->x^2->10 MLP (the digits MLP shape) compiled for the single layout."""
    square_mlp_program(32, 10, 256).save(folder / DEFAULT_MODEL)
    return folder


def start_server(programs: Path, log: Path, extra: list[str],
                 tree: Path | None = None) -> tuple[subprocess.Popen, str]:
    """``polyfhe serve`` on a free loopback port; ``tree``: the checkout whose polyfhe it runs (default: this
    one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "polyfhe.cli", "serve", "--programs", str(programs.resolve()), "--port", str(port),
           *extra]
    env = dict(os.environ)
    if tree is not None:
        paths = [str(tree.resolve()), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # the checkout's own directory as the working directory: `python -m` puts it before PYTHONPATH, so started
    # from this tree a "baseline" would import this tree's polyfhe
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            cwd=None if tree is None else str(tree.resolve()))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start within {STARTUP_S:g} s:\n{log.read_text()[-3000:]}")


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the server's worker processes)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _hwm(pid: int) -> int:
    return proc_bytes(f"/proc/{pid}/status", "VmHWM") or 0


def peak_rss(url: str, pid: int | None = None, seen: dict[int, int] | None = None) -> int | None:
    """The server's peak RSS: the VmHWM of its process and its worker processes when known (``seen``: peaks of
    processes sampled earlier, e.g. workers that have since ended), else ``/metrics``."""
    if pid is not None:
        peaks = dict(seen or {})
        for p in _tree(pid):
            peaks[p] = max(peaks.get(p, 0), _hwm(p))
        if any(peaks.values()):
            return sum(peaks.values())
    try:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("polyfhe_peak_resident_memory_bytes "):
                return int(float(line.split()[1]))
    except httpx.HTTPError:
        pass
    return None


HOLDER_TITLE = "ray::ServeReplica:polyfhe:KeyHolder"  # the process title Ray gives a key-holding replica


def holder_pids(pid: int) -> list[int]:
    """The ``polyfhe serve --ray`` replicas that hold keys, among the server's descendants (its local cluster)."""
    out = []
    for p in _tree(pid):
        try:
            if Path(f"/proc/{p}/cmdline").read_bytes().startswith(HOLDER_TITLE.encode()):
                out.append(p)
        except OSError:
            pass
    return sorted(out)


def answers_with(url: str, status: str) -> int:
    """Infer requests the server answered with ``status`` (its /metrics)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0
    needle = f'route="/v1/sessions/{{session_id}}/infer",status="{status}"}} '
    return sum(int(float(line.split()[-1])) for line in text.splitlines() if needle in line)


def kill_a_replica(pid: int, after_fraction: float, total: int):
    """A ``chaos`` for :func:`run_load`: SIGKILL the first key-holding replica once ``after_fraction`` of the
    ``total`` requests were answered."""
    import signal

    def chaos(answered) -> float | None:
        while answered() < after_fraction * total:
            time.sleep(0.05)
        victims = holder_pids(pid)
        if not victims:
            return None
        os.kill(victims[0], signal.SIGKILL)
        print(f"  killed replica process {victims[0]} after {answered()} answers", flush=True)
        return time.perf_counter()

    return chaos


def server_commit(tree: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], check=False,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def _pct(values: list[float], q: float) -> float | None:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))] if v else None


def attack(url: str, model: str, program, sample: np.ndarray, start: threading.Barrier, stop: threading.Event,
           codes: list[int]) -> None:
    """Open a session (with the crafted keys where the server accepts them), wait at ``start`` with the honest
    clients, then loop the crafted requests until ``stop``; ``codes`` gets every status (0: no answer)."""
    keys = program.client()
    with httpx.Client(base_url=url, timeout=300) as http:
        session = None
        try:
            for context in (attack_requests(keys, sample, "-", model)[0][1], keys.public_context()):
                opened = http.post("/v1/sessions", params={"model": model}, content=context, headers=OCTETS)
                codes.append(opened.status_code)
                if opened.status_code == 201:  # the crafted keys where a server accepts them, else valid ones
                    session = opened.json()["session_id"]
                    break
            requests = attack_requests(keys, sample, session or "-", model)
        finally:
            start.wait()
        if session is None:
            return
        i = 0
        while not stop.is_set():
            path, body, params = requests[i % len(requests)]
            try:
                codes.append(http.post(path, content=body, params=params, headers=OCTETS).status_code)
            except httpx.HTTPError:
                codes.append(0)
                time.sleep(0.5)  # the server is gone: no busy loop
            i += 1


def slow_uploads(url: str, model: str, program, count: int) -> SlowUploads | None:
    """``count`` uploads declaring 4 GiB and ``count`` declaring the most a context for ``model`` can have, each
    from a loopback address of its own, a byte a second (None when ``count`` is 0)."""
    if not count:
        return None
    from polyfhe.program.engines import max_context_bytes

    host, port = url.removeprefix("http://").rsplit(":", 1)
    bound = max_context_bytes(program) if program is not None else None
    declared = [4 << 30] * count + [bound or (4 << 30)] * count
    sources = [f"127.0.0.{2 + i}" for i in range(len(declared))]
    return SlowUploads(host, int(port), f"/v1/sessions?model={model}", declared, sources)


def run_load(url: str, model: str, clients: int, requests: int, program=None, retries: int = 10,
             attacker: bool = False, chaos=None, slow: int = 0) -> dict:
    """K threads, each its own session; the first request of each apart, then M - 1 timed together; with
    ``attacker``, one more thread loops crafted requests meanwhile; ``chaos(answered)``, if given, runs in a thread
    of its own once the clients start (``answered()``: requests answered so far) and returns when it struck (a
    ``time.perf_counter()``, or None); ``slow``: trickling uploads kept open meanwhile (:func:`slow_uploads`)."""
    with ServeClient(url) as api:
        manifest = api.manifest(model)
    shape = tuple(manifest.input_shape[1:])
    inputs = np.random.default_rng(0).random((max(requests, 1) * clients, *shape))
    reference = None if program is None else np.concatenate([program.run_plain(x[None]) for x in inputs])
    start = threading.Barrier(clients + 1 + bool(attacker and program is not None))
    first: list[float] = []
    latencies: list[float] = []
    server_s: list[float] = []
    setup_s: list[float] = []
    errors: list[str] = []
    bytes_sent = [0]
    done_at: list[float] = []
    answered: list[tuple[int, float]] = []  # (client, time) of every right answer
    lock = threading.Lock()

    def client(k: int) -> None:
        session = None
        try:
            t0 = time.perf_counter()
            with ServeClient(url, retries=retries) as api:
                try:
                    session = api.open_session(model)
                    with lock:
                        setup_s.append(time.perf_counter() - t0)
                        bytes_sent[0] += session.context_bytes
                finally:
                    start.wait()
                if session is None:
                    return
                for j in range(requests):
                    i = k * requests + j
                    try:
                        result = session.infer(inputs[i])
                    except ServeError as exc:
                        with lock:
                            errors.append(f"client {k} request {j}: {exc}")
                        continue
                    wrong = reference is not None and not np.allclose(result.logits, reference[i], atol=1e-3)
                    with lock:
                        bytes_sent[0] += result.bytes_sent
                        if wrong:
                            errors.append(f"client {k} request {j}: answer differs from the plaintext "
                                          "program")
                            continue
                        (first if j == 0 else latencies).append(result.timings["total"])
                        server_s.append(result.timings["server"])
                        answered.append((k, time.perf_counter()))
                with lock:
                    done_at.append(time.perf_counter())
                session.close()
        except Exception as exc:  # noqa: BLE001 - any failure is an error of this client, reported below
            with lock:
                errors.append(f"client {k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    stop, attack_codes = threading.Event(), []
    attacker_thread = None
    if attacker and program is not None:
        attacker_thread = threading.Thread(target=attack, args=(url, model, program, inputs[0], start, stop,
                                                                attack_codes))
        attacker_thread.start()
    trickles = slow_uploads(url, model, program, slow)
    if trickles is not None:
        trickles.start()
        time.sleep(2)  # every trickle has declared its length before an honest client uploads
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    struck: list[float | None] = []
    chaos_thread = None
    if chaos is not None:
        chaos_thread = threading.Thread(target=lambda: struck.append(chaos(lambda: len(answered))))
        chaos_thread.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if chaos_thread is not None:
        chaos_thread.join(600)
    stop.set()
    slow_answers = trickles.stop() if trickles is not None else None
    if attacker_thread is not None:
        attacker_thread.join(600)
    try:
        alive = httpx.get(url + "/healthz", timeout=10).status_code == 200
    except httpx.HTTPError:
        alive = False
    ok = len(first) + len(latencies)
    return {"attacker_codes": {str(c): attack_codes.count(c) for c in sorted(set(attack_codes))} if attacker
            else None, "slow_upload_answers": slow_answers, "server_alive": alive,"clients": clients, "requests_per_client": requests, "ok": ok, "errors": clients * requests - ok,
            "error_messages": errors[:20], "wall_s": wall, "throughput_rps": ok / wall if wall else None,
            "first_p50_s": statistics.median(first) if first else None, "first_p95_s": _pct(first, 0.95),
            "p50_s": _pct(latencies, 0.50), "p95_s": _pct(latencies, 0.95),
            "mean_s": statistics.fmean(latencies) if latencies else None,
            "server_p50_s": statistics.median(server_s) if server_s else None,
            "session_setup_p50_s": statistics.median(setup_s) if setup_s else None,
            "session_setup_max_s": max(setup_s) if setup_s else None,
            "bytes_sent": bytes_sent[0], "checked_against_plaintext": reference is not None,
            "recovery_s": _recovery(answered, struck[0] if struck else None, clients)}


def _recovery(answered: list[tuple[int, float]], struck: float | None, clients: int) -> float | None:
    """Seconds from ``struck`` until every client that still had requests to send got an answer again."""
    if struck is None:
        return None
    after: dict[int, float] = {}
    for k, t in answered:
        if t > struck and k not in after:
            after[k] = t
    return max(after.values()) - struck if after else None


# ------------------------------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _codes(codes: dict | None) -> str:
    return "-" if codes is None else ", ".join(f"{c}: {n}" for c, n in codes.items()) or "none"


def _replicas(row: dict) -> str:
    return " + ".join(f"{b / 1e6:.0f}" for b in row.get("replica_peak_rss_bytes") or []) or "-"


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def markdown(rows: list[dict]) -> str:
    head = ("| server | clients x requests | ok / errors | first request p50 (cold), ms "
            "| p50 / p95 (warm), ms | server evaluation p50, ms | throughput, requests/s "
            "| session setup p50 / max, s | peak server RSS, MB | key-holding replicas' peak RSS, MB "
            "| 503 answers (retried) | recovery after the kill, s | attacker's answers (status: count) "
            "| slow uploads' answers (status: count) | alive at the end |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        setup = "-" if r["session_setup_p50_s"] is None else (f"{r['session_setup_p50_s']:.1f} / "
                                                               f"{r['session_setup_max_s']:.1f}")
        rss = "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 1e6:.0f}"
        tput = "-" if r["throughput_rps"] is None else f"{r['throughput_rps']:.1f}"
        lines.append(f"| {r['server']} | {r['clients']} x {r['requests_per_client']} | {r['ok']} / "
                     f"{r['errors']} | {_ms(r['first_p50_s'])} | {_ms(r['p50_s'])} / {_ms(r['p95_s'])} | "
                     f"{_ms(r['server_p50_s'])} | {tput} | {setup} | {rss} | {_replicas(r)} | "
                     f"{r.get('answers_503', '-')} | {_seconds(r.get('recovery_s'))} | {_codes(r.get('attacker_codes'))} | "
                     f"{_codes(r.get('slow_upload_answers'))} | {'yes' if r.get('server_alive') else 'NO'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, tput) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["server"] for r in rows):
        rs = sorted((r for r in rows if r["server"] == name and r["p50_s"] is not None),
                    key=lambda r: r["clients"])
        ks = [r["clients"] for r in rs]
        line = lat.plot(ks, [r["p50_s"] * 1000 for r in rs], marker="o", label=f"{name} p50")[0]
        lat.plot(ks, [r["p95_s"] * 1000 for r in rs], marker="^", linestyle="--", color=line.get_color(),
                 label=f"{name} p95")
        tput.plot(ks, [r["throughput_rps"] for r in rs], marker="o", color=line.get_color(), label=name)
    lat.set(xlabel="concurrent clients", ylabel="latency per request, ms (warm)", title="latency")
    tput.set(xlabel="concurrent clients", ylabel="requests / s", title="throughput")
    for ax in (lat, tput):
        ax.set_xticks(sorted({r["clients"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ray_flags(replicas: int, cpus: int, tmp: str) -> list[str]:
    store = Path(tmp) / f"keys-{replicas}-{time.monotonic_ns()}"
    return ["--ray", "--replicas", f"{replicas}:{replicas}", "--ray-cpus", str(cpus), "--key-store", str(store)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", "-k", type=int, nargs="+", default=[8, 32],
                   help="concurrent clients, one run each (default 8 32)")
    p.add_argument("--requests", "-m", type=int, default=8,
                   help="requests per client (default 8; the first is cold)")
    p.add_argument("--server", help="URL of a running server (default: start one here per run)")
    p.add_argument("--programs", type=Path,
                   help="programs folder to serve (default: build a digits-sized MLP)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name (default {DEFAULT_MODEL})")
    p.add_argument("--baseline-tree", type=Path, help="also run against the server of this polyfhe checkout")
    p.add_argument("--server-args", default="",
                   help="extra `polyfhe serve` flags, e.g. '--max-concurrency 2'")
    p.add_argument("--retries", type=int, default=10, help="503 retries per request (default 10)")
    p.add_argument("--isolation", nargs="+", choices=("process", "thread"), default=None,
                   help="run this tree's server once per isolation mode (default: its default only)")
    p.add_argument("--attacker", action="store_true",
                   help="one more client loops crafted requests while the honest ones run (serve_attacks.py)")
    p.add_argument("--slow-uploads", type=int, default=0, metavar="N",
                   help="also keep N session uploads declaring 4 GiB and N declaring the model's largest context "
                        "open, each trickling a byte a second from a loopback address of its own")
    p.add_argument("--ray", type=int, nargs="+", default=None, metavar="R",
                   help="also serve with `polyfhe serve --ray --replicas R:R`, once per R (e.g. --ray 1 2)")
    p.add_argument("--ray-cpus", type=int, default=os.cpu_count(), help="CPUs of the local Ray cluster")
    p.add_argument("--failover", action="store_true",
                   help="with --ray: one more run on max(R) replicas, the first killed under load")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for serve_load.json")
    p.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help=f"PNG to write (default {DEFAULT_PLOT})")
    args = p.parse_args(argv)

    info = machine_info()
    m, load = info, os.getloadavg()
    print(f"machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), load average at the start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; Python {m['python']} on "
          f"{m['platform']}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="polyfhe-serve-load-") as tmp:
        program = None
        if args.server is None:
            programs = args.programs or build_program(Path(tmp))
            from polyfhe.program.ckks_program import load_program

            program = load_program(programs / args.model)
        mine = f"this tree ({server_commit(HERE.parent)}+)"
        servers: list[tuple[str, Path | None, list[str]]] = (
            [(mine, None, [])] if args.isolation is None else
            [(f"{mine}, {mode}", None, ["--isolation", mode]) for mode in args.isolation])
        if args.baseline_tree is not None:
            servers.append((f"baseline {server_commit(args.baseline_tree)}", args.baseline_tree, []))
        for r in args.ray or []:
            servers.append((f"ray, {r} replica{'s' if r > 1 else ''}", None, _ray_flags(r, args.ray_cpus, tmp)))
        failover = []
        if args.ray and args.failover:
            r = max(args.ray)
            failover = [(f"ray, {r} replicas, one killed", None, _ray_flags(r, args.ray_cpus, tmp))]
        for k in args.clients:
            for name, tree, flags in servers + failover if args.server is None else [("given", None, [])]:
                proc, url, pid = None, args.server, None
                try:
                    if url is None:
                        # every client holds a session; every request may wait: no 503 by design
                        sessions = str(max(16, k) + 2 * args.attacker)
                        # every client shares one address here: this tree's per-client limits are lifted
                        quota = ["--max-sessions-per-client", sessions, "--max-uploads-per-client", sessions] \
                            if tree is None else []
                        extra = ["--max-sessions", sessions, *quota, "--max-queue", str(max(16, 2 * k)), *flags,
                                 *args.server_args.split()]
                        log = Path(tmp) / f"server-{k}-{len(rows)}.log"
                        proc, url = start_server(programs, log, extra, tree)
                        pid = proc.pid
                    with ServeClient(url) as api:
                        card = next((c for c in api.models() if c["name"] == args.model), None)
                    if card is None:
                        raise SystemExit(f"the server has no model {args.model!r}")
                    t0 = time.perf_counter()
                    killed = name.endswith("one killed") and pid is not None
                    chaos = kill_a_replica(pid, 0.5, k * args.requests) if killed else None
                    result = run_load(url, args.model, k, args.requests, program, args.retries, args.attacker,
                                      chaos, args.slow_uploads)
                    replicas = [_hwm(p) for p in holder_pids(pid)] if pid is not None else []
                    row = {"server": name, **result, "peak_rss_bytes": peak_rss(url, pid),
                           "replica_peak_rss_bytes": replicas, "answers_503": answers_with(url, "503"),
                           "params": card.get("params_text"), "run_s": time.perf_counter() - t0}
                finally:
                    if proc is not None:
                        proc.terminate()
                        proc.wait(timeout=60)
                rows.append(row)
                print(f"{name}: {k} clients: {row['ok']} ok, {row['errors']} errors, warm p50 "
                      f"{_ms(row['p50_s'])} ms, {row['run_s']:.0f} s", flush=True)
                for message in row["error_messages"]:
                    print(f"  error: {message}", file=sys.stderr)
    table = markdown(rows)
    print()
    print(table)
    model_text = f"model {args.model} ({rows[0]['params']})" if rows else ""
    print(f"\n{model_text}; latency = encrypt + request + decrypt on the same machine (clients and server "
          f"share the cores); first request = cold (fresh server, empty plaintext store), p50/p95 = the "
          f"other {args.requests - 1} requests of every client (warm)")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "serve_load.json"
    out.write_text(json.dumps({"machine": info, "model": args.model, "runs": rows, "table": table}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    if rows and args.plot:
        plot(rows, args.plot, f"{model_text}; {info['cpu']}, {info['usable_cores']} cores")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
