"""A job's records: units planned once by byte range, read back exactly as the reference reading
(tests/reference_samples.py) numbers them; pre-tokenized records; the bounded submit-time check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hsx.server.ingest import (
    DatasetError,
    Pretokenized,
    SampleError,
    UnitRange,
    inspect_head,
    parse_record,
    plan_units,
    prepare,
    read_unit,
)
from hsx.server.ingest import errors as codes
from hsx.server.ingest.errors import DATASET_CHANGED
from hsx.server.ingest.inspection import SMALL_ARRAY_BYTES
from hsx.server.ingest.records import local_records
from tests.reference_samples import count_samples, iter_samples, parse_line

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
SHAREGPT = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
PRETOKENIZED = {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}


def _chat(k: int) -> Any:
    """Varied records: both chat forms, non-ASCII and escaped newlines, and ones that must be rejected."""
    kinds: list[Any] = [
        {"messages": [{"role": "user", "content": f"q{k} é ☃"}, {"role": "assistant", "content": f"a\n{k}"}]},
        {"conversations": [{"from": "human", "value": f"q{k}"}, {"from": "gpt", "value": f"a{k}"}]},
        {"messages": [{"role": "user", "content": f"only a question {k}"}]},  # no assistant turn
        {"messages": [{"role": "robot", "content": "x"}]},
        {"text": f"plain {k}"},
    ]
    return kinds[k % len(kinds)]


def _line(record: Any) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode()


def _tricky_jsonl(path: Path) -> tuple[list[int], list[bytes]]:
    """A BOM, CRLF, blank and whitespace-only lines, a malformed line and no final newline. Returns where
    each record's line starts and the records' lines."""
    pieces: list[tuple[bytes, bool]] = [
        (b"\xef\xbb\xbf", False),
        (_line(CHAT), True),
        (b"\r\n\n  \t \r\n", False),
        (_line(SHAREGPT), True),
        (b"\n", False),
        (b"{not json", True),
        (b"\n", False),
        (_line(_chat(2)), True),
        (b"\r\n\n\n", False),
        (_line(_chat(0)), True),  # the last line has no newline
    ]
    blob, starts, lines = b"", [], []
    for piece, is_record in pieces:
        if is_record:
            starts.append(len(blob))
            lines.append(piece)
        blob += piece
    path.write_bytes(blob)
    return starts, lines


def _nonblank(blob: bytes) -> list[bytes]:
    return [line.strip(b" \t\r\n") for line in blob.split(b"\n") if line.strip(b" \t\r\n")]


@pytest.mark.parametrize("per_unit", [1, 2, 3, 5, 100])
def test_plan_units_byte_ranges(tmp_path: Path, per_unit: int) -> None:
    path = tmp_path / "data.jsonl"
    starts, lines = _tricky_jsonl(path)
    raw = path.read_bytes()
    prepared = plan_units(str(path), per_unit)
    assert (prepared.path, prepared.bytes, prepared.samples) == (str(path), len(raw), 5)
    assert prepared.samples == count_samples(path)
    expected_units = [(s, min(s + per_unit, 5)) for s in range(0, 5, per_unit)]
    assert [(u.sample_start, u.sample_end) for u in prepared.units] == expected_units
    assert prepared.units[0].byte_start == 3  # after the BOM
    for unit, next_unit in zip(prepared.units, [*prepared.units[1:], None], strict=True):
        assert unit.byte_start == starts[unit.sample_start]
        assert unit.byte_end == (next_unit.byte_start if next_unit else len(raw))
        # The unit's bytes hold exactly its own records.
        assert _nonblank(raw[unit.byte_start : unit.byte_end]) == lines[unit.sample_start : unit.sample_end]


def test_plan_units_of_empty_files_and_bad_sizes(tmp_path: Path) -> None:
    for name, content in (
        ("empty.jsonl", b""),
        ("blank.jsonl", b"\n \r\n\t\n"),
        ("bom.jsonl", b"\xef\xbb\xbf\n"),
    ):
        (tmp_path / name).write_bytes(content)
        prepared = plan_units(str(tmp_path / name), 4)
        assert (prepared.samples, prepared.units) == (0, [])
    with pytest.raises(ValueError):
        plan_units(str(tmp_path / "empty.jsonl"), 0)


def _read_all(path: str, per_unit: int) -> list[tuple[int, Any]]:
    prepared = plan_units(path, per_unit)
    got: list[tuple[int, Any]] = []
    for unit in prepared.units:
        got.extend(read_unit(prepared.path, prepared.bytes, unit))
    return got


@pytest.mark.parametrize("per_unit", [1, 2, 3, 7, 1000])
def test_read_unit_matches_dataset_iter_samples_on_jsonl(tmp_path: Path, per_unit: int) -> None:
    tricky = tmp_path / "tricky.jsonl"
    _tricky_jsonl(tricky)
    larger = tmp_path / "larger.jsonl"
    larger.write_bytes(b"\n".join(_line(_chat(k)) for k in range(37)) + b"\n\n")
    for path in (tricky, larger):
        prepared = plan_units(str(path), per_unit)
        for unit in prepared.units:
            got = list(read_unit(str(path), prepared.bytes, unit))
            want = list(iter_samples(path, unit.sample_start, unit.sample_end))
            assert got == want
            assert [i for i, _ in got] == list(range(unit.sample_start, unit.sample_end))
        assert len(_read_all(str(path), per_unit)) == count_samples(path)
    reasons = [r.reason for _, r in _read_all(str(tricky), per_unit) if isinstance(r, SampleError)]
    assert reasons == [codes.MALFORMED_JSON, codes.NO_ASSISTANT_TURN]


@pytest.mark.parametrize("per_unit", [1, 4, 1000])
def test_json_array_is_converted_once_and_read_like_the_array(tmp_path: Path, per_unit: int) -> None:
    records: list[Any] = [_chat(k) for k in range(23)] + [5, None, "text", [], {"input_ids": [1, 2]}]
    array = tmp_path / "data.json"
    array.write_bytes(b"\xef\xbb\xbf\n  " + json.dumps(records, indent=2, ensure_ascii=False).encode())
    work = tmp_path / "out" / ".prepared"
    converted = local_records(str(array), work)
    assert converted == str(work / "source.jsonl")
    assert sorted(p.name for p in work.iterdir()) == ["source.jsonl"]  # no temp file left
    prepared = plan_units(converted, per_unit)
    assert prepared.samples == len(records)
    last = len(records) - 1  # pre-tokenized: the reference reading does not know that kind of record
    for unit in prepared.units:
        got = list(read_unit(converted, prepared.bytes, unit))
        want = list(iter_samples(array, unit.sample_start, unit.sample_end))
        assert [i for i, _ in got] == [i for i, _ in want] == list(range(unit.sample_start, unit.sample_end))
        assert [r for i, r in got if i != last] == [r for i, r in want if i != last]
    assert _read_all(converted, per_unit)[-1] == (last, Pretokenized([1, 2], [1, 1]))

    again = prepare(str(array), str(tmp_path / "out"), per_unit)
    assert again == prepared


def test_jsonl_is_used_in_place(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(_line(CHAT) + b"\n" + _line(SHAREGPT) + b"\n")
    prepared = prepare(str(path), str(tmp_path / "out"), 1)
    assert prepared.path == str(path) and prepared.samples == 2
    assert not (tmp_path / "out").exists()


def test_json_array_with_an_escaped_lone_surrogate_converts(tmp_path: Path) -> None:
    array = tmp_path / "data.json"
    array.write_text(
        '[{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "a"}]}]'
    )
    converted = local_records(str(array), tmp_path / "work")
    prepared = plan_units(converted, 1)
    assert list(read_unit(converted, prepared.bytes, prepared.units[0])) == list(iter_samples(array, 0, 1))


def test_a_changed_dataset_is_noticed(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    original = b"".join(_line(CHAT) + b"\n" for _ in range(6))
    path.write_bytes(original)
    prepared = plan_units(str(path), 2)
    unit = prepared.units[1]

    for changed in (original + _line(CHAT) + b"\n", original[:-20], original[:-1]):
        path.write_bytes(changed)
        with pytest.raises(DatasetError) as caught:
            next(read_unit(str(path), prepared.bytes, unit))
        assert caught.value.reason == DATASET_CHANGED

    # Same size, other line breaks: the record count of the unit's bytes gives it away.
    split = original.replace(b'"messages": ', b'"messages":\n', 3)
    merged = original.replace(b"}\n{", b"} {", 3)
    for changed in (split, merged):
        assert len(changed) == len(original)
        path.write_bytes(changed)
        with pytest.raises(DatasetError) as caught:
            list(read_unit(str(path), prepared.bytes, unit))
        assert caught.value.reason == DATASET_CHANGED

    path.write_bytes(original)
    assert [i for i, _ in read_unit(str(path), prepared.bytes, unit)] == [2, 3]
    too_many = UnitRange(sample_start=0, sample_end=1, byte_start=0, byte_end=len(original))
    with pytest.raises(DatasetError, match="more than 1"):
        list(read_unit(str(path), None, too_many))
    path.unlink()
    with pytest.raises(DatasetError) as caught:
        next(read_unit(str(path), prepared.bytes, unit))
    assert caught.value.reason == "not_found"


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (PRETOKENIZED, Pretokenized([5, 6, 7], [0, 1, 1])),
        ({"input_ids": [5, 6, 7]}, Pretokenized([5, 6, 7], [1, 1, 1])),
        ({"input_ids": [0], "loss_mask": None}, Pretokenized([0], [1])),
        ({"input_ids": "5 6 7"}, codes.WRONG_SHAPE),
        ({"input_ids": [5, "6"]}, codes.WRONG_SHAPE),
        ({"input_ids": [5, 6.0]}, codes.WRONG_SHAPE),
        ({"input_ids": [True, 6]}, codes.WRONG_SHAPE),
        ({"input_ids": [5, -1]}, codes.WRONG_SHAPE),
        ({"input_ids": None}, codes.WRONG_SHAPE),
        ({"input_ids": []}, codes.EMPTY_CONVERSATION),
        ({"input_ids": [5, 6], "loss_mask": [1]}, codes.WRONG_SHAPE),
        ({"input_ids": [5, 6], "loss_mask": [1, 2]}, codes.WRONG_SHAPE),
        ({"input_ids": [5, 6], "loss_mask": "11"}, codes.WRONG_SHAPE),
        ({"input_ids": [5, 6], "loss_mask": [0, -1]}, codes.WRONG_SHAPE),
    ],
)
def test_pretokenized_records(record: dict[str, Any], expected: Pretokenized | str) -> None:
    got = parse_record(_line(record))
    if isinstance(expected, Pretokenized):
        assert got == expected
    else:
        assert isinstance(got, SampleError) and got.reason == expected


def test_pretokenized_records_only_in_auto_mode_and_read_by_unit(tmp_path: Path) -> None:
    got = parse_record(_line(PRETOKENIZED), "messages")
    assert isinstance(got, SampleError) and got.reason == codes.WRONG_SHAPE
    assert parse_record(_line(CHAT)) == parse_line(_line(CHAT))
    bad = parse_record(b'{"input_ids": [1,')
    assert isinstance(bad, SampleError) and bad.reason == codes.MALFORMED_JSON

    path = tmp_path / "tokens.jsonl"
    path.write_bytes(b"\n".join(_line({"input_ids": list(range(k + 1))}) for k in range(5)))
    assert _read_all(str(path), 2) == [(k, Pretokenized(list(range(k + 1)), [1] * (k + 1))) for k in range(5)]


def _write_lines(path: Path, records: list[Any]) -> str:
    path.write_bytes(b"".join(_line(r) + b"\n" for r in records))
    return str(path)


def test_inspect_head_accepts_known_kinds(tmp_path: Path) -> None:
    limit = 1 << 30
    assert inspect_head(_write_lines(tmp_path / "m.jsonl", [CHAT] * 3), limit) == "messages"
    assert inspect_head(_write_lines(tmp_path / "s.jsonl", [SHAREGPT] * 3), limit) == "sharegpt"
    assert inspect_head(_write_lines(tmp_path / "p.jsonl", [PRETOKENIZED] * 3), limit) == "pretokenized"
    assert inspect_head(_write_lines(tmp_path / "x.jsonl", [CHAT, SHAREGPT, PRETOKENIZED]), limit) == "mixed"
    # Some bad lines in the head are per-sample problems, not a wrong file.
    (tmp_path / "some_bad.jsonl").write_bytes(b"{oops\n" + _line(CHAT) + b"\n42\n")
    assert inspect_head(str(tmp_path / "some_bad.jsonl"), limit) == "messages"
    (tmp_path / "a.json").write_text(json.dumps([SHAREGPT, SHAREGPT]))
    assert inspect_head(str(tmp_path / "a.json"), limit) == "sharegpt"

    # A JSON array too large to parse at submit is left to the worker that prepares the job.
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.write(b"[ garbage")
        fh.truncate(SMALL_ARRAY_BYTES + 1)
    assert inspect_head(str(big), limit) == "deferred"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty_file"),
        (b"\n  \r\n\t\n", "empty_file"),
        (b"[]", "empty_file"),
        (b"not json\nat all\n", "not_json_lines"),
        (b"1\n2\n[3]\n", "not_json_lines"),
        (b"[1, 2, 3]", "not_json_lines"),
        (b"[1, 2", "not_json_lines"),
        (b'{"text": "a"}\n{"prompt": "b"}\n', "unrecognized_format"),
        (b'[{"text": "a"}]', "unrecognized_format"),
    ],
)
def test_inspect_head_refuses_with_a_reason(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "data"
    path.write_bytes(content)
    with pytest.raises(DatasetError) as caught:
        inspect_head(str(path), 1 << 30)
    assert caught.value.reason == reason


def test_inspect_head_size_limit_and_missing_file(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "m.jsonl", [CHAT] * 3)
    with pytest.raises(DatasetError) as caught:
        inspect_head(path, os.path.getsize(path) - 1)
    assert caught.value.reason == "too_large"
    assert inspect_head(path, os.path.getsize(path)) == "messages"
    with pytest.raises(DatasetError) as caught:
        inspect_head(str(tmp_path / "nowhere.jsonl"), 1 << 30)
    assert caught.value.reason == "not_found"


def test_inspect_head_reads_only_the_head(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    line = _line(CHAT) + b"\n"
    path.write_bytes(line * 99_999 + b"\x00garbage{{{\n")
    assert inspect_head(str(path), 1 << 30) == "messages"

    # After the head, 64 GiB of a hole without a line break: reading on would need that much memory. The
    # check runs in a child limited to 1 GiB of address space, so reading past the head fails at once.
    sparse = tmp_path / "sparse.jsonl"
    with open(sparse, "wb") as fh:
        fh.write(line * 8)
        fh.truncate(64 << 30)
    script = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from hsx.server.ingest import inspect_head
        print(inspect_head({str(sparse)!r}, 1 << 40))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
        check=False,
    )
    assert (result.returncode, result.stdout.strip()) == (0, "messages"), result.stderr[-2000:]
