"""Load test of ``polyfhe serve`` on loopback: K concurrent clients x M encrypted requests each.

    python bench/serve_load.py                              # builds a digits-sized MLP program, K=8, M=4
    python bench/serve_load.py --clients 8 --requests 20    # heavier
    python bench/serve_load.py --programs DIR --model NAME  # serve your own programs folder
    python bench/serve_load.py --server URL --model NAME    # an already running server

Each client has its own keys and session (key generation and the context upload are timed apart); then all
clients start together and send M requests each (encrypt -> POST -> decrypt). Printed and written to
``--out/serve_load.json``: p50/p95 latency, throughput, error count, peak server RSS (from ``/metrics``), and
the machine (CPU, cores, Python). With the program at hand, every answer is checked against ``run_plain``;
a wrong answer counts as an error. Target: zero errors at 8 concurrent clients.
"""

from __future__ import annotations

import argparse
import json
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

from polyfhe.serve.http_client import ServeClient, ServeError

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL = "digits_mlp"


def build_program(folder: Path) -> Path:
    """An untrained 64->32->x^2->10 MLP (the digits MLP shape) compiled for the single layout."""
    import torch
    from torch import nn

    import polyfhe

    class Square(nn.Module):
        def forward(self, x):
            return x * x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), Square(), nn.Linear(32, 10)).eval()
    calib = np.random.default_rng(0).random((256, 1, 8, 8)).astype(np.float32)
    polyfhe.export(model, target="ckks", calibration=calib, input_shape=(1, 8, 8)).save(folder / DEFAULT_MODEL)
    return folder


def start_server(programs: Path, log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "polyfhe.cli", "serve", "--programs", str(programs), "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start within 120 s; see {log}")


def peak_rss(url: str) -> int | None:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("polyfhe_peak_resident_memory_bytes "):
            return int(float(line.split()[1]))
    return None


def run_load(url: str, model: str, clients: int, requests: int, program=None) -> dict:
    """K threads, each its own session; latencies of the M requests after a common start."""
    manifest = ServeClient(url).manifest(model)
    shape = tuple(manifest.input_shape[1:])
    rng = np.random.default_rng(0)
    inputs = rng.random((max(requests, 1) * clients, *shape))
    reference = None if program is None else np.concatenate([program.run_plain(x[None]) for x in inputs])
    start = threading.Barrier(clients + 1)
    latencies: list[float] = []
    server_s: list[float] = []
    setup_s: list[float] = []
    errors: list[str] = []
    bytes_sent = [0]
    lock = threading.Lock()

    def client(k: int) -> None:
        session = None
        try:
            t0 = time.perf_counter()
            with ServeClient(url) as api:
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
                            errors.append(f"client {k} request {j}: answer differs from the plaintext program")
                            continue
                        latencies.append(result.timings["total"])
                        server_s.append(result.timings["server"])
                session.close()
        except Exception as exc:  # noqa: BLE001 - any failure is an error of this client, reported below
            with lock:
                errors.append(f"client {k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)

    def pct(q: float) -> float | None:
        return lat[min(len(lat) - 1, round(q * (len(lat) - 1)))] if lat else None

    return {"clients": clients, "requests_per_client": requests, "ok": len(lat),
            "errors": clients * requests - len(lat),
            "error_messages": errors[:20], "wall_s": wall, "throughput_rps": len(lat) / wall if wall else None,
            "p50_s": pct(0.50), "p95_s": pct(0.95), "mean_s": statistics.fmean(lat) if lat else None,
            "server_p50_s": statistics.median(server_s) if server_s else None,
            "session_setup_p50_s": statistics.median(setup_s) if setup_s else None,
            "bytes_sent": bytes_sent[0], "checked_against_plaintext": reference is not None}


def render(result: dict, info: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f} ms"

    m = info["machine"]
    rows = [
        ("machine", f"{m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), load {m['load_avg_1m']:.1f}"),
        ("python", f"{m['python']} on {m['platform']}"),
        ("server", f"{info['url']} model {info['model']} ({info['params']})"),
        ("clients x requests", f"{result['clients']} x {result['requests_per_client']}"),
        ("ok / errors", f"{result['ok']} / {result['errors']}"
                        + (" (checked against run_plain)" if result["checked_against_plaintext"] else "")),
        ("latency p50 / p95", f"{ms(result['p50_s'])} / {ms(result['p95_s'])} (encrypt + request + decrypt)"),
        ("server evaluation p50", ms(result["server_p50_s"])),
        ("throughput", f"{result['throughput_rps']:.2f} requests/s over {result['wall_s']:.1f} s"
                       if result["throughput_rps"] else "-"),
        ("session setup p50", f"{ms(result['session_setup_p50_s'])} (keygen + context upload + load)"),
        ("bytes sent", f"{result['bytes_sent'] / 1e6:.1f} MB (public contexts included)"),
        ("peak server RSS", "-" if info["peak_rss_bytes"] is None else f"{info['peak_rss_bytes'] / 1e6:.0f} MB"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", "-k", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--requests", "-m", type=int, default=4, help="requests per client (default 4)")
    p.add_argument("--server", help="URL of a running server (default: start one here)")
    p.add_argument("--programs", type=Path, help="programs folder to serve (default: build a digits-sized MLP)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name (default {DEFAULT_MODEL})")
    p.add_argument("--server-args", default="", help="extra `polyfhe serve` flags, e.g. '--max-concurrency 2'")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for serve_load.json")
    args = p.parse_args(argv)

    proc = None
    program = None
    with tempfile.TemporaryDirectory(prefix="polyfhe-serve-load-") as tmp:
        try:
            url = args.server
            if url is None:
                programs = args.programs or build_program(Path(tmp))
                from polyfhe.fhe.program import load_program

                program = load_program(programs / args.model)
                extra = ["--max-sessions", str(max(16, args.clients))] + args.server_args.split()
                proc, url = start_server(programs, Path(tmp) / "server.log", extra)
            card = next((m for m in ServeClient(url).models() if m["name"] == args.model), None)
            if card is None:
                raise SystemExit(f"the server has no model {args.model!r}")
            result = run_load(url, args.model, args.clients, args.requests, program)
            info = {"url": url, "model": args.model, "params": card["params_text"], "machine": machine_info(),
                    "peak_rss_bytes": peak_rss(url), "server_started_here": proc is not None}
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    print(render(result, info))
    for message in result["error_messages"]:
        print(f"error: {message}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "serve_load.json"
    out.write_text(json.dumps({**info, **result}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
