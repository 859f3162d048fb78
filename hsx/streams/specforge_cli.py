"""``hsx feed specforge JOB``'s arguments and their defaults; torch-free, so the ``hsx`` parser (and with
it ``hsx api``) stays torch-free. The command itself runs in :mod:`hsx.streams.specforge_feeder`
(``run_feed_command``), imported only to run, and takes its defaults from here."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_WINDOW = 64  # refs appended but not consumed
DEFAULT_LEASE_SECONDS = 3600.0  # the feeder holds a shard until the trainer is done with all of it


def add_feed_arguments(parser: argparse.ArgumentParser, api_url: str) -> None:
    parser.add_argument("target", choices=["specforge"], help="whose stream to feed")
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
        help="mooncake: memory this feeder lends the store (holds what is appended but not consumed)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help="refs appended but not consumed before the feeder stops leasing (at least the trainer's "
        "refs per optimizer step, which it reads from the channel)",
    )
    parser.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS)
    parser.add_argument("--api-url", default=api_url)
    parser.add_argument("--poll-seconds", type=float, default=0.5)
