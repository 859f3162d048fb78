"""Loss masks under the chat templates of workers/templates (Llama-3, Qwen3, GPT-OSS, DeepSeek-V3, Kimi-K2
behaviours), checked token by token against the hand-written expectations of tests/chat_references.py.

Records go through the dataset reader first, in OpenAI's own shapes (developer role, list-of-parts content,
tool calls with null content and JSON-text arguments, tool results), so the path is the one a job takes.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken

from hsx.server.ingest import ChatMessage, SampleError, normalize_record
from tests.chat_references import BOS, REFERENCES, SPECIAL_MARKERS
from workers.chat import ChatEncoder

TEMPLATES = Path(__file__).resolve().parent.parent / "workers" / "templates"


def _call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


RECORDS: dict[str, dict[str, Any]] = {
    "plain": {
        "messages": [
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": [{"type": "text", "text": "6"}, {"type": "text", "text": "."}]},
        ]
    },
    "reasoning": {
        "messages": [
            {"role": "user", "content": "Is 7 prime?"},
            {"role": "assistant", "content": "<think>\nIt has no divisor but 1 and 7.\n</think>\n\nYes."},
            {"role": "user", "content": "Is 9?"},
            {"role": "assistant", "content": "<think>\n9 = 3 * 3.\n</think>\n\nNo, 9 is 3 squared."},
        ]
    },
    "tools": {
        "messages": [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    _call("call_1", "get_weather", '{"city": "Paris"}'),
                    _call("call_2", "get_weather", '{"city": "Rome"}'),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 18}'},
            {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": '{"temp": 24}'},
            {"role": "assistant", "content": "Paris is 18 C and Rome is 24 C."},
            {"role": "user", "content": "Convert Rome to Fahrenheit."},
            {
                "role": "assistant",
                "content": "Let me compute.",
                "reasoning_content": "24 * 9 / 5 + 32 = 75.2",
                "tool_calls": [_call("call_3", "calculator", {"expression": "24*9/5+32"})],
            },
            {"role": "tool", "tool_call_id": "call_3", "name": "calculator", "content": "75.2"},
            {"role": "assistant", "content": "<think>\nThe tool agrees.\n</think>\n\nRome is 75.2 F."},
        ]
    },
    "tools_without_reasoning": {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call("c1", "get_weather", '{"city": "Oslo"}')],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "-3"},
            {"role": "assistant", "content": "It is -3 C in Oslo."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You're welcome."},
        ]
    },
    "short": {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "Say nothing."},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "end"},
            {"role": "assistant", "content": "end"},
        ]
    },
}

# (family, template variables, records): thinking on and off where the family has the switch.
CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("smollm2", {}, list(RECORDS)),
    ("llama3", {}, list(RECORDS)),
    ("qwen3", {}, list(RECORDS)),
    ("qwen3", {"enable_thinking": False}, ["plain", "tools_without_reasoning", "short"]),
    ("gpt_oss", {}, list(RECORDS)),
    ("deepseek_v3", {}, list(RECORDS)),
    ("deepseek_v3", {"thinking": True}, list(RECORDS)),
    ("kimi_k2", {}, list(RECORDS)),
]
PARAMS = [
    pytest.param(
        family,
        variables,
        record,
        id=f"{family}-{'-'.join(map(str, variables.values())) or 'default'}-{record}",
    )
    for family, variables, records in CASES
    for record in records
]


@functools.cache
def _family_tokenizer(base: Any, family: str) -> Any:
    tokenizer = copy.deepcopy(base)
    special, plain = SPECIAL_MARKERS[family]
    markers = [AddedToken(t, special=True, normalized=False) for t in special]
    markers += [AddedToken(t, special=False, normalized=False) for t in plain]
    tokenizer.add_tokens(markers)
    if family in BOS:
        tokenizer.bos_token = BOS[family]
    if family != "smollm2":  # the default model's tokenizer keeps its own template
        tokenizer.chat_template = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    return tokenizer


def _read(record: dict[str, Any]) -> list[ChatMessage]:
    messages = normalize_record(json.loads(json.dumps(record)))
    assert not isinstance(messages, SampleError), messages
    return messages


@pytest.mark.parametrize(("family", "variables", "record"), PARAMS)
def test_masks_match_the_family_reference_token_by_token(
    tokenizer: Any, family: str, variables: dict[str, Any], record: str
) -> None:
    variant = _family_tokenizer(tokenizer, family)
    messages = _read(RECORDS[record])
    pieces = REFERENCES[family]([dict(m) for m in messages], **variables)
    text = "".join(piece for piece, _ in pieces)
    # The template renders exactly what the reference says it does.
    assert variant.apply_chat_template(messages, tokenize=False, **variables) == text

    labels: list[bool] = []
    for piece, trained in pieces:
        labels.extend([trained] * len(piece))
    encoding = variant(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = [(int(s), int(e)) for s, e in encoding["offset_mapping"]]
    starts = {s for s, _ in offsets} | {len(text)}
    boundaries = {i for i in range(1, len(text)) if labels[i] != labels[i - 1]}
    assert boundaries <= starts, (
        "a reference boundary falls inside a token; the expectation would be ambiguous"
    )
    expected = [int(any(labels[s:e])) for s, e in offsets]

    encoded = ChatEncoder(variant, template_kwargs=variables).encode(messages)
    assert encoded.input_ids == encoding["input_ids"]
    mismatches = [
        (position, variant.decode([token]), bit, want)
        for position, (token, bit, want) in enumerate(
            zip(encoded.input_ids, encoded.loss_mask, expected, strict=True)
        )
        if bit != want
    ]
    assert not mismatches, mismatches[:10]
    # One trained run per assistant turn, and none rejected.
    runs = sum(1 for i, label in enumerate(labels) if label and (i == 0 or not labels[i - 1]))
    assert runs == sum(1 for m in messages if m["role"] == "assistant")


def test_qwen3_drops_earlier_reasoning_yet_every_turn_is_trained(tokenizer: Any) -> None:
    variant = _family_tokenizer(tokenizer, "qwen3")
    messages = _read(RECORDS["reasoning"])
    text = variant.apply_chat_template(messages, tokenize=False)
    assert "It has no divisor" not in text and "9 = 3 * 3." in text  # the first turn's reasoning is gone
    encoded = ChatEncoder(variant).encode(messages)
    trained = variant.decode([t for t, bit in zip(encoded.input_ids, encoded.loss_mask, strict=True) if bit])
    assert trained == "Yes.<|im_end|>\n<think>\n9 = 3 * 3.\n</think>\n\nNo, 9 is 3 squared.<|im_end|>\n"


def test_gpt_oss_trains_each_turns_own_end_marker(tokenizer: Any) -> None:
    variant = _family_tokenizer(tokenizer, "gpt_oss")
    messages = _read(RECORDS["plain"])
    encoded = ChatEncoder(variant).encode(messages)
    trained = variant.decode([t for t, bit in zip(encoded.input_ids, encoded.loss_mask, strict=True) if bit])
    assert trained == "<|channel|>final<|message|>4.<|end|><|channel|>final<|message|>6.<|return|>"
