"""The tokenizer side of a job on this worker: the tokenizer at the engine's model path (or
``HSX_TOKENIZER_PATH``), the chat encoder built from it, and the record the job is bound to (the engine,
the tokenizer and its chat template), which every worker that joins the job must match."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hsx.contract import EngineInfo, canonical_state_dtype
from hsx.server.job_options import JobOptions
from hsx.server.settings import Settings

if TYPE_CHECKING:
    from workers.chat import ChatEncoder

_TOKENIZERS: dict[str, Any] = {}


class TokenizerMissing(Exception):
    """Chat records arrived and no usable tokenizer loads (none at the engine's model path or
    HSX_TOKENIZER_PATH, or one without the chat template the job asks for)."""


def load_tokenizer(path: str) -> Any:
    """One tokenizer per path for the life of the process (a work horse runs many units)."""
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


def tokenizer_path(settings: Settings, info: EngineInfo) -> str:
    return settings.tokenizer_path or info.model_path


def engine_record(settings: Settings, info: EngineInfo) -> dict[str, Any]:
    """What the job is bound to: the engine's model and layers, the tokenizer and its chat template."""
    from workers.chat import chat_template_sha256, tokenizer_identity

    record = info.to_dict()
    record["state_dtype"] = canonical_state_dtype(info.dtype)
    try:
        tokenizer = load_tokenizer(tokenizer_path(settings, info))
    except (OSError, ValueError) as exc:
        # Pre-tokenized data needs none; a chat record then fails the job saying so (TokenizerMissing).
        record.update(tokenizer={"error": f"no tokenizer at {info.model_path!r}: {exc}"[:500]})
        record.update(chat_template_sha256="")
        return record
    record.update(
        tokenizer=tokenizer_identity(tokenizer), chat_template_sha256=chat_template_sha256(tokenizer)
    )
    return record


def worker_side(record: dict[str, Any]) -> dict[str, Any]:
    """The part of an engine record this worker brings rather than the engine: its tokenizer."""
    return {
        "tokenizer": record.get("tokenizer"),
        "chat_template_sha256": record.get("chat_template_sha256"),
    }


def chat_encoder(settings: Settings, info: EngineInfo, options: JobOptions) -> ChatEncoder:
    """The job's encoder, without a length limit (the unit processor applies the job's truncation)."""
    from workers.chat import ChatEncoder

    path = tokenizer_path(settings, info)
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise TokenizerMissing(
            f"chat records need a tokenizer, and none loads from {path!r} (set HSX_TOKENIZER_PATH, "
            f"or send pre-tokenized records): {exc}"
        ) from exc
    try:
        return ChatEncoder(tokenizer, options.chat_template, None)
    except ValueError as exc:  # a base model's tokenizer has no chat template
        raise TokenizerMissing(
            f"the tokenizer at {path!r} cannot encode this job's chat records: {exc} (submit with "
            "chat_template=false, or pre-tokenized records)"
        ) from exc
