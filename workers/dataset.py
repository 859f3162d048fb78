"""Chat datasets: JSONL (one record per line) or a single JSON array, in ``messages`` or ``sharegpt`` form.

Sample numbering is the contract the job table relies on: sample ``i`` is the ``i``-th non-blank line of a
JSONL file (blank meaning only spaces, tabs and line breaks), or element ``i`` of a JSON array. A record
that cannot be used becomes a :class:`SampleError` at its own index; it never stops the unit and is never
skipped, so every index a unit owns is accounted for.

Seeking: :func:`iter_samples` without an index scans raw lines up to ``start`` (it splits bytes, it never
parses JSON before ``start``). Callers that visit many units of one big file build the byte-offset index
once with :func:`build_line_index` (or :func:`cached_line_index`, which keeps it next to a cache key in a
compact little-endian ``uint64`` file) and pass it in, which turns the seek into one ``file.seek``.
A JSON array has no line structure: it is parsed whole each time it is read.

Standard library only.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

RecordFormat = Literal["auto", "messages", "sharegpt"]
Layout = Literal["jsonl", "json_array"]

# Per-sample rejection reasons; stable strings, stored with each rejected sample.
MALFORMED_JSON = "malformed_json"
WRONG_SHAPE = "wrong_shape"
UNKNOWN_FORMAT = "unknown_format"
UNKNOWN_ROLE = "unknown_role"
NON_STRING_CONTENT = "non_string_content"
EMPTY_CONVERSATION = "empty_conversation"
NO_ASSISTANT_TURN = "no_assistant_turn"

# File-level reasons raised by DatasetError.
FILE_NOT_FOUND = "not_found"
FILE_EMPTY = "empty_file"
FILE_TOO_LARGE = "too_large"
FILE_NOT_JSON_LINES = "not_json_lines"
FILE_UNRECOGNIZED_FORMAT = "unrecognized_format"
FILE_NOT_INDEXABLE = "not_indexable"

# What validation reads to guess the format; enough to catch a wrong file without reading a large one.
VALIDATION_RECORDS = 8

_JSON_WHITESPACE = b" \t\r\n"
_UTF8_BOM = b"\xef\xbb\xbf"
_MESSAGES_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
# ShareGPT exports disagree on role names; the human/gpt spelling is the original, user/assistant is common.
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
_INDEX_MAGIC = b"HSXLIDX1"


class ChatMessage(TypedDict):
    role: str
    content: str


@dataclass(frozen=True)
class SampleError:
    """Why one sample cannot be used: a stable ``reason`` code and a human-readable ``detail``."""

    reason: str
    detail: str


RawSample = list[ChatMessage] | SampleError


class DatasetError(Exception):
    """The file as a whole is unusable (raised at submit time, or when an index cannot be built)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class DatasetSummary:
    samples: int
    bytes: int
    format_guess: str  # "messages", "sharegpt" or "mixed"
    layout: Layout = "jsonl"


# --- layout and line scanning --------------------------------------------------------------------------


def _is_blank(line: bytes) -> bool:
    return not line.strip(_JSON_WHITESPACE)


def detect_layout(path: str | os.PathLike[str]) -> Layout:
    """``json_array`` when the first non-whitespace byte is ``[``, otherwise ``jsonl``."""
    with open(path, "rb") as fh:
        head = fh.read(len(_UTF8_BOM))
        if head != _UTF8_BOM:
            fh.seek(0)
        while chunk := fh.read(1 << 16):
            stripped = chunk.lstrip(_JSON_WHITESPACE)
            if stripped:
                return "json_array" if stripped[:1] == b"[" else "jsonl"
    return "jsonl"


def _load_array(path: str | os.PathLike[str]) -> list[Any]:
    try:
        with open(path, "rb") as fh:
            records = json.loads(fh.read())
    except (ValueError, RecursionError) as exc:
        raise DatasetError(FILE_NOT_JSON_LINES, f"not a valid JSON array: {exc}") from exc
    if not isinstance(records, list):
        raise DatasetError(FILE_NOT_JSON_LINES, "the top-level JSON value is not an array")
    return records


