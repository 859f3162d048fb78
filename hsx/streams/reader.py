"""Reading a streamed shard before its job has a manifest: the job's engine record (``GET /jobs/{id}``'s
``engine``) says what finalize would write in the manifest, so a shard handed out by a lease is checked and
read exactly as the loader reads a finished job's."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hsx.fp8 import STATE_DTYPE_OPTION
from hsx.job_options import JobOptions
from hsx.loader import Sample, ShardView
from hsx.manifest import Manifest, ShardEntry, job_manifest


def manifest_for(job: Mapping[str, Any]) -> Manifest:
    """The manifest of a started job without its shard list, from its document (``GET /jobs/{id}``: its
    ``engine`` record and ``options``), built as finalize builds the one it writes."""
    options = JobOptions.from_stored(job.get("options"))
    return job_manifest(str(job["id"]), job["engine"], fp8=options.state_dtype == STATE_DTYPE_OPTION)


def open_item(item: dict[str, Any], manifest: Manifest, verify: bool = True) -> ShardView:
    """A leased item's shard (a ``POST .../leases`` item), checked against the item's checksums."""
    entry = ShardEntry(
        path=Path(item["path"]).name,
        sha256=str(item["sha256"]),
        bytes=int(item["bytes"]),
        samples=int(item["samples"]),
        tokens=int(item["tokens"]),
        header_sha256=item.get("header_sha256"),
    )
    return ShardView(Path(item["path"]), entry, manifest, verify)


def item_samples(
    item: dict[str, Any], manifest: Manifest, verify: bool = True, raw_bf16: bool = False
) -> Iterator[Sample]:
    view = open_item(item, manifest, verify)
    for k in range(len(view)):
        yield view.sample(k, raw_bf16)
