"""The one way hsx talks to S3-compatible storage: a boto3 client for an endpoint, and error mapping.

The server builds the endpoint from its settings (:attr:`hsx.server.settings.Settings.s3_endpoint`); a
trainer that reads a published job's items, with no settings object, from the same ``HSX_S3_*`` variables
(:meth:`S3Endpoint.from_environment`). Credentials come from boto3's standard chain (environment, shared
config, instance role), so no secret is ever stored in hsx's settings or with a job. boto3 is in the
``interop`` extra and is imported on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hsx.errors import HsxError

DEFAULT_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class S3Endpoint:
    url: str = ""  # empty: AWS itself; set for MinIO, Ceph or a local test server
    region: str = ""
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS  # connect and per-read

    @classmethod
    def from_environment(cls) -> S3Endpoint:
        """The endpoint the server's settings would give on this host: ``HSX_S3_ENDPOINT_URL``,
        ``HSX_S3_REGION`` and ``HSX_HTTP_TIMEOUT_SECONDS``."""
        timeout = os.environ.get("HSX_HTTP_TIMEOUT_SECONDS")
        return cls(
            url=os.environ.get("HSX_S3_ENDPOINT_URL", ""),
            region=os.environ.get("HSX_S3_REGION", ""),
            timeout_seconds=float(timeout) if timeout else DEFAULT_TIMEOUT_SECONDS,
        )


class StorageError(HsxError):
    """An object store request failed; ``error`` says how (not_found, access_denied, unreachable, ...)."""

    status_code = 502
    error = "storage_error"


def s3_client(endpoint: S3Endpoint) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - the interop extra is part of every supported install
        raise StorageError(
            "boto3 is not installed (pip install 'hsx[interop]')", error="s3_not_installed"
        ) from exc
    config = Config(
        retries={"max_attempts": 5, "mode": "standard"},
        connect_timeout=endpoint.timeout_seconds,
        read_timeout=endpoint.timeout_seconds,
        # Plain SigV4 path-style requests work against AWS and every S3-compatible server alike.
        s3={"addressing_style": "path"} if endpoint.url else {},
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint.url or None,
        region_name=endpoint.region or None,
        config=config,
    )


def storage_error(exc: Exception, what: str) -> StorageError:
    """A boto/botocore exception as a :class:`StorageError` with a stable code."""
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("NoSuchKey", "NoSuchBucket", "NotFound", "404") or status == 404:
            return StorageError(f"{what}: not found ({code})", error="not_found")
        if code in ("AccessDenied", "403", "Forbidden") or status == 403:
            return StorageError(f"{what}: access denied", error="access_denied")
        return StorageError(f"{what}: {code or status}: {exc}", error="storage_request_failed")
    if isinstance(exc, NoCredentialsError):
        return StorageError(f"{what}: no S3 credentials are configured", error="no_credentials")
    if isinstance(exc, EndpointConnectionError):
        return StorageError(f"{what}: the object store is unreachable: {exc}", error="unreachable")
    if isinstance(exc, BotoCoreError):
        return StorageError(f"{what}: {exc}", error="storage_request_failed")
    return StorageError(f"{what}: {exc}", error="storage_request_failed")
