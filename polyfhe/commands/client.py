"""``polyfhe client infer --server URL --model NAME INPUT...``: encrypted inference against ``polyfhe serve``.

Keys are made here from the model's manifest; the public context is uploaded once per run (one session),
then each input is encrypted, evaluated by the server and decrypted here. The server never sees the inputs,
the results or the secret key. INPUT is an ``.npy`` array, an ``.npz`` with array ``x`` or an image
(``.png``/``.jpg``), read as ``polyfhe run`` reads it. Each file is one request: a stack in an ``.npy``/``.npz``
holds up to as many samples as the program interleaves in one ciphertext, and they share that request.
``polyfhe client models --server URL`` lists the models.

Exit codes: 0 done; 1 the server refused a request or could not be reached; 2 bad input file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["EXIT_BAD_INPUT", "EXIT_SERVER", "add_parser", "run_infer", "run_models"]

EXIT_SERVER = 1
EXIT_BAD_INPUT = 2
DEFAULT_SERVER = "http://127.0.0.1:8000"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("client", description=__doc__, help="encrypted inference against a polyfhe server",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="client_command", required=True, metavar="ACTION")
    infer = sub.add_parser("infer", help="encrypt inputs, have the server evaluate them, decrypt the results")
    infer.add_argument("--server", default=DEFAULT_SERVER, metavar="URL", help=f"server URL (default {DEFAULT_SERVER})")
    infer.add_argument("--model", required=True, metavar="NAME", help="model name (see `polyfhe client models`)")
    infer.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help=".npy, .npz or .png/.jpg files")
    infer.add_argument("--json", action="store_true", help="print one JSON object per sample (JSON Lines)")
    infer.add_argument("--timeout", type=float, default=900.0, help="seconds per HTTP request (default 900)")
    infer.set_defaults(func=run_infer)
    models = sub.add_parser("models", help="list the server's models")
    models.add_argument("--server", default=DEFAULT_SERVER, metavar="URL")
    models.add_argument("--json", action="store_true", help="print the server's JSON")
    models.set_defaults(func=run_models)


def run_infer(args: argparse.Namespace) -> int:
    from polyfhe.commands.run import RunInputError, read_input
    from polyfhe.fhe.client import InputError
    from polyfhe.serve.http_client import ServeClient, ServeError

    rows: list[dict] = []
    try:
        with ServeClient(args.server, timeout=args.timeout) as api:
            manifest = api.manifest(args.model)
            try:
                inputs = [(path, read_input(path, manifest)) for path in args.inputs]
            except RunInputError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return EXIT_BAD_INPUT
            from polyfhe.fhe.backends import client_for

            with api.open_session(args.model, keys=client_for(manifest)) as session:
                head = {"server": api.url, "model": args.model, "program_id": manifest.program_id,
                        "session": {"keygen_s": session.keygen_seconds, "context_bytes": session.context_bytes,
                                    "upload_s": session.upload_seconds}}
                if not args.json:
                    _render_head(head, manifest)
                for request, (path, x) in enumerate(inputs):  # a file holds at most one ciphertext's samples
                    try:
                        results = session.infer_many(x)
                    except InputError as exc:
                        print(f"error: {path}: {exc}", file=sys.stderr)
                        return EXIT_BAD_INPUT
                    for i, result in enumerate(results):
                        row = {"input": str(path), "sample": i, "request": request, **result.to_dict(),
                               "model": args.model, "context_bytes": session.context_bytes}
                        rows.append(row)
                        if args.json:
                            print(json.dumps(row), flush=True)
                        else:
                            _render_row(row)
    except ServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER
    if not args.json:
        _render_totals(rows, head)
    return 0


def run_models(args: argparse.Namespace) -> int:
    from polyfhe.serve.http_client import ServeClient, ServeError

    try:
        with ServeClient(args.server) as api:
            models = api.models()
    except ServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER
    if args.json:
        print(json.dumps({"models": models}))
        return 0
    for m in models:
        acc = "" if m.get("accuracy") is None else f", accuracy {m['accuracy']:.1%}"
        print(f"{m['name']}: {m.get('model_name')} input {'x'.join(map(str, m['input_shape']))}, {m['classes']} "
              f"classes, degree {m.get('degree')}, levels {m['depth']}/{m['levels']}{acc}; {m['params_text']}")
    return 0


# ------------------------------------------------------------------------------------------------------------
def _render_head(head: dict, manifest: Any) -> None:
    s = head["session"]
    print(f"model {head['model']} (program {head['program_id']}) at {head['server']}: {manifest.params.describe()}")
    print(f"keys made here in {s['keygen_s']:.2f} s; public context {s['context_bytes'] / 1e6:.2f} MB uploaded "
          f"in {s['upload_s']:.2f} s (the secret key stays here)")


def _render_row(row: dict) -> None:
    print(f"{row['input']}[{row['sample']}]: class {row['class']} (confidence {row['confidence']:.1%})")
    print("  logits: " + " ".join(f"{v:.5g}" for v in row["logits"]))
    if row["sample"] == row["request_samples"] - 1:  # the request's cost once, after its last sample
        t = row["timings"]
        print(f"  request of {row['request_samples']} sample(s) in one ciphertext: encrypt "
              f"{t['encrypt'] * 1000:.0f} ms, round trip {t['request'] * 1000:.0f} ms (server "
              f"{t['server'] * 1000:.0f} ms), decrypt {t['decrypt'] * 1000:.0f} ms; sent "
              f"{row['bytes_sent'] / 1e6:.3f} MB, received {row['bytes_received'] / 1e6:.3f} MB")


def _render_totals(rows: list[dict], head: dict) -> None:
    requests = list({row["request"]: row for row in rows}.values())  # timings and bytes are per request
    sent = head["session"]["context_bytes"] + sum(r["bytes_sent"] for r in requests)
    received = sum(r["bytes_received"] for r in requests)
    total = sum(r["timings"]["total"] for r in requests)
    print(f"{len(rows)} sample(s) in {len(requests)} request(s), {total:.2f} s; bytes sent {sent / 1e6:.2f} MB "
          f"(public context included), received {received / 1e6:.3f} MB")
