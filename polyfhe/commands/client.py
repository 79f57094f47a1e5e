"""``polyfhe client infer --server URL --model NAME INPUT...``: encrypted inference against ``polyfhe serve``.

Keys are made here from the model's manifest; the public context is uploaded once per run (one session),
then each input is encrypted, evaluated by the server and decrypted here. The server never sees the inputs,
the results or the secret key. INPUT is an ``.npy`` array, an ``.npz`` with array ``x`` or an image
(``.png``/``.jpg``), read as ``polyfhe run`` reads it. A stack in an ``.npy``/``.npz`` holds any number of samples:
they are sent in requests of as many as the program interleaves in one ciphertext (one request per chunk).
Values outside the program's calibrated range (``input_range`` in its manifest) are refused before anything is
encrypted (exit code 2) unless ``--clip`` clips them to it, with a warning saying how many.
``polyfhe client models --server URL`` lists the models.

Keys that persist: ``polyfhe client keys create --model NAME --server URL --out KEYDIR`` makes keys once and
writes them to KEYDIR (the secret key in a file of mode 0600); ``polyfhe client infer --keys KEYDIR`` restores
them and resumes the session they opened while the server still holds it, so the public context is uploaded
once, not on every run. ``--model`` and ``--server`` default to the ones the keys were made for.

Exit codes: 0 done; 1 the server refused a request or could not be reached; 2 bad input file or key folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from polyfhe.commands import client_keys
from polyfhe.commands.client_keys import DEFAULT_SERVER, EXIT_BAD_INPUT, EXIT_SERVER

__all__ = ["EXIT_BAD_INPUT", "EXIT_SERVER", "add_parser", "run_infer", "run_models"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("client", description=__doc__, help="encrypted inference against a polyfhe server",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="client_command", required=True, metavar="ACTION")
    infer = sub.add_parser("infer", help="encrypt inputs, have the server evaluate them, decrypt the results")
    infer.add_argument("--server", metavar="URL",
                       help=f"server URL (default: the one --keys were made for, else {DEFAULT_SERVER})")
    infer.add_argument("--model", metavar="NAME",
                       help="model name (see `polyfhe client models`; default: the one --keys were made for)")
    infer.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help=".npy, .npz or .png/.jpg files")
    infer.add_argument("--keys", type=Path, metavar="KEYDIR",
                       help="restore keys from this folder (`polyfhe client keys create`) and resume their session")
    infer.add_argument("--json", action="store_true", help="print one JSON object per sample (JSON Lines)")
    infer.add_argument("--timeout", type=float, default=900.0, help="seconds per HTTP request (default 900)")
    infer.add_argument("--clip", action="store_true",
                       help="clip input values outside the model's calibrated range to it (with a warning) instead "
                            "of refusing them (exit code 2)")
    client_keys.add_insecure_argument(infer)
    client_keys.add_connection_arguments(infer)
    infer.set_defaults(func=run_infer)
    client_keys.add_parser(sub)
    models = sub.add_parser("models", help="list the server's models")
    models.add_argument("--server", default=DEFAULT_SERVER, metavar="URL")
    models.add_argument("--json", action="store_true", help="print the server's JSON")
    client_keys.add_connection_arguments(models)
    models.set_defaults(func=run_models)


class _BadInput(Exception):
    """An input file or key folder that cannot be used (exit code 2)."""


def run_infer(args: argparse.Namespace) -> int:
    from polyfhe.program.keydir import KeyDir, KeyDirError
    from polyfhe.serve.http_client import ServeError

    keydir = None if args.keys is None else KeyDir(args.keys)
    try:
        record = {} if keydir is None else keydir.record()
    except KeyDirError as exc:
        return _fail(exc, EXIT_BAD_INPUT)
    model = args.model or record.get("model")
    if not model:
        return _fail("name the model with --model NAME (see `polyfhe client models`)", EXIT_BAD_INPUT)
    try:
        with client_keys.connect(args, args.server or record.get("server") or DEFAULT_SERVER,
                                 timeout=args.timeout) as api:
            return _infer(args, api, model, keydir)
    except ServeError as exc:
        return _fail(exc, EXIT_SERVER)
    except (_BadInput, KeyDirError) as exc:
        return _fail(exc, EXIT_BAD_INPUT)


def _infer(args: argparse.Namespace, api: Any, model: str, keydir: Any) -> int:
    from polyfhe.commands.inputs import RunInputError, read_input
    from polyfhe.commands.progress import progress_bar
    from polyfhe.program.boundary import InputError

    manifest = api.manifest(model, allow_insecure=args.allow_insecure)
    if args.clip and manifest.scheme != "ckks":
        raise _BadInput("--clip applies to CKKS models; a Concrete ML model quantises its inputs itself")
    try:
        inputs = [(path, read_input(path, manifest)) for path in args.inputs]
    except RunInputError as exc:
        raise _BadInput(str(exc)) from None
    if manifest.scheme == "ckks":  # every file checked against the calibrated range before any key is made
        from polyfhe.program.boundary import check_samples

        checked = []
        for path, x in inputs:
            try:
                checked.append((path, check_samples(manifest, x, args.clip)))
            except InputError as exc:
                raise _BadInput(f"{path}: {exc}") from None
        inputs = checked
    step = manifest.samples_per_query
    rows: list[dict] = []
    with _session(api, model, manifest, keydir) as session:
        head = {"server": api.url, "model": model, "program_id": manifest.program_id,
                "keys": None if keydir is None else str(keydir.path),
                "session": {"keygen_s": session.keygen_seconds, "context_bytes": session.context_bytes,
                            "upload_s": session.upload_seconds, "resumed": session.uploads == 0}}
        if not args.json:
            _render_head(head, manifest)
        requests = sum(-(-len(x) // step) for _, x in inputs)
        with progress_bar(requests, "requests", unit="request") as bar:
            request = 0
            for path, x in inputs:  # a file's samples in chunks of one ciphertext's worth, a request each
                try:
                    results = session.infer_many(x)
                except InputError as exc:
                    raise _BadInput(f"{path}: {exc}") from None
                bar.update(-(-len(x) // step))
                for i, result in enumerate(results):
                    row = {"input": str(path), "sample": i, "request": request + i // step, **result.to_dict(),
                           "model": model, "context_bytes": session.context_bytes,
                           "context_uploads": session.uploads}
                    rows.append(row)
                    _emit_row(row, args.json, last=i == len(results) - 1 or (i + 1) % step == 0)
                request += -(-len(x) // step)
        head["session"].update(uploads=session.uploads, context_bytes=session.context_bytes)
    if not args.json:
        _render_totals(rows, head)
    return 0


def _session(api: Any, model: str, manifest: Any, keydir: Any) -> Any:
    """A one-run session with new keys, or (``keydir``) restored keys and the session they opened before."""
    from polyfhe.commands.progress import UploadProgress, progress_bar

    upload = UploadProgress("uploading public context")
    if keydir is None:
        with progress_bar(1, "making keys", unit="key set") as bar:
            keys = api.make_keys(model, manifest)
            bar.update(1)
        return api.open_session(model, keys=keys, progress=upload)
    from polyfhe.program.engines import kind_of

    why_not = kind_of(manifest).key_folders
    if why_not:
        raise _BadInput(why_not)
    keys = keydir.load(manifest, f"model {model} at {api.url}")
    return api.keyed_session(model, keys, keydir.session_id(api.url, model), progress=upload,
                             on_open=lambda sid: keydir.remember_session(api.url, model, sid))


def run_models(args: argparse.Namespace) -> int:
    from polyfhe.serve.http_client import ServeError

    try:
        with client_keys.connect(args, args.server) as api:
            models = api.models()
    except ServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SERVER
    if args.json:
        print(json.dumps({"models": models}))
        return 0
    for m in models:
        acc = "" if m.get("accuracy") is None else f", accuracy {m['accuracy']:.1%}"
        engine = m.get("engine") or "engine not stated"
        levels = f", levels {m['depth']}/{m['levels']}" if "levels" in m else ""
        print(f"{m['name']} ({m.get('scheme', 'ckks').upper()} on {engine}): {m.get('model_name')} input "
              f"{'x'.join(map(str, m['input_shape']))}, {m['classes']} classes, degree {m.get('degree')}{levels}"
              f"{acc}; {m['params_text']}")
    return 0


def _fail(message: Any, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


# ------------------------------------------------------------------------------------------------------------
def _render_head(head: dict, manifest: Any) -> None:
    from polyfhe.commands.progress import echo
    from polyfhe.program.engines import kind_of

    s = head["session"]
    scheme = kind_of(manifest).params_text(manifest)
    echo(f"model {head['model']} (program {head['program_id']}) at {head['server']}: {scheme}")
    keys = (f"keys made here in {s['keygen_s']:.2f} s" if head["keys"] is None
            else f"keys restored from {head['keys']} in {s['keygen_s']:.2f} s")
    if s["resumed"]:
        echo(f"{keys}; resuming the session they opened before (no upload while the server holds it)")
    else:
        echo(f"{keys}; public context {s['context_bytes'] / 1e6:.2f} MB uploaded in {s['upload_s']:.2f} s "
             "(the secret key stays here)")


def _emit_row(row: dict, as_json: bool, last: bool = True) -> None:
    from polyfhe.commands.progress import echo

    if as_json:
        echo(json.dumps(row))
        sys.stdout.flush()
        return
    echo(f"{row['input']}[{row['sample']}]: class {row['class']} (confidence {row['confidence']:.1%})")
    echo("  logits: " + " ".join(f"{v:.5g}" for v in row["logits"]))
    if last:  # the request's cost once, after its last sample
        t = row["timings"]
        echo(f"  request of {row['request_samples']} sample(s) in one ciphertext: encrypt "
             f"{t['encrypt'] * 1000:.0f} ms, round trip {t['request'] * 1000:.0f} ms (server "
             f"{t['server'] * 1000:.0f} ms), decrypt {t['decrypt'] * 1000:.0f} ms; sent "
             f"{row['bytes_sent'] / 1e6:.3f} MB, received {row['bytes_received'] / 1e6:.3f} MB")


def _render_totals(rows: list[dict], head: dict) -> None:
    requests = list({row["request"]: row for row in rows}.values())  # timings and bytes are per request
    s = head["session"]
    sent = s["context_bytes"] * s["uploads"] + sum(r["bytes_sent"] for r in requests)
    received = sum(r["bytes_received"] for r in requests)
    total = sum(r["timings"]["total"] for r in requests)
    context = (f"public context uploaded {s['uploads']} time(s)" if s["uploads"]
               else "no public context uploaded: the session was resumed")
    print(f"{len(rows)} sample(s) in {len(requests)} request(s), {total:.2f} s; bytes sent {sent / 1e6:.2f} MB "
          f"({context}), received {received / 1e6:.3f} MB")
