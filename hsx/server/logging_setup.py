"""Structured logs: one JSON object a line (or ``key=value`` text) carrying the job id, unit index, attempt
and rid of the work in hand, with secrets scrubbed.

* :func:`configure_logging` installs the formatter on the root logger (the API and the worker call it).
* :func:`log_context` binds ``job_id``, ``unit``, ``attempt`` and ``rid`` for everything logged inside it,
  in this thread or task (contextvars; a thread pool needs ``contextvars.copy_context().run``).
* Every line is scrubbed of the API token, ``Authorization`` values and bearer tokens, passwords in URLs
  (``scheme://user:password@host``) and credential-like query parameters (``X-Amz-Signature``, ``token``,
  ...), so a dataset URI or a database URL can be logged as it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

CONTEXT_FIELDS = ("job_id", "unit", "attempt", "rid")
_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("hsx_log_context", default={})  # noqa: B039 - never mutated

REDACTED = "[redacted]"
_URL_PASSWORD = re.compile(r"(?P<prefix>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s:/@]*:)[^\s@/]+(?=@)")
_AUTH_HEADER = re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?)(?:bearer\s+|basic\s+)?[^\s'\",}]+")
_BEARER = re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=\-]+")
_SECRET_PARAM = re.compile(
    r"(?i)([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|signature|sig|token|access_token|"
    r"api_key|apikey|key|password|secret)=)[^&\s'\"]+"
)
_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Bind these fields (``job_id=``, ``unit=``, ``attempt=``, ``rid=``) to every record logged inside."""
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class Redactor:
    """Scrubs secrets out of a rendered line. ``secrets`` are exact strings (the API token)."""

    def __init__(self, secrets: list[str] | None = None) -> None:
        # Short strings would blank out ordinary words; a real token is long.
        self.secrets = sorted({s for s in (secrets or []) if len(s) >= 8}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        text = _URL_PASSWORD.sub(lambda m: m.group("prefix") + REDACTED, text)
        text = _AUTH_HEADER.sub(lambda m: m.group(1) + REDACTED, text)
        text = _BEARER.sub("Bearer " + REDACTED, text)
        return _SECRET_PARAM.sub(lambda m: m.group(1) + REDACTED, text)


class ContextFilter(logging.Filter):
    """Copies the bound context onto each record, so any formatter (and handler) can see it."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, val in _context.get().items():
            if not hasattr(record, key):
                setattr(record, key, val)
        return True


class StructuredFormatter(logging.Formatter):
    def __init__(self, style_name: str = "json", redactor: Redactor | None = None) -> None:
        super().__init__()
        self.style_name = style_name
        self.redact = redactor or Redactor()

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            if getattr(record, key, None) is not None:
                out[key] = getattr(record, key)
        for key, val in vars(record).items():  # extra={...} given at the call
            if key not in _RESERVED and key not in out and not key.startswith("_"):
                out[key] = val
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return out

    def format(self, record: logging.LogRecord) -> str:
        fields = self.fields(record)
        if self.style_name == "json":
            # Which process: one host runs many workers (hsx worker --processes N) into one stream.
            fields.setdefault("pid", record.process)
            return self.redact(json.dumps(fields, default=str, ensure_ascii=False))
        head = f"{fields.pop('ts')} {fields.pop('level'):<7} {fields.pop('logger')}: {fields.pop('msg')}"
        exc = fields.pop("exc", None)
        tail = " ".join(f"{k}={_kv(v)}" for k, v in fields.items())
        line = f"{head} {tail}".rstrip() + (f"\n{exc}" if exc else "")
        return self.redact(line)


def _kv(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in '"=' for c in text) else text


def configure_logging(
    log_format: str = "text", level: str | int = "INFO", secrets: list[str] | None = None
) -> None:
    """Route every logger (uvicorn's and RQ's included) through one scrubbing formatter on stderr."""
    if log_format not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', not {log_format!r}")
    if secrets is None:
        secrets = _configured_secrets()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(StructuredFormatter(log_format, Redactor(secrets)))
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "rq.worker"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True


def _configured_secrets() -> list[str]:
    from hsx.server.settings import get_settings

    with contextlib.suppress(OSError):
        token = get_settings().token()
        return [token] if token else []
    return []
