"""The ``hsx`` command: serve the API, run workers and engines, submit and inspect jobs, verify an engine."""

from __future__ import annotations

import argparse
import sys

# The commands, grouped by what they are for. Each imports what it runs inside the function that runs it,
# so importing them here adds nothing to a command's start but the modules themselves.
from hsx.cli.check_commands import BENCHES, cmd_bench, cmd_demo, cmd_verify
from hsx.cli.job_commands import (
    cmd_export,
    cmd_feed,
    cmd_jobs,
    cmd_regenerated,
    cmd_retry,
    cmd_status,
    cmd_submit,
    cmd_watch,
)
from hsx.cli.service_commands import cmd_api, cmd_db, cmd_engine, cmd_worker
from hsx.server.settings import get_settings


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
