"""Object storage: publishing a finished output to ``s3://bucket/prefix`` (upload) and the S3 client (s3)."""

from hsx.storage.s3 import StorageError, s3_client
from hsx.storage.upload import (
    OutputBucketNotAllowed,
    OutputUriRefused,
    UploadEvent,
    UploadReport,
    parse_output_uri,
    upload_output,
)

__all__ = [
    "OutputBucketNotAllowed",
    "OutputUriRefused",
    "StorageError",
    "UploadEvent",
    "UploadReport",
    "parse_output_uri",
    "s3_client",
    "upload_output",
]
