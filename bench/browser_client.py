"""The web page as a client, measured: key generation, upload size and end-to-end latency in headless Chromium.

For each program given, a real ``polyfhe serve`` holds it and Debian's Chromium (driven by playwright) opens the
page, makes keys (node-seal 7.0.0 in WebAssembly), uploads the public context, then classifies ``--queries``
test images: the first query pays the upload (cold), the others reuse the session (warm). In the same run, the
Python client (``ServeClient``, TenSEAL) does the same against the same server: the baseline, cold against cold
and warm against warm. Writes browser_client.md, .json and .png to ``--out``.

    python bench/browser_client.py --program digits8=PROGRAM_DIR --images digits8=images.npy --out docs/results/issue38
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serve"))
from browserlib import headless_page
from machine_info import machine_info
from serve_testlib import start_server

from polyfhe.serve.http_client import ServeClient

DRAW_INPUT = """(values) => {  // the image, upscaled on the page's canvas exactly as a dropped file is
  const [c, h, w] = window.polyfhePage.spec.input.shape.slice(-3);
  const small = document.createElement("canvas"); small.width = w; small.height = h;
  const ctx = small.getContext("2d"); const img = ctx.createImageData(w, h);
  for (let p = 0; p < h * w; p++) { const v = Math.round(255 * values[p]);
    img.data.set([v, v, v, 255], 4 * p); }
  ctx.putImageData(img, 0, 0);
  const big = document.getElementById("draw").getContext("2d");
  big.imageSmoothingEnabled = false; big.drawImage(small, 0, 0, 280, 280);
}"""


def _page_run(page, model: str, images: np.ndarray, shots: Path | None = None) -> dict:
    page.select_option("#page-model", model)
    page.wait_for_function(f"window.polyfhePage.spec && window.polyfhePage.spec.model === '{model}'")
    if shots is not None:
        page.evaluate(DRAW_INPUT, [float(v) for v in images[0].reshape(-1)])
        page.screenshot(path=str(shots / "serve-page-before.png"), full_page=True)
    page.click("#make-keys")
    page.wait_for_function("window.polyfhePage.client && document.body.dataset.busy === ''", timeout=600_000)
    keygen_ms = page.evaluate("window.polyfhePage.client.keygenMs")
    context_bytes = page.evaluate("window.polyfhePage.client.publicContext().length")
    queries = []
    for image in images:
        page.evaluate(DRAW_INPUT, [float(v) for v in image.reshape(-1)])
        before = page.locator("#result").get_attribute("data-done") or ""
        page.click("#classify")
        page.wait_for_function(f"(document.getElementById('result').dataset.done || '') !== {json.dumps(before)}"
                               " || !document.getElementById('page-error').hidden", timeout=900_000)
        if page.locator("#page-error").is_visible():
            raise RuntimeError(page.locator("#page-error").inner_text())
        t = page.evaluate("window.polyfhePage.timings")
        queries.append({"total_s": t["total_ms"] / 1e3, "server_s": t["server_s"], "encrypt_s": t["encrypt_ms"] / 1e3,
                        "decrypt_s": t["decrypt_ms"] / 1e3, "upload_s": t.get("upload_ms", 0) / 1e3,
                        "query_bytes": t["query_bytes"],
                        "class": int(page.locator("#result").get_attribute("data-class"))})
    if shots is not None:
        page.screenshot(path=str(shots / "serve-page-after.png"), full_page=True)
    return {"keygen_s": keygen_ms / 1e3, "context_bytes": context_bytes, "queries": queries}


def _python_run(url: str, model: str, images: np.ndarray) -> dict:
    with ServeClient(url) as api:
        t0 = time.perf_counter()
        session = api.open_session(model)
        opened = time.perf_counter() - t0
        queries = []
        for i, image in enumerate(images):
            t0 = time.perf_counter()
            result = session.infer(image)
            total = time.perf_counter() - t0 + (opened if i == 0 else 0.0)
            queries.append({"total_s": total, "server_s": result.timings["server"], "class": result.label,
                            "upload_s": session.upload_seconds if i == 0 else 0.0})
        out = {"keygen_s": session.keygen_seconds, "context_bytes": session.context_bytes, "queries": queries}
        session.close()
    return out


def _summary(run: dict) -> dict:
    q = run["queries"]
    warm = [x["total_s"] for x in q[1:]] or [q[0]["total_s"]]
    return {"keygen_s": run["keygen_s"], "upload_mb": run["context_bytes"] / 1e6, "cold_s": q[0]["total_s"],
            "warm_s": statistics.median(warm), "server_s": statistics.median(x["server_s"] for x in q)}


def _table(rows: list[dict], header: str) -> str:
    lines = [header, ("| program | Galois keys | client | key generation s | public keys uploaded | cold query s "
             "(with upload) | warm query s (median) | server s (median) | same class as the Python client |"),
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        for who in ("page", "python"):
            s = r[who + "_summary"]
            if s is None:
                continue
            agree = "" if who == "python" or r["agree"] is None else f"{r['agree']} / {len(r['python']['queries'])}"
            lines.append(f"| {r['model']} ({r['ring']}) | {r['galois_keys']} | "
                         f"{'page (Chromium)' if who == 'page' else 'Python (baseline)'} | "
                         f"{s['keygen_s']:.2f} | {s['upload_mb']:.1f} MB | {s['cold_s']:.2f} | {s['warm_s']:.2f} | "
                         f"{s['server_s']:.2f} | {agree} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    x = np.arange(len(rows))
    for k, who in enumerate(("page", "python")):
        pick = [(i, r[who + "_summary"]) for i, r in enumerate(rows) if r[who + "_summary"] is not None]
        at = np.array([i for i, _ in pick]) + (k - 0.5) * 0.38
        axes[0].bar(at, [s["warm_s"] for _, s in pick], 0.38, label="page (Chromium)" if who == "page" else "Python client")
        axes[1].bar(at, [s["upload_mb"] for _, s in pick], 0.38)
    for ax, label in zip(axes, ("warm query, end to end (s)", "public keys uploaded (MB)")):
        ax.set_xticks(x, [r["model"] for r in rows])
        ax.set_ylabel(label)
    axes[1].axhline(150, color="#a1262d", linestyle="--", linewidth=1)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", action="append", required=True, metavar="NAME=DIR", help="a CKKS program folder")
    ap.add_argument("--python-only", action="append", default=[], metavar="NAME=DIR",
                    help="a program measured with the Python client only (e.g. the same model exported without "
                         "--for-browser: what composing rotations costs the server)")
    ap.add_argument("--images", action="append", required=True, metavar="NAME=FILE",
                    help=".npy of test images in [0, 1], shaped (n, ...), for program NAME")
    ap.add_argument("--queries", type=int, default=3, help="images per client (the first is cold)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "browser_client")
    ap.add_argument("--warm", action="store_true",
                    help="start the server with --warm (every program's plaintexts encoded before the first query), so "
                         "that no client's cold query pays for the encoding another client's query did before")
    ap.add_argument("--screenshots", type=Path, help="folder for the page before and after the last program's query")
    args = ap.parse_args(argv)
    image_files = dict(item.split("=", 1) for item in args.images)
    work = Path(tempfile.mkdtemp(prefix="polyfhe-bench-page-"))
    rows = []
    try:
        programs = work / "programs"
        programs.mkdir()
        for spec in args.program + args.python_only:
            name, folder = spec.split("=", 1)
            shutil.copytree(folder, programs / name)
        server = start_server(programs, work / "server.log", "--max-context-mb", "2000", "--max-ciphertext-mb", "64",
                              *(["--warm"] if args.warm else []), startup_s=900)
        try:
            with headless_page(work, 1250, 1100) as (page, _errors):
                page.goto(server.url + "/")
                page.wait_for_selector("body[data-ready='1']", timeout=120_000)
                for spec in args.program:
                    name = spec.split("=", 1)[0]
                    model = next(m for m in ServeClient(server.url).models() if m["name"] == name)
                    size = int(np.prod(model["input_shape"]))
                    all_images = np.load(image_files[name])
                    images = all_images.reshape(len(all_images), -1)
                    if images.shape[1] != size:
                        raise SystemExit(f"--images hold {images.shape[1]} values per image; {name} takes {size}")
                    images = images[: args.queries]
                    last = spec == args.program[-1] and args.screenshots is not None
                    if last:
                        args.screenshots.mkdir(parents=True, exist_ok=True)
                    page_run = _page_run(page, name, images, args.screenshots if last else None)
                    python_run = _python_run(server.url, name, images)
                    agree = sum(a["class"] == b["class"] for a, b in zip(page_run["queries"], python_run["queries"]))
                    rows.append({"model": name, "ring": f"N={model['params']['poly_modulus_degree']}",
                                 "galois_keys": model["galois_keys"], "page": page_run, "python": python_run,
                                 "page_summary": _summary(page_run), "python_summary": _summary(python_run),
                                 "agree": agree})
            for spec in args.python_only:
                name = spec.split("=", 1)[0]
                model = next(m for m in ServeClient(server.url).models() if m["name"] == name)
                all_images = np.load(image_files[name])
                images = all_images.reshape(len(all_images), -1)[: args.queries]
                python_run = _python_run(server.url, name, images)
                rows.append({"model": name, "ring": f"N={model['params']['poly_modulus_degree']}",
                             "galois_keys": model["galois_keys"], "page": None, "python": python_run,
                             "page_summary": None, "python_summary": _summary(python_run), "agree": None})
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = ("machine: " + ", ".join(f"{k} {v}" for k, v in machine_info().items()) + "\n"
              f"{args.queries} images per client against one polyfhe serve{' --warm' if args.warm else ''}; cold = the "
              "first query (key upload included), warm = the later ones (median); the Python client is the baseline, "
              "same run, same server, after the page"
              + ("" if args.warm else " (its cold query finds the plaintexts the page's first query encoded)") + "\n")
    text = _table(rows, header)
    print(text, end="")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "browser_client.md").write_text(text)
    (args.out / "browser_client.json").write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=1))
    _plot(rows, args.out / "browser_client.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
