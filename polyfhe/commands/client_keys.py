"""``polyfhe client keys create``: make a client's keys once and keep them in a folder (``--keys KEYDIR`` later).

For a served model (``--model NAME --server URL``: its manifest is fetched) or a local program folder
(``--program DIR``, for ``polyfhe run --keys``); either is refused below 128-bit security unless
``--allow-insecure`` (exit code 2 for a program folder). KEYDIR gets
the private backup (``secret.pfhe``: the secret key, mode 0600; never sent anywhere), the public context
(``public.pfhe``: what a server gets) and ``keys.json`` (what the keys are for, and the last session per server).
A folder that already holds keys is refused unless ``--force`` (sessions opened with the old keys become useless).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_SERVER", "EXIT_BAD_INPUT", "EXIT_SERVER", "add_insecure_argument", "add_parser", "run_create"]

EXIT_SERVER = 1
EXIT_BAD_INPUT = 2
DEFAULT_SERVER = "http://127.0.0.1:8000"


def add_insecure_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-insecure", action="store_true",
                        help="make keys for a program or manifest below 128-bit security (security \"none\"; "
                             "experiments only; refused otherwise)")


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """How to reach a server that asks for a token or serves HTTPS with its own certificate authority."""
    parser.add_argument("--auth-token-file", type=Path, metavar="FILE",
                        help="bearer token for a server started with --auth-token-file (the file's first token)")
    parser.add_argument("--ca-file", type=Path, metavar="PEM",
                        help="certificate authority that signed an HTTPS server's certificate (e.g. self-signed)")


def connect(args: argparse.Namespace, url: str, **kwargs: Any) -> Any:
    """A ServeClient for ``url`` with the token and certificate authority the arguments name."""
    from polyfhe.serve.http_client import ServeClient, read_token

    token = None if getattr(args, "auth_token_file", None) is None else read_token(args.auth_token_file)
    return ServeClient(url, token=token, ca_file=getattr(args, "ca_file", None), **kwargs)


def add_parser(sub: Any) -> None:
    keys = sub.add_parser("keys", help="make keys once and keep them in a folder (for --keys KEYDIR)",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="make keys for a served model or a program folder and write them")
    source = create.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="NAME", help="a model of the server at --server")
    source.add_argument("--program", type=Path, metavar="DIR", help="a local program folder (`polyfhe export`)")
    create.add_argument("--server", default=DEFAULT_SERVER, metavar="URL",
                        help=f"server URL for --model (default {DEFAULT_SERVER})")
    create.add_argument("--out", type=Path, required=True, metavar="KEYDIR", help="folder to write the keys to")
    create.add_argument("--force", action="store_true", help="replace keys already in KEYDIR")
    create.add_argument("--json", action="store_true", help="print the key record as JSON")
    add_insecure_argument(create)
    add_connection_arguments(create)
    create.set_defaults(func=run_create)


def run_create(args: argparse.Namespace) -> int:
    from polyfhe.program.keydir import KeyDir, KeyDirError
    from polyfhe.serve.http_client import ServeError

    keydir = KeyDir(args.out)
    if keydir.holds_keys() and not args.force:  # before any key generation or network request
        return _fail(f"{args.out} already holds keys; pass --force to replace them (sessions opened with them "
                     "become useless) or choose another folder", EXIT_BAD_INPUT)
    try:
        manifest, server, model = _manifest(args)
    except ServeError as exc:
        return _fail(exc, EXIT_SERVER)
    except ValueError as exc:  # ProgramError, InsecureParametersError
        return _fail(exc, EXIT_BAD_INPUT)
    client = _make_keys(manifest)
    try:
        record = keydir.save(client, overwrite=args.force, server=server, model=model)
    except (KeyDirError, OSError) as exc:
        return _fail(exc, EXIT_BAD_INPUT)
    if args.json:
        print(json.dumps({**record, "keys": str(args.out), "keygen_s": client.keygen_seconds}))
    else:
        target = f"program {args.program}" if args.program else f"model {model} at {server}"
        _render(record, target, args.out, client.keygen_seconds)
    return 0


def _manifest(args: argparse.Namespace) -> tuple[Any, str | None, str | None]:
    """(manifest, server URL, model name) of the keys' target."""
    if args.program is not None:
        from polyfhe.program.ckks_program import load_program
        from polyfhe.program.params import require_secure

        manifest = load_program(args.program).manifest
        require_secure(manifest.params, args.allow_insecure, "create keys for")
        return manifest, None, None
    with connect(args, args.server) as api:
        return api.manifest(args.model, allow_insecure=args.allow_insecure), api.url, args.model


def _make_keys(manifest: Any) -> Any:
    from polyfhe.commands.progress import progress_bar
    from polyfhe.program.engines import client_for

    with progress_bar(1, "making keys", unit="key set") as bar:
        client = client_for(manifest)
        bar.update(1)
    return client


def _render(record: dict, target: str, out: Path, keygen_s: float) -> None:
    files = record["files"]
    print(f"keys for {target} (program {record['program_id']}, {record['backend']}: {record['params_text']}) made in "
          f"{keygen_s:.2f} s and written to {out}:")
    print(f"  secret.pfhe  {files['secret.pfhe']['bytes'] / 1e6:.2f} MB  the secret key (mode 0600): keep it private, "
          "never send it")
    print(f"  public.pfhe  {files['public.pfhe']['bytes'] / 1e6:.2f} MB  the public context a server gets")
    print("  keys.json    what the keys are for, and the last session per server")
    print(f"use them with `polyfhe client infer --keys {out} INPUT...`"
          if record["model"] else f"use them with `polyfhe run PROGRAM --keys {out} --input FILE`")


def _fail(message: Any, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code