def _iter_nonblank_lines(path: str | os.PathLike[str], offset: int = 0) -> Iterator[tuple[int, bytes]]:
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
                if line.startswith(_UTF8_BOM):
                    line = line[len(_UTF8_BOM) :]
                    start += len(_UTF8_BOM)
            if not _is_blank(line):
                yield start, line


def count_samples(path: str | os.PathLike[str]) -> int:
    """Non-blank lines of a JSONL file, or the length of a JSON array."""
    if detect_layout(path) == "json_array":
        return len(_load_array(path))
    return sum(1 for _ in _iter_nonblank_lines(path))


# --- line-offset index ---------------------------------------------------------------------------------


def build_line_index(path: str | os.PathLike[str]) -> list[int]:
    """Byte offset of every sample's line in a JSONL file (entry ``i`` is where sample ``i`` starts)."""
    if detect_layout(path) == "json_array":
        raise DatasetError(FILE_NOT_INDEXABLE, "a JSON array file has no line index; read it without one")
    return [offset for offset, _ in _iter_nonblank_lines(path)]


def _index_key(path: Path) -> bytes:
    # The index is valid for this exact file version: path, size and modification time.
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).digest()


def save_line_index(index: Sequence[int], index_path: Path, dataset_path: Path) -> None:
    """Store ``index`` as magic + key + little-endian uint64 offsets, written through a rename."""
    offsets = array.array("Q", index)
    if sys.byteorder != "little":
        offsets.byteswap()
    tmp = index_path.with_name(index_path.name + f".{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(_INDEX_MAGIC)
        fh.write(_index_key(dataset_path))
        fh.write(offsets.tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, index_path)


def load_line_index(index_path: Path, dataset_path: Path) -> list[int] | None:
    """The stored index, or None when it is missing, corrupt, or was built for another file version."""
    try:
        blob = index_path.read_bytes()
        key = _index_key(dataset_path)
    except OSError:
        return None
    header = len(_INDEX_MAGIC) + len(key)
    if blob[: len(_INDEX_MAGIC)] != _INDEX_MAGIC or blob[len(_INDEX_MAGIC) : header] != key:
        return None
    if (len(blob) - header) % 8:
        return None
    offsets = array.array("Q")
    offsets.frombytes(blob[header:])
    if sys.byteorder != "little":
        offsets.byteswap()
    return offsets.tolist()


def cached_line_index(dataset_path: Path, cache_dir: Path) -> list[int] | None:
    """Load or build-and-store the line index of a JSONL file; None for a JSON array (nothing to index)."""
    if detect_layout(dataset_path) == "json_array":
        return None
    name = hashlib.sha256(str(dataset_path.resolve()).encode()).hexdigest()[:32] + ".lidx"
    index_path = cache_dir / name
    index = load_line_index(index_path, dataset_path)
    if index is None:
        index = build_line_index(dataset_path)
        cache_dir.mkdir(parents=True, exist_ok=True)
        save_line_index(index, index_path, dataset_path)
    return index


# --- record normalization ------------------------------------------------------------------------------


def _normalize_turns(
    turns: Any, role_key: str, content_key: str, roles: dict[str, str], label: str
) -> list[ChatMessage] | SampleError:
    if not isinstance(turns, list):
        return SampleError(WRONG_SHAPE, f"'{label}' is {type(turns).__name__}, expected a list")
    if not turns:
        return SampleError(EMPTY_CONVERSATION, f"'{label}' is empty")
    messages: list[ChatMessage] = []
    for position, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return SampleError(WRONG_SHAPE, f"turn {position} is {type(turn).__name__}, expected an object")
        raw_role = turn.get(role_key)
        if not isinstance(raw_role, str) or raw_role not in roles:
            return SampleError(UNKNOWN_ROLE, f"turn {position} has {role_key}={raw_role!r}")
        content = turn.get(content_key)
        if not isinstance(content, str):
            return SampleError(
                NON_STRING_CONTENT, f"turn {position} {content_key} is {type(content).__name__}, expected str"
            )
        messages.append(ChatMessage(role=roles[raw_role], content=content))
    if not any(message["role"] == "assistant" for message in messages):
        return SampleError(NO_ASSISTANT_TURN, "the conversation has no assistant turn")
    return messages


def normalize_record(record: Any, record_format: RecordFormat = "auto") -> RawSample:
    """A parsed JSON record as a list of ``{"role", "content"}`` messages, or why it cannot be one."""
    if not isinstance(record, dict):
        return SampleError(WRONG_SHAPE, f"record is {type(record).__name__}, expected an object")
    use_messages = record_format == "messages" or (record_format == "auto" and "messages" in record)
    use_sharegpt = record_format == "sharegpt" or (record_format == "auto" and "conversations" in record)
    if use_messages:
        return _normalize_turns(record.get("messages"), "role", "content", _MESSAGES_ROLES, "messages")
    if use_sharegpt:
        return _normalize_turns(
            record.get("conversations"), "from", "value", _SHAREGPT_ROLES, "conversations"
        )
    keys = ", ".join(sorted(str(key) for key in record)[:8])
    return SampleError(UNKNOWN_FORMAT, f"no 'messages' or 'conversations' key (keys: {keys})")


def parse_line(line: bytes, record_format: RecordFormat = "auto") -> RawSample:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and UnicodeDecodeError; deep nesting raises RecursionError.
        return SampleError(MALFORMED_JSON, str(exc)[:200])
    return normalize_record(record, record_format)


def record_format_of(record: Any) -> str | None:
    if isinstance(record, dict):
        if "messages" in record:
            return "messages"
        if "conversations" in record:
            return "sharegpt"
    return None


# --- reading -------------------------------------------------------------------------------------------


def iter_samples(
    path: str | os.PathLike[str],
    start: int,
    end: int,
    *,
    record_format: RecordFormat = "auto",
    line_index: Sequence[int] | None = None,
) -> Iterator[tuple[int, RawSample]]:
    """Yield ``(index, sample)`` for ``start <= index < end`` (``end`` clipped to the dataset's size).

    ``line_index`` (from :func:`build_line_index` for this exact file) makes the seek O(1).
    """
    if start < 0 or end < start:
        raise ValueError(f"bad sample range [{start}, {end})")
    if detect_layout(path) == "json_array":
        records = _load_array(path)
        for index in range(start, min(end, len(records))):
            yield index, normalize_record(records[index], record_format)
        return
    if line_index is not None:
        if start >= len(line_index):
            return
        lines = _iter_nonblank_lines(path, line_index[start])
        index = start
    else:
        lines = _iter_nonblank_lines(path)
        index = 0
    for _, line in lines:
        if index >= end:
            break
        if index >= start:
            yield index, parse_line(line, record_format)
        index += 1


def validate_dataset_file(path: str | os.PathLike[str], max_bytes: int) -> DatasetSummary:
    """The submit-time check: size, that records are JSON objects of a known format, and the count."""
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise DatasetError(FILE_NOT_FOUND, f"cannot read {os.fspath(path)}: {exc.strerror}") from exc
    if size > max_bytes:
        raise DatasetError(FILE_TOO_LARGE, f"{size} bytes, the limit is {max_bytes}")
    layout = detect_layout(path)
    if layout == "json_array":
        records = _load_array(path)
        head: list[Any] = records[:VALIDATION_RECORDS]
        samples = len(records)
    else:
        head = []
        for _, line in _iter_nonblank_lines(path):
            try:
                head.append(json.loads(line))
            except (ValueError, RecursionError):
                head.append(None)
            if len(head) >= VALIDATION_RECORDS:
                break
        samples = count_samples(path) if head else 0
    if not head:
        raise DatasetError(FILE_EMPTY, "the file holds no records")
    if not any(isinstance(record, dict) for record in head):
        raise DatasetError(FILE_NOT_JSON_LINES, f"none of the first {len(head)} records is a JSON object")
    formats = {fmt for fmt in (record_format_of(record) for record in head) if fmt is not None}
    if not formats:
        raise DatasetError(
            FILE_UNRECOGNIZED_FORMAT, "records have neither 'messages' nor 'conversations' (sharegpt)"
        )
    format_guess = formats.pop() if len(formats) == 1 else "mixed"
    return DatasetSummary(samples=samples, bytes=size, format_guess=format_guess, layout=layout)
