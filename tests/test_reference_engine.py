"""The reference engine over real HTTP: faithful captures, SGLang-like prefix caching, and clean refusals."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from hsx import contract
from hsx.engine.dumps import Dump, as_float32, read_dump
from hsx.server.settings import Settings
from tests.fixtures.engine import RunningEngine, captured_rid, unique_prompt
from workers.engines.model_store import DEFAULT_MODEL, convert_gguf, resolve_model_dir
from workers.engines.reference.cli import build_parser
from workers.engines.reference.engine import tensor_bytes
from workers.engines.reference.prefix_cache import PrefixCache
from workers.reference_check import compare_with_transformers

MIN_COSINE = 0.999


def prefill(
    engine: RunningEngine, ids: list[int], extra_key: str | None = None
) -> tuple[dict[str, Any], Dump]:
    rid = captured_rid()
    reply = engine.client.prefill(ids, rid, extra_key)
    return reply, read_dump(engine.dump_dir, rid, wait_seconds=10)


def test_info_describes_the_engine(engine_nocache: RunningEngine, engine_cache: RunningEngine) -> None:
    info = engine_nocache.info
    assert (info.backend, info.num_layers, info.hidden_size, info.dtype) == ("reference", 30, 576, "float32")
    assert info.aux_layer_ids == contract.eagle3_aux_layer_ids(30) == [1, 14, 26]
    assert info.hf_indices == [2, 15, 27, 30]
    assert info.dump_dir == engine_nocache.dump_dir
    assert info.prefix_cache is False and engine_cache.info.prefix_cache is True
    model_info = httpx.get(f"{engine_nocache.url}/get_model_info").json()
    assert model_info["model_path"] == info.model_path and model_info["is_generation"] is True


@pytest.mark.parametrize("length", [3, 24, 77])
def test_captured_states_equal_a_direct_transformers_forward(
    engine_nocache: RunningEngine, model_dir: Path, length: int
) -> None:
    ids = unique_prompt(length)
    reply, dump = prefill(engine_nocache, ids)
    assert reply["meta_info"]["prompt_tokens"] == length and reply["meta_info"]["cached_tokens"] == 0
    assert len(reply["output_ids"]) == 1
    assert dump.input_ids.tolist() == ids
    assert (dump.meta.num_tokens, dump.meta.prompt_tokens, dump.meta.cached_tokens) == (length, length, 0)
    assert sorted(dump.states) == engine_nocache.info.hf_indices
    assert all(state.shape == (length, 576) and dump.dtypes[i] == "F32" for i, state in dump.states.items())
    similarities = compare_with_transformers(model_dir, ids, dump)
    assert min(similarities.values()) >= MIN_COSINE, similarities


def test_the_comparison_notices_wrong_layers(engine_nocache: RunningEngine, model_dir: Path) -> None:
    # Guards the test above: a dump with its first and last layers swapped must score far below the bar.
    ids = unique_prompt(16)
    _, dump = prefill(engine_nocache, ids)
    dump.states[2], dump.states[30] = dump.states[30], dump.states[2]
    similarities = compare_with_transformers(model_dir, ids, dump)
    assert similarities[2] < 0.9 and similarities[30] < 0.9
    assert similarities[15] >= MIN_COSINE


def test_prefix_cache_truncates_the_capture_like_sglang(engine_cache: RunningEngine, model_dir: Path) -> None:
    prefix = unique_prompt(40)
    first = prefix + [101, 102, 103]
    second = prefix + [201, 202, 203, 204]

    reply, dump = prefill(engine_cache, first)
    assert reply["meta_info"]["cached_tokens"] == 0 and dump.meta.num_tokens == len(first)

    reply, dump = prefill(engine_cache, second)
    assert reply["meta_info"]["prompt_tokens"] == 44
    assert reply["meta_info"]["cached_tokens"] == 40
    # Only the recomputed tail is dumped: the silent truncation hsx exists to catch.
    assert (dump.meta.num_tokens, dump.meta.prompt_tokens, dump.meta.cached_tokens) == (4, 44, 40)
    assert dump.input_ids.tolist() == second[40:]
    assert all(state.shape[0] == 4 for state in dump.states.values())
    # The rows that are there are right: the reused keys and values are the real ones.
    assert min(compare_with_transformers(model_dir, second, dump).values()) >= MIN_COSINE

    reply, dump = prefill(engine_cache, second)
    assert reply["meta_info"]["cached_tokens"] == 43, "a repeated prompt still computes its last token"
    assert dump.input_ids.tolist() == second[-1:]


def test_extra_key_namespaces_the_prefix_cache(engine_cache: RunningEngine) -> None:
    prefix = unique_prompt(20)
    reply, _ = prefill(engine_cache, prefix + [11, 12], extra_key="job-a")
    assert reply["meta_info"]["cached_tokens"] == 0
    reply, dump = prefill(engine_cache, prefix + [13, 14], extra_key="job-b")
    assert reply["meta_info"]["cached_tokens"] == 0 and dump.meta.num_tokens == 22
    reply, dump = prefill(engine_cache, prefix + [15], extra_key=None)
    assert reply["meta_info"]["cached_tokens"] == 0 and dump.meta.num_tokens == 21
    reply, dump = prefill(engine_cache, prefix + [16], extra_key="job-a")
    assert reply["meta_info"]["cached_tokens"] == 20 and dump.meta.num_tokens == 1


def test_disabled_prefix_cache_never_reuses(engine_nocache: RunningEngine) -> None:
    ids = unique_prompt(12)
    for _ in range(2):
        reply, dump = prefill(engine_nocache, ids)
        assert reply["meta_info"]["cached_tokens"] == 0
        assert dump.meta.num_tokens == 12 and dump.input_ids.tolist() == ids


def test_uncaptured_requests_leave_no_dump(engine_cache: RunningEngine) -> None:
    before = sorted(os.listdir(engine_cache.dump_dir))
    reply = engine_cache.client.prefill(unique_prompt(5), "warmup-1")
    assert reply["meta_info"]["id"] == "warmup-1"
    # No rid; one new token (left out, max_new_tokens is SGLang's 128, and the engine would generate them).
    body = {"input_ids": unique_prompt(4), "sampling_params": {"max_new_tokens": 1}}
    response = httpx.post(f"{engine_cache.url}/generate", json=body, timeout=60)
    assert response.status_code == 200
    assert httpx.get(f"{engine_cache.url}/health_generate", timeout=60).status_code == 200
    assert sorted(os.listdir(engine_cache.dump_dir)) == before


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"input_ids": [], "rid": "hsx-empty"}, "empty_input"),
        ({"input_ids": [5, 49152], "rid": "hsx-vocab"}, "token_out_of_vocab"),
        ({"input_ids": [5, -1], "rid": "hsx-negative"}, "token_out_of_vocab"),
        ({"input_ids": [7] * 8193, "rid": "hsx-long"}, "too_long"),
        ({"input_ids": [5, 6], "rid": "hsx-../escape"}, "bad_rid"),
        ({"input_ids": [5, 6], "rid": 17}, "bad_rid"),
        ({"input_ids": [5, "6"], "rid": "hsx-str"}, "bad_request"),
        ({"input_ids": [[5, 6]], "rid": "hsx-batch"}, "bad_request"),
        ({"text": "hello", "rid": "hsx-text"}, "bad_request"),
        ([5, 6], "bad_request"),
    ],
)
def test_bad_requests_get_400_with_a_reason(engine_cache: RunningEngine, body: Any, error: str) -> None:
    response = httpx.post(f"{engine_cache.url}/generate", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"] == error and response.json()["detail"]


def test_non_json_body_gets_400(engine_cache: RunningEngine) -> None:
    response = httpx.post(f"{engine_cache.url}/generate", content=b"{not json", timeout=60)
    assert response.status_code == 400 and response.json()["error"] == "bad_request"


def test_a_rid_already_in_flight_is_refused(tmp_path: Path) -> None:
    # The engine's own app in process over a tiny random Llama, so the test can hold the forward lock (as a
    # long prompt would) and wait until the queued rid is in flight, instead of guessing with sleeps.
    from fastapi.testclient import TestClient
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.engines.reference.engine import EngineConfig, ReferenceEngine
    from workers.engines.reference.server import create_app

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    engine = ReferenceEngine(
        EngineConfig(
            model_dir=tmp_path / "model", dump_dir=str(tmp_path / "dumps"), prefix_cache=False, device="cpu"
        )
    )
    client = TestClient(create_app(engine))
    queued_rid = captured_rid("dup")
    replies: dict[str, httpx.Response] = {}

    def send(name: str, rid: str) -> None:
        replies[name] = client.post("/generate", json=contract.generate_body([5, 6, 7], rid))

    with engine._forward_lock:  # a long forward holds the engine
        queued = threading.Thread(target=send, args=("queued", queued_rid))
        queued.start()
        deadline = time.monotonic() + 60
        while queued_rid not in engine._inflight:  # until the queued request has claimed its rid
            assert time.monotonic() < deadline and queued.is_alive(), replies
            time.sleep(0.01)
        twin = threading.Thread(target=send, args=("twin", queued_rid))
        twin.start()
        twin.join(60)  # refused at once: it must not wait for the lock like the queued one
        assert not twin.is_alive(), "the twin was not refused: it waits for the forward lock"
        assert queued.is_alive(), "the queued request waits for the forward lock"
    queued.join(60)
    assert replies["queued"].status_code == 200, replies["queued"].text
    assert replies["twin"].status_code == 400 and replies["twin"].json()["error"] == "duplicate_rid"
    send("again", queued_rid)  # once the first is done, the rid is free again
    assert replies["again"].status_code == 200, replies["again"].text


def test_bf16_states_are_dumped_as_raw_words_that_widen_back() -> None:
    values = torch.tensor([[1.0, -2.5, 3.140625], [0.0, 65280.0, -1e-3]], dtype=torch.bfloat16)
    words = np.frombuffer(tensor_bytes(values), dtype=np.uint16).reshape(2, 3)
    np.testing.assert_array_equal(as_float32(words, "BF16"), values.float().numpy())


def test_prefix_cache_keeps_only_the_most_recent_prompts() -> None:
    cache = PrefixCache(max_prompts=2)
    layer = [(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2))]
    for first in (1, 2, 3):
        cache.insert(None, [first, 7, 7, 7, 7], layer)
    assert len(cache) == 2
    assert cache.longest_prefix(None, [1, 7, 7, 7, 7])[0] == 0, "the oldest prompt was evicted"
    length, kv = cache.longest_prefix(None, [3, 7, 7, 9])
    assert length == 3 and kv[0][0].shape[2] == 3
    assert cache.longest_prefix("other", [3, 7, 7, 9])[0] == 0


def test_the_default_model_resolves_to_the_converted_directory(model_dir: Path) -> None:
    settings = Settings(model_cache_dir=model_dir.parent)
    assert resolve_model_dir(None, settings) == model_dir
    assert resolve_model_dir(DEFAULT_MODEL, settings) == model_dir
    assert resolve_model_dir(str(model_dir), settings) == model_dir


def test_the_converted_model_also_suits_older_loaders(model_dir: Path) -> None:
    # SGLang pins transformers 4.x, which reads rope_theta and knows no TokenizersBackend class.
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>" in tokenizer_config["chat_template"]


@pytest.mark.parametrize("model", ["HuggingFaceTB/SmolLM2-135M-Instruct", "no/such/dir", "."])
def test_models_that_are_not_local_directories_are_refused(model: str) -> None:
    with pytest.raises(ValueError, match="model"):
        resolve_model_dir(model, Settings())


def test_a_failed_conversion_leaves_nothing_behind(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ValueError):
        convert_gguf(bad, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf"]


def test_the_engine_cli_parses_its_options() -> None:
    args = build_parser().parse_args(
        ["--aux-layers", "1,14,26", "--disable-prefix-cache", "--dtype", "bfloat16"]
    )
    assert (args.aux_layers, args.disable_prefix_cache, args.dtype, args.port) == (
        [1, 14, 26],
        True,
        "bfloat16",
        30000,
    )
    assert args.model == DEFAULT_MODEL and args.host == "127.0.0.1"
