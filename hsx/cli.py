"""The ``hsx`` command: serve the API, run workers and engines, submit and inspect jobs, verify an engine."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from hsx.settings import get_settings

FINAL_STATES = {"succeeded", "failed", "cancelled"}


def _client_headers() -> dict[str, str]:
    token = get_settings().token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _print(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True, default=str))


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run("app.main:app", host=args.host, port=args.port, log_level="info")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.worker_main import run_worker, run_worker_processes

    processes = args.processes or get_settings().worker_processes
    if processes > 1:
        return run_worker_processes(processes, burst=args.burst, reconcile=not args.no_reconciler)
    return run_worker(get_settings(), burst=args.burst, reconcile=not args.no_reconciler)


def cmd_engine(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hsx engine", add_help=False)
    parser.add_argument("--backend", choices=["reference", "sglang", "synthetic"], default="reference")
    known, rest = parser.parse_known_args(argv)
    if known.backend == "synthetic":
        from workers.engines.synthetic.cli import main as synthetic_main

        return synthetic_main(rest)
    if known.backend == "sglang":
        from workers.engines.sglang.launcher import main as sglang_main

        return sglang_main(rest)
    from workers.engines.reference.cli import main as reference_main

    return reference_main(rest)


def cmd_db(args: argparse.Namespace) -> int:
    from hsx.db.migrate import downgrade, upgrade

    url = get_settings().resolved_database_url
    if args.action == "upgrade":
        upgrade(url, args.revision or "head")
    else:
        downgrade(url, args.revision or "-1")
    print(f"database {args.action}d: {url.split('@')[-1]}")
    return 0


def wait_for_job(api_url: str, job_id: str, timeout: float, quiet: bool = False) -> dict[str, Any]:
    import httpx

    deadline = time.monotonic() + timeout
    last = ""
    while True:
        doc: dict[str, Any] = httpx.get(
            f"{api_url}/jobs/{job_id}", headers=_client_headers(), timeout=30
        ).json()
        p = doc.get("progress", {})
        line = (
            f"{doc.get('state')}: {p.get('samples_done')}/{p.get('samples_total')} done, "
            f"{p.get('samples_rejected')} rejected"
        )
        if line != last and not quiet:
            print(line, file=sys.stderr)
            last = line
        if doc.get("state") in FINAL_STATES or time.monotonic() > deadline:
            return doc
        time.sleep(0.5)


def cmd_submit(args: argparse.Namespace) -> int:
    import httpx

    options: dict[str, Any] = {
        "chat_template": not args.no_chat_template,
        "samples_per_shard": args.samples_per_shard,
    }
    if args.max_length:
        options["max_length"] = args.max_length
    if args.aux_layers:
        options["aux_layers"] = [int(x) for x in args.aux_layers.split(",")]
    headers = _client_headers()
    if args.idempotency_key:
        headers["Idempotency-Key"] = args.idempotency_key
    resp = httpx.post(
        f"{args.api_url}/jobs",
        json={"dataset_uri": args.dataset, "options": options},
        headers=headers,
        timeout=120,
    )
    doc = resp.json()
    if resp.status_code >= 400:
        _print(doc)
        return 2
    if args.wait:
        doc = wait_for_job(args.api_url, doc["id"], args.timeout)
    _print(doc)
    return 0 if not args.wait or doc.get("state") == "succeeded" else 1


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    resp = httpx.get(f"{args.api_url}/jobs/{args.job_id}", headers=_client_headers(), timeout=30)
    _print(resp.json())
    return 0 if resp.status_code == 200 else 1


def cmd_verify(args: argparse.Namespace) -> int:
    from hsx.verify import run_verification

    settings = get_settings()
    report = run_verification(
        args.engine_url or settings.engine_url, args.dump_dir or settings.dump_dir or None
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
    from hsx.demo import run_demo

    return run_demo(
        args.dataset,
        engine_urls=args.engine_url or None,
        samples_per_shard=args.samples_per_shard,
        repeat=args.repeat,
        timeout=args.timeout,
    )


def cmd_export(args: argparse.Namespace) -> int:
    from hsx.export.cli import run_export_command

    return run_export_command(args)


def build_parser() -> argparse.ArgumentParser:
    settings = get_settings()
    parser = argparse.ArgumentParser(prog="hsx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("api", help="serve the HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
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

    sub.add_parser("engine", help="run an engine: --backend reference|sglang [engine args]", add_help=False)

    p = sub.add_parser("db", help="database migrations")
    p.add_argument("action", choices=["upgrade", "downgrade"])
    p.add_argument("revision", nargs="?")
    p.set_defaults(func=cmd_db)

    p = sub.add_parser("submit", help="submit a dataset")
    p.add_argument("dataset")
    p.add_argument("--api-url", default=settings.api_url)
    p.add_argument("--wait", action="store_true")
    p.add_argument("--timeout", type=float, default=24 * 3600)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--max-length", type=int)
    p.add_argument("--aux-layers")
    p.add_argument("--samples-per-shard", type=int, default=64)
    p.add_argument("--idempotency-key")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="show a job")
    p.add_argument("job_id")
    p.add_argument("--api-url", default=settings.api_url)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("verify", help="prove the engine cannot hand out truncated states")
    p.add_argument("--engine-url")
    p.add_argument("--dump-dir")
    p.add_argument("--reference", action="store_true", help="also compare values with a transformers forward")
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
    from hsx.export.cli import add_export_arguments

    add_export_arguments(p)
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:
        return cmd_engine(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
