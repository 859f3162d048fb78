"""The ``hsx`` command: serve the API, run workers and engines, submit and inspect jobs, verify an engine."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hsx.server.settings import get_settings


def _client_headers() -> dict[str, str]:
    token = get_settings().token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _print(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True, default=str))


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


def _api(url: str) -> Any:
    from hsx.cli.progress import Api

    return Api(url, _client_headers())


def cmd_submit(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from hsx.cli import progress as ui
    from hsx.cli.options import describe_error, options_from_args
    from hsx.server.job_options import JobOptions

    try:
        options = options_from_args(args, args.option_flags, JobOptions)
    except ValidationError as exc:
        print(f"hsx submit: {describe_error(exc)}", file=sys.stderr)
        return ui.EXIT_REFUSED
    api = _api(args.api_url)
    if args.idempotency_key:
        api.headers["Idempotency-Key"] = args.idempotency_key
    body = {"dataset_uri": ui.local_dataset_uri(args.dataset), "options": options}
    return _post_job(api, "/jobs", body, args)


def cmd_retry(args: argparse.Namespace) -> int:
    return _post_job(_api(args.api_url), f"/jobs/{args.job_id}/retry", None, args)


def _post_job(api: Any, path: str, body: dict[str, Any] | None, args: argparse.Namespace) -> int:
    """POST something that answers a job document; with ``--wait``, follow the job to its end."""
    from hsx.cli import progress as ui

    try:
        doc = api.call("POST", path, json=body, timeout=120) if body is not None else api.call("POST", path)
        if args.wait:
            doc = ui.watch(api, doc["id"], args.timeout, args.interval, show=not args.json)
    except ui.ApiError as exc:
        return ui.print_error(exc, args.json)
    _show_job(doc, args.json)
    return ui.exit_code_for_state(doc.get("state"), waiting=True) if args.wait else ui.EXIT_SUCCEEDED


def cmd_regenerated(args: argparse.Namespace) -> int:
    from hsx.cli import progress as ui
    from hsx.cli.regenerated import run

    try:
        return run(_api(args.api_url), args.job_id, args.output)
    except ui.ApiError as exc:
        return ui.print_error(exc, True)


def cmd_watch(args: argparse.Namespace) -> int:
    from hsx.cli import progress as ui

    try:
        doc = ui.watch(_api(args.api_url), args.job_id, args.timeout, args.interval, show=not args.json)
    except ui.ApiError as exc:
        return ui.print_error(exc, args.json)
    _show_job(doc, args.json)
    return ui.exit_code_for_state(doc.get("state"), waiting=True)


def cmd_status(args: argparse.Namespace) -> int:
    from hsx.cli import progress as ui

    api = _api(args.api_url)
    # One look, whose exit code says whether the job is over: the job table's answer, not a poll's kept one.
    api.headers["Cache-Control"] = "no-cache"
    try:
        doc = api.call("GET", f"/jobs/{args.job_id}")
    except ui.ApiError as exc:
        return ui.print_error(exc, args.json)
    _show_job(doc, args.json)
    return ui.exit_code_for_state(doc.get("state"), waiting=False)


def cmd_jobs(args: argparse.Namespace) -> int:
    from hsx.cli import progress as ui

    params: dict[str, Any] = {"limit": args.limit, "offset": args.offset}
    if args.state:
        params["state"] = args.state
    try:
        page = _api(args.api_url).call("GET", "/jobs", params=params)
    except ui.ApiError as exc:
        return ui.print_error(exc, args.json)
    if args.json:
        ui.print_json(page)
    else:
        from rich.console import Console

        console = Console()  # in a pipe, COLUMNS or 80 wide
        console.print(ui.jobs_table(page, console.width))
    return ui.EXIT_SUCCEEDED


def _show_job(doc: dict[str, Any], as_json: bool) -> None:
    from hsx.cli import progress as ui

    if as_json:
        ui.print_json(doc)
    else:
        from rich.console import Console

        Console().print(ui.job_table(doc))


def cmd_verify(args: argparse.Namespace) -> int:
    from hsx.engine.verify import run_verification

    settings = get_settings()
    job = None
    if args.job:
        from hsx.cli import progress as ui

        try:
            job = _api(args.api_url).call("GET", f"/jobs/{args.job}")
        except ui.ApiError as exc:
            return ui.print_error(exc, True)
    report = run_verification(
        args.engine_url or settings.engine_url, args.dump_dir or settings.dump_dir or None, job=job
    )
    doc = report.to_dict()
    if args.reference and report.ok:
        from workers.reference_check import reference_checks

        extra = reference_checks(args.engine_url or settings.engine_url, args.dump_dir)
        doc["checks"].extend(c.to_dict() for c in extra)
        doc["ok"] = doc["ok"] and all(c.ok for c in extra)
    _print(doc)
    return 0 if doc["ok"] else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from hsx.cli.demo import run_demo

    return run_demo(
        args.dataset,
        engine_urls=args.engine_url or None,
        samples_per_shard=args.samples_per_shard,
        repeat=args.repeat,
        timeout=args.timeout,
    )


BENCHES = (
    "pipeline",
    "e2e",
    "memory",
    "api",
    "scale",
    "submit",
    "stream",
    "fp8",
    "fp8_error",
    "regenerate",
    "long",
)


def cmd_bench(argv: list[str]) -> int:
    """``hsx bench NAME [args]``: run ``bench/NAME.py`` of this checkout (benchmarks are not installed)."""
    import runpy
    from pathlib import Path

    if not argv or argv[0] not in BENCHES:
        print(f"usage: hsx bench {{{','.join(BENCHES)}}} [args]  (each takes --help)", file=sys.stderr)
        return 2
    script = Path(__file__).resolve().parents[1] / "bench" / f"{argv[0]}.py"
    if not script.is_file():
        print(f"hsx bench: {script} is missing (benchmarks run from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [f"hsx bench {argv[0]}", *argv[1:]]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hsx.cli.export import run_export_command

    return run_export_command(args)


def cmd_feed(args: argparse.Namespace) -> int:
    from hsx.integrations.specforge.feeder import run_feed_command

    return run_feed_command(args, get_settings().token())


def build_parser() -> argparse.ArgumentParser:
    from hsx.cli.options import add_model_flags
    from hsx.server.job_options import JobOptions
    from hsx.server.serving import add_port_file_option

    settings = get_settings()
    parser = argparse.ArgumentParser(prog="hsx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("api", help="serve the HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (see --port-file)")
    add_port_file_option(p)
    p.set_defaults(func=cmd_api)

    p = sub.add_parser("worker", help="run a worker (RQ) with the reconciler")
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.add_argument("--no-reconciler", action="store_true")
    p.add_argument(
        "--processes",
        type=int,
        default=0,
        help="worker processes on this host, each with a unit in flight (default: HSX_WORKER_PROCESSES)",
    )
    p.set_defaults(func=cmd_worker)

    sub.add_parser(
        "engine", help="run an engine: --backend reference|sglang|synthetic [engine args]", add_help=False
    )
    sub.add_parser("bench", help=f"run a benchmark: {', '.join(BENCHES)} (from a checkout)", add_help=False)

    p = sub.add_parser("db", help="database migrations")
    p.add_argument("action", choices=["upgrade", "downgrade"])
    p.add_argument("revision", nargs="?")
    p.set_defaults(func=cmd_db)

    json_help = "print the JSON document only (for scripts)"
    p = sub.add_parser("submit", help="submit a dataset (a relative path is sent as an absolute one)")
    p.add_argument("dataset")
    p.add_argument("--api-url", default=settings.api_url)
    p.add_argument("--wait", action="store_true", help="draw a progress bar until the job ends")
    p.add_argument("--timeout", type=float, default=24 * 3600)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls while waiting")
    p.add_argument("--idempotency-key")
    p.add_argument("--json", action="store_true", help=json_help)
    # Every job option, one flag each, made from JobOptions itself (hsx/cli/options.py).
    p.set_defaults(func=cmd_submit, option_flags=add_model_flags(p, JobOptions))

    p = sub.add_parser("watch", help="draw a job's progress until it ends")
    p.add_argument("job_id")
    p.add_argument("--api-url", default=settings.api_url)
    p.add_argument("--timeout", type=float, default=24 * 3600)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("retry", help="run a finished job again: its failed units and engine-side rejections")
    p.add_argument("job_id")
    p.add_argument("--api-url", default=settings.api_url)
    p.add_argument("--wait", action="store_true", help="draw a progress bar until the job ends")
    p.add_argument("--timeout", type=float, default=24 * 3600)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=cmd_retry)

    p = sub.add_parser("regenerated", help="download a regenerate job's regenerated dataset (JSONL)")
    p.add_argument("job_id")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")
    p.add_argument("--api-url", default=settings.api_url)
    p.set_defaults(func=cmd_regenerated)

    p = sub.add_parser("status", help="show a job")
    p.add_argument("job_id")
    p.add_argument("--api-url", default=settings.api_url)
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("jobs", help="list jobs, newest first")
    p.add_argument("--state", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--api-url", default=settings.api_url)
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("verify", help="prove the engine cannot hand out truncated states")
    p.add_argument("--engine-url")
    p.add_argument("--dump-dir")
    p.add_argument("--reference", action="store_true", help="also compare values with a transformers forward")
    p.add_argument(
        "--job",
        help="also say whether the engine may serve this job (and why not); for an fp8 job, check a few of "
        "its stored samples against the engine's states (within the bound of docs/format.md)",
    )
    p.add_argument("--api-url", default=settings.api_url)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("demo", help="run a real extraction job end to end on the embedded defaults")
    p.add_argument("--dataset", default="data/sample_chats.jsonl")
    p.add_argument(
        "--engine-url", action="append", help="use this running engine (repeatable: one worker each)"
    )
    p.add_argument("--samples-per-shard", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1, help="repeat the dataset this many times")
    p.add_argument("--timeout", type=float, default=1800)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "export", help="write a job's output in a trainer's layout (SpecForge, speculators, ModelOpt)"
    )
    from hsx.cli.export import add_export_arguments

    add_export_arguments(p)
    p.set_defaults(func=cmd_export)

    # "publish": the command's first name, still accepted.
    p = sub.add_parser(
        "feed", aliases=["publish"], help="feed a running job into a trainer's own stream (SpecForge)"
    )
    from hsx.integrations.specforge.feed_args import add_feed_arguments

    add_feed_arguments(p, settings.api_url)
    p.set_defaults(func=cmd_feed)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:
        return cmd_engine(argv[1:])
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
