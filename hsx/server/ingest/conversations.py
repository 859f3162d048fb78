"""Chat records in ``messages`` (OpenAI) or ``sharegpt`` form, normalized to one list of
:class:`ChatMessage` per sample, or the :class:`~hsx.server.ingest.errors.SampleError` that says why not. A
record that cannot be used is rejected at its own index; it never stops the unit and is never skipped.

Standard library only.
"""

from __future__ import annotations

import json
from typing import Any, Literal, NotRequired, TypedDict

from hsx.server.ingest.errors import (
    EMPTY_CONVERSATION,
    INVALID_TOOL_CALL,
    NO_ASSISTANT_TURN,
    NON_STRING_CONTENT,
    UNKNOWN_FORMAT,
    UNKNOWN_ROLE,
    UNSUPPORTED_CONTENT_PART,
    WRONG_SHAPE,
    SampleError,
)

RecordFormat = Literal["auto", "messages", "sharegpt"]

# OpenAI's ``developer`` role is its newer name for ``system``; templates know only the latter.
_MESSAGES_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
# ShareGPT exports disagree on role names; the human/gpt spelling is the original, user/assistant is common,
# and tool-use exports add function_call (the assistant calling) and observation (the tool's answer).
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}


class ToolFunction(TypedDict):
    name: str
    arguments: dict[str, Any] | str  # a JSON object is parsed; anything else stays the string it was


class ToolCall(TypedDict):
    type: str  # always "function"
    function: ToolFunction
    id: NotRequired[str]


class ChatMessage(TypedDict):
    """One turn. ``role`` is system, user, assistant or tool; ``content`` is always a string (possibly
    empty when an assistant turn only calls tools). The optional keys are passed to the chat template."""

    role: str
    content: str
    tool_calls: NotRequired[list[ToolCall]]
    name: NotRequired[str]
    tool_call_id: NotRequired[str]
    reasoning_content: NotRequired[str]
    thinking: NotRequired[str]


RawSample = list[ChatMessage] | SampleError


