from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest

from hsx.server.ingest import ChatMessage
from tests.reference_samples import iter_samples
from workers.chat import (
    NO_ASSISTANT_TOKENS,
    TEMPLATE_NOT_SEPARABLE,
    ChatEncoder,
    EncodeError,
    chat_template_sha256,
    tokenizer_identity,
)

SAMPLE_CHATS = Path(__file__).resolve().parent.parent / "data" / "sample_chats.jsonl"

# Not prefix-stable: the first thing rendered depends on how many messages there are.
COUNTING_TEMPLATE = (
    "{{ messages|length }}{% for m in messages %}<{{ m.role }}>{{ m.content }}<|im_end|>{% endfor %}"
)
# Trims contents, and has no generation prompt, so the header is not known from the template.
TRIMMING_TEMPLATE = (
    "{% for m in messages %}### {{ m.role }}:\n{{ m.content | trim }}\n<|im_end|>\n{% endfor %}"
)
# Renders the conversation backwards: no order of turns to train in.
REVERSED_TEMPLATE = "{% for m in messages | reverse %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"


def _messages(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in turns]


def _masked_runs(tokenizer: Any, input_ids: list[int], loss_mask: list[int]) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs: list[list[int]] = []
    previous = 0
    for token, bit in zip(input_ids, loss_mask, strict=True):
        if bit and not previous:
            runs.append([])
        if bit:
            runs[-1].append(token)
        previous = bit
    return [tokenizer.decode(run) for run in runs]


def _with_template(tokenizer: Any, template: str) -> Any:
    variant = copy.deepcopy(tokenizer)
    variant.chat_template = template
    return variant


def _sample_chats() -> list[list[ChatMessage]]:
    chats: list[list[ChatMessage]] = []
    for _, sample in iter_samples(SAMPLE_CHATS, 0, 1000):
        assert isinstance(sample, list)
        chats.append(sample)
    return chats


def test_template_mask_covers_each_assistant_content_and_its_end_marker(tokenizer: Any) -> None:
    encoder = ChatEncoder(tokenizer)
    for messages in _sample_chats():
        encoded = encoder.encode(messages)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        assert encoded.input_ids == tokenizer(full, add_special_tokens=False)["input_ids"]
        assert not encoded.truncated
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        runs = _masked_runs(tokenizer, encoded.input_ids, encoded.loss_mask)
        assert len(runs) == len(answers)
        for run, answer in zip(runs, answers, strict=True):
            # The content starts the run (the role header is not trained); the turn's end marker ends it.
            assert run.startswith(answer)
            assert run[len(answer) :].strip() == tokenizer.eos_token


def test_user_and_system_text_is_never_trained(tokenizer: Any) -> None:
    messages = _messages(
        ("system", "SYSTEM-ZEBRA"), ("user", "USER-GIRAFFE"), ("assistant", "ok"), ("user", "USER-OKAPI")
    )
    messages.append({"role": "assistant", "content": "fine"})
    encoded = ChatEncoder(tokenizer).encode(messages)
    trained = "".join(_masked_runs(tokenizer, encoded.input_ids, encoded.loss_mask))
    for word in ("ZEBRA", "GIRAFFE", "OKAPI", "system", "user", "assistant"):
        assert word not in trained
    assert encoded.loss_mask[0] == 0


def test_content_that_repeats_the_role_name_is_located_after_the_header(tokenizer: Any) -> None:
    encoded = ChatEncoder(tokenizer).encode(_messages(("user", "Say your role."), ("assistant", "assistant")))
    runs = _masked_runs(tokenizer, encoded.input_ids, encoded.loss_mask)
    assert len(runs) == 1 and runs[0].startswith("assistant" + tokenizer.eos_token)


def test_empty_assistant_turn_trains_only_its_end_marker(tokenizer: Any) -> None:
    encoded = ChatEncoder(tokenizer).encode(_messages(("user", "Say nothing."), ("assistant", "")))
    runs = _masked_runs(tokenizer, encoded.input_ids, encoded.loss_mask)
    assert [run.strip() for run in runs] == [tokenizer.eos_token]


def test_without_template_the_mask_is_the_assistant_contents(tokenizer: Any) -> None:
    messages = _messages(("user", "What is 2+2?"), ("assistant", "It is 4."), ("user", "And 3+3?"))
    messages.append({"role": "assistant", "content": "It is 6."})
    encoded = ChatEncoder(tokenizer, use_chat_template=False).encode(messages)
    text = "What is 2+2?\nIt is 4.\nAnd 3+3?\nIt is 6."
    assert encoded.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    runs = _masked_runs(tokenizer, encoded.input_ids, encoded.loss_mask)
    assert [run.strip() for run in runs] == ["It is 4.", "It is 6."]


