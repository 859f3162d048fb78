from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsx.server.ingest import DatasetError, SampleError, detect_layout, inspect_head, normalize_record
from hsx.server.ingest import errors as codes
from tests.reference_samples import count_samples, iter_samples

DATA = Path(__file__).resolve().parent.parent / "data"
SAMPLE_CHATS = DATA / "sample_chats.jsonl"
BAD_CHATS = DATA / "bad_chats.jsonl"

# What data/bad_chats.jsonl holds, by sample index (its blank line is not a sample).
BAD_CHATS_EXPECTED: list[str | None] = [
    None,
    codes.MALFORMED_JSON,
    codes.NO_ASSISTANT_TURN,
    codes.UNKNOWN_ROLE,
    codes.NON_STRING_CONTENT,
    None,
    codes.EMPTY_CONVERSATION,
    codes.UNKNOWN_FORMAT,
    None,
]


def _write_lines(path: Path, lines: list[str], newline: str = "\n") -> Path:
    path.write_bytes(newline.join(lines).encode("utf-8") + newline.encode())
    return path


def _chat(user: str, answer: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def test_sample_chats_are_all_valid_messages_records() -> None:
    assert count_samples(SAMPLE_CHATS) == 24
    samples = list(iter_samples(SAMPLE_CHATS, 0, 1000))
    assert [index for index, _ in samples] == list(range(24))
    for _, sample in samples:
        assert isinstance(sample, list)
        assert any(message["role"] == "assistant" for message in sample)
        assert all(set(message) == {"role", "content"} for message in sample)


def test_bad_records_become_per_sample_errors_at_stable_indices() -> None:
    assert count_samples(BAD_CHATS) == len(BAD_CHATS_EXPECTED)
    samples = dict(iter_samples(BAD_CHATS, 0, 100))
    assert sorted(samples) == list(range(len(BAD_CHATS_EXPECTED)))
    for index, expected in enumerate(BAD_CHATS_EXPECTED):
        sample = samples[index]
        if expected is None:
            assert isinstance(sample, list), (index, sample)
        else:
            assert isinstance(sample, SampleError), (index, sample)
            assert sample.reason == expected
            assert sample.detail
    # The good record after the blank line keeps its place: it is the 6th sample, not the 7th line.
    good = samples[5]
    assert isinstance(good, list) and good[0]["content"] == "Name a prime number greater than 10."


def test_sub_ranges_match_the_full_read() -> None:
    everything = list(iter_samples(BAD_CHATS, 0, 100))
    for start in range(len(everything) + 2):
        for end in range(start, len(everything) + 3):
            assert list(iter_samples(BAD_CHATS, start, end)) == everything[start:end]


def test_bad_range_is_refused() -> None:
    with pytest.raises(ValueError):
        list(iter_samples(BAD_CHATS, -1, 3))
    with pytest.raises(ValueError):
        list(iter_samples(BAD_CHATS, 4, 3))


def test_sharegpt_records_are_normalized(tmp_path: Path) -> None:
    record = {
        "conversations": [
            {"from": "system", "value": "Be kind."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
        ]
    }
    path = _write_lines(tmp_path / "s.jsonl", [json.dumps(record), json.dumps(_chat("x", "y"))])
    [(_, sharegpt), (_, messages)] = list(iter_samples(path, 0, 2))
    assert sharegpt == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert messages == [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert inspect_head(str(path), 1 << 20) == "mixed"

    # A forced format refuses records of the other one instead of guessing.
    [(_, forced)] = list(iter_samples(path, 0, 1, record_format="messages"))
    assert isinstance(forced, SampleError) and forced.reason == codes.WRONG_SHAPE
    [(_, forced)] = list(iter_samples(path, 1, 2, record_format="sharegpt"))
    assert isinstance(forced, SampleError) and forced.reason == codes.WRONG_SHAPE


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ([1, 2], codes.WRONG_SHAPE),
        ({"messages": "hello"}, codes.WRONG_SHAPE),
        ({"messages": ["hello"]}, codes.WRONG_SHAPE),
        ({"messages": [{"role": "user"}]}, codes.NON_STRING_CONTENT),
        ({"messages": [{"role": "assistant", "content": None}]}, codes.NON_STRING_CONTENT),
        ({"messages": [{"content": "x"}]}, codes.UNKNOWN_ROLE),
        ({"conversations": [{"from": "bot", "value": "x"}]}, codes.UNKNOWN_ROLE),
        ({"conversations": []}, codes.EMPTY_CONVERSATION),
        ({"conversations": [{"from": "human", "value": "only me"}]}, codes.NO_ASSISTANT_TURN),
        ({"text": "plain"}, codes.UNKNOWN_FORMAT),
    ],
)
def test_wrong_shapes_are_named(record: object, reason: str) -> None:
    result = normalize_record(record)
    assert isinstance(result, SampleError)
    assert result.reason == reason


def test_undecodable_and_deeply_nested_lines_are_malformed_samples(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b'{"messages": "\xff\xfe"}\n' + b"[" * 200_000 + b"\n" + json.dumps(_chat("a", "b")).encode()
    )
    results = list(iter_samples(path, 0, 10))
    assert [index for index, _ in results] == [0, 1, 2]
    assert [getattr(sample, "reason", None) for _, sample in results] == [
        codes.MALFORMED_JSON,
        codes.MALFORMED_JSON,
        None,
    ]


def test_byte_order_mark_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_chat("a", "b")).encode() + b"\r\n\r\n \t\r\n")
    assert count_samples(path) == 1
    [(_, sample)] = list(iter_samples(path, 0, 5))
    assert isinstance(sample, list)


