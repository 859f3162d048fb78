"""The HTTP face of the synthetic engine: the part of SGLang's server API that hsx uses."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from hsx import contract
from hsx.engine import regenerate_contract as engine_contract
from hsx.engine.regenerate_contract import GenerationParamError, GenerationParams
from workers.engines.synthetic.engine import SyntheticEngine


def _bad(detail: str) -> JSONResponse:
    return JSONResponse(status_code=400, content={"error": "bad_request", "detail": detail})


def _is_token(value: object) -> bool:
    # bool is an int subclass, but true/false in a prompt is a client bug, not token 1/0.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def create_app(engine: SyntheticEngine) -> FastAPI:
    app = FastAPI(title="hsx synthetic engine", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/generate", response_model=None)
    async def generate(request: Request) -> dict[str, Any] | JSONResponse:
        started = time.monotonic()
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return _bad(f"body is not JSON: {exc}")
        ids = body.get("input_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not ids or not all(_is_token(t) for t in ids):
            return _bad("input_ids must be a non-empty list of non-negative integers")
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            return _bad("rid must be a string")
        sampling = body.get("sampling_params")
        if sampling is not None and not isinstance(sampling, dict):
            return _bad("sampling_params must be an object")
        try:
            params = GenerationParams.from_sampling_params(sampling)
        except GenerationParamError as exc:
            return _bad(f"sampling_params.{exc}")
        limit = engine.prompt_limit()
        if len(ids) > limit:
            detail = f"{len(ids)} tokens exceed the longest prompt it takes, {limit}"
            return JSONResponse(status_code=400, content={"error": "too_long", "detail": detail})
        # A capture (an hsx- rid) is held to the longest prompt the engine reports; a generation's new tokens
        # must fit in the context beside its prompt.
        capture = (rid or "").startswith(contract.RID_PREFIX)
        if not capture and len(ids) + params.max_new_tokens > engine.config.context_length:
            return JSONResponse(
                status_code=400,
                content={
                    "error": "too_long",
                    "detail": f"{len(ids)} prompt tokens and {params.max_new_tokens} new ones exceed the "
                    f"context length {engine.config.context_length}",
                },
            )
        try:
            await run_in_threadpool(engine.prefill, ids, rid or "")
        except FileExistsError:
            return JSONResponse(
                status_code=409, content={"error": "duplicate_rid", "detail": f"{rid} was already captured"}
            )
        except (ValueError, OSError) as exc:  # a rid that escapes the dump dir or is too long for a name
            return _bad(f"cannot dump under rid {rid!r}: {exc}")
        output_ids, finish = engine.generate(ids, params)
        return engine_contract.generation_reply(rid or "", output_ids, finish, len(ids), 0, started)

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    def health_generate() -> Response:
        return Response(status_code=200)

    @app.get(contract.INFO_PATH)
    def info() -> dict[str, Any]:
        return engine.info().to_dict()

    @app.post("/flush_cache")
    def flush_cache() -> Response:
        return Response(content="Cache flushed.\n", status_code=200)

    return app
