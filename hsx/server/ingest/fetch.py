"""Guarded fetch of a remote dataset into a local folder: http(s) and s3.

* ``http://`` and ``https://`` (:func:`download_dataset`): each hop (redirects are followed by hand, at most
  :data:`MAX_REDIRECTS`) must name a host whose every address is public
  (:func:`~hsx.server.ingest.policy.ensure_public_host`), and the connection goes to an address that was
  checked, never through a second DNS lookup, so DNS rebinding cannot swap in a private address between the
  check and the connect. TLS is still verified against the host name. Environment proxies are ignored (they
  would connect on our behalf, unchecked). The body is staged under a temporary name and renamed to its
  sha256, within the size and time limits.
* ``s3://bucket/key`` (:func:`fetch_s3`): the object, or a ``datasets`` folder stored under the prefix
  ``key/``, copied with the size limit.

:func:`resolve_dataset_uri` answers any URI with one vetted local regular file, downloading http(s) first.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import ssl
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from hsx.server.ingest.errors import DatasetError
from hsx.server.ingest.policy import (
    HTTP_SCHEMES,
    HostCheck,
    HttpTarget,
    InvalidUri,
    ResolvedDataset,
    check_s3_uri,
    ensure_public_host,
    resolve_local_dataset,
    uri_scheme,
)
from hsx.server.settings import Settings

MAX_REDIRECTS = 5
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_SAFE_SUFFIX = re.compile(r"^\.[A-Za-z0-9]{1,10}$")
_CHUNK_BYTES = 1 << 20


def resolve_dataset_uri(uri: str, settings: Settings) -> ResolvedDataset:
    """Resolve ``uri`` to a vetted local file, downloading http(s) datasets first."""
    scheme = uri_scheme(uri, settings)
    if scheme == "file":
        return resolve_local_dataset(uri, settings, allow_folder=False)
    if scheme in HTTP_SCHEMES:
        return download_dataset(uri, settings)
    if scheme == "s3":
        check_s3_uri(uri, settings)
        raise InvalidUri(
            "an s3:// dataset is read by the worker that prepares the job, not resolved to a local file here",
            error="s3_read_by_worker",
        )
    raise InvalidUri(f"scheme {scheme!r} is allowed but hsx cannot read it", error="uri_scheme_not_supported")


def download_dataset(
    url: str,
    settings: Settings,
    *,
    check_host: HostCheck = ensure_public_host,
    tls_context: ssl.SSLContext | None = None,
    into: Path | None = None,
) -> ResolvedDataset:
    """Download ``url`` into ``into`` (default ``data_dir/downloads``) and return it as a dataset.

    ``check_host`` vets every hop and returns the addresses to connect to; production passes nothing and
    gets :func:`ensure_public_host`. Tests inject a check that lets a loopback server through, and
    ``tls_context`` to trust a test certificate.
    """
    deadline = time.monotonic() + settings.http_download_deadline_seconds
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        target = HttpTarget.parse(current, settings)
        addresses = check_host(target.host)
        with _pinned_get(target, addresses, settings, tls_context) as response:
            if response.status_code in _REDIRECT_STATUSES:
                location = response.headers.get("location")
                if not location:
                    raise InvalidUri(
                        f"{target.host} sent a redirect without a Location", error="download_failed"
                    )
                current = urljoin(current, location)
                continue
            if response.status_code != 200:
                raise InvalidUri(
                    f"{target.host} answered HTTP {response.status_code}", error="download_failed"
                )
            path, size, sha256 = _stage(response, current, settings, deadline, into)
            return ResolvedDataset(uri=url, path=path, size_bytes=size, sha256=sha256, source_url=current)
    raise InvalidUri(f"more than {MAX_REDIRECTS} redirects", error="too_many_redirects")


@contextmanager
def _pinned_get(
    target: HttpTarget, addresses: list[str], settings: Settings, tls_context: ssl.SSLContext | None
) -> Iterator[httpx.Response]:
    """GET ``target`` from the first of the checked ``addresses`` that accepts a connection."""
    headers = {"Host": target.host_header, "Accept-Encoding": "identity", "User-Agent": "hsx-dataset-fetch"}
    # The URL names the address, so nothing resolves the host again; SNI and certificate checks use the name.
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    last_error: Exception | None = None
    for address in addresses:
        # One client per hop: a pooled TLS connection must not carry a request for another host name.
        client = httpx.Client(
            trust_env=False,
            follow_redirects=False,
            timeout=httpx.Timeout(settings.http_timeout_seconds),
            verify=tls_context if tls_context is not None else True,
        )
        try:
            try:
                request = client.build_request(
                    "GET", target.pinned_url(address), headers=headers, extensions=extensions
                )
            except (httpx.InvalidURL, ValueError) as exc:
                raise InvalidUri(f"the URI is malformed: {exc}", error="invalid_uri") from exc
            try:
                response = client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last_error = exc
                continue
            except httpx.HTTPError as exc:
                raise InvalidUri(
                    f"fetching from {target.host} failed: {exc}", error="download_failed"
                ) from exc
            try:
                yield response
            finally:
                response.close()
            return
        finally:
            client.close()
    raise InvalidUri(f"could not connect to {target.host}: {last_error}", error="download_failed")


def _stage(
    response: httpx.Response, url: str, settings: Settings, deadline: float, into: Path | None
) -> tuple[Path, int, str]:
    """Stream the body into a staging file, then rename it to its sha256. Returns path, size, digest."""
    limit = settings.max_dataset_bytes
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise InvalidUri(
            f"the dataset is {declared} bytes, over the limit of {limit}", error="dataset_too_large"
        )
    downloads = (into or settings.data_dir / "downloads").resolve()
    downloads.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    size = 0
    fd, partial_name = tempfile.mkstemp(dir=downloads, prefix=".partial-")
    partial = Path(partial_name)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                for chunk in response.iter_bytes(_CHUNK_BYTES):
                    size += len(chunk)
                    # Counted after decoding, so a compressed body cannot expand past the limit.
                    if size > limit:
                        raise InvalidUri(
                            f"the dataset is over the limit of {limit} bytes", error="dataset_too_large"
                        )
                    if time.monotonic() > deadline:
                        raise InvalidUri("the download took too long", error="download_failed")
                    digest.update(chunk)
                    out.write(chunk)
            except httpx.HTTPError as exc:
                raise InvalidUri(f"the download broke off: {exc}", error="download_failed") from exc
            out.flush()
            os.fsync(out.fileno())
        final = downloads / f"{digest.hexdigest()}{_suffix_of(url)}"
        os.replace(partial, final)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return final, size, digest.hexdigest()


def _suffix_of(url: str) -> str:
    """The URL path's file suffixes (``.jsonl``, ``.json.gz``) when they are plain, for format detection."""
    suffixes = Path(unquote(urlsplit(url).path)).suffixes[-2:]
    return "".join(suffix for suffix in suffixes if _SAFE_SUFFIX.match(suffix))


