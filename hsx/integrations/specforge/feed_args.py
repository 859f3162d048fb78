"""``hsx feed specforge JOB``'s arguments and their defaults; torch-free, so the ``hsx`` parser (and with
it ``hsx api``) stays torch-free. The command itself runs in :mod:`hsx.integrations.specforge.feeder`
(``run_feed_command``), imported only to run, and takes its defaults from here."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from hsx.integrations.specforge.schedule import TrainerConfigError, TrainerRun, read_trainer_config

DEFAULT_WINDOW = 64  # refs appended but not consumed
DEFAULT_LEASE_SECONDS = 3600.0  # the feeder holds a shard until the trainer is done with all of it


def add_feed_arguments(parser: argparse.ArgumentParser, api_url: str) -> None:
    parser.add_argument("target", choices=["specforge"], help="whose stream to feed")
    parser.add_argument("job_id")
    parser.add_argument(
        "--specforge-config",
        type=Path,
        help="the trainer's run YAML (`specforge train` role consumer): the feeder writes the schedule "
        "record its consumer waits for from it, and takes the channel, store and backend from its "
        "deployment.disaggregated unless given here",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        help="with --specforge-config and more than one epoch: the distinct conversations; the job's "
        "dataset holds each once per epoch (python -m hsx.integrations.specforge.schedule epochs)",
    )
    parser.add_argument(
        "--channel", type=Path, help="the StreamingRefChannel file (shared; default: the config's)"
    )
    parser.add_argument(
        "--backend",
        choices=["shared_dir", "mooncake"],
        help="SpecForge's DISAGG_BACKEND: a shared directory, or a Mooncake store (cross-node; what "
        "`specforge train`'s online consumer takes). Default: the config's, else shared_dir",
    )
    parser.add_argument("--store-root", type=Path, help="shared_dir: SharedDirFeatureStore root (shared)")
    parser.add_argument(
        "--store-id",
        help="the trainer's store_id (DISAGG_STORE_ID; default: the config's store_id or run_id, else the "
        "job id)",
    )
    parser.add_argument("--mooncake-master", help="mooncake: the master's host:port")
    parser.add_argument(
        "--mooncake-metadata", help="mooncake: the metadata server, http://host:port/metadata"
    )
    parser.add_argument("--mooncake-host", help="mooncake: this host, as others reach it (127.0.0.1)")
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


@dataclass(frozen=True)
class FeedTarget:
    """Where the feeder writes, resolved from the options and the trainer's config."""

    channel: Path
    backend: str
    store_id: str
    store_root: Path | None
    mooncake_master: str | None
    mooncake_metadata: str | None
    mooncake_host: str
    trainer: TrainerRun | None


def _pick(name: str, given: object, configured: object) -> object:
    """An option given on the command line wins only where the config agrees or says nothing: two
    different channels or stores for one trainer would leave it waiting on data that goes elsewhere."""
    if given is not None and configured is not None and str(given) != str(configured):
        raise TrainerConfigError(f"{name} is {given} here but {configured} in the trainer's config")
    return given if given is not None else configured


def resolve_target(args: argparse.Namespace) -> FeedTarget:
    """The feed's target from ``hsx feed specforge``'s arguments; raises TrainerConfigError saying why not."""
    run = read_trainer_config(args.specforge_config) if args.specforge_config else None
    if args.prompts is not None and run is None:
        raise TrainerConfigError("--prompts needs --specforge-config (the epochs it counts come from there)")
    channel = _pick("--channel", args.channel, run.channel if run else None)
    if channel is None:
        raise TrainerConfigError(
            "give --channel, or --specforge-config with deployment.disaggregated.control_dir"
        )
    backend = str(_pick("--backend", args.backend, run.backend if run else None) or "shared_dir")
    store_root = _pick("--store-root", args.store_root, run.store_root if run else None)
    master = _pick("--mooncake-master", args.mooncake_master, run.mooncake_master if run else None)
    metadata = _pick("--mooncake-metadata", args.mooncake_metadata, run.mooncake_metadata if run else None)
    host = _pick("--mooncake-host", args.mooncake_host, run.mooncake_host if run else None)
    if backend == "mooncake" and not (master and metadata):
        raise TrainerConfigError("--backend mooncake needs --mooncake-master and --mooncake-metadata")
    if backend == "shared_dir" and store_root is None:
        raise TrainerConfigError("--backend shared_dir needs --store-root")
    return FeedTarget(
        channel=Path(str(channel)),
        backend=backend,
        store_id=str(_pick("--store-id", args.store_id, run.store_id if run else None) or args.job_id),
        store_root=Path(str(store_root)) if store_root is not None else None,
        mooncake_master=str(master) if master else None,
        mooncake_metadata=str(metadata) if metadata else None,
        mooncake_host=str(host or "127.0.0.1"),
        trainer=run,
    )
