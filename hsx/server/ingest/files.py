"""A dataset file's layout and its lines, as every reader here sees them.

Sample numbering is the contract the job table relies on: sample ``i`` is the ``i``-th non-blank line of a
JSONL file (blank meaning only spaces, tabs and line breaks), or element ``i`` of a JSON array. A UTF-8
byte order mark at the very start is not part of the first line.

Standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, Literal

from hsx.server.ingest.errors import FILE_NOT_JSON_LINES, DatasetError

Layout = Literal["jsonl", "json_array"]

JSON_WHITESPACE = b" \t\r\n"
UTF8_BOM = b"\xef\xbb\xbf"
PARQUET_MAGIC = b"PAR1"  # the first bytes of a Parquet file


def is_blank(line: bytes) -> bool:
    return not line.strip(JSON_WHITESPACE)


def detect_layout(path: str | os.PathLike[str]) -> Layout:
    """``json_array`` when the first non-whitespace byte is ``[``, otherwise ``jsonl``."""
    with open(path, "rb") as fh:
        head = fh.read(len(UTF8_BOM))
        if head != UTF8_BOM:
            fh.seek(0)
        while chunk := fh.read(1 << 16):
            stripped = chunk.lstrip(JSON_WHITESPACE)
            if stripped:
                return "json_array" if stripped[:1] == b"[" else "jsonl"
    return "jsonl"


def load_array(path: str | os.PathLike[str]) -> list[Any]:
    """The records of a file holding one JSON array; :class:`DatasetError` when it is not one."""
    try:
        with open(path, "rb") as fh:
            records = json.loads(fh.read())
    except (ValueError, RecursionError) as exc:
        raise DatasetError(FILE_NOT_JSON_LINES, f"not a valid JSON array: {exc}") from exc
    if not isinstance(records, list):
        raise DatasetError(FILE_NOT_JSON_LINES, "the top-level JSON value is not an array")
    return records


def iter_nonblank_lines(path: str | os.PathLike[str], offset: int = 0) -> Iterator[tuple[int, bytes]]:
    """Yield ``(byte offset, line)`` for every non-blank line at or after ``offset``."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        position = offset
        first = offset == 0
        for line in fh:
            start = position
            position += len(line)
            if first:
                first = False
                if line.startswith(UTF8_BOM):
                    line = line[len(UTF8_BOM) :]
                    start += len(UTF8_BOM)
            if not is_blank(line):
                yield start, line
