"""The reference reading of sample numbering, for tests only: scan a dataset from its first byte and number
its samples, with none of the byte-range planning that jobs use (hsx.server.ingest.records), so the two can be
compared. Sample ``i`` is the ``i``-th non-blank line of a JSONL file (blank: only spaces, tabs and line
breaks; a UTF-8 byte order mark at the very start is no part of the first line), or element ``i`` of a JSON
array.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from hsx.server.ingest import RawSample, RecordFormat, detect_layout, load_array, normalize_record
from hsx.server.ingest.errors import MALFORMED_JSON, SampleError

_BOM = b"\xef\xbb\xbf"


def _nonblank_lines(path: str | os.PathLike[str]) -> list[bytes]:
    with open(path, "rb") as fh:
        data = fh.read()
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    pieces = data.split(b"\n")
    # Each line keeps its line break, as reading a file line by line gives it.
    lines = [piece + b"\n" for piece in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
    return [line for line in lines if line.strip(b" \t\r\n")]


def parse_line(line: bytes, record_format: RecordFormat = "auto") -> RawSample:
    """One JSONL line as a chat sample (no pre-tokenized records: those are hsx.server.ingest.records'
    own)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:
        return SampleError(MALFORMED_JSON, str(exc)[:200])
    return normalize_record(record, record_format)


def count_samples(path: str | os.PathLike[str]) -> int:
    """Non-blank lines of a JSONL file, or the length of a JSON array."""
    if detect_layout(path) == "json_array":
        return len(load_array(path))
    return len(_nonblank_lines(path))


def iter_samples(
    path: str | os.PathLike[str], start: int, end: int, *, record_format: RecordFormat = "auto"
) -> Iterator[tuple[int, RawSample]]:
    """Yield ``(index, sample)`` for ``start <= index < end`` (``end`` clipped to the dataset's size)."""
    if start < 0 or end < start:
        raise ValueError(f"bad sample range [{start}, {end})")
    if detect_layout(path) == "json_array":
        records = load_array(path)
        for index in range(start, min(end, len(records))):
            yield index, normalize_record(records[index], record_format)
        return
    for index, line in enumerate(_nonblank_lines(path)):
        if index >= end:
            break
        if index >= start:
            yield index, parse_line(line, record_format)
