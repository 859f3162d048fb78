"""Publishing a job's output object by object, as it is made: a shard when its unit commits, the manifest
last when the job finalizes, and the deletion of an acknowledged shard's object (consume retention).

Every object goes up through :mod:`hsx.server.storage.upload` (checksummed, confirmed, resumable), so a
publisher killed at any point leaves nothing half-written under a key (an S3 object appears whole or not at
all; an unfinished multipart upload is continued by the next publisher, reusing its parts), and publishing
again is a no-op once the object is confirmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hsx.manifest import MANIFEST_FILE
from hsx.s3 import StorageError, s3_client, storage_error
from hsx.server.settings import Settings
from hsx.server.storage.upload import (
    ObjectReport,
    OutputLocation,
    Progress,
    _confirmed,
    _put,
    _refuse_other_manifest,
    local_digest,
    parse_output_uri,
)


def put_shard(
    path: Path, relative: str, dest_uri: str, settings: Settings, progress: Progress | None = None
) -> ObjectReport:
    """Put one committed shard at ``<dest_uri>/<relative>``. While a job runs its destination holds no
    manifest (finalize puts it after every shard): one there belongs to another output, refused as
    :func:`~hsx.server.storage.upload.upload_output` refuses it, unless this shard is already confirmed
    there."""
    location = parse_output_uri(dest_uri, settings)
    client = s3_client(settings.s3_endpoint)
    key = location.key(relative)
    there = _has_manifest(client, location)
    if there and not _confirmed(client, location.bucket, key, local_digest(path, settings)):
        raise StorageError(
            f"{location.uri} holds another output's manifest; choose another prefix",
            error="destination_holds_another_output",
        )
    return _put(client, location.bucket, key, path, settings, progress)


def put_manifest(
    output_dir: Path, dest_uri: str, settings: Settings, progress: Progress | None = None
) -> ObjectReport:
    """Put the manifest, last: every shard it names that is still meant to be there is confirmed already."""
    location = parse_output_uri(dest_uri, settings)
    client = s3_client(settings.s3_endpoint)
    path = Path(output_dir) / MANIFEST_FILE
    _refuse_other_manifest(client, location, path.read_bytes())
    return _put(client, location.bucket, location.key(MANIFEST_FILE), path, settings, progress)


def delete_objects(dest_uri: str, relatives: Sequence[str], settings: Settings) -> list[str]:
    """Delete ``<dest_uri>/<relative>`` for each (a missing object counts as deleted); returns those gone.
    Raises :class:`StorageError` when the store cannot be asked at all."""
    if not relatives:
        return []
    location = parse_output_uri(dest_uri, settings)
    client = s3_client(settings.s3_endpoint)
    gone: list[str] = []
    for start in range(0, len(relatives), 1000):  # DeleteObjects takes at most 1000 keys
        batch = list(relatives[start : start + 1000])
        keys = {location.key(relative): relative for relative in batch}
        try:
            answer = client.delete_objects(
                Bucket=location.bucket,
                Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True},
            )
        except Exception as exc:
            raise storage_error(exc, location.uri) from exc
        failed = {str(error.get("Key")) for error in answer.get("Errors", [])}
        gone += [relative for key, relative in keys.items() if key not in failed]
    return gone


def _has_manifest(client: Any, location: OutputLocation) -> bool:
    key = location.key(MANIFEST_FILE)
    try:
        client.head_object(Bucket=location.bucket, Key=key)
    except Exception as exc:  # noqa: BLE001 - mapped; only "not there" is the normal case
        error = storage_error(exc, f"s3://{location.bucket}/{key}")
        if error.error == "not_found":
            return False
        raise error from exc
    return True