def test_truncation_keeps_the_head_and_is_reported(tokenizer: Any) -> None:
    messages = _messages(("user", "Count."), ("assistant", " ".join(str(n) for n in range(200))))
    full = ChatEncoder(tokenizer).encode(messages)
    limit = len(full.input_ids) - 50
    cut = ChatEncoder(tokenizer, max_length=limit).encode(messages)
    assert cut.truncated
    assert cut.input_ids == full.input_ids[:limit]
    assert cut.loss_mask == full.loss_mask[:limit]


def test_truncation_that_removes_every_assistant_token_is_rejected(tokenizer: Any) -> None:
    messages = _messages(("user", "A long question " * 40), ("assistant", "Short answer."))
    with pytest.raises(EncodeError) as caught:
        ChatEncoder(tokenizer, max_length=20).encode(messages)
    assert caught.value.reason == NO_ASSISTANT_TOKENS


def test_conversation_without_assistant_is_rejected(tokenizer: Any) -> None:
    with pytest.raises(EncodeError) as caught:
        ChatEncoder(tokenizer).encode(_messages(("user", "Hello?")))
    assert caught.value.reason == NO_ASSISTANT_TOKENS
    with pytest.raises(EncodeError) as caught:
        ChatEncoder(tokenizer, use_chat_template=False).encode(_messages(("user", "Hello?")))
    assert caught.value.reason == NO_ASSISTANT_TOKENS


def test_template_that_is_not_prefix_stable_gets_an_exact_mask(tokenizer: Any) -> None:
    variant = _with_template(tokenizer, COUNTING_TEMPLATE)
    messages = _messages(("user", "Hi"), ("assistant", "Hello"), ("user", "More"), ("assistant", "Sure"))
    encoded = ChatEncoder(variant).encode(messages)
    text = "4<user>Hi<|im_end|><assistant>Hello<|im_end|><user>More<|im_end|><assistant>Sure<|im_end|>"
    assert variant.decode(encoded.input_ids) == text
    assert _masked_runs(variant, encoded.input_ids, encoded.loss_mask) == [
        "Hello<|im_end|>",
        "Sure<|im_end|>",
    ]


def test_template_that_reorders_turns_is_refused(tokenizer: Any) -> None:
    encoder = ChatEncoder(_with_template(tokenizer, REVERSED_TEMPLATE))
    with pytest.raises(EncodeError) as caught:
        encoder.encode(_messages(("user", "Hi"), ("assistant", "Hello")))
    assert caught.value.reason == TEMPLATE_NOT_SEPARABLE


@pytest.mark.parametrize("answer", ["im", "end", "_end|", ">", "<|im_end|>", "assistant"])
def test_short_answers_are_located_where_the_template_put_them(tokenizer: Any, answer: str) -> None:
    # The contents also occur inside the end marker or the header; only where the template put them counts.
    variant = _with_template(tokenizer, TRIMMING_TEMPLATE.replace(" | trim", ""))
    messages = _messages(("user", "Say it."), ("assistant", answer), ("user", "Again."))
    messages.append({"role": "assistant", "content": answer})
    encoded = ChatEncoder(variant).encode(messages)
    runs = _masked_runs(variant, encoded.input_ids, encoded.loss_mask)
    assert runs == [answer + "\n<|im_end|>\n"] * 2


def test_trimming_template_without_generation_prompt_is_located_by_search(tokenizer: Any) -> None:
    variant = _with_template(tokenizer, TRIMMING_TEMPLATE)
    messages = _messages(("user", "  Hi  "), ("assistant", "  Hello there  "), ("user", "Bye"))
    messages.append({"role": "assistant", "content": "Goodbye"})
    encoded = ChatEncoder(variant).encode(messages)
    runs = _masked_runs(variant, encoded.input_ids, encoded.loss_mask)
    assert [run.split("\n")[0] for run in runs] == ["Hello there", "Goodbye"]
    assert all("### assistant" not in run for run in runs)
    assert all(run.rstrip().endswith("<|im_end|>") for run in runs)


def test_encoder_arguments_are_checked(tokenizer: Any) -> None:
    with pytest.raises(ValueError):
        ChatEncoder(tokenizer, max_length=0)
    with pytest.raises(ValueError):
        ChatEncoder(_with_template(tokenizer, ""), use_chat_template=True)


def test_identities(tokenizer: Any) -> None:
    expected = hashlib.sha256(tokenizer.chat_template.encode("utf-8")).hexdigest()
    assert chat_template_sha256(tokenizer) == expected
    assert chat_template_sha256(_with_template(tokenizer, COUNTING_TEMPLATE)) != expected
    identity = tokenizer_identity(tokenizer)
    assert identity["vocab_size"] == len(tokenizer)
    assert identity["name_or_path"] == str(tokenizer.name_or_path)
    tokenizer_json = Path(tokenizer.name_or_path) / "tokenizer.json"
    assert identity["tokenizer_json_sha256"] == hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
