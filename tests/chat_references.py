"""Independent expectations for the chat templates in workers/templates: each family's format written out in
plain Python as (text, trained) pieces, following the conventions of workers/turn_spans.py.

A piece is trained when the model produces it in that turn: everything after the text the generation prompt
supplies, through the turn's end marker and what the template emits after it for the turn. These functions
know nothing of how the encoder finds spans; they only say what the rendering is and which part is trained.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

Pieces = list[tuple[str, bool]]
Message = dict[str, Any]


def _args(call: Message) -> str:
    arguments = call["function"]["arguments"]
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _split_reasoning(message: Message, strip_newlines: bool) -> tuple[str, str]:
    content = message["content"]
    reasoning = message.get("reasoning_content", "")
    if not reasoning and "</think>" in content:
        reasoning = content.split("</think>")[0].split("<think>")[-1]
        content = content.split("</think>")[-1]
        if strip_newlines:
            reasoning, content = reasoning.strip("\n"), content.lstrip("\n")
    return reasoning, content


def _last_user(messages: list[Message]) -> int:
    return max((k for k, m in enumerate(messages) if m["role"] == "user"), default=-1)


def smollm2(messages: list[Message], **_: Any) -> Pieces:
    """The default model's own ChatML template: tool calls are not shown, a default system turn is added."""
    pieces: Pieces = []
    if messages[0]["role"] != "system":
        default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        pieces.append((f"<|im_start|>system\n{default}<|im_end|>\n", False))
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant":
            pieces += [("<|im_start|>assistant\n", False), (content + "<|im_end|>\n", True)]
        else:
            pieces.append((f"<|im_start|>{role}\n{content}<|im_end|>\n", False))
    return pieces


def llama3(messages: list[Message], **_: Any) -> Pieces:
    system = messages[0]["content"].strip() if messages[0]["role"] == "system" else ""
    pieces: Pieces = [
        (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" + system + "<|eot_id|>",
            False,
        )
    ]
    for k, message in enumerate(messages):
        role = message["role"]
        if k == 0 and role == "system":
            continue
        if role == "assistant":
            pieces.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", False))
            calls = message.get("tool_calls")
            if calls:
                body = "\n".join(
                    f'{{"name": "{call["function"]["name"]}", "parameters": {_args(call)}}}' for call in calls
                )
            else:
                body = message["content"].strip()
            pieces.append((body + "<|eot_id|>", True))
        else:
            shown = "ipython" if role == "tool" else role
            text = f"<|start_header_id|>{shown}<|end_header_id|>\n\n{message['content'].strip()}<|eot_id|>"
            pieces.append((text, False))
    return pieces


def qwen3(messages: list[Message], enable_thinking: bool = True, **_: Any) -> Pieces:
    last_query = _last_user(messages)
    pieces: Pieces = []
    for k, message in enumerate(messages):
        role = message["role"]
        if role in ("system", "user"):
            pieces.append((f"<|im_start|>{role}\n{message['content']}<|im_end|>\n", False))
        elif role == "assistant":
            reasoning, content = _split_reasoning(message, strip_newlines=True)
            pieces.append(("<|im_start|>assistant\n", False))
            if k > last_query and (k == len(messages) - 1 or reasoning):
                block = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
                # Without thinking the generation prompt itself carries the empty block.
                pieces.append((block, not (enable_thinking is False and not reasoning)))
            body = content
            for number, call in enumerate(message.get("tool_calls") or []):
                if content or number:
                    body += "\n"
                name = call["function"]["name"]
                body += f'<tool_call>\n{{"name": "{name}", "arguments": {_args(call)}}}\n</tool_call>'
            pieces.append((body + "<|im_end|>\n", True))
        elif role == "tool":
            first = k == 0 or messages[k - 1]["role"] != "tool"
            last = k == len(messages) - 1 or messages[k + 1]["role"] != "tool"
            text = (
                "<|im_start|>user" if first else ""
            ) + f"\n<tool_response>\n{message['content']}\n</tool_response>"
            pieces.append((text + ("<|im_end|>\n" if last else ""), False))
    return pieces


def gpt_oss(messages: list[Message], **_: Any) -> Pieces:
    last_user = _last_user(messages)
    pieces: Pieces = [
        (
            "<|start|>system<|message|>Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n"
            "# Valid channels: analysis, commentary, final.<|end|>",
            False,
        )
    ]
    tool_name = ""
    for k, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "system":
            pieces.append((f"<|start|>developer<|message|># Instructions\n\n{content}<|end|>", False))
        elif role == "user":
            pieces.append((f"<|start|>user<|message|>{content}<|end|>", False))
        elif role == "assistant":
            thinking = message.get("thinking") or message.get("reasoning_content") or ""
            parts: list[str] = []
            if thinking and k > last_user:
                parts.append(f"<|channel|>analysis<|message|>{thinking}<|end|>")
            calls = message.get("tool_calls")
            if calls:
                if content:
                    parts.append(f"<|channel|>commentary<|message|>{content}<|end|>")
                for call in calls:
                    tool_name = call["function"]["name"]
                    parts.append(
                        f"<|channel|>commentary to=functions.{tool_name} <|constrain|>json<|message|>"
                        f"{_args(call)}<|call|>"
                    )
            else:
                ending = "<|return|>" if k == len(messages) - 1 else "<|end|>"
                parts.append(f"<|channel|>final<|message|>{content}{ending}")
            # The generation prompt is "<|start|>assistant"; the model writes every later message header.
            pieces.append(("<|start|>assistant", False))
            pieces.append(("<|start|>assistant".join(parts), True))
        elif role == "tool":
            name = message.get("name") or tool_name
            text = f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{content}<|end|>"
            pieces.append((text, False))
    return pieces


