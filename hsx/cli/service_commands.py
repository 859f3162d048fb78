"""The ``hsx`` commands that run the service's parts on this host: the API, a worker, an engine, and the
database's migrations."""

from __future__ import annotations

import argparse
import sys

from hsx.server.settings import get_settings


def cmd_api(args: argparse.Namespace) -> int:
    from app.security import serving_refusal
    from hsx.server.logging_setup import configure_logging
    from hsx.server.serving import serve

    settings = get_settings()
    refusal = serving_refusal(args.host, settings)
    if refusal:
        print(f"hsx api: {refusal}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    # A job document rendered on a worker thread holds the GIL; the event loop answering cached polls gets
    # it back after at most this long (Python's default is 5 ms, which shows in the tail latency).
    sys.setswitchinterval(0.0005)
    trusted_proxies = settings.forwarded_allow_ips.strip()
    serve(
        "app.main:app",
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        log_config=None,
        # Forwarded headers rewrite the client address; they count only from proxies named in the settings.
        proxy_headers=bool(trusted_proxies),
        forwarded_allow_ips=trusted_proxies or None,
    )
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.worker_main import run_worker, run_worker_processes

    processes = args.processes or get_settings().worker_processes
    if processes > 1:
        return run_worker_processes(processes, burst=args.burst, reconcile=not args.no_reconciler)
    return run_worker(get_settings(), burst=args.burst, reconcile=not args.no_reconciler)


def _engine_parser(backends: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx engine",
        add_help=False,
        description="Run an engine that serves hidden-state capture: hsx engine [--backend NAME] [ARGS].",
        epilog="Every other argument goes to the backend.",
    )
    parser.add_argument(
        "--backend", choices=backends, default="reference", help="which engine to run (default: reference)"
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return parser


def _engine_help(parser: argparse.ArgumentParser, backend: str) -> int:
    parser.print_help()
    print()
    if backend == "sglang":
        print("SGLang's own arguments: python -m sglang.launch_server --help; the hsx flags: --hsx-help")
        return 0
    if backend == "synthetic":
        from workers.engines.synthetic.cli import build_parser as backend_parser
    else:
        from workers.engines.reference.cli import build_parser as backend_parser
    print(f"The {backend} backend's arguments:")
    backend_help = backend_parser()
    backend_help.prog = f"hsx engine --backend {backend}"
    backend_help.print_help()
    return 0


def cmd_engine(argv: list[str]) -> int:
    parser = _engine_parser(["reference", "sglang", "synthetic"])
    known, rest = parser.parse_known_args(argv)
    if known.help:
        return _engine_help(parser, known.backend)
    if known.backend == "synthetic":
        from workers.engines.synthetic.cli import main as synthetic_main

        return synthetic_main(rest)
    if known.backend == "sglang":
        from workers.engines.sglang.launcher import main as sglang_main

        return sglang_main(rest)
    from workers.engines.reference.cli import main as reference_main

    return reference_main(rest)


def cmd_db(args: argparse.Namespace) -> int:
    from hsx.server.db.migrate import downgrade, upgrade

    url = get_settings().resolved_database_url
    if args.action == "upgrade":
        upgrade(url, args.revision or "head")
    else:
        downgrade(url, args.revision or "-1")
    print(f"database {args.action}d: {url.split('@')[-1]}")
    return 0
