"""A job's records: prepared once per job, then read one unit at a time by byte range.

Preparing (the first step of a job, done by one worker under a lease, never inside the API request):
the dataset becomes a local JSONL file (a local JSONL dataset is used in place; a JSON array, Parquet, a
``datasets`` folder or a remote dataset is converted or fetched once into ``<output_dir>/.prepared/`` by
:mod:`hsx.server.ingest.convert`), which is scanned once to find where every unit's records begin and end. A
unit then reads exactly its own bytes: the cost of a unit does not grow with the dataset, and no index is
loaded per unit.

Sample numbering is that of :mod:`hsx.server.ingest.files`: sample ``i`` is the ``i``-th non-blank line. A
record may also be pre-tokenized (``{"input_ids": [...], "loss_mask": [...]}``): it skips the chat template. A
record's own ``id`` (or ``conversation_id``) is read with it, so a rejection can name it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.server.ingest.conversations import RawSample, RecordFormat, normalize_record
from hsx.server.ingest.convert import as_jsonl, materialize
from hsx.server.ingest.errors import (
    DATASET_CHANGED,
    EMPTY_CONVERSATION,
    FILE_NOT_FOUND,
    MALFORMED_JSON,
    WRONG_SHAPE,
    DatasetError,
    SampleError,
)
from hsx.server.ingest.files import JSON_WHITESPACE, UTF8_BOM, iter_nonblank_lines
from hsx.server.settings import Settings, get_settings

PREPARED_DIR = ".prepared"


@dataclass(frozen=True)
class Pretokenized:
    """A record that brings its own tokens and loss mask."""

    input_ids: list[int]
    loss_mask: list[int]


Record = RawSample | Pretokenized


@dataclass(frozen=True)
class UnitRange:
    sample_start: int
    sample_end: int
    byte_start: int
    byte_end: int


@dataclass(frozen=True)
class PreparedRecords:
    path: str
    bytes: int
    samples: int
    units: list[UnitRange]


def prepared_dir(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / PREPARED_DIR


def local_records(dataset: str, work_dir: Path, settings: Settings | None = None) -> str:
    """A local JSONL file holding the dataset's records, one per line: a local JSONL file as it is;
    anything else (a JSON array, Parquet, a ``datasets`` folder, an http(s) or s3:// URI) converted or
    fetched once into ``work_dir`` by :mod:`hsx.server.ingest.convert`."""
    if os.path.exists(dataset):
        return str(as_jsonl(Path(dataset), work_dir))
    return str(materialize(dataset, work_dir, settings or get_settings()))


# Called with every record's line during the planning pass (the output's size is projected from them).
LineObserver = Callable[[bytes], None]


def plan_units(
    records_path: str, samples_per_shard: int, observe: LineObserver | None = None
) -> PreparedRecords:
    """One pass over the file: sample count and each unit's byte range."""
    if samples_per_shard < 1:
        raise ValueError("samples_per_shard must be positive")
    size = os.stat(records_path).st_size
    starts: list[int] = []
    samples = 0
    for offset, line in iter_nonblank_lines(records_path):
        if samples % samples_per_shard == 0:
            starts.append(offset)
        if observe is not None:
            observe(line)
        samples += 1
    units = [
        UnitRange(
            sample_start=i * samples_per_shard,
            sample_end=min((i + 1) * samples_per_shard, samples),
            byte_start=start,
            byte_end=starts[i + 1] if i + 1 < len(starts) else size,
        )
        for i, start in enumerate(starts)
    ]
    return PreparedRecords(path=records_path, bytes=size, samples=samples, units=units)


def prepare(
    dataset: str,
    output_dir: str,
    samples_per_shard: int,
    settings: Settings | None = None,
    observe: LineObserver | None = None,
) -> PreparedRecords:
    """``dataset``: the local path the API resolved, or the URI of a remote dataset. ``observe`` sees every
    record's line during the planning pass."""
    return plan_units(local_records(dataset, prepared_dir(output_dir), settings), samples_per_shard, observe)


def parse_record(line: bytes, record_format: RecordFormat = "auto") -> Record:
    return parse_record_with_id(line, record_format)[0]


RECORD_ID_KEYS = ("id", "conversation_id")
RECORD_ID_MAX_CHARS = 200
# A record that is not valid JSON may still show its id near the start; read it as a hint.
_ID_IN_TEXT = re.compile(rb'"(?:id|conversation_id)"\s*:\s*(?:"([^"\\]{1,200})"|(-?\d{1,30})\b)')


def parse_record_with_id(
    line: bytes, record_format: RecordFormat = "auto", answered: bool = True
) -> tuple[Record, str | None]:
    """The record and its own ``id`` (or ``conversation_id``), when it has a string or integer one.
    ``answered``: see :func:`normalize_record`."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:
        return SampleError(MALFORMED_JSON, str(exc)[:200]), _id_from_text(line)
    record_id = record_id_of(record)
    if isinstance(record, dict) and "input_ids" in record and record_format == "auto":
        return pretokenized(record), record_id
    return normalize_record(record, record_format, answered), record_id


def record_id_of(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    for key in RECORD_ID_KEYS:
        value = record.get(key)
        if isinstance(value, str) and value:
            return value[:RECORD_ID_MAX_CHARS]
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    return None


def _id_from_text(line: bytes) -> str | None:
    match = _ID_IN_TEXT.search(line[:4096])
    if match is None:
        return None
    return (match.group(1) or match.group(2)).decode("utf-8", "replace")


def pretokenized(record: dict[str, Any]) -> Pretokenized | SampleError:
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return SampleError(WRONG_SHAPE, "input_ids must be a list of integers")
    if not ids:
        return SampleError(EMPTY_CONVERSATION, "input_ids is empty")
    if min(ids) < 0:
        return SampleError(WRONG_SHAPE, "input_ids holds a negative id")
    if mask is None:
        mask = [1] * len(ids)
    if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
        return SampleError(WRONG_SHAPE, "loss_mask must be a list of 0 and 1 as long as input_ids")
    return Pretokenized(input_ids=list(ids), loss_mask=[int(m) for m in mask])


def read_unit(
    records_path: str,
    expected_bytes: int | None,
    unit: UnitRange,
    record_format: RecordFormat = "auto",
) -> Iterator[tuple[int, Record]]:
    """Yield ``(index, record)`` for every sample of the unit, reading only the unit's bytes."""
    for index, record, _record_id in read_unit_records(records_path, expected_bytes, unit, record_format):
        yield index, record


def read_unit_records(
    records_path: str,
    expected_bytes: int | None,
    unit: UnitRange,
    record_format: RecordFormat = "auto",
    answered: bool = True,
) -> Iterator[tuple[int, Record, str | None]]:
    """Yield ``(index, record, record_id)`` for every sample of the unit, reading only the unit's bytes
    (``answered``: see :func:`normalize_record`)."""
    try:
        with open(records_path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if expected_bytes is not None and size != expected_bytes:
                raise DatasetError(
                    DATASET_CHANGED,
                    f"{records_path} has {size} bytes, {expected_bytes} when the job was prepared",
                )
            fh.seek(unit.byte_start)
            blob = fh.read(unit.byte_end - unit.byte_start)
    except FileNotFoundError as exc:
        raise DatasetError(FILE_NOT_FOUND, f"{records_path} is gone since the job was prepared") from exc
    if unit.byte_start == 0 and blob.startswith(UTF8_BOM):
        blob = blob[len(UTF8_BOM) :]
    index = unit.sample_start
    for line in blob.split(b"\n"):  # the same line breaks as hsx.server.ingest.files counts
        if not line.strip(JSON_WHITESPACE):
            continue
        if index >= unit.sample_end:
            raise DatasetError(
                DATASET_CHANGED, f"unit bytes hold more than {unit.sample_end - unit.sample_start} records"
            )
        yield (index, *parse_record_with_id(line, record_format, answered))
        index += 1
    if index != unit.sample_end:
        raise DatasetError(
            DATASET_CHANGED,
            f"unit holds {index - unit.sample_start} records, expected {unit.sample_end - unit.sample_start}",
        )
