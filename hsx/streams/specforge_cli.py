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
        "--backend",
        choices=["shared_dir", "mooncake"],
        default="shared_dir",
        help="SpecForge's DISAGG_BACKEND: a shared directory, or a Mooncake store (cross-node)",
    )
    parser.add_argument("--store-root", type=Path, help="shared_dir: SharedDirFeatureStore root (shared)")
    parser.add_argument("--store-id", help="the trainer's store_id (DISAGG_STORE_ID; default: the job id)")
    parser.add_argument("--mooncake-master", help="mooncake: the master's host:port")
    parser.add_argument(
        "--mooncake-metadata", help="mooncake: the metadata server, http://host:port/metadata"
    )
    parser.add_argument(
        "--mooncake-host", default="127.0.0.1", help="mooncake: this host, as others reach it"
    )
    parser.add_argument(
        "--mooncake-segment-bytes",
        type=int,
        default=1 << 30,
        help="mooncake: memory this publisher lends the store (holds what is published but not consumed)",
    )
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

    store_id = args.store_id or args.job_id
    sink = None
    if args.backend == "mooncake":
        if not (args.mooncake_master and args.mooncake_metadata):
            print("hsx publish: --backend mooncake needs --mooncake-master and --mooncake-metadata")
            return 2
        from hsx.streams.specforge_mooncake import MooncakeFeatures, MooncakeSetup

        setup = MooncakeSetup(
            master=args.mooncake_master,
            metadata_server=args.mooncake_metadata,
            local_hostname=args.mooncake_host,
            segment_bytes=args.mooncake_segment_bytes,
        )
        sink = MooncakeFeatures(setup, store_id)
    elif args.store_root is None:
        print("hsx publish: --backend shared_dir needs --store-root")
        return 2
    publisher = SpecForgePublisher(
        api_url=args.api_url,
        job_id=args.job_id,
        channel_path=args.channel,
        store_root=args.store_root or Path("."),
        store_id=store_id,
        token=token,
        window=args.window,
        lease_seconds=args.lease_seconds,
        poll_seconds=args.poll_seconds,
        sink=sink,
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
