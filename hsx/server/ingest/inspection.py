"""The submit-time inspection of a dataset: what ``POST /jobs`` checks before it records a job.

Bounded work only, whatever the dataset's size: downloading, converting, counting and indexing are the job's
first step, done by a worker (:mod:`hsx.server.ingest.records`). A local dataset is vetted by the URI policy
and its head read; a remote one is checked by the policy without any transfer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from hsx.errors import BadRequest
from hsx.server.ingest.errors import (
    FILE_EMPTY,
    FILE_NOT_FOUND,
    FILE_NOT_JSON_LINES,
    FILE_TOO_LARGE,
    FILE_UNRECOGNIZED_FORMAT,
    DatasetError,
)
from hsx.server.ingest.files import PARQUET_MAGIC, detect_layout, iter_nonblank_lines, load_array
from hsx.server.ingest.policy import check_dataset_uri, resolve_local_dataset, uri_scheme
from hsx.server.settings import Settings

# A JSON array this small is parsed at submit, so a wrong file is refused at once; larger ones by the worker.
SMALL_ARRAY_BYTES = 16 << 20


@dataclass(frozen=True)
class DatasetInspection:
    dataset_path: str  # what the job stores: a local dataset's real path, or a remote dataset's URI
    record_kind: str  # messages, sharegpt, pretokenized, mixed; deferred when only the worker can tell


def inspect_dataset(uri: str, settings: Settings) -> DatasetInspection:
    """Vet a job's dataset URI at submit time. Raises a :class:`~hsx.server.ingest.policy.UriRefused` for a
    URI the policy refuses, and a :class:`~hsx.errors.BadRequest` (``dataset_<reason>``) for a local file
    whose head is unusable."""
    if uri_scheme(uri, settings) != "file":
        check_dataset_uri(uri, settings)
        return DatasetInspection(dataset_path=uri, record_kind="deferred")
    path = str(resolve_local_dataset(uri, settings).path)
    try:
        kind = inspect_head(path, settings.max_dataset_bytes)
    except DatasetError as exc:
        raise BadRequest(exc.detail, error=f"dataset_{exc.reason}") from exc
    return DatasetInspection(dataset_path=path, record_kind=kind)


def inspect_head(path: str, max_bytes: int, head_records: int = 8) -> str:
    """The submit-time check, bounded in cost whatever the file's size: the size limit, and that the first
    records are JSON objects of a known kind. Returns the format guess; raises :class:`DatasetError`."""
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise DatasetError(FILE_NOT_FOUND, f"cannot read {path}: {exc.strerror}") from exc
    if size > max_bytes:
        raise DatasetError(FILE_TOO_LARGE, f"{size} bytes, the limit is {max_bytes}")
    if os.path.isdir(path):
        return "deferred"  # a datasets folder: read by the worker that prepares the job
    with open(path, "rb") as fh:
        if fh.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC:
            return "deferred"  # Parquet, likewise
    head: list[Any] = []
    if detect_layout(path) == "json_array":
        if size > SMALL_ARRAY_BYTES:
            return "deferred"  # parsed once by the worker that prepares the job
        head = load_array(path)[:head_records]
    else:
        for _, line in iter_nonblank_lines(path):
            try:
                head.append(json.loads(line))
            except (ValueError, RecursionError):
                head.append(None)
            if len(head) >= head_records:
                break
    if not head:
        raise DatasetError(FILE_EMPTY, "the file holds no records")
    if not any(isinstance(record, dict) for record in head):
        raise DatasetError(FILE_NOT_JSON_LINES, f"none of the first {len(head)} records is a JSON object")
    kinds = {kind for kind in map(record_kind, head) if kind is not None}
    if not kinds:
        raise DatasetError(
            FILE_UNRECOGNIZED_FORMAT,
            "records have neither 'messages', 'conversations' (sharegpt) nor 'input_ids' (pre-tokenized)",
        )
    return kinds.pop() if len(kinds) == 1 else "mixed"


def record_kind(record: Any) -> str | None:
    if isinstance(record, dict):
        if "messages" in record:
            return "messages"
        if "conversations" in record:
            return "sharegpt"
        if "input_ids" in record:
            return "pretokenized"
    return None
