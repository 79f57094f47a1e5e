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
    positive_float,
    positive_int,
)
from polyfhe.runtime.plaintexts import DEFAULT_PLAINTEXT_BYTES

__all__ = ["EXIT_BAD_INPUT", "add_parser", "config_from_args", "run"]

log = logging.getLogger(__name__)

EXIT_BAD_INPUT = 2
MIB = 1 << 20
KEEP_ALIVE_S = 30  # idle connections; clients (ServeClient) drop theirs after 4 s, well before


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
    p.add_argument("--max-sessions-per-client", type=positive_int, default=None, metavar="N",
                   help="live sessions one client (bearer token, or address without tokens) may hold (default: a "
                        "half of --max-sessions, at least 1; past it: 429)")
    p.add_argument("--max-uploads-per-client", type=positive_int, default=d.max_uploads_per_client, metavar="N",
                   help=f"public-context uploads one client runs at once (default {d.max_uploads_per_client}; past "
                        "it: 429)")
    p.add_argument("--min-upload-rate", type=non_negative_float, default=d.min_upload_bytes_per_s / 1024,
                   metavar="KB/S", help=f"slowest average rate an upload may arrive at once its grace period is "
                                        f"over (default {d.min_upload_bytes_per_s / 1024:g} KiB/s; slower: 408; "
                                        "0: no floor)")
    p.add_argument("--upload-grace", type=non_negative_float, default=d.upload_grace_s, metavar="S",
                   help=f"seconds before an upload's rate is checked (default {d.upload_grace_s:g})")
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
    p.add_argument("--isolation", choices=("process", "thread"), default=d.isolation,
                   help="where sessions' keys live and evaluations run: 'process' (default) in worker processes, "
                        "so a crash or an out-of-memory kill costs only that worker's sessions; 'thread' in this "
                        "process (no copy of the bytes, no isolation)")
    p.add_argument("--worker-processes", type=positive_int, default=None, metavar="N",
                   help="worker processes with --isolation process (default: one per core, at most 4, fewer when "
                        "the programs would not fit memory; the log says how many and why); each loads the "
                        "programs and gets its share of the plaintext cache, and a crash costs only its sessions")
    p.add_argument("--worker-memory-mb", type=positive_float, default=None, metavar="MB",
                   help="address space each worker process may add after loading the programs (RLIMIT_AS); a "
                        "request past it fails with 507 in that worker alone (default: no limit)")
    p.add_argument("--auth-token-file", type=Path, default=None, metavar="FILE",
                   help="bearer tokens, one per line (at least 16 characters each): opening and using sessions "
                        "then needs 'Authorization: Bearer TOKEN', and a session answers only its own token")
    p.add_argument("--ssl-certfile", type=Path, default=None, metavar="PEM",
                   help="serve HTTPS with this certificate (chain) file; needs --ssl-keyfile")
    p.add_argument("--ssl-keyfile", type=Path, default=None, metavar="PEM", help="the certificate's private key")
    p.add_argument("--allow-insecure", action="store_true",
                   help="serve programs whose CKKS parameters are below 128-bit security (security='none'; "
                        "tests and experiments only)")
    _add_ray_arguments(p)
    p.add_argument("--test-eval-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slow model
    p.set_defaults(func=run)


def replicas_range(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (or ``N`` for a fixed count) replicas."""
    low, _, high = text.partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX replicas (e.g. 1:4), got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"replicas need 1 <= MIN <= MAX, got {text!r}")
    return bounds


def _add_ray_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray Serve (--ray; needs pip install 'polyfhe[ray]'; docs/deploy-ray.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve with Ray Serve replicas that scale with load; sessions' public contexts go to a key "
                        "store every replica reads, so any replica serves any session")
    g.add_argument("--replicas", type=replicas_range, default=(1, 1), metavar="MIN:MAX",
                   help="key-holding replicas (default 1:1; MIN < MAX: Ray Serve autoscaling between them)")
    g.add_argument("--key-store", default="polyfhe-keys", metavar="URL",
                   help="where sessions' public contexts are kept: a local folder (default ./polyfhe-keys, made "
                        "private) or an fsspec URL such as s3://bucket/prefix for a cluster of machines")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="an existing Ray cluster (auto, HOST:PORT); default: start a local one on this machine")
    g.add_argument("--ray-cpus", type=positive_int, default=None, metavar="N",
                   help="CPUs of the local cluster (default: the machine's)")
    g.add_argument("--requests-per-replica", type=positive_int, default=2, metavar="N",
                   help="evaluations one replica runs at once (default 2); more requests wait inside the replica "
                        "that holds their session's keys")


def config_from_args(args: argparse.Namespace) -> Any:
    from polyfhe.serve.config import ServeConfig

    return ServeConfig(
        programs_dir=args.programs, max_context_bytes=int(args.max_context_mb * MIB),
        max_ciphertext_bytes=int(args.max_ciphertext_mb * MIB), session_ttl_s=args.session_ttl,
        max_sessions=args.max_sessions, key_budget_bytes=int(args.key_budget_mb * MIB),
        request_timeout_s=args.request_timeout, max_concurrency=args.max_concurrency, max_queue=args.max_queue,
        eval_delay_s=args.test_eval_delay, isolation=args.isolation, worker_processes=args.worker_processes,
        worker_memory_headroom_bytes=None if args.worker_memory_mb is None else int(args.worker_memory_mb * MIB),
        auth_token_file=args.auth_token_file, max_sessions_per_client=args.max_sessions_per_client,
        max_uploads_per_client=args.max_uploads_per_client, min_upload_bytes_per_s=int(args.min_upload_rate * 1024),
        upload_grace_s=args.upload_grace)


LOOPBACK_HOSTS = ("localhost", "::1")


def warn_plain_tokens(config: Any, host: str, tls: bool) -> None:
    """Bearer tokens sent over plain HTTP to a non-loopback address can be read on the way: say so."""
    if config.auth_token_file is None or tls:
        return
    if host in LOOPBACK_HOSTS or host.startswith("127."):
        return
    log.warning("bearer tokens are on but %s serves plain HTTP: anyone on the network path can read a token and "
                "use its sessions; serve HTTPS (--ssl-certfile/--ssl-keyfile) or terminate TLS in front", host)


def tls_options(args: argparse.Namespace) -> dict:
    """uvicorn's certificate options, checked: both files or neither, each readable."""
    cert, key = args.ssl_certfile, args.ssl_keyfile
    if (cert is None) != (key is None):
        raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    if cert is None:
        return {}
    for flag, path in (("--ssl-certfile", cert), ("--ssl-keyfile", key)):
        if not path.is_file():
            raise ValueError(f"{flag} {path}: no such file")
    return {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}


def require_secure_models(registry: Any, allow_insecure: bool) -> None:
    """Every served CKKS model through the library's one security check (``require_secure``); raises
    ``InsecureParametersError`` naming the model."""
    from polyfhe.program.params import InsecureParametersError, require_secure

    for name, model in sorted(registry.models.items()):
        if model.program.scheme != "ckks":
            continue
        try:
            require_secure(model.program.params, allow_insecure, "serve")
        except InsecureParametersError as exc:
            raise InsecureParametersError(f"model {name}: {exc}") from None


def _warm(registry: Any) -> None:
    """Encode each served CKKS program's plaintexts now (its engine's ``warm_plaintexts``), saying what it took."""
    from polyfhe.program.engines import warm_plaintexts

    for name in registry.names():
        program = registry.models[name].program
        if program.scheme != "ckks":
            continue
        encoded, seconds, held = warm_plaintexts(program)
        print(f"warmed {name}: {encoded} plaintexts encoded in {seconds:.1f} s ({held / 1e9:.2f} GB held)",
              flush=True)


def run_ray(args: argparse.Namespace) -> int:
    """``polyfhe serve --ray``: the same API on Ray Serve, until SIGINT or SIGTERM."""
    try:
        from polyfhe.serve import ray_app
        from polyfhe.serve.registry import Registry, RegistryError

        ray_app.require_ray()
    except ImportError as exc:
        print(f"error: polyfhe serve --ray needs Ray Serve: pip install 'polyfhe[ray]' ({exc})", file=sys.stderr)
        return EXIT_BAD_INPUT
    from polyfhe.serve.auth import TokenAuth, TokenFileError

    try:
        config = config_from_args(args)
        if args.ssl_certfile or args.ssl_keyfile:
            raise ValueError("--ray serves plain HTTP: terminate TLS in front of it (a load balancer or an ingress "
                             "controller, docs/deploy-ray.md)")
        if config.auth_token_file is not None:
            TokenAuth.from_file(config.auth_token_file)
        warn_plain_tokens(config, args.host, False)
        registry = Registry(config.programs_dir)
        require_secure_models(registry, args.allow_insecure)
        low, high = args.replicas
        options = ray_app.RayOptions(low, high, key_store=args.key_store, threads_per_replica=args.threads or 1,
                                     address=args.ray_address, num_cpus=args.ray_cpus,
                                     max_ongoing_requests=args.requests_per_replica, plaintext_cache_bytes=None
                                     if args.plaintext_cache_mb is None else int(args.plaintext_cache_mb * MIB))
    except (ValueError, RegistryError, TokenFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for name, reason in registry.skipped.items():
        print(f"warning: skipped {name}: {reason}", file=sys.stderr)
    server = ray_app.start(config, options, args.host, args.port)
    try:
        print(f"serving {len(registry.models)} model(s) {', '.join(registry.names())} on {server.url}/ (Ray Serve, "
              f"{low}:{high} key-holding replicas, {options.threads_per_replica} thread(s) each, key store "
              f"{args.key_store})", flush=True)
        ray_app.wait_for_signal()
    finally:
        server.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    apply_threads(args)
    if getattr(args, "ray", False):
        return run_ray(args)
    try:
        import uvicorn

        from polyfhe.serve.app import create_app
        from polyfhe.serve.registry import Registry, RegistryError
    except ImportError as exc:
        print(f"error: the server needs the serve extra: pip install 'polyfhe[serve]' ({exc})", file=sys.stderr)
        return EXIT_BAD_INPUT
    from polyfhe.serve.auth import TokenFileError
    from polyfhe.serve.process_host import WorkerLost

    try:
        config = config_from_args(args)
        tls = tls_options(args)
        registry = Registry(config.programs_dir, plaintext_cache_bytes=None if args.plaintext_cache_mb is None
                            else int(args.plaintext_cache_mb * MIB))
        require_secure_models(registry, args.allow_insecure)
        warn_plain_tokens(config, args.host, bool(tls))
        if args.warm and config.isolation == "thread":
            _warm(registry)
        app = create_app(config, registry, warm=args.warm)
    except (ValueError, RegistryError, TokenFileError, WorkerLost) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for entry in getattr(app.state.polyfhe.backend.host, "warmed", list)():
        print(f"warmed {entry['name']}: {entry['encoded']} plaintexts encoded in {entry['seconds']:.1f} s "
              f"({entry['bytes'] / 1e9:.2f} GB held, in each worker process)", flush=True)
    for name, reason in registry.skipped.items():
        print(f"warning: skipped {name}: {reason}", file=sys.stderr)
    scheme = "https" if tls else "http"
    processes = app.state.polyfhe.backend.host.stats().get("processes")
    where = f"{len(processes)} worker process(es)" if processes is not None else "this process"
    tokens = ", bearer tokens required" if config.auth_token_file else ""
    print(f"serving {len(registry.models)} model(s) {', '.join(registry.names())} on {scheme}://{args.host}:"
          f"{args.port}/ (max {config.max_sessions} sessions, {config.max_concurrency} at once, sessions in "
          f"{where}{tokens})", flush=True)
    level = logging.getLogger().getEffectiveLevel()
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=args.access_log,
                log_level=logging.getLevelName(level).lower(), timeout_graceful_shutdown=5,
                timeout_keep_alive=KEEP_ALIVE_S, **tls)
    return 0
