"""Turn a normalized conversation into token ids and a loss mask over the assistant's tokens.

With the chat template, the text is rendered once and tokenized once (with character offsets); assistant
spans are located by rendering growing prefixes of the conversation. That only works when the template is
prefix-stable (rendering ``messages[:i]`` yields a string prefix of rendering all messages); templates that
rewrite earlier turns later (dropping reasoning from old turns, say) are refused per sample rather than
silently mis-masked.

A trained token is one whose character span overlaps an assistant turn from the first character of its
content through the end of that turn's rendering, so the end-of-turn marker (and whatever the template
emits after it for that turn) is trained, while the role header before the content is not.

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

from workers.dataset import ChatMessage

# Per-sample rejection reasons (stored with the rejected sample, next to the dataset's reasons).
TEMPLATE_NOT_PREFIX_STABLE = "template_not_prefix_stable"
TEMPLATE_FAILED = "template_failed"
ASSISTANT_CONTENT_NOT_FOUND = "assistant_content_not_found"
EMPTY_SAMPLE = "empty_sample"
NO_ASSISTANT_TOKENS = "no_assistant_tokens"


class EncodeError(Exception):
    """One sample cannot be encoded; ``reason`` is a stable code, ``detail`` says what was seen."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class EncodedSample:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


Span = tuple[int, int]


def _overlaps(token: Span, span: Span) -> bool:
    token_start, token_end = token
    start, end = span
    if token_start == token_end:  # zero-width tokens sit at a point
        return start <= token_start < end
    return token_start < end and token_end > start


class ChatEncoder:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        use_chat_template: bool = True,
        max_length: int | None = None,
    ) -> None:
        if not tokenizer.is_fast:
            raise ValueError("ChatEncoder needs a fast tokenizer: it relies on character offsets")
        if use_chat_template and not tokenizer.chat_template:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template
        self.max_length = max_length

    def encode(self, messages: Sequence[ChatMessage] | Sequence[Mapping[str, str]]) -> EncodedSample:
        """Token ids and loss mask of one conversation; raises :class:`EncodeError` for an unusable one."""
        conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.use_chat_template:
            text, spans = self._template_spans(conversation)
        else:
            text, spans = self._plain_spans(conversation)
        input_ids, loss_mask = self._tokenize(text, spans)
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

    def _render(self, conversation: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # templates raise anything (jinja errors, raise_exception(...))
            raise EncodeError(TEMPLATE_FAILED, f"{type(exc).__name__}: {exc}"[:300]) from exc
        if not isinstance(rendered, str):
            raise EncodeError(TEMPLATE_FAILED, f"the template returned {type(rendered).__name__}, not str")
        return rendered

    def _template_spans(self, conversation: list[dict[str, str]]) -> tuple[str, list[Span]]:
        full = self._render(conversation)
        spans: list[Span] = []
        for i, message in enumerate(conversation):
            if message["role"] != "assistant":
                continue
            # An empty conversation cannot be rendered; before the first turn lies the empty string.
            before = self._render(conversation[:i]) if i else ""
            through = self._render(conversation[: i + 1])
            for label, prefix in ((f"messages[:{i}]", before), (f"messages[:{i + 1}]", through)):
                if not full.startswith(prefix):
                    raise EncodeError(
                        TEMPLATE_NOT_PREFIX_STABLE, f"rendering {label} is not a prefix of the whole"
                    )
            turn_start, turn_end = len(before), len(through)
            content_start = self._content_start(conversation, i, full, turn_start, turn_end)
            spans.append((content_start, turn_end))
        return full, spans

    def _content_start(
        self, conversation: list[dict[str, str]], i: int, full: str, turn_start: int, turn_end: int
    ) -> int:
        content = conversation[i]["content"]
        # Preferred: the generation prompt is exactly the role header, so the content begins where it ends.
        if i:
            try:
                header = self._render(conversation[:i], add_generation_prompt=True)
            except EncodeError:
                header = ""
            if (
                header
                and full.startswith(header)
                and turn_start <= len(header) <= turn_end
                and full.startswith(content, len(header))
            ):
                return len(header)
        # Otherwise the content is the last occurrence inside the turn (the header precedes it, only the
        # end-of-turn marker follows); templates that trim the content are matched on the trimmed text.
        for needle in (content, content.strip()):
            if needle:
                found = full.rfind(needle, turn_start, turn_end)
                if found >= 0:
                    return found
        if not content.strip():
            return self._empty_content_start(full, turn_start, turn_end)
        raise EncodeError(ASSISTANT_CONTENT_NOT_FOUND, f"assistant turn {i} content is not in its rendering")

    def _empty_content_start(self, full: str, turn_start: int, turn_end: int) -> int:
        # Nothing to find: train the turn's closing marker only, taken as the eos token when present.
        eos = self.tokenizer.eos_token
        if isinstance(eos, str) and eos:
            found = full.rfind(eos, turn_start, turn_end)
            if found >= 0:
                return found
        return turn_end

    @staticmethod
    def _plain_spans(conversation: list[dict[str, str]]) -> tuple[str, list[Span]]:
        pieces: list[str] = []
        spans: list[Span] = []
        cursor = 0
        for i, message in enumerate(conversation):
            if i:
                pieces.append("\n")
                cursor += 1
            content = message["content"]
            if message["role"] == "assistant":
                spans.append((cursor, cursor + len(content)))
            pieces.append(content)
            cursor += len(content)
        return "".join(pieces), spans

    def _tokenize(self, text: str, spans: list[Span]) -> tuple[list[int], list[int]]:
        if not text:
            return [], []
        encoding = self.tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        input_ids = [int(token) for token in encoding["input_ids"]]
        offsets: list[Span] = [(int(s), int(e)) for s, e in encoding["offset_mapping"]]
        loss_mask = [0] * len(input_ids)
        # Tokens and spans are both sorted by position, so one forward sweep assigns every token: a span
        # that ends at or before a token's start cannot touch it or any later token.
        span_index = 0
        for position, token in enumerate(offsets):
            while span_index < len(spans) and spans[span_index][1] <= token[0]:
                span_index += 1
            if span_index < len(spans) and _overlaps(token, spans[span_index]):
                loss_mask[position] = 1
        return input_ids, loss_mask


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
