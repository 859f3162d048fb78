"""Publish a finished job output directory to ``s3://bucket/prefix``: every shard the manifest lists, then
the manifest itself, last, so a reader that finds the manifest finds every object it names.

* Each shard is checked against the manifest before it leaves the disk (size, sha256s: the loader's own
  check), so a damaged shard is never published.
* Small files go up in one PUT; files of ``s3_multipart_threshold_bytes`` or more in parts of
  ``s3_part_bytes``. Every PUT and part carries its SHA-256 (and MD5), which the server checks on receipt.
* Every object is confirmed afterwards: its size, and the SHA-256 the server computed (whole-object, or
  the composite over the parts) or, on a server without checksums, its MD5-based ETag, all against what
  was computed from the local file. An object that does not match is uploaded again.
* Resumable and idempotent: an object already there and confirmed is skipped; an unfinished multipart
  upload of the same key is continued, each part already uploaded reused only if its size and digest
  match; stale unfinished uploads of the key are aborted once the object is complete. A process killed at
  any point leaves either no manifest or a manifest whose objects are all confirmed; running the upload
  again finishes the job.
* A destination that already holds a different manifest is refused before anything is uploaded.

The call: ``upload_output(Path(job.output_dir), f"{output_uri}/{job.id}", settings)``; it returns an
:class:`UploadReport` or raises :class:`~hsx.s3.StorageError` (or the loader's error for a damaged
shard). A running job is published object by object through the same uploads
(:mod:`hsx.server.storage.publish`).
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from hsx.errors import BadRequest, Forbidden
from hsx.manifest import MANIFEST_FILE, Manifest
from hsx.s3 import StorageError, s3_client, storage_error
from hsx.server.settings import Settings

META_SHA256 = "hsx-sha256"  # user metadata: the whole file's sha256, hex
META_PART_BYTES = "hsx-part-bytes"  # user metadata: the part size used, 0 for a single PUT
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class OutputUriRefused(BadRequest):
    error = "invalid_output_uri"


class OutputBucketNotAllowed(Forbidden):
    error = "bucket_not_allowed"


@dataclass(frozen=True)
class OutputLocation:
    bucket: str
    prefix: str  # no leading or trailing slash

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}"

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_output_uri(uri: str, settings: Settings) -> OutputLocation:
    """``s3://bucket/prefix`` with a bucket in ``settings.allowed_buckets`` and a plain prefix."""
    parts = urlsplit(uri)
    prefix = unquote(parts.path).strip("/")
    segments = prefix.split("/")
    plain = all(s not in ("", ".", "..") for s in segments) and not any(c in prefix for c in "\\\x00")
    if (
        parts.scheme.lower() != "s3"
        or not _BUCKET.match(parts.netloc)
        or not prefix
        or not plain
        or parts.query
        or parts.fragment
    ):
        raise OutputUriRefused(f"an output URI is s3://bucket/prefix, got {uri!r}")
    if parts.netloc not in settings.allowed_buckets:
        raise OutputBucketNotAllowed(f"bucket {parts.netloc!r} is not in the allowed buckets")
    return OutputLocation(parts.netloc, prefix)


@dataclass(frozen=True)
class LocalDigest:
    size: int
    sha256: str  # hex, whole file
    part_bytes: int  # 0: one PUT
    part_sha256: list[bytes]  # raw digests, one per part (one entry for a single PUT)
    part_md5: list[bytes]

    def part_range(self, number: int) -> tuple[int, int]:
        """Byte range of part ``number`` (1-based)."""
        start = (number - 1) * self.part_bytes
        return start, min(start + self.part_bytes, self.size)

    @property
    def parts(self) -> int:
        return len(self.part_sha256)

    def expected_sha256(self) -> str:
        """What S3 reports as ChecksumSHA256: base64, composite (hash of part hashes) for multipart."""
        if not self.part_bytes:
            return base64.b64encode(self.part_sha256[0]).decode()
        return base64.b64encode(hashlib.sha256(b"".join(self.part_sha256)).digest()).decode()

    def expected_etag(self) -> str:
        if not self.part_bytes:
            return self.part_md5[0].hex()
        return f"{hashlib.md5(b''.join(self.part_md5)).hexdigest()}-{self.parts}"


