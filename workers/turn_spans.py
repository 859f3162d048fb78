"""Where each assistant turn lies in one rendering of a whole conversation, found without assuming that the
template renders a turn the same way whatever follows it.

Many templates render a turn differently once more turns follow: Qwen3 drops the ``<think>`` block of every
assistant turn before the last user message, GPT-OSS ends the final turn with ``<|return|>`` and the others
with ``<|end|>``, templates group consecutive tool results. So the conversation is rendered once, as a whole,
and every assistant span is located inside that one text ``T``:

1. **Payload regions, by difference.** For each message ``k``, ``T`` is compared with the rendering of the
   same conversation in which only message ``k``'s payload (its content, reasoning and tool-call arguments)
   is replaced by a sentinel made of characters that occur nowhere in ``T``. The two texts agree before the
   first character that depends on that payload and after the last one, and the sentinel cannot match
   anything in ``T``, so the common prefix and suffix give exactly the region ``[p_k, q_k)`` of ``T`` that
   message ``k`` supplies, whatever the template did to it (trimmed, split, moved into another block). The
   regions must come in message order without overlapping; otherwise the template is refused for the sample
   (``template_not_separable``) instead of guessed at.
2. **Header and closing.** Between two payload regions lies template text only: the closing of one turn and
   the header of the next. An assistant turn is trained from the end of its header, the text its generation
   prompt supplies, through the end of its closing, the end-of-turn marker and whatever the template emits
   after it for that turn:

   * header: when the conversation up to the turn plus the generation prompt is a prefix of ``T`` (the
     template is stable up to there), the turn starts where that prefix ends. Otherwise the generation
     prompt's own text (what it adds to the conversation so far) is looked for between the previous region
     and ``p_i``; its last occurrence ends the header, and when it does not occur (Qwen3 without thinking:
     the prompt carries an empty ``<think>`` block that earlier turns no longer have) the turn starts at
     ``p_i``.
   * closing: when the conversation through the turn is a prefix of ``T``, the turn ends where it ends.
     Otherwise the closing is what follows the payload when this turn is the last one (found by the same
     difference); if ``T`` continues with exactly that text after ``q_i``, that is the closing. If not, the
     last turn uses another end marker than the others (GPT-OSS): the closing is then the special token that
     starts the gap, plus the whitespace tokens after it; a gap that does not start with a special token is
     refused.

Why the result is exact: ``T`` is the only text tokenized, so the ids are those of the template. Every
payload character of an assistant turn lies in its span (``h_i <= p_i <= q_i <= e_i``), and no character of
another message's payload can (spans stay inside the gaps between regions). What remains a convention is
how template text in a gap is split between two turns, and that is decided by the template's own
generation prompt and its own rendering of the turn as the last one.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Per-sample rejection reasons (stored with the rejected sample, next to the dataset's reasons).
TEMPLATE_FAILED = "template_failed"
TEMPLATE_NOT_SEPARABLE = "template_not_separable"
ASSISTANT_CONTENT_NOT_FOUND = "assistant_content_not_found"

Span = tuple[int, int]
Message = dict[str, Any]
# Renders a conversation; the flag asks for the generation prompt. Raises EncodeError when the template fails.
Render = Callable[[list[Message], bool], str]

# Private-use code points: no tokenizer gives them meaning and real text almost never holds them.
_SENTINEL_CANDIDATES = "".join(chr(code) for code in range(0xE000, 0xE100))
_BLOCK = 512


class EncodeError(Exception):
    """One sample cannot be encoded; ``reason`` is a stable code, ``detail`` says what was seen."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class TokenView:
    """The tokenization of ``T``: character offsets of each token and whether it is a special token."""

    offsets: Sequence[Span]
    special: Sequence[bool]


