"""``hsx publish specforge JOB``'s arguments and command; torch-free, so the ``hsx`` parser (and with it
``hsx api``) stays torch-free: the publisher (:mod:`hsx.streams.specforge_publisher`) is imported to run."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_WINDOW = 64  # refs published but not consumed
DEFAULT_LEASE_SECONDS = 3600.0  # the publisher holds a shard until the trainer is done with all of it


def add_publish_arguments(parser: argparse.ArgumentParser, api_url: str) -> None:
    parser.add_argument("target", choices=["specforge"], help="whose stream to publish into")
    parser.add_argument("job_id")
    parser.add_argument("--channel", required=True, type=Path, help="the StreamingRefChannel file (shared)")
    parser.add_argument(
        "--store-root", required=True, type=Path, help="SharedDirFeatureStore root (shared with the trainer)"
    )
    parser.add_argument("--store-id", help="SharedDirFeatureStore store_id (default: the job id)")
    parser.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help="refs published but not consumed before the publisher stops leasing (at least the trainer's "
        "refs per optimizer step, which it reads from the channel)",
    )
    parser.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS)
    parser.add_argument("--api-url", default=api_url)
    parser.add_argument("--poll-seconds", type=float, default=0.5)


def run_publish_command(args: argparse.Namespace, token: str | None) -> int:
    from hsx.streams.specforge_publisher import PublishError, SpecForgePublisher

    publisher = SpecForgePublisher(
        api_url=args.api_url,
        job_id=args.job_id,
        channel_path=args.channel,
        store_root=args.store_root,
        store_id=args.store_id or args.job_id,
        token=token,
        window=args.window,
        lease_seconds=args.lease_seconds,
        poll_seconds=args.poll_seconds,
    )
    try:
        result = publisher.run()
    except PublishError as exc:
        print(f"hsx publish: {exc}")
        return 2
    print(
        f"hsx publish specforge: {result.outcome}; {result.published} refs published, "
        f"{result.acked_items} shards acknowledged" + (f"; {result.reason}" if result.reason else "")
    )
    return 0 if result.outcome in ("closed", "trainer_done") else 1
