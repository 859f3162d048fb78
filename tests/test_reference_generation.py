"""The reference engine generating (regeneration's engine contract): transformers' own greedy output,
seeded sampling that repeats, SGLang's stop rules, and captures untouched by the generations around them."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from hsx import contract
from hsx.engine import regenerate_contract as engine_contract
from hsx.engine.client import EngineRejected
from hsx.engine.dumps import read_dump
from hsx.engine.regenerate_contract import GenerationParams, generation_rid
from tests.fixtures.engine import RunningEngine, captured_rid, unique_prompt
from workers.reference_check import compare_with_transformers, transformers_greedy

EOS = 2  # SmolLM2's <|im_end|>, the eos of its config
_keys = itertools.count()


def chat_prompt(tokenizer: Any, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def rid() -> str:
    return generation_rid(f"test-{os.getpid()}-{next(_keys)}")


@pytest.mark.parametrize(
    ("question", "finish"),
    [("What is 2+2? Answer with one number.", "stop"), ("Name a color.", "length")],
)
def test_greedy_output_equals_transformers_generate(
    engine_nocache: RunningEngine, model_dir: Path, tokenizer: Any, question: str, finish: str
) -> None:
    prompt = chat_prompt(tokenizer, question)
    generation = engine_nocache.client.generate(prompt, GenerationParams(max_new_tokens=9), rid())
    assert generation.output_ids == transformers_greedy(model_dir, prompt, 9)
    assert generation.finish_reason == finish
    assert (generation.prompt_tokens, generation.cached_tokens) == (len(prompt), 0)
    if finish == "stop":  # the eos that ended it is the last token, kept as SGLang keeps it
        assert generation.output_ids[-1] == EOS and len(generation.output_ids) < 9
    else:
        assert len(generation.output_ids) == 9 and EOS not in generation.output_ids


def test_a_stop_token_of_the_request_ends_the_generation(
    engine_nocache: RunningEngine, tokenizer: Any
) -> None:
    prompt = chat_prompt(tokenizer, "Name a color.")
    free = engine_nocache.client.generate(prompt, GenerationParams(max_new_tokens=6), rid())
    stop_at = free.output_ids[2]
    assert stop_at not in free.output_ids[:2]
    stopped = engine_nocache.client.generate(
        prompt, GenerationParams(max_new_tokens=6, stop_token_ids=(stop_at,)), rid()
    )
    assert (stopped.output_ids, stopped.finish_reason) == (free.output_ids[:3], "stop")


def test_seeded_sampling_repeats_and_another_seed_differs(
    engine_nocache: RunningEngine, tokenizer: Any
) -> None:
    prompt = chat_prompt(tokenizer, "Write a word.")
    params = GenerationParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    first = engine_nocache.client.generate(prompt, params, rid())
    again = engine_nocache.client.generate(prompt, params, rid())
    other = engine_nocache.client.generate(
        prompt, GenerationParams(max_new_tokens=10, temperature=1.0, seed=99), rid()
    )
    assert first == again
    assert first.output_ids != other.output_ids
    assert engine_nocache.info.extra[engine_contract.SEEDED_SAMPLING] is True
    # one process on one device: what the datasets it makes record as their layout
    assert engine_nocache.info.parallel_layout == contract.ParallelLayout()


def test_a_capture_after_generations_is_untouched(engine_nocache: RunningEngine, model_dir: Path) -> None:
    prompt = unique_prompt(40)
    before = set(os.listdir(engine_nocache.dump_dir))
    generation = engine_nocache.client.generate(prompt, GenerationParams(max_new_tokens=6), rid())
    sampled = engine_nocache.client.generate(
        prompt, GenerationParams(max_new_tokens=6, temperature=1.0, seed=3), rid()
    )
    assert set(os.listdir(engine_nocache.dump_dir)) == before  # generations are never dumped
    conversation = prompt + generation.output_ids + sampled.output_ids
    capture_rid = captured_rid("after-generation")
    reply = engine_nocache.client.prefill(conversation, capture_rid)
    assert reply["meta_info"]["cached_tokens"] == 0
    dump = read_dump(engine_nocache.dump_dir, capture_rid, wait_seconds=10)
    assert (dump.meta.cached_tokens, dump.meta.num_tokens) == (0, len(conversation))
    assert dump.input_ids.tolist() == conversation
    assert min(compare_with_transformers(model_dir, conversation, dump).values()) > 0.999


def test_a_captured_request_that_generates_dumps_its_prompt_only(engine_nocache: RunningEngine) -> None:
    prompt, capture_rid = unique_prompt(9), captured_rid("generating")
    body = {"input_ids": prompt, "rid": capture_rid, "sampling_params": {"max_new_tokens": 4}}
    reply = httpx.post(f"{engine_nocache.url}/generate", json=body, timeout=120).json()
    assert 1 <= len(reply["output_ids"]) <= 4
    dump = read_dump(engine_nocache.dump_dir, capture_rid, wait_seconds=10)
    assert dump.input_ids.tolist() == prompt and dump.meta.prompt_tokens == 9


def test_with_its_cache_on_an_engine_reuses_the_generated_turn(engine_cache: RunningEngine) -> None:
    """What a separate generation engine with its cache on saves: the next turn re-prefills only the
    new tokens, the previous turn's prompt and generated tokens come from the cache."""
    prompt = unique_prompt(30)
    first = engine_cache.client.generate(prompt, GenerationParams(max_new_tokens=5), rid(), extra_key="turns")
    assert first.cached_tokens == 0
    next_turn = prompt + first.output_ids + unique_prompt(7)
    second = engine_cache.client.generate(
        next_turn, GenerationParams(max_new_tokens=3), rid(), extra_key="turns"
    )
    assert second.cached_tokens == len(prompt) + len(first.output_ids) - 1
    elsewhere = engine_cache.client.generate(
        next_turn, GenerationParams(max_new_tokens=3), rid(), extra_key="other"
    )
    assert elsewhere.cached_tokens == 0 and elsewhere.output_ids == second.output_ids


@pytest.mark.parametrize(
    ("sampling", "reason", "says"),
    [
        ({"max_new_tokens": 0}, "bad_request", "max_new_tokens"),
        ({"max_new_tokens": 4, "top_p": 2}, "bad_request", "top_p"),
        ({"max_new_tokens": 4, "top_k": 20}, "bad_request", "top_k"),
        ({"max_new_tokens": 8000}, "too_long", "8192 positions"),
    ],
)
def test_a_generation_the_engine_cannot_run_is_refused_with_a_reason(
    engine_nocache: RunningEngine, sampling: dict[str, Any], reason: str, says: str
) -> None:
    prompt = unique_prompt(200)
    body = {"input_ids": prompt, "rid": rid(), "sampling_params": sampling}
    reply = httpx.post(f"{engine_nocache.url}/generate", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"] == reason and says in reply.json()["detail"]
    if reason == "too_long":
        with pytest.raises(EngineRejected) as refused:
            engine_nocache.client.generate(prompt, GenerationParams(max_new_tokens=8000), rid())
        assert refused.value.reason == "too_long"