def local_digest(path: Path, settings: Settings) -> LocalDigest:
    size = path.stat().st_size
    multipart = size >= settings.s3_multipart_threshold_bytes
    part_bytes = settings.s3_part_bytes if multipart else 0
    step = part_bytes or max(size, 1)
    whole = hashlib.sha256()
    shas: list[bytes] = []
    md5s: list[bytes] = []
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(step)
            if not chunk and shas:
                break
            whole.update(chunk)
            shas.append(hashlib.sha256(chunk).digest())
            md5s.append(hashlib.md5(chunk).digest())
            if len(chunk) < step:
                break
    return LocalDigest(size, whole.hexdigest(), part_bytes, shas, md5s)


@dataclass
class ObjectReport:
    key: str
    bytes: int
    sha256: str
    parts: int
    parts_uploaded: int = 0
    parts_reused: int = 0
    already_there: bool = False


@dataclass
class UploadReport:
    uri: str
    objects: list[ObjectReport] = field(default_factory=list)

    @property
    def bytes_uploaded(self) -> int:
        return sum(o.bytes for o in self.objects if not o.already_there)


@dataclass(frozen=True)
class UploadEvent:
    kind: str  # "part", "object"
    key: str
    part: int = 0
    parts: int = 0


Progress = Callable[[UploadEvent], None]


def upload_output(
    output_dir: Path | str, dest_uri: str, settings: Settings, *, progress: Progress | None = None
) -> UploadReport:
    """Publish ``output_dir`` (a finished job's output) under ``dest_uri``; see the module docstring."""
    from hsx.loader import ShardView

    directory = Path(output_dir)
    location = parse_output_uri(dest_uri, settings)
    manifest = Manifest.load(directory)
    manifest_bytes = (directory / MANIFEST_FILE).read_bytes()
    client = s3_client(settings.s3_endpoint)
    _refuse_other_manifest(client, location, manifest_bytes)
    report = UploadReport(location.uri)
    for entry in manifest.shards:
        path = manifest.shard_path(directory, entry)
        ShardView(path, entry, manifest, verify=True)  # never publish a shard that fails its manifest
        report.objects.append(
            _put(client, location.bucket, location.key(entry.path), path, settings, progress)
        )
    manifest_path = directory / MANIFEST_FILE
    report.objects.append(
        _put(client, location.bucket, location.key(MANIFEST_FILE), manifest_path, settings, progress)
    )
    return report


def _refuse_other_manifest(client: Any, location: OutputLocation, manifest_bytes: bytes) -> None:
    key = location.key(MANIFEST_FILE)
    try:
        existing = client.get_object(Bucket=location.bucket, Key=key)["Body"].read()
    except Exception as exc:  # noqa: BLE001 - mapped; only "not there" is the normal case
        error = storage_error(exc, f"s3://{location.bucket}/{key}")
        if error.error == "not_found":
            return
        raise error from exc
    if existing != manifest_bytes:
        raise StorageError(
            f"s3://{location.bucket}/{key} holds another output's manifest; choose another prefix",
            error="destination_holds_another_output",
        )


def _put(
    client: Any, bucket: str, key: str, path: Path, settings: Settings, progress: Progress | None
) -> ObjectReport:
    digest = local_digest(path, settings)
    report = ObjectReport(key, digest.size, digest.sha256, digest.parts)
    where = f"s3://{bucket}/{key}"
    try:
        if _confirmed(client, bucket, key, digest):
            report.already_there = True
        else:
            for attempt in (1, 2):
                if digest.part_bytes:
                    _multipart(client, bucket, key, path, digest, report, progress, fresh=attempt == 2)
                else:
                    _single(client, bucket, key, path, digest)
                    report.parts_uploaded = 1
                if _confirmed(client, bucket, key, digest):
                    break
                if attempt == 2:
                    raise StorageError(
                        f"{where} does not match the local file after upload", error="upload_mismatch"
                    )
    except Exception as exc:
        # Two publishers of one key (the worker that committed a unit and the reconciler or finalize) may
        # complete or abort the upload the other continues: an object confirmed now is the other's success.
        if _confirmed_quietly(client, bucket, key, digest):
            report.already_there = True
        elif isinstance(exc, StorageError):
            raise
        else:
            raise storage_error(exc, where) from exc
    if progress is not None:
        progress(UploadEvent("object", key, digest.parts, digest.parts))
    return report


def _metadata(digest: LocalDigest) -> dict[str, str]:
    return {META_SHA256: digest.sha256, META_PART_BYTES: str(digest.part_bytes)}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _single(client: Any, bucket: str, key: str, path: Path, digest: LocalDigest) -> None:
    with open(path, "rb") as body:
        client.put_object(
            Bucket=bucket,
            Key=key,
            Body=body,
            ContentLength=digest.size,
            ContentMD5=_b64(digest.part_md5[0]),
            ChecksumSHA256=_b64(digest.part_sha256[0]),
            Metadata=_metadata(digest),
        )


