"""The HTTP face of the reference engine: the subset of SGLang's server API that hsx uses."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from hsx import contract
from hsx.engine import regenerate_contract as engine_contract
from hsx.engine.regenerate_contract import GenerationParamError, GenerationParams
from workers.engines.reference.engine import ReferenceEngine, RequestRejected

log = logging.getLogger(__name__)


def create_app(engine: ReferenceEngine) -> FastAPI:
    app = FastAPI(title="hsx reference engine", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestRejected)
    async def _rejected(_request: Request, exc: RequestRejected) -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": exc.error, "detail": exc.detail})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": "bad_request", "detail": _short(exc.errors())})

    @app.exception_handler(Exception)
    async def _failed(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(status_code=500, content={"error": "internal", "detail": repr(exc)})

    # The forwards run in the thread pool (sync handlers, run_in_threadpool); the engine serialises them.
    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        started = time.monotonic()
        # Parsed by hand, whatever the content type (SGLang clients often omit it), into 400s with reasons.
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise RequestRejected("bad_request", f"body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise RequestRejected("bad_request", "body must be a JSON object")
        input_ids, rid, extra_key, params = parse_generate_body(body)
        result = await run_in_threadpool(engine.generate, input_ids, rid, extra_key, params)
        return engine_contract.generation_reply(
            result.rid,
            result.output_ids,
            result.finish_reason,
            result.prompt_tokens,
            result.cached_tokens,
            started,
        )

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    def health_generate() -> Response:
        engine.health_generate()
        return Response(status_code=200)

    @app.get(contract.INFO_PATH)
    def info() -> dict[str, Any]:
        return engine.info().to_dict()

    @app.get("/get_model_info")
    def model_info() -> dict[str, Any]:
        model_path = str(engine.config.model_dir)
        return {
            "model_path": model_path,
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }

    @app.post("/flush_cache")
    def flush_cache() -> Response:
        engine.flush_cache()
        return Response(content="Cache flushed.\n", status_code=200)

    return app


def parse_generate_body(
    body: Mapping[str, Any],
) -> tuple[list[int], str, str | None, GenerationParams]:
    """The prompt, rid, cache namespace and sampling of a ``/generate`` body (SGLang's defaults for the
    sampling parameters left out); RequestRejected says what is wrong."""
    input_ids = body.get("input_ids")
    if input_ids is None:
        raise RequestRejected("bad_request", "input_ids is required (text prompts are not supported)")
    if not isinstance(input_ids, list):
        raise RequestRejected("bad_request", "input_ids must be a list of token ids")
    if input_ids and isinstance(input_ids[0], list):
        raise RequestRejected(
            "bad_request", "batched requests are not supported; send one prompt per request"
        )
    for position, token in enumerate(input_ids):
        # bool is an int subclass, but true/false in a prompt is a client bug, not token 1/0.
        if not isinstance(token, int) or isinstance(token, bool):
            raise RequestRejected("bad_request", f"input_ids[{position}] = {token!r} is not an integer")
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex  # SGLang names anonymous requests itself; such rids are never captured
    elif not isinstance(rid, str) or not rid:
        raise RequestRejected("bad_rid", f"rid must be a non-empty string, got {rid!r}")
    extra_key = body.get("extra_key")
    if extra_key is not None and not isinstance(extra_key, str):
        raise RequestRejected("bad_request", f"extra_key must be a string, got {type(extra_key).__name__}")
    sampling = body.get("sampling_params", {})
    if sampling is not None and not isinstance(sampling, dict):
        raise RequestRejected("bad_request", "sampling_params must be an object")
    try:
        params = GenerationParams.from_sampling_params(sampling)
    except GenerationParamError as exc:
        raise RequestRejected("bad_request", f"sampling_params.{exc}") from exc
    return input_ids, rid, extra_key, params


def _short(errors: Any, limit: int = 500) -> str:
    text = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in errors)
    return text[:limit] or "invalid request"
