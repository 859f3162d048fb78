"""Dataset ingestion: from the dataset URI of a job request to the records a unit reads.

The public API is what this package exports; its modules import one another's public names only.

==========================  =================================================================================
module                      what lives there
==========================  =================================================================================
:mod:`.policy`              the URI policy: schemes, dataset roots, buckets, public addresses (no transfer)
:mod:`.fetch`               guarded fetch of http(s) and s3 datasets into a local folder
:mod:`.convert`             conversion of any accepted dataset to the prepared JSONL (JSON array, Parquet,
                            ``datasets`` folders)
:mod:`.files`               a file's layout and its non-blank lines: the sample numbering
:mod:`.conversations`       chat records (``messages``, ``sharegpt``) normalized to :class:`ChatMessage` lists
:mod:`.records`             preparation (units planned by byte range) and record parsing with byte-range reads
:mod:`.inspection`          :func:`inspect_dataset`, what ``POST /jobs`` runs at submit time
:mod:`.errors`              :class:`DatasetError`, :class:`SampleError` and their reason codes
==========================  =================================================================================

No torch here: the API imports this package. pyarrow and boto3 are imported only when a Parquet file, a
``datasets`` folder or an s3 object is read.
"""

from __future__ import annotations

from hsx.server.ingest.conversations import ChatMessage, RawSample, RecordFormat, ToolCall, normalize_record
from hsx.server.ingest.convert import SOURCE_FILE, as_jsonl, materialize, without_nulls
from hsx.server.ingest.errors import DatasetError, SampleError
from hsx.server.ingest.fetch import download_dataset, fetch_s3, resolve_dataset_uri
from hsx.server.ingest.files import detect_layout, iter_nonblank_lines, load_array
from hsx.server.ingest.inspection import DatasetInspection, inspect_dataset, inspect_head
from hsx.server.ingest.policy import (
    ForbiddenUri,
    InvalidUri,
    ResolvedDataset,
    UriRefused,
    check_dataset_uri,
    ensure_public_host,
    is_public_address,
)
from hsx.server.ingest.records import (
    PreparedRecords,
    Pretokenized,
    Record,
    UnitRange,
    parse_record,
    parse_record_with_id,
    plan_units,
    prepare,
    read_unit,
    read_unit_records,
)

__all__ = [
    "SOURCE_FILE",
    "ChatMessage",
    "DatasetError",
    "DatasetInspection",
    "ForbiddenUri",
    "InvalidUri",
    "PreparedRecords",
    "Pretokenized",
    "RawSample",
    "Record",
    "RecordFormat",
    "ResolvedDataset",
    "SampleError",
    "ToolCall",
    "UnitRange",
    "UriRefused",
    "as_jsonl",
    "check_dataset_uri",
    "detect_layout",
    "download_dataset",
    "ensure_public_host",
    "fetch_s3",
    "inspect_dataset",
    "inspect_head",
    "is_public_address",
    "iter_nonblank_lines",
    "load_array",
    "materialize",
    "normalize_record",
    "parse_record",
    "parse_record_with_id",
    "plan_units",
    "prepare",
    "read_unit",
    "read_unit_records",
    "resolve_dataset_uri",
    "without_nulls",
]