# --- s3 ---------------------------------------------------------------------------------------------------


def fetch_s3(uri: str, downloads: Path, settings: Settings) -> Path:
    """The object (or the ``datasets`` folder stored under ``key/``) copied into ``downloads``."""
    from hsx.s3 import StorageError, s3_client, storage_error

    location = check_s3_uri(uri, settings)
    client = s3_client(settings.s3_endpoint)
    downloads.mkdir(parents=True, exist_ok=True)
    try:
        if not location.key.endswith("/"):
            try:
                head = client.head_object(Bucket=location.bucket, Key=location.key)
            except Exception as exc:  # noqa: BLE001 - mapped, and a missing object may be a folder prefix
                error = storage_error(exc, uri)
                if error.error != "not_found":
                    raise error from exc
            else:
                return _fetch_object(
                    client, location.bucket, location.key, int(head["ContentLength"]), downloads, settings
                )
        return _fetch_folder(client, location.bucket, location.key.rstrip("/") + "/", downloads, settings)
    except StorageError as exc:
        raise DatasetError(exc.error, exc.detail) from exc


def _fetch_object(client: Any, bucket: str, key: str, size: int, downloads: Path, settings: Settings) -> Path:
    from hsx.s3 import storage_error

    if size > settings.max_dataset_bytes:
        raise DatasetError(
            "too_large", f"s3://{bucket}/{key} is {size} bytes, the limit is {settings.max_dataset_bytes}"
        )
    partial = downloads / f".partial-{secrets.token_hex(6)}"
    digest = hashlib.sha256()
    received = 0
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        with open(partial, "wb") as out:
            for chunk in body.iter_chunks(_CHUNK_BYTES):
                received += len(chunk)
                if received > settings.max_dataset_bytes:
                    raise DatasetError("too_large", f"s3://{bucket}/{key} grew past the limit while read")
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if received != size:
            raise DatasetError("download_failed", f"s3://{bucket}/{key}: {received} of {size} bytes arrived")
        suffix = "".join(PurePosixPath(key).suffixes[-2:])
        final = downloads / f"{digest.hexdigest()}{suffix if suffix.replace('.', '').isalnum() else ''}"
        os.replace(partial, final)
    except DatasetError:
        partial.unlink(missing_ok=True)
        raise
    except Exception as exc:
        partial.unlink(missing_ok=True)
        raise storage_error(exc, f"s3://{bucket}/{key}") from exc
    return final


def _fetch_folder(client: Any, bucket: str, prefix: str, downloads: Path, settings: Settings) -> Path:
    from hsx.s3 import storage_error

    try:
        objects = [
            item
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for item in page.get("Contents", [])
        ]
    except Exception as exc:
        raise storage_error(exc, f"s3://{bucket}/{prefix}") from exc
    names = {item["Key"][len(prefix) :] for item in objects}
    if not objects:
        raise DatasetError("not_found", f"s3://{bucket}/{prefix.rstrip('/')}: no such object or folder")
    if not names & {"state.json", "dataset_dict.json"}:
        raise DatasetError(
            "unsupported_format", f"s3://{bucket}/{prefix} is a prefix but not a datasets folder"
        )
    total = sum(int(item["Size"]) for item in objects)
    if total > settings.max_dataset_bytes:
        raise DatasetError(
            "too_large", f"the folder is {total} bytes, the limit is {settings.max_dataset_bytes}"
        )
    staging = downloads / f".partial-{secrets.token_hex(6)}"
    final = downloads / hashlib.sha256(f"s3://{bucket}/{prefix}".encode()).hexdigest()
    try:
        for item in objects:
            relative = PurePosixPath(item["Key"][len(prefix) :])
            if not relative.parts or any(part in ("", ".", "..") for part in relative.parts):
                raise DatasetError("unsupported_format", f"object key {item['Key']!r} is not a plain path")
            target = staging.joinpath(*relative.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, item["Key"], str(target))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    except DatasetError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise storage_error(exc, f"s3://{bucket}/{prefix}") from exc
    return final
