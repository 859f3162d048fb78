"""Reading a streamed shard before its job has a manifest: the job's engine record (``GET /jobs/{id}``'s
``engine``) says what finalize would write in the manifest, so a shard handed out by a lease is checked and
read exactly as the loader reads a finished job's, from the workers' filesystem or from the object store
the job is published to."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from hsx.loader import LoaderError, ShardView
from hsx.manifest import Manifest, ShardEntry, job_manifest, stores_fp8
from hsx.samples import Sample

# Where a consumer reads an item: its path, its object in the store, or the path when it can see it.
Source = Literal["auto", "file", "s3"]


def manifest_for(job: Mapping[str, Any]) -> Manifest:
    """The manifest of a started job without its shard list, from its document (``GET /jobs/{id}``: its
    ``engine`` record and ``options``), built as finalize builds the one it writes."""
    fp8 = stores_fp8((job.get("options") or {}).get("state_dtype"))
    return job_manifest(str(job["id"]), job["engine"], fp8=fp8)


class ShardGone(LoaderError):
    """A leased item's shard is no longer there (its file or its object). In a ``consume`` job a shard is
    deleted only once an acknowledgement of it has committed, so the item was delivered again, after this
    delivery's lease ran out, to a consumer that acknowledged it."""


def open_item(
    item: dict[str, Any], manifest: Manifest, verify: bool = True, source: Source = "auto"
) -> ShardView:
    """A leased item's shard (a ``POST .../leases`` item), checked against the item's checksums. Read from
    its ``path``, or from the object store at its ``uri`` (``source="s3"``; ``"auto"``: when the path is
    not there, as on another host than the workers'). Raises :class:`ShardGone` when it is in neither."""
    try:
        return _open_item(item, manifest, verify, source)
    except FileNotFoundError as exc:
        raise ShardGone(f"item {item.get('id')}: {exc.filename} is gone") from exc


def _open_item(item: dict[str, Any], manifest: Manifest, verify: bool, source: Source) -> ShardView:
    entry = ShardEntry(
        path=Path(item["path"]).name,
        sha256=str(item["sha256"]),
        bytes=int(item["bytes"]),
        samples=int(item["samples"]),
        tokens=int(item["tokens"]),
        header_sha256=item.get("header_sha256"),
    )
    if source == "file" or (source == "auto" and (not item.get("uri") or Path(item["path"]).exists())):
        return ShardView(Path(item["path"]), entry, manifest, verify)
    if not item.get("uri"):
        raise LoaderError(f"item {item.get('id')} has no uri: its job is not published to an object store")
    with tempfile.TemporaryDirectory(prefix="hsx-item-") as scratch:
        copy = Path(scratch) / entry.path
        _download(str(item["uri"]), copy)
        return ShardView(copy, entry, manifest, verify)  # mapped: the copy may go once it is open


def _download(uri: str, target: Path) -> None:
    from hsx.s3 import S3Endpoint, s3_client, storage_error

    parts = urlsplit(uri)
    try:
        s3_client(S3Endpoint.from_environment()).download_file(
            parts.netloc, parts.path.lstrip("/"), str(target)
        )
    except Exception as exc:
        error = storage_error(exc, uri)
        if error.error == "not_found":
            raise ShardGone(str(error)) from exc
        raise error from exc


def item_samples(
    item: dict[str, Any], manifest: Manifest, verify: bool = True, source: Source = "auto"
) -> Iterator[Sample]:
    """The item's samples, read as a torch reader reads them (bf16 as its words: hand each to
    :func:`hsx.samples.sample_item` or :func:`hsx.samples.to_torch` with the manifest's dtype). The shard is
    opened (and checked) by this call, not at the first sample, so :class:`ShardGone` and checksum errors
    are raised here."""
    view = open_item(item, manifest, verify, source)
    return (view.sample(k, raw_bf16=True) for k in range(len(view)))