def _text_of(content: Any, where: str) -> str | SampleError:
    """A turn's text: a string as is, or OpenAI's list of parts with every text part joined in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return SampleError(NON_STRING_CONTENT, f"{where} is {type(content).__name__}, expected str")
    texts: list[str] = []
    for number, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            shown = kind if isinstance(kind, str) else type(part).__name__
            return SampleError(
                UNSUPPORTED_CONTENT_PART, f"{where} part {number} is {shown!r}; only text parts are read"
            )
        text = part.get("text")
        if not isinstance(text, str):
            return SampleError(NON_STRING_CONTENT, f"{where} part {number} has no string 'text'")
        texts.append(text)
    return "".join(texts)


def _tool_call(raw: Any, where: str) -> ToolCall | SampleError:
    """One OpenAI tool call (``{"type": "function", "function": {"name", "arguments"}}``) in one shape."""
    function = raw.get("function", raw) if isinstance(raw, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(function, dict) or not isinstance(name, str) or not name:
        return SampleError(INVALID_TOOL_CALL, f"{where} has no function name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        # OpenAI sends arguments as JSON text; chat templates expect the object (they serialize it).
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    elif not isinstance(arguments, dict):
        return SampleError(
            INVALID_TOOL_CALL, f"{where} arguments are {type(arguments).__name__}, expected an object"
        )
    call = ToolCall(type="function", function=ToolFunction(name=name, arguments=arguments))
    if isinstance(raw, dict) and isinstance(raw.get("id"), str):
        call["id"] = raw["id"]
    return call


def _tool_calls(turn: dict[str, Any], role: str, where: str) -> list[ToolCall] | SampleError | None:
    raw_calls = turn.get("tool_calls")
    if raw_calls is None and turn.get("function_call") is not None:
        raw_calls = [turn["function_call"]]  # the pre-tools OpenAI spelling of one call
    if raw_calls is None or raw_calls == []:
        return None
    if role != "assistant":
        return SampleError(INVALID_TOOL_CALL, f"{where} is a {role} turn with tool calls")
    if not isinstance(raw_calls, list):
        return SampleError(INVALID_TOOL_CALL, f"{where} tool_calls is {type(raw_calls).__name__}")
    calls: list[ToolCall] = []
    for number, raw in enumerate(raw_calls):
        call = _tool_call(raw, f"{where} tool call {number}")
        if isinstance(call, SampleError):
            return call
        calls.append(call)
    return calls


def _normalize_turn(
    turn: Any, position: int, role_key: str, content_key: str, roles: dict[str, str]
) -> ChatMessage | SampleError:
    where = f"turn {position}"
    if not isinstance(turn, dict):
        return SampleError(WRONG_SHAPE, f"{where} is {type(turn).__name__}, expected an object")
    raw_role = turn.get(role_key)
    if not isinstance(raw_role, str) or raw_role not in roles:
        return SampleError(UNKNOWN_ROLE, f"{where} has {role_key}={raw_role!r}")
    role = roles[raw_role]
    calls = _tool_calls(turn, role, where)
    if isinstance(calls, SampleError):
        return calls
    content = turn.get(content_key)
    if content is None and calls:
        content = ""  # OpenAI: an assistant turn that only calls tools has null content
    text = _text_of(content, f"{where} {content_key}")
    if isinstance(text, SampleError):
        return text
    message = ChatMessage(role=role, content=text)
    if calls:
        message["tool_calls"] = calls
    if name := _optional_text(turn, "name"):
        message["name"] = name
    if tool_call_id := _optional_text(turn, "tool_call_id"):
        message["tool_call_id"] = tool_call_id
    if reasoning := _optional_text(turn, "reasoning_content"):
        message["reasoning_content"] = reasoning
    if thinking := _optional_text(turn, "thinking"):
        message["thinking"] = thinking
    return message


def _optional_text(turn: dict[str, Any], key: str) -> str | None:
    value = turn.get(key)
    return value if isinstance(value, str) and value else None


def _normalize_turns(
    turns: Any, role_key: str, content_key: str, roles: dict[str, str], label: str, answered: bool
) -> list[ChatMessage] | SampleError:
    if not isinstance(turns, list):
        return SampleError(WRONG_SHAPE, f"'{label}' is {type(turns).__name__}, expected a list")
    if not turns:
        return SampleError(EMPTY_CONVERSATION, f"'{label}' is empty")
    messages: list[ChatMessage] = []
    for position, turn in enumerate(turns):
        message = _normalize_turn(turn, position, role_key, content_key, roles)
        if isinstance(message, SampleError):
            return message
        messages.append(message)
    if answered and not any(message["role"] == "assistant" for message in messages):
        return SampleError(NO_ASSISTANT_TURN, "the conversation has no assistant turn")
    return messages


def normalize_record(record: Any, record_format: RecordFormat = "auto", answered: bool = True) -> RawSample:
    """A parsed JSON record as a list of :class:`ChatMessage`, or why it cannot be one. ``answered``: the
    conversation must hold an assistant turn (a regenerate job takes prompts without one: it generates it).

    Accepted beyond plain strings: OpenAI's ``developer`` (read as system) and ``tool`` roles, content as a
    list of text parts, ``tool_calls`` (or the older ``function_call``) with null content, and the optional
    ``name``, ``tool_call_id``, ``reasoning_content`` and ``thinking`` strings, which reach the template.
    """
    if not isinstance(record, dict):
        return SampleError(WRONG_SHAPE, f"record is {type(record).__name__}, expected an object")
    use_messages = record_format == "messages" or (record_format == "auto" and "messages" in record)
    use_sharegpt = record_format == "sharegpt" or (record_format == "auto" and "conversations" in record)
    if use_messages:
        return _normalize_turns(
            record.get("messages"), "role", "content", _MESSAGES_ROLES, "messages", answered
        )
    if use_sharegpt:
        return _normalize_turns(
            record.get("conversations"), "from", "value", _SHAREGPT_ROLES, "conversations", answered
        )
    keys = ", ".join(sorted(str(key) for key in record)[:8])
    return SampleError(UNKNOWN_FORMAT, f"no 'messages' or 'conversations' key (keys: {keys})")