def common_prefix_length(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    start = 0
    while start < limit:
        stop = min(start + _BLOCK, limit)
        if a[start:stop] != b[start:stop]:
            while a[start] == b[start]:
                start += 1
            return start
        start = stop
    return limit


def common_suffix_length(a: str, b: str, limit: int) -> int:
    """Length of the common suffix of ``a`` and ``b``, at most ``limit``."""
    limit = min(limit, len(a), len(b))
    done = 0
    while done < limit:
        step = min(_BLOCK, limit - done)
        if a[len(a) - done - step : len(a) - done] != b[len(b) - done - step : len(b) - done]:
            while a[len(a) - done - 1] == b[len(b) - done - 1]:
                done += 1
            return done
        done += step
    return limit


def changed_region(text: str, variant: str) -> Span | None:
    """The region of ``text`` that differs from ``variant``; None when they are equal."""
    if text == variant:
        return None
    start = common_prefix_length(text, variant)
    tail = common_suffix_length(text, variant, min(len(text), len(variant)) - start)
    return start, len(text) - tail


def pick_sentinel(text: str, conversation: Sequence[Message]) -> str:
    """Two characters that occur neither in ``text`` nor in any message, so a sentinel can match nothing."""
    seen = set(text)
    for message in conversation:
        seen.update(repr(message))
    free = [char for char in _SENTINEL_CANDIDATES if char not in seen]
    if len(free) < 2:
        raise EncodeError(TEMPLATE_NOT_SEPARABLE, "the sample uses every private-use sentinel character")
    return free[0] + free[1]


def payload_variant(message: Message, sentinel: str) -> Message:
    """``message`` with its payload (content, reasoning, tool-call arguments) replaced by ``sentinel``.

    Everything else stays, tool names and ids included, so text the template derives from them (a tool
    result's header names the function it answers) renders the same.
    """
    variant = dict(message)
    variant["content"] = sentinel
    for key in ("reasoning_content", "thinking"):
        if isinstance(variant.get(key), str):
            variant[key] = sentinel
    calls = variant.get("tool_calls")
    if isinstance(calls, list):
        variant["tool_calls"] = [_call_variant(call, sentinel) for call in calls]
    return variant


def _call_variant(call: Any, sentinel: str) -> Any:
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if isinstance(function, dict):
        return {**call, "function": {**function, "arguments": sentinel}}
    return {**call, "arguments": sentinel}


class TurnLocator:
    """Finds the trained span of every assistant turn of ``conversation`` in its rendering ``text``."""

    def __init__(self, render: Render, conversation: list[Message], text: str, tokens: TokenView) -> None:
        self.render = render
        self.conversation = conversation
        self.text = text
        self.tokens = tokens
        self.sentinel = pick_sentinel(text, conversation)

    def assistant_spans(self) -> list[Span]:
        regions = self._payload_regions()
        spans: list[Span] = []
        for i, message in enumerate(self.conversation):
            if message["role"] != "assistant":
                continue
            region = regions[i]
            if region is None:
                raise EncodeError(
                    ASSISTANT_CONTENT_NOT_FOUND, f"the template does not render assistant turn {i}"
                )
            lower = max((r[1] for r in regions[:i] if r is not None), default=0)
            upper = min((r[0] for r in regions[i + 1 :] if r is not None), default=len(self.text))
            start = self._turn_start(i, lower, region[0])
            end = self._turn_end(i, region[1], upper)
            if spans and start < spans[-1][1]:
                start = spans[-1][1]  # two assistant turns in a row: the gap belongs to the first closing
            spans.append((start, end))
        return spans

    # --- step 1: payload regions ------------------------------------------------------------------------

    def _payload_regions(self) -> list[Span | None]:
        regions: list[Span | None] = []
        previous: tuple[int, Span] | None = None
        for k, message in enumerate(self.conversation):
            variant = [
                *self.conversation[:k],
                payload_variant(message, self.sentinel),
                *self.conversation[k + 1 :],
            ]
            region = changed_region(self.text, self.render(variant, False))
            if region is not None and previous is not None and region[0] < previous[1][1]:
                raise EncodeError(
                    TEMPLATE_NOT_SEPARABLE,
                    f"the text of message {k} ({message['role']}) is not rendered after that of message "
                    f"{previous[0]}",
                )
            if region is not None:
                previous = (k, region)
            regions.append(region)
        return regions

    # --- step 2: header and closing ---------------------------------------------------------------------

    def _try_render(self, conversation: list[Message], generation_prompt: bool) -> str | None:
        try:
            return self.render(conversation, generation_prompt)
        except EncodeError:
            return None  # some templates cannot render an empty or partial conversation

    def _turn_start(self, i: int, lower: int, payload_start: int) -> int:
        before = self.conversation[:i]
        prompt = self._try_render(before, True)
        context = self._try_render(before, False) if before else ""
        if prompt is None or context is None:
            return payload_start
        header = prompt[common_prefix_length(prompt, context) :]
        if not header:  # no generation prompt: nothing tells the header apart, so train from the payload
            return payload_start
        if self.text.startswith(prompt) and lower <= len(prompt) <= payload_start:
            return len(prompt)
        found = self.text.rfind(header, lower, payload_start)
        return found + len(header) if found >= 0 else payload_start

    def _turn_end(self, i: int, payload_end: int, upper: int) -> int:
        if i == len(self.conversation) - 1:
            return len(self.text)  # the whole conversation: whatever follows the payload closes this turn
        through = self.render(self.conversation[: i + 1], False)
        if self.text.startswith(through) and payload_end <= len(through) <= upper:
            return len(through)
        variant = [*self.conversation[:i], payload_variant(self.conversation[i], self.sentinel)]
        region = changed_region(through, self.render(variant, False))
        closing = through[region[1] :] if region is not None else ""
        if self.text.startswith(closing, payload_end) and payload_end + len(closing) <= upper:
            return payload_end + len(closing)
        return self._marker_end(i, payload_end, upper, closing)

    def _marker_end(self, i: int, payload_end: int, upper: int, closing_when_last: str) -> int:
        offsets, special = self.tokens.offsets, self.tokens.special
        first = bisect.bisect_left(offsets, (payload_end, payload_end))
        if first == len(offsets) or offsets[first][0] != payload_end or not special[first]:
            seen = self.text[payload_end : min(upper, payload_end + 40)]
            raise EncodeError(
                TEMPLATE_NOT_SEPARABLE,
                f"assistant turn {i} ends with {closing_when_last[:40]!r} when last but is followed by "
                f"{seen!r} here, which does not start with a special token",
            )
        end = offsets[first][1]
        for t in range(first + 1, len(offsets)):
            start, stop = offsets[t]
            if special[t] or start != end or self.text[start:stop].strip() or stop > upper:
                break
            end = stop
        return min(end, upper)
