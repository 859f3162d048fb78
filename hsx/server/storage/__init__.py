"""Object storage: publishing a finished output to ``s3://bucket/prefix`` (upload, publish); the S3 client
itself is the SDK's (:mod:`hsx.s3`)."""

from hsx.server.storage.upload import (
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
    "UploadEvent",
    "UploadReport",
    "parse_output_uri",
    "upload_output",
]
