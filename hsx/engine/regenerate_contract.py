"""The engine contract of regeneration: how a worker asks an engine to continue a conversation.

Standard library only: the worker, the API (to check options) and the hsx engines import it.

**Request.** SGLang's native ``POST /generate``, one prompt per request::

    {"input_ids": [...], "rid": "hsxgen-...",
     "sampling_params": {"max_new_tokens": N, "temperature": T, "top_p": P, "top_k": -1,
                         "stop_token_ids": [...], "sampling_seed": S}}

The rid starts with :data:`GENERATION_RID_PREFIX`, never with ``hsx.contract.RID_PREFIX``: the capture
(the SGLang plugin's planner, the reference and synthetic engines) dumps only ``hsx-`` rids, so a generation
leaves no dump and takes no capture buffer. ``extra_key`` (SGLang's cache namespace) may be sent as for a
prefill. ``sampling_seed`` is left out when no seed is asked for. The prompt and ``max_new_tokens`` together
must fit the engine's ``context_length`` (``/hsx/info``): SGLang refuses a request that does not (HTTP 400,
unless it runs with ``--allow-auto-truncate``), and so do the hsx engines (``too_long``).

**Reply.** ``{"output_ids": [...], "meta_info": {"prompt_tokens", "completion_tokens", "cached_tokens",
"finish_reason": {"type": "stop", "matched": id} | {"type": "length", "length": N}}}``. ``output_ids`` are
the generated tokens only (not the prompt). On a stop, the matched stop token is the last of them: the
template's end-of-turn token comes back from the engine, it is not added by the worker.

**Checked against SGLang 0.5.17** (the wheel's own source):

* ``srt/sampling/sampling_params.py``: ``SamplingParams`` has ``max_new_tokens`` (default 128),
  ``stop_token_ids``, ``temperature`` (default 1.0; below 1e-6 it means greedy, top_k = 1), ``top_p``
  (default 1.0, must be in (0, 1]), ``top_k`` (-1: the whole vocabulary) and ``sampling_seed``: the
  per-request seed is called ``sampling_seed``, not ``seed``.
* ``srt/sampling/sampling_batch_info.py``: ``sampling_seed`` reaches the sampler only when the server runs
  with ``--enable-deterministic-inference``; without it the seed is ignored and sampling draws from the
  device's generator. (Regeneration does not depend on it: a unit's texts are kept before its capture.)
* ``srt/managers/schedule_batch.py``: ``FINISH_MATCHED_TOKEN.to_json()`` is ``{"type": "stop", "matched":
  id}``, ``FINISH_LENGTH``'s ``{"type": "length", "length": n}``, ``FINISH_ABORT``'s ``{"type": "abort",
  "message", ...}``. ``Req._check_token_based_finish`` stops on ``stop_token_ids``, on the model's eos ids
  (``config.json`` and ``generation_config.json``) and on the tokenizer's eos (none under
  ``--skip-tokenizer-init``); the reply carries ``output_ids_through_stop``, so the matched token is kept.
* ``srt/managers/tokenizer_manager.py``: ``meta_info`` holds ``id``, ``finish_reason``, ``prompt_tokens``,
  ``completion_tokens`` and ``cached_tokens``; under ``--skip-tokenizer-init`` (``BatchTokenIDOutput``) a
  finished reply is ``{"output_ids", "meta_info"}``, no ``text``.
* The same file merges a deployment's ``--preferred-sampling-params`` under the request's own; the model's
  ``generation_config.json`` defaults (``--sampling-defaults model``) apply to the OpenAI routes only. The
  request therefore names every parameter that shapes the distribution, ``top_k: -1`` included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hsx import contract

# Not "hsx-": the capture never dumps these (see hsx.contract.is_captured_rid).
GENERATION_RID_PREFIX = "hsxgen-"
FinishReason = Literal["stop", "length"]
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length")
# SGLang's default when a request names no max_new_tokens (SamplingParams.max_new_tokens).
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
SEED_LIMIT = 2**63  # sampling_seed is an int64 tensor in SGLang's sampler
GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: a lower temperature is greedy decoding
# The key of EngineInfo.extra that says whether the engine honours sampling_seed (a bool; SGLang: only
# under --enable-deterministic-inference). Absent: unknown.
SEEDED_SAMPLING = "seeded_sampling"

if GENERATION_RID_PREFIX.startswith(contract.RID_PREFIX):  # pragma: no cover - a guard on the constants
    raise AssertionError("generation rids must never be captured rids")


class GenerationParamError(ValueError):
    """A sampling parameter out of range; ``field`` names it (for a 422 or a 400 that says which)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class GenerationParams:
    """What one generation asks of the engine. Checked when made: a bad value raises
    :class:`GenerationParamError` naming the field."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise GenerationParamError(
                "max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}"
            )
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise GenerationParamError(
                "temperature", f"must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise GenerationParamError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise GenerationParamError("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(token) and token >= 0 for token in self.stop_token_ids
        ):
            raise GenerationParamError(
                "stop_token_ids", f"must be a tuple of token ids >= 0, got {self.stop_token_ids!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def sampling_params(self) -> dict[str, Any]:
        """The ``sampling_params`` object of the request, in SGLang's names."""
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": -1,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params

    @classmethod
    def from_sampling_params(cls, raw: Mapping[str, Any] | None) -> GenerationParams:
        """An engine's reading of a request's ``sampling_params``, with SGLang's defaults for what is left
        out. ``top_k`` other than -1 (or absent) is refused: hsx engines sample from the whole vocabulary."""
        raw = raw or {}
        top_k = raw.get("top_k", -1)
        if top_k is not None and top_k != -1:
            raise GenerationParamError("top_k", f"only -1 (the whole vocabulary) is supported, got {top_k!r}")
        stop = raw.get("stop_token_ids") or ()
        if not isinstance(stop, (list, tuple)):
            raise GenerationParamError("stop_token_ids", f"must be a list of token ids, got {stop!r}")
        return cls(
            max_new_tokens=_default(raw.get("max_new_tokens"), SGLANG_DEFAULT_MAX_NEW_TOKENS),
            temperature=_default(raw.get("temperature"), 1.0),
            top_p=_default(raw.get("top_p"), 1.0),
            seed=raw.get("sampling_seed"),
            stop_token_ids=tuple(stop),
        )