def test_json_array_files(tmp_path: Path) -> None:
    records = [_chat("a", "b"), {"messages": []}, _chat("c", "d")]
    path = tmp_path / "d.json"
    path.write_text("  \n" + json.dumps(records, indent=2), encoding="utf-8")
    assert detect_layout(path) == "json_array"
    assert count_samples(path) == 3
    results = list(iter_samples(path, 1, 10))
    assert [index for index, _ in results] == [1, 2]
    assert isinstance(results[0][1], SampleError) and results[0][1].reason == codes.EMPTY_CONVERSATION


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", codes.FILE_EMPTY),
        (b"\n  \n\t\n", codes.FILE_EMPTY),
        (b"user: hi\nassistant: hello\n", codes.FILE_NOT_JSON_LINES),
        (b"[1, 2, 3]\n", codes.FILE_NOT_JSON_LINES),
        (b"[1, 2", codes.FILE_NOT_JSON_LINES),
        (b'{"prompt": "a", "completion": "b"}\n', codes.FILE_UNRECOGNIZED_FORMAT),
    ],
)
def test_validation_refuses_unusable_files(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(DatasetError) as caught:
        inspect_head(str(path), 1 << 20)
    assert caught.value.reason == reason


def test_validation_refuses_large_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as caught:
        inspect_head(str(SAMPLE_CHATS), 100)
    assert caught.value.reason == codes.FILE_TOO_LARGE
    with pytest.raises(DatasetError) as caught:
        inspect_head(str(tmp_path / "absent.jsonl"), 100)
    assert caught.value.reason == codes.FILE_NOT_FOUND


def test_validation_accepts_a_file_whose_first_records_are_partly_broken() -> None:
    assert inspect_head(str(BAD_CHATS), 1 << 20) == "messages"


def test_openai_shapes_are_read() -> None:
    record = {
        "messages": [
            {"role": "developer", "content": "Be exact."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                    },
                    {"type": "function", "function": {"name": "clock", "arguments": "not json"}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "-3"},
            {"role": "assistant", "content": "It is -3 C.", "reasoning_content": "Read the tool."},
        ]
    }
    assert normalize_record(record) == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Oslo"}},
                    "id": "c1",
                },
                {"type": "function", "function": {"name": "clock", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "content": "-3", "name": "weather", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is -3 C.", "reasoning_content": "Read the tool."},
    ]


def test_legacy_function_call_and_sharegpt_tool_roles_are_read() -> None:
    legacy = {
        "messages": [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": None, "function_call": {"name": "clock", "arguments": "{}"}},
        ]
    }
    [_, call] = normalize_record(legacy)  # type: ignore[misc]
    assert call["tool_calls"] == [{"type": "function", "function": {"name": "clock", "arguments": {}}}]
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "Time?"},
            {"from": "function_call", "value": '{"name": "clock"}'},
            {"from": "observation", "value": "09:00"},
            {"from": "gpt", "value": "It is nine."},
        ]
    }
    roles = [m["role"] for m in normalize_record(sharegpt)]  # type: ignore[union-attr]
    assert roles == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize(
    ("turn", "reason"),
    [
        ({"role": "assistant", "content": None}, codes.NON_STRING_CONTENT),
        ({"role": "assistant", "content": None, "tool_calls": []}, codes.NON_STRING_CONTENT),
        (
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {}}]},
            codes.UNSUPPORTED_CONTENT_PART,
        ),
        ({"role": "assistant", "content": [{"type": "text"}]}, codes.NON_STRING_CONTENT),
        ({"role": "assistant", "content": [7]}, codes.UNSUPPORTED_CONTENT_PART),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}, codes.INVALID_TOOL_CALL),
        ({"role": "assistant", "content": "", "tool_calls": "call"}, codes.INVALID_TOOL_CALL),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
            codes.INVALID_TOOL_CALL,
        ),
        (
            {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
            codes.INVALID_TOOL_CALL,
        ),
        ({"role": "function", "content": "x"}, codes.UNKNOWN_ROLE),
    ],
)
def test_what_stays_invalid_keeps_a_stable_reason(turn: dict[str, object], reason: str) -> None:
    result = normalize_record({"messages": [{"role": "user", "content": "q"}, turn]})
    assert isinstance(result, SampleError), result
    assert result.reason == reason
    assert result.detail.startswith("turn 1")
