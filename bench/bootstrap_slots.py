"""What one Lattigo bootstrap costs at each slot count: the evidence behind sizing bootstraps to the data.

A bootstrap of ``2^s`` slots on ring N runs CoeffsToSlots, EvalMod and SlotsToCoeffs; at full slots (N/2) EvalMod
runs twice (the real and imaginary halves), below it once. This bench times one bootstrap alone (a graph of just
``input -> bootstrap``) at each slot count on one ring, with the key generation and key bytes, and the error
against the plain input. Cold = the first query of a fresh evaluator, warm = the median of the next ones.

INSECURE rings only (``security="none"``): timings and sizes are what it measures; no key is kept.

    python bench/bootstrap_slots.py                       # N=2^14, [60, 40 x 7, 60], 2^10 / 2^12 / 2^13 slots
    GOMAXPROCS=1 python bench/bootstrap_slots.py --log-slots 12 13
    python bench/bootstrap_slots.py --log-ring 12 --chain 60,40,40,40,60 --log-slots 8 10 11 --out /tmp/b12

Writes ``bootstrap_slots.md`` (each width beside the widest measured in the same run), ``.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine_info

from polyfhe.engines.lattigo.bootcircuit import BOOT_SPECIAL_PRIMES
from polyfhe.engines.lattigo.bootkeys import generate_here
from polyfhe.engines.lattigo.bootparams import bootstrap_key_bytes
from polyfhe.engines.lattigo.format import evaluation_key_set, lattigo_params, secret_weight
from polyfhe.engines.lattigo.probes import graph_container, graph_node
from polyfhe.program.bootstrapping import BootstrapSpec
from polyfhe.program.params import CKKSParams


def _bootstrap_graph(params: CKKSParams, spec: dict, slots: int) -> bytes:
    top = params.levels
    config = {"input_level": top, "input_min": -1.0, "input_max": 1.0, "prescale": 0.5, "postscale": 2.0,
              "constant": 0.0, "slots": slots}
    nodes = [graph_node("input", "flatten", top), graph_node("boot", "bootstrap", top, config)]
    return graph_container(params, nodes, [("input", "boot")], [], [], True, spec)


def measure(params: CKKSParams, log_slots: int, queries: int) -> dict:
    from lattigo import ckks, rlwe
    from orion_evaluator import Evaluator, Model

    slots = 1 << log_slots
    spec = BootstrapSpec(int(np.log2(params.poly_modulus_degree)), BOOT_SPECIAL_PRIMES, log_slots).to_dict()
    lp = lattigo_params(params, spec)
    lparams = ckks.Parameters.from_dict(lp)
    keygen = rlwe.KeyGenerator(lparams)
    secret = keygen.gen_secret_key()
    public = keygen.gen_public_key(secret)
    relin = keygen.gen_relin_key(secret).marshal_binary()
    t0 = time.perf_counter()
    boot_keys = generate_here(lp, spec, secret.marshal_binary(), secret_weight(params.poly_modulus_degree))
    keygen_s = time.perf_counter() - t0
    evaluator = Evaluator(lp, b"".join(evaluation_key_set(relin, {})), bytes(boot_keys))
    model = Model.load(_bootstrap_graph(params, spec, slots))
    encoder = ckks.Encoder(lparams)
    encryptor, decryptor = rlwe.Encryptor(lparams, public), rlwe.Decryptor(lparams, secret)
    rng = np.random.default_rng(0)
    values = np.tile(rng.uniform(-1.5, 1.5, slots), params.slots // slots)
    times, errors = [], []
    for _ in range(queries):
        ct = encryptor.encrypt_new(encoder.encode(values.tolist(), params.levels, 1 << params.scale_bits))
        data = ct.marshal_binary()
        t0 = time.perf_counter()
        (out,) = evaluator.forward(model, [data])
        times.append(time.perf_counter() - t0)
        got = np.asarray(encoder.decode(decryptor.decrypt_new(rlwe.Ciphertext.unmarshal_binary(out)), params.slots))
        errors.append(float(np.max(np.abs(got - values))))
    for obj in (model, evaluator, encoder, encryptor, decryptor, public, secret, keygen, lparams):
        obj.close()  # Go memory: the next slot count's keys would otherwise sit beside these
    return {"log_slots": log_slots, "keygen_s": keygen_s, "key_bytes": len(boot_keys),
            "predicted_key_bytes": bootstrap_key_bytes(params, BootstrapSpec.from_dict(spec)),
            "cold_s": times[0], "warm_s": statistics.median(times[1:]) if len(times) > 1 else float("nan"),
            "max_error": max(errors)}


def _table(rows: list[dict], header: str) -> str:
    """Markdown: each slot count against the full-ring bootstrap measured in the same run (the baseline)."""
    full = max(rows, key=lambda r: r["log_slots"])
    columns = ("| slots | key generation s | key bytes (predicted) | cold s | warm s | warm vs 2^"
               f"{full['log_slots']} | max error |")
    lines = [header, columns, "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| 2^{r['log_slots']} | {r['keygen_s']:.1f} | {r['key_bytes'] / 1e6:,.0f} MB "
                     f"({r['predicted_key_bytes'] / 1e6:,.0f} MB) | {r['cold_s']:.2f} | {r['warm_s']:.2f} | "
                     f"{r['warm_s'] / full['warm_s']:.2f} | {r['max_error']:.1e} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"2^{r['log_slots']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(x - 0.2, [r["warm_s"] for r in rows], 0.4, label="warm")
    ax.bar(x + 0.2, [r["cold_s"] for r in rows], 0.4, label="cold (first of a process)")
    ax.set_xticks(x, labels)
    ax.set_xlabel("slots refreshed")
    ax.set_ylabel("seconds per bootstrap")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log-ring", type=int, default=14)
    ap.add_argument("--chain", default="60," + ",".join(["40"] * 7) + ",60", help="residual chain bits")
    ap.add_argument("--log-slots", type=int, nargs="+", default=[10, 12, 13])
    ap.add_argument("--queries", type=int, default=4, help="bootstraps per slot count (the first is cold)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "bootstrap_slots",
                    help="folder for bootstrap_slots.md, .json and .png")
    args = ap.parse_args(argv)
    bits = tuple(int(b) for b in args.chain.split(","))
    params = CKKSParams(1 << args.log_ring, bits, bits[1], security="none")
    rows = [measure(params, s, args.queries) for s in sorted(args.log_slots)]
    title = (f"ring N=2^{args.log_ring}, chain {list(bits)} (INSECURE, timing only), GOMAXPROCS="
             f"{os.environ.get('GOMAXPROCS', 'unset')}, {args.queries} bootstraps each")
    header = ("machine: " + ", ".join(f"{k} {v}" for k, v in machine_info().items()) + "\n" + title + "\n")
    text = _table(rows, header)
    print(text, end="")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bootstrap_slots.md").write_text(text)
    (args.out / "bootstrap_slots.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    _plot(rows, title, args.out / "bootstrap_slots.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
