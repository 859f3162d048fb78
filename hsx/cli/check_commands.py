"""The ``hsx`` commands that check and measure: verify an engine, run a demo job end to end, run a
benchmark of this checkout."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hsx.server.settings import get_settings


def _print(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True, default=str))


def cmd_verify(args: argparse.Namespace) -> int:
    from hsx.engine.verify import run_verification

    settings = get_settings()
    job = None
    if args.job:
        from hsx.cli import api_client as client

        try:
            job = client.api_at(args.api_url).call("GET", f"/jobs/{args.job}")
        except client.ApiError as exc:
            return client.print_error(exc, True)
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
    script = Path(__file__).resolve().parents[2] / "bench" / f"{argv[0]}.py"  # the checkout's root
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