def deepseek_v3(messages: list[Message], thinking: bool = False, **_: Any) -> Pieces:
    last_user = _last_user(messages)
    system = "".join(m["content"] for m in messages if m["role"] == "system")
    pieces: Pieces = [("<｜begin▁of▁sentence｜>" + system, False)]
    in_tools = False
    for k, message in enumerate(messages):
        role = message["role"]
        if role == "user":
            opener = "<｜tool▁outputs▁end｜>" if in_tools else ""
            in_tools = False
            pieces.append((opener + "<｜User｜>" + message["content"], False))
        elif role == "assistant":
            reasoning, content = _split_reasoning(message, strip_newlines=False)
            opener = "<｜tool▁outputs▁end｜>" if in_tools else "<｜Assistant｜>"
            in_tools = False
            if thinking and k > last_user:
                # The generation prompt ends with "<think>"; the reasoning and its close are the model's.
                pieces.append((opener + "<think>", False))
                body = reasoning + "</think>" + content
            else:
                pieces.append((opener + "</think>", False))
                body = content
            calls = message.get("tool_calls")
            if calls:
                body += "<｜tool▁calls▁begin｜>"
                for call in calls:
                    name = call["function"]["name"]
                    body += f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{_args(call)}<｜tool▁call▁end｜>"
                body += "<｜tool▁calls▁end｜>"
            pieces.append((body + "<｜end▁of▁sentence｜>", True))
        elif role == "tool":
            opener = "" if in_tools else "<｜tool▁outputs▁begin｜>"
            in_tools = True
            pieces.append(
                (f"{opener}<｜tool▁output▁begin｜>{message['content']}<｜tool▁output▁end｜>", False)
            )
    if in_tools:
        pieces.append(("<｜tool▁outputs▁end｜>", False))
    return pieces


def kimi_k2(messages: list[Message], **_: Any) -> Pieces:
    last_user = _last_user(messages)
    pieces: Pieces = []
    if messages[0]["role"] != "system":
        default = "You are Kimi, an AI assistant created by Moonshot AI."
        pieces.append((f"<|im_system|>system<|im_middle|>{default}<|im_end|>", False))
    for k, message in enumerate(messages):
        role = message["role"]
        if role == "system":
            pieces.append((f"<|im_system|>system<|im_middle|>{message['content']}<|im_end|>", False))
        elif role == "user":
            pieces.append((f"<|im_user|>user<|im_middle|>{message['content']}<|im_end|>", False))
        elif role == "assistant":
            reasoning, content = _split_reasoning(message, strip_newlines=False)
            pieces.append(("<|im_assistant|>assistant<|im_middle|>", False))
            body = (f"<think>{reasoning}</think>" if k > last_user else "<think></think>") + content
            calls = message.get("tool_calls")
            if calls:
                body += "<|tool_calls_section_begin|>"
                for number, call in enumerate(calls):
                    call_id = call.get("id") or f"functions.{call['function']['name']}:{number}"
                    body += f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{_args(call)}"
                    body += "<|tool_call_end|>"
                body += "<|tool_calls_section_end|>"
            pieces.append((body + "<|im_end|>", True))
        elif role == "tool":
            call_id = message.get("tool_call_id") or "unknown"
            text = f"<|im_system|>tool<|im_middle|>## Return of {call_id}\n{message['content']}<|im_end|>"
            pieces.append((text, False))
    return pieces


REFERENCES: dict[str, Callable[..., Pieces]] = {
    "smollm2": smollm2,
    "llama3": llama3,
    "qwen3": qwen3,
    "gpt_oss": gpt_oss,
    "deepseek_v3": deepseek_v3,
    "kimi_k2": kimi_k2,
}

# The markers each family's tokenizer knows as single tokens (special ones end turns; Qwen's are not special).
SPECIAL_MARKERS: dict[str, tuple[list[str], list[str]]] = {
    "smollm2": ([], []),
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], []),
    "qwen3": (
        [],
        ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
    ),
    "gpt_oss": (
        ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"],
        [],
    ),
    "deepseek_v3": (
        [
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ],
        ["<think>", "</think>"],
    ),
    "kimi_k2": (
        [
            "<|im_system|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_middle|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ],
        ["<think>", "</think>"],
    ),
}
BOS = {"llama3": "<|begin_of_text|>", "deepseek_v3": "<｜begin▁of▁sentence｜>"}