@dataclass(frozen=True)
class Generation:
    """An engine's answer to one generation request."""

    output_ids: list[int]  # the generated tokens; on "stop", the matched stop token is the last
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


class GenerationReplyError(ValueError):
    """A reply that breaks this contract (the engine is unfit, not the sample)."""


class GenerationAborted(ValueError):
    """The engine finished the request with ``{"type": "abort"}`` (SGLang: out of memory, a too-long
    prompt, a cancelled request); ``message`` is its reason."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def generation_rid(key: str) -> str:
    """The rid of a generation named by ``key`` (a sample and turn, an attempt); never a captured rid."""
    if not key or "/" in key or "\\" in key or "\x00" in key:
        raise ValueError(f"not a usable generation key: {key!r}")
    return f"{GENERATION_RID_PREFIX}{key}"


def is_generation_rid(rid: object) -> bool:
    return isinstance(rid, str) and rid.startswith(GENERATION_RID_PREFIX)


def generate_body(
    input_ids: Sequence[int], params: GenerationParams, rid: str, extra_key: str | None = None
) -> dict[str, Any]:
    if contract.is_captured_rid(rid):
        raise ValueError(f"{rid!r} is a captured rid: a generation must not be dumped")
    body: dict[str, Any] = {
        "input_ids": [int(token) for token in input_ids],
        "rid": rid,
        "sampling_params": params.sampling_params(),
    }
    if extra_key is not None:
        body["extra_key"] = extra_key
    return body


def parse_reply(reply: Any, prompt_length: int, params: GenerationParams) -> Generation:
    """The :class:`Generation` of a ``/generate`` reply; :class:`GenerationAborted` for an abort,
    :class:`GenerationReplyError` for a reply no engine keeping this contract sends."""
    if not isinstance(reply, Mapping):
        raise GenerationReplyError(f"the reply is not an object: {str(reply)[:200]}")
    meta = reply.get("meta_info")
    output_ids = reply.get("output_ids")
    if not isinstance(meta, Mapping):
        raise GenerationReplyError(f"the reply has no meta_info: {str(reply)[:200]}")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, Mapping) else None
        raise GenerationAborted(str(message or "aborted by the engine"))
    if kind not in FINISH_REASONS:
        raise GenerationReplyError(f"finish_reason {finish!r} is neither stop nor length")
    if not isinstance(output_ids, list) or not all(_is_int(t) and t >= 0 for t in output_ids):
        raise GenerationReplyError(
            f"output_ids must be a list of token ids (is the server run with --skip-tokenizer-init?): "
            f"{str(output_ids)[:200]}"
        )
    prompt_tokens, cached_tokens = meta.get("prompt_tokens"), meta.get("cached_tokens", 0)
    if prompt_tokens != prompt_length:
        raise GenerationReplyError(f"prompt_tokens is {prompt_tokens!r}, the prompt had {prompt_length}")
    if not _is_int(cached_tokens) or not 0 <= cached_tokens <= prompt_length:
        raise GenerationReplyError(f"cached_tokens {cached_tokens!r} is not in [0, {prompt_length}]")
    if len(output_ids) > params.max_new_tokens or (
        kind == "length" and len(output_ids) != params.max_new_tokens
    ):
        raise GenerationReplyError(
            f"{len(output_ids)} tokens finished on {kind!r} with max_new_tokens {params.max_new_tokens}"
        )
    if kind == "stop" and not output_ids:
        raise GenerationReplyError("finished on 'stop' without the stop token")
    return Generation(list(output_ids), kind, prompt_tokens, cached_tokens)


def generation_reply(
    rid: str,
    output_ids: Sequence[int],
    finish_reason: FinishReason,
    prompt_tokens: int,
    cached_tokens: int,
    started: float,
) -> dict[str, Any]:
    """The ``/generate`` answer of the hsx engines, shaped like SGLang's under ``--skip-tokenizer-init``
    (``started``: ``time.monotonic()`` when the request arrived)."""
    finish: dict[str, Any] = (
        {"type": "stop", "matched": int(output_ids[-1])}
        if finish_reason == "stop"
        else {"type": "length", "length": len(output_ids)}
    )
    return {
        "output_ids": [int(token) for token in output_ids],
        "meta_info": {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(output_ids),
            "cached_tokens": cached_tokens,
            "e2e_latency": time.monotonic() - started,
        },
    }


def _is_int(value: object) -> bool:
    # bool is an int subclass, but true/false is a client bug, not 1/0.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value