def _confirmed(client: Any, bucket: str, key: str, digest: LocalDigest) -> bool:
    """Whether the object is there, whole, and the server's own checksum matches the local file."""
    try:
        head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    except Exception as exc:  # noqa: BLE001 - mapped; only "not there" means "upload it"
        error = storage_error(exc, f"s3://{bucket}/{key}")
        if error.error == "not_found":
            return False
        raise error from exc
    meta = {k.lower(): v for k, v in head.get("Metadata", {}).items()}
    if int(head["ContentLength"]) != digest.size or meta.get(META_SHA256) != digest.sha256:
        return False
    if meta.get(META_PART_BYTES) != str(digest.part_bytes):
        return False  # made with another part size: its composite checksum cannot be compared; redo it
    server_sha = head.get("ChecksumSHA256")
    if server_sha:
        return bool(server_sha.split("-")[0] == digest.expected_sha256())
    return bool(str(head.get("ETag", "")).strip('"') == digest.expected_etag())


def _confirmed_quietly(client: Any, bucket: str, key: str, digest: LocalDigest) -> bool:
    try:
        return _confirmed(client, bucket, key, digest)
    except Exception:  # noqa: BLE001 - asked after a failure: an error here only means "not confirmed"
        return False


def _open_upload(client: Any, bucket: str, key: str) -> str | None:
    """The newest unfinished multipart upload of exactly ``key``, if any."""
    uploads = []
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=key):
        uploads += [u for u in page.get("Uploads", []) if u["Key"] == key]
    if not uploads:
        return None
    newest: str = max(uploads, key=lambda u: u["Initiated"])["UploadId"]
    return newest


def _reusable_parts(
    client: Any, bucket: str, key: str, upload_id: str, digest: LocalDigest
) -> dict[int, dict[str, Any]] | None:
    """Parts already uploaded that match the local file; None when the upload cannot be continued."""
    listed = []
    for page in client.get_paginator("list_parts").paginate(Bucket=bucket, Key=key, UploadId=upload_id):
        listed += page.get("Parts", [])
    reusable: dict[int, dict[str, Any]] = {}
    for part in listed:
        number = int(part["PartNumber"])
        if number > digest.parts:
            return None  # cut for another file or part size
        start, end = digest.part_range(number)
        sha = part.get("ChecksumSHA256")
        matches = (
            sha == _b64(digest.part_sha256[number - 1])
            if sha
            else str(part["ETag"]).strip('"') == digest.part_md5[number - 1].hex()
        )
        if int(part["Size"]) == end - start and matches:
            reusable[number] = {
                "PartNumber": number,
                "ETag": part["ETag"],
                "ChecksumSHA256": _b64(digest.part_sha256[number - 1]),
            }
    return reusable


def _multipart(
    client: Any,
    bucket: str,
    key: str,
    path: Path,
    digest: LocalDigest,
    report: ObjectReport,
    progress: Progress | None,
    fresh: bool,
) -> None:
    done: dict[int, dict[str, Any]] = {}
    upload_id = None if fresh else _open_upload(client, bucket, key)
    if upload_id is not None:
        reusable = _reusable_parts(client, bucket, key, upload_id, digest)
        if reusable is None:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            upload_id = None
        else:
            done = reusable
    if upload_id is None:
        created = client.create_multipart_upload(
            Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256", Metadata=_metadata(digest)
        )
        upload_id = created["UploadId"]
    report.parts_reused = len(done)
    with open(path, "rb") as fh:
        for number in range(1, digest.parts + 1):
            if number in done:
                continue
            start, end = digest.part_range(number)
            fh.seek(start)
            body = fh.read(end - start)
            answer = client.upload_part(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
                ContentMD5=_b64(digest.part_md5[number - 1]),
                ChecksumSHA256=_b64(digest.part_sha256[number - 1]),
            )
            done[number] = {
                "PartNumber": number,
                "ETag": answer["ETag"],
                "ChecksumSHA256": _b64(digest.part_sha256[number - 1]),
            }
            report.parts_uploaded += 1
            if progress is not None:
                progress(UploadEvent("part", key, number, digest.parts))
    parts = [done[number] for number in sorted(done)]
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
    )
    _abort_stale(client, bucket, key)


def _abort_stale(client: Any, bucket: str, key: str) -> None:
    """Unfinished uploads of a key that is now complete only cost storage: abort them."""
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=key):
        for upload in page.get("Uploads", []):
            if upload["Key"] == key:
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"])
