"""The ``hsx`` commands a client runs against the API about a job: submit, retry, watch, status and the job
list; a regenerate job's dataset; and a job's output for a trainer (export, feed)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from hsx.server.settings import get_settings

if TYPE_CHECKING:
    from hsx.cli.api_client import Api


def cmd_submit(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from hsx.cli import api_client as client
    from hsx.cli.options import describe_error, options_from_args
    from hsx.server.job_options import JobOptions

    try:
        options = options_from_args(args, args.option_flags, JobOptions)
    except ValidationError as exc:
        print(f"hsx submit: {describe_error(exc)}", file=sys.stderr)
        return client.EXIT_REFUSED
    api = client.api_at(args.api_url)
    if args.idempotency_key:
        api.headers["Idempotency-Key"] = args.idempotency_key
    body = {"dataset_uri": client.local_dataset_uri(args.dataset), "options": options}
    return _post_job(api, "/jobs", body, args)


def cmd_retry(args: argparse.Namespace) -> int:
    from hsx.cli import api_client as client

    return _post_job(client.api_at(args.api_url), f"/jobs/{args.job_id}/retry", None, args)


def _post_job(api: Api, path: str, body: dict[str, Any] | None, args: argparse.Namespace) -> int:
    """POST something that answers a job document; with ``--wait``, follow the job to its end."""
    from hsx.cli import api_client as client
    from hsx.cli.progress import watch

    try:
        doc = api.call("POST", path, json=body, timeout=120) if body is not None else api.call("POST", path)
        if args.wait:
            doc = watch(api, doc["id"], args.timeout, args.interval, show=not args.json)
    except client.ApiError as exc:
        return client.print_error(exc, args.json)
    _show_job(doc, args.json)
    return client.exit_code_for_state(doc.get("state"), waiting=True) if args.wait else client.EXIT_SUCCEEDED


def cmd_regenerated(args: argparse.Namespace) -> int:
    from hsx.cli import api_client as client
    from hsx.cli.regenerated import run

    try:
        return run(client.api_at(args.api_url), args.job_id, args.output)
    except client.ApiError as exc:
        return client.print_error(exc, True)


def cmd_watch(args: argparse.Namespace) -> int:
    from hsx.cli import api_client as client
    from hsx.cli.progress import watch

    try:
        doc = watch(client.api_at(args.api_url), args.job_id, args.timeout, args.interval, show=not args.json)
    except client.ApiError as exc:
        return client.print_error(exc, args.json)
    _show_job(doc, args.json)
    return client.exit_code_for_state(doc.get("state"), waiting=True)


def cmd_status(args: argparse.Namespace) -> int:
    from hsx.cli import api_client as client

    api = client.api_at(args.api_url)
    # One look, whose exit code says whether the job is over: the job table's answer, not a poll's kept one.
    api.headers["Cache-Control"] = "no-cache"
    try:
        doc = api.call("GET", f"/jobs/{args.job_id}")
    except client.ApiError as exc:
        return client.print_error(exc, args.json)
    _show_job(doc, args.json)
    return client.exit_code_for_state(doc.get("state"), waiting=False)


def cmd_jobs(args: argparse.Namespace) -> int:
    from hsx.cli import api_client as client

    params: dict[str, Any] = {"limit": args.limit, "offset": args.offset}
    if args.state:
        params["state"] = args.state
    try:
        page = client.api_at(args.api_url).call("GET", "/jobs", params=params)
    except client.ApiError as exc:
        return client.print_error(exc, args.json)
    if args.json:
        client.print_json(page)
    else:
        from rich.console import Console

        from hsx.cli.job_tables import jobs_table

        console = Console()  # in a pipe, COLUMNS or 80 wide
        console.print(jobs_table(page, console.width))
    return client.EXIT_SUCCEEDED


def _show_job(doc: dict[str, Any], as_json: bool) -> None:
    from hsx.cli import api_client as client

    if as_json:
        client.print_json(doc)
    else:
        from rich.console import Console

        from hsx.cli.job_tables import job_table

        Console().print(job_table(doc))


def cmd_export(args: argparse.Namespace) -> int:
    from hsx.cli.export import run_export_command

    return run_export_command(args)


def cmd_feed(args: argparse.Namespace) -> int:
    from hsx.integrations.specforge.feeder import run_feed_command

    return run_feed_command(args, get_settings().token())
