"""Turn a normalized conversation into token ids and a loss mask over the assistant's tokens.

With the chat template, the conversation is rendered once and tokenized once (with character offsets). The
assistant spans inside that text are found by :mod:`workers.turn_spans`, which does not need the template
to render a turn the same way whatever follows it (Qwen3, GPT-OSS and others do not) and explains why the
spans are exact. A trained token is one whose character span overlaps an assistant span: from the end of the
turn's header (what the generation prompt supplies) through its end-of-turn marker and whatever the template
emits after that marker for the turn (ChatML's newline, say).

Without a template, the contents are joined with newlines and each assistant content (with its tool calls
written as JSON) is trained.

Special tokens are never added on top of the rendered text (``add_special_tokens=False``): the template is
responsible for them, and without a template the raw text is used as is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from hsx.server.ingest import ChatMessage
from workers.turn_spans import (
    ASSISTANT_CONTENT_NOT_FOUND,
    TEMPLATE_FAILED,
    TEMPLATE_NOT_SEPARABLE,
    EncodeError,
    Message,
    Span,
    TokenView,
    TurnLocator,
)

__all__ = [
    "ASSISTANT_CONTENT_NOT_FOUND",
    "EMPTY_SAMPLE",
    "NO_ASSISTANT_TOKENS",
    "TEMPLATE_FAILED",
    "TEMPLATE_NOT_SEPARABLE",
    "ChatEncoder",
    "EncodeError",
    "EncodedSample",
    "chat_template_sha256",
    "tokenizer_identity",
]

# Per-sample rejection reasons (stored with the rejected sample, next to the dataset's reasons).
EMPTY_SAMPLE = "empty_sample"
NO_ASSISTANT_TOKENS = "no_assistant_tokens"


@dataclass(frozen=True)
class EncodedSample:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def overlaps(token: Span, span: Span) -> bool:
    token_start, token_end = token
    start, end = span
    if token_start == token_end:  # zero-width tokens sit at a point
        return start <= token_start < end
    return token_start < end and token_end > start


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = {int(token_id) for token_id in tokenizer.all_special_ids}
    for token_id, token in tokenizer.added_tokens_decoder.items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)


class ChatEncoder:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        use_chat_template: bool = True,
        max_length: int | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """``template_kwargs`` go to the template as variables (``enable_thinking=False`` for Qwen3, say)."""
        if not tokenizer.is_fast:
            raise ValueError("ChatEncoder needs a fast tokenizer: it relies on character offsets")
        if use_chat_template and not tokenizer.chat_template:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template
        self.max_length = max_length
        self.template_kwargs = dict(template_kwargs or {})
        self.special_ids = special_token_ids(tokenizer)

    def encode(self, messages: Sequence[ChatMessage] | Sequence[Mapping[str, Any]]) -> EncodedSample:
        """Token ids and loss mask of one conversation; raises :class:`EncodeError` for an unusable one."""
        conversation: list[Message] = [json.loads(json.dumps(dict(m))) for m in messages]
        if self.use_chat_template:
            text = self.render(conversation, False)
            input_ids, tokens = self.tokenize(text)
            spans = TurnLocator(self.render, conversation, text, tokens).assistant_spans() if text else []
        else:
            text, spans = self._plain_spans(conversation)
            input_ids, tokens = self.tokenize(text)
        loss_mask = self._mask(tokens.offsets, spans)
        truncated = False
        if self.max_length is not None and len(input_ids) > self.max_length:
            input_ids, loss_mask = input_ids[: self.max_length], loss_mask[: self.max_length]
            truncated = True
        if not input_ids:
            raise EncodeError(EMPTY_SAMPLE, "the conversation renders to no tokens")
        if not any(loss_mask):
            where = f"within the first {self.max_length} tokens" if truncated else "in the sample"
            raise EncodeError(NO_ASSISTANT_TOKENS, f"no assistant token {where}")
        return EncodedSample(input_ids=input_ids, loss_mask=loss_mask, truncated=truncated)

    # --- rendering ---------------------------------------------------------------------------------

    def render(self, conversation: list[Message], add_generation_prompt: bool = False) -> str:
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except Exception as exc:  # templates raise anything (jinja errors, raise_exception(...))
            raise EncodeError(TEMPLATE_FAILED, f"{type(exc).__name__}: {exc}"[:300]) from exc
        if not isinstance(rendered, str):
            raise EncodeError(TEMPLATE_FAILED, f"the template returned {type(rendered).__name__}, not str")
        return rendered

    @staticmethod
    def _plain_spans(conversation: list[Message]) -> tuple[str, list[Span]]:
        pieces: list[str] = []
        spans: list[Span] = []
        cursor = 0
        for i, message in enumerate(conversation):
            if i:
                pieces.append("\n")
                cursor += 1
            text = str(message.get("content") or "")
            if message["role"] == "assistant":
                calls = [json.dumps(call.get("function", call)) for call in message.get("tool_calls") or []]
                text = "\n".join(part for part in (text, *calls) if part)
                spans.append((cursor, cursor + len(text)))
            pieces.append(text)
            cursor += len(text)
        return "".join(pieces), spans

    def tokenize(self, text: str) -> tuple[list[int], TokenView]:
        if not text:
            return [], TokenView(offsets=[], special=[])
        encoding = self.tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        input_ids = [int(token) for token in encoding["input_ids"]]
        offsets: list[Span] = [(int(s), int(e)) for s, e in encoding["offset_mapping"]]
        special = [token in self.special_ids for token in input_ids]
        return input_ids, TokenView(offsets=offsets, special=special)

    @staticmethod
    def _mask(offsets: Sequence[Span], spans: list[Span]) -> list[int]:
        loss_mask = [0] * len(offsets)
        # Tokens and spans are both sorted by position, so one forward sweep assigns every token: a span
        # that ends at or before a token's start cannot touch it or any later token.
        span_index = 0
        for position, token in enumerate(offsets):
            while span_index < len(spans) and spans[span_index][1] <= token[0]:
                span_index += 1
            if span_index < len(spans) and overlaps(token, spans[span_index]):
                loss_mask[position] = 1
        return loss_mask


# --- identities recorded in the manifest ---------------------------------------------------------------


def chat_template_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the chat template text (named templates as sorted JSON); empty string when there is none."""
    template: Any = tokenizer.chat_template
    if not template:
        return ""
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What identifies the tokenizer: where it came from, its size, and a hash of its tokenizer.json."""
    name_or_path = str(tokenizer.name_or_path)
    tokenizer_json = Path(name_or_path) / "tokenizer.json"
    digest: str | None = None
    if tokenizer_json.is_file():
        digest = hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    return {
        "name_or_path": name_or_path,
        "vocab_size": len(tokenizer),
        "tokenizer_json_sha256": digest,
    }
