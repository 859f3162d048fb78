"""The generation contract (hsx.engine.regenerate_contract) and the worker's client of it: what a request
says, what a reply must hold, and which error each engine answer becomes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hsx import contract
from hsx.engine import regenerate_contract as engine_contract
from hsx.engine.client import EngineClient, EngineRejected, EngineUnfit
from hsx.engine.regenerate_contract import (
    Generation,
    GenerationParamError,
    GenerationParams,
    generate_body,
    generation_reply,
    generation_rid,
    parse_reply,
)
from tests.fixtures.live_server import serve_in_thread


def test_a_generation_rid_is_never_a_captured_rid() -> None:
    rid = generation_rid("job-1-sample-7-turn-3")
    assert engine_contract.is_generation_rid(rid) and not contract.is_captured_rid(rid)
    with pytest.raises(ValueError, match="captured rid"):
        generate_body([1, 2], GenerationParams(max_new_tokens=4), "hsx-would-be-dumped")
    for key in ("", "a/b", "a\\b"):
        with pytest.raises(ValueError):
            generation_rid(key)


def test_the_body_names_sglangs_sampling_parameters() -> None:
    params = GenerationParams(max_new_tokens=64, temperature=0.7, top_p=0.95, seed=123, stop_token_ids=(2, 7))
    body = generate_body([1, 2, 3], params, "hsxgen-x", extra_key="ns")
    assert body == {
        "input_ids": [1, 2, 3],
        "rid": "hsxgen-x",
        "extra_key": "ns",
        "sampling_params": {
            "max_new_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.95,
            "top_k": -1,
            "stop_token_ids": [2, 7],
            "sampling_seed": 123,
        },
    }
    plain = generate_body([1], GenerationParams(max_new_tokens=8), "hsxgen-y")["sampling_params"]
    assert "sampling_seed" not in plain and "stop_token_ids" not in plain and plain["temperature"] == 0.0
    assert GenerationParams.from_sampling_params(body["sampling_params"]) == params


def test_an_engine_reads_left_out_parameters_as_sglangs_defaults() -> None:
    params = GenerationParams.from_sampling_params({})
    assert (params.max_new_tokens, params.temperature, params.top_p, params.seed) == (128, 1.0, 1.0, None)
    assert not params.greedy and GenerationParams(max_new_tokens=1, temperature=1e-7).greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": float("nan")}, "temperature"),
        ({"max_new_tokens": 4, "temperature": -0.1}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "seed": -1}, "seed"),
        ({"max_new_tokens": 4, "seed": 2**63}, "seed"),
        ({"max_new_tokens": 4, "seed": 1.5}, "seed"),
        ({"max_new_tokens": 4, "stop_token_ids": [2]}, "stop_token_ids"),
        ({"max_new_tokens": 4, "stop_token_ids": (2, -3)}, "stop_token_ids"),
    ],
)
def test_out_of_range_parameters_name_their_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(GenerationParamError) as caught:
        GenerationParams(**kwargs)
    assert caught.value.field == field and field in str(caught.value)


PARAMS = GenerationParams(max_new_tokens=4)


def test_a_reply_of_the_hsx_engines_parses_back() -> None:
    stop = generation_reply("hsxgen-a", [9, 8, 2], "stop", 5, 0, 0.0)
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert parse_reply(stop, 5, PARAMS) == Generation([9, 8, 2], "stop", 5, 0)
    length = generation_reply("hsxgen-b", [9, 8, 7, 6], "length", 5, 3, 0.0)
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    parsed = parse_reply(length, 5, PARAMS)
    assert (parsed.finish_reason, parsed.cached_tokens, parsed.completion_tokens) == ("length", 3, 4)


def _reply(output_ids: Any, finish: Any, prompt_tokens: Any = 5, cached: Any = 0) -> dict[str, Any]:
    meta = {"finish_reason": finish, "prompt_tokens": prompt_tokens, "cached_tokens": cached}
    return {"output_ids": output_ids, "meta_info": meta}


@pytest.mark.parametrize(
    ("reply", "complaint"),
    [
        ([1, 2], "not an object"),
        ({"output_ids": [1]}, "no meta_info"),
        (_reply([1], {"type": "eos"}), "neither stop nor length"),
        (_reply(None, {"type": "stop"}), "skip-tokenizer-init"),
        (_reply([1, "2"], {"type": "stop"}), "output_ids"),
        (_reply([1], {"type": "stop"}, prompt_tokens=4), "prompt_tokens"),
        (_reply([1], {"type": "stop"}, cached=6), "cached_tokens"),
        (_reply([1, 2, 3, 4, 5], {"type": "length"}), "max_new_tokens"),
        (_reply([1, 2], {"type": "length"}), "max_new_tokens"),
        (_reply([], {"type": "stop"}), "without the stop token"),
    ],
)
def test_a_reply_that_breaks_the_contract_is_refused(reply: Any, complaint: str) -> None:
    with pytest.raises(engine_contract.GenerationReplyError, match=complaint):
        parse_reply(reply, 5, PARAMS)


def test_an_abort_is_told_apart() -> None:
    with pytest.raises(engine_contract.GenerationAborted, match="out of memory"):
        parse_reply(_reply([], {"type": "abort", "message": "out of memory"}), 5, PARAMS)


def _engine(answers: dict[str, tuple[int, Any]]) -> FastAPI:
    """An engine that answers each rid as told: the misbehaving engines no real one can be made into."""
    app = FastAPI()
    app.state.bodies = []

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        app.state.bodies.append(body)
        status, content = answers[body["rid"]]
        return JSONResponse(status_code=status, content=content)

    return app


@pytest.fixture
def odd_engine() -> Iterator[tuple[EngineClient, FastAPI]]:
    app = _engine(
        {
            "hsxgen-ok": (200, generation_reply("hsxgen-ok", [4, 2], "stop", 3, 0, 0.0)),
            "hsxgen-refused": (400, {"error": "too_long", "detail": "3 + 4 tokens exceed 5"}),
            "hsxgen-sglang-refused": (400, {"error": {"message": "Requested token count exceeds"}}),
            "hsxgen-aborted": (200, _reply([], {"type": "abort", "message": "aborted"}, 3)),
            "hsxgen-garbled": (200, {"text": "no ids"}),
            "hsxgen-no-route": (404, {"detail": "Not Found"}),
        }
    )
    with serve_in_thread(app) as url, EngineClient(url, timeout=10, retries=0) as client:
        yield client, app


def test_the_client_turns_each_answer_into_a_generation_or_the_right_error(
    odd_engine: tuple[EngineClient, FastAPI],
) -> None:
    client, app = odd_engine
    assert client.generate([1, 2, 3], PARAMS, "hsxgen-ok") == Generation([4, 2], "stop", 3, 0)
    assert app.state.bodies[-1] == generate_body([1, 2, 3], PARAMS, "hsxgen-ok")
    with pytest.raises(EngineRejected) as refused:
        client.generate([1, 2, 3], PARAMS, "hsxgen-refused")
    assert (refused.value.reason, refused.value.status) == ("too_long", 400)
    with pytest.raises(EngineRejected) as sglang:
        client.generate([1, 2, 3], PARAMS, "hsxgen-sglang-refused")
    assert sglang.value.reason == "http_400" and "token count" in sglang.value.detail
    with pytest.raises(EngineRejected) as aborted:
        client.generate([1, 2, 3], PARAMS, "hsxgen-aborted")
    assert aborted.value.reason == "generation_aborted"
    with pytest.raises(EngineUnfit, match="broke the generation contract"):
        client.generate([1, 2, 3], PARAMS, "hsxgen-garbled")
    with pytest.raises(EngineUnfit, match="404"):
        client.generate([1, 2, 3], PARAMS, "hsxgen-no-route")
