"""``polyfhe serve --programs DIR``: the encrypted-inference demo server (FastAPI on uvicorn).

DIR holds CKKS programs written by ``polyfhe export --target ckks``, one per subfolder; the folder name is
the model name. An optional ``card.json`` in a program folder adds what the web page shows about the model,
e.g. ``{"accuracy": 0.89, "dataset": "fashion-mnist"}``. The server only ever holds public keys and
ciphertexts. Open http://HOST:PORT/ for the web page; the API is described in docs/serve.md.

Exit codes: 0 stopped cleanly; 2 bad input (no usable program under DIR, bad limits).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from polyfhe.commands.arguments import (
    add_threads_argument,
    apply_threads,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from polyfhe.fhe.plaintexts import DEFAULT_PLAINTEXT_BYTES

__all__ = ["EXIT_BAD_INPUT", "add_parser", "config_from_args", "run"]

log = logging.getLogger(__name__)

EXIT_BAD_INPUT = 2
MIB = 1 << 20
KEEP_ALIVE_S = 30  # idle connections; clients (ServeClient) drop theirs after 4 s, well before


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def add_parser(subparsers: Any) -> None:
    from polyfhe.serve.config import ServeConfig

    d = ServeConfig(Path("."))
    p = subparsers.add_parser("serve", description=__doc__, help="serve CKKS programs over HTTP (encrypted inference)",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", required=True, type=Path, metavar="DIR",
                   help="folder of CKKS programs, one per subfolder (the folder name is the model name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=non_negative_int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--max-context-mb", type=positive_float, default=d.max_context_bytes / MIB, metavar="MB",
                   help=f"largest public-context upload (default {d.max_context_bytes / MIB:g} MiB)")
    p.add_argument("--max-ciphertext-mb", type=positive_float, default=d.max_ciphertext_bytes / MIB, metavar="MB",
                   help=f"largest ciphertext upload (default {d.max_ciphertext_bytes / MIB:g} MiB)")
    p.add_argument("--key-budget-mb", type=positive_float, default=d.key_budget_bytes / MIB, metavar="MB",
                   help=f"public-context bytes all sessions may hold together (default {d.key_budget_bytes / MIB:g} "
                        "MiB; past it: 507)")
    p.add_argument("--session-ttl", type=positive_float, default=d.session_ttl_s, metavar="S",
                   help=f"seconds a session lives after its last use (default {d.session_ttl_s:g})")
    p.add_argument("--max-sessions", type=positive_int, default=d.max_sessions, metavar="N",
                   help=f"live sessions at most (default {d.max_sessions}; past it: 503)")
    p.add_argument("--request-timeout", type=positive_float, default=d.request_timeout_s, metavar="S",
                   help=f"seconds per request, upload and evaluation included (default {d.request_timeout_s:g})")
    p.add_argument("--max-concurrency", type=positive_int, default=d.max_concurrency, metavar="N",
                   help=f"evaluations running at once (default: CPU count, {d.max_concurrency})")
    p.add_argument("--max-queue", type=non_negative_int, default=d.max_queue, metavar="N",
                   help=f"requests waiting for a worker (default {d.max_queue}; past it: 503 with Retry-After)")
    p.add_argument("--plaintext-cache-mb", type=non_negative_float, default=None,
                   metavar="MB", help="encoded plaintext diagonals kept per model, shared by its sessions; past it "
                                      "the cheapest are encoded again on every request (default: half of this "
                                      f"machine's memory, {DEFAULT_PLAINTEXT_BYTES / MIB:g} MiB, split between the "
                                      "models; 0: none)")
    p.add_argument("--warm", action="store_true",
                   help="encode every model's plaintexts before serving (SEAL programs), so the first query costs "
                        "what later ones do (cpolynext_fhe_bn at 28x28: 45 s and 12 GB at startup)")
    add_threads_argument(p)
    p.add_argument("--access-log", action="store_true", help="also print uvicorn's access log (it shows session ids)")
    p.add_argument("--test-eval-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slow model
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> Any:
    from polyfhe.serve.config import ServeConfig

    return ServeConfig(
        programs_dir=args.programs, max_context_bytes=int(args.max_context_mb * MIB),
        max_ciphertext_bytes=int(args.max_ciphertext_mb * MIB), session_ttl_s=args.session_ttl,
        max_sessions=args.max_sessions, key_budget_bytes=int(args.key_budget_mb * MIB),
        request_timeout_s=args.request_timeout, max_concurrency=args.max_concurrency, max_queue=args.max_queue,
        eval_delay_s=args.test_eval_delay)


def _warm(registry: Any) -> None:
    """Encode each served CKKS program's plaintexts now (``polyfhe/fhe/prewarm.py``), saying what it took."""
    from polyfhe.fhe.prewarm import warm_plaintexts

    for name in registry.names():
        program = registry.models[name].program
        if program.scheme != "ckks":
            continue
        stats = warm_plaintexts(program)
        print(f"warmed {name}: {stats.encoded} plaintexts encoded in {stats.seconds:.1f} s "
              f"({stats.bytes / 1e9:.2f} GB held)", flush=True)


def run(args: argparse.Namespace) -> int:
    apply_threads(args)
    try:
        import uvicorn

        from polyfhe.serve.app import create_app
        from polyfhe.serve.registry import Registry, RegistryError
    except ImportError as exc:
        print(f"error: the server needs the serve extra: pip install 'polyfhe[serve]' ({exc})", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        config = config_from_args(args)
        registry = Registry(config.programs_dir, plaintext_cache_bytes=None if args.plaintext_cache_mb is None
                            else int(args.plaintext_cache_mb * MIB))
    except (ValueError, RegistryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.warm:
        _warm(registry)
    app = create_app(config, registry)
    for name, reason in registry.skipped.items():
        print(f"warning: skipped {name}: {reason}", file=sys.stderr)
    print(f"serving {len(registry.models)} model(s) {', '.join(registry.names())} on http://{args.host}:{args.port}/ "
          f"(max {config.max_sessions} sessions, {config.max_concurrency} workers)", flush=True)
    level = logging.getLogger().getEffectiveLevel()
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=args.access_log,
                log_level=logging.getLevelName(level).lower(), timeout_graceful_shutdown=5,
                timeout_keep_alive=KEEP_ALIVE_S)
    return 0
