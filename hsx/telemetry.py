"""Worker-side measurements that only a worker can take, pushed through Redis so one scrape of the API's
``/metrics`` shows every worker.

The worker calls the functions at the bottom (``engine_request``, ``dump_wait``, ``bytes_written``,
``samples_truncated``, ...). Each call only adds to an in-process total under a lock; at most every
:data:`FLUSH_INTERVAL_SECONDS` (and on :func:`flush`) the totals are added to Redis with ``HINCRBYFLOAT``,
one hash per metric under the queue name, so every worker's numbers sum on the server and nothing needs a
per-worker key.

Telemetry never hurts the work: a Redis error is logged (rate-limited) and swallowed, the totals are kept
for the next flush, and after a failure no flush is tried for :data:`RETRY_AFTER_SECONDS`. A flush whose
reply was lost may be counted twice; these are operator numbers, not the job table.

RQ runs each unit in a forked work horse that leaves with ``os._exit``, which skips ``atexit``: the job
runner calls :func:`flush` at the end of every unit. Totals a parent had not flushed are dropped in the
child at fork so they are not counted twice.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

KEY_PREFIX = "hsx:metrics:"
FLUSH_INTERVAL_SECONDS = 2.0
RETRY_AFTER_SECONDS = 5.0
REDIS_TIMEOUT_SECONDS = 0.5
# Fields of a histogram hash: one cumulative count per upper bound ("le:<bound>"), plus "sum" and "count".
SUM_FIELD = "sum"
# The one field of an unlabelled counter's hash; a labelled counter has one field per label value.
VALUE_FIELD = "value"
COUNT_FIELD = "count"


@dataclass(frozen=True)
class MetricSpec:
    """A metric the workers push; the API renders it under ``name`` with ``help``."""

    name: str
    kind: str  # "counter" or "histogram"
    help: str
    label: str | None = None  # one optional label, e.g. a reason
    buckets: tuple[float, ...] = ()


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

ENGINE_REQUEST_SECONDS = MetricSpec(
    "hsx_engine_request_seconds",
    "histogram",
    "Time of one prefill request to the engine, as the worker saw it.",
    buckets=LATENCY_BUCKETS,
)
DUMP_WAIT_SECONDS = MetricSpec(
    "hsx_dump_wait_seconds",
    "histogram",
    "Time a worker waited for a request's dump to appear after the engine answered.",
    buckets=LATENCY_BUCKETS,
)
BYTES_WRITTEN = MetricSpec("hsx_bytes_written", "counter", "Bytes of shards written by workers.")
SAMPLES_TRUNCATED = MetricSpec(
    "hsx_samples_truncated", "counter", "Samples cut to the job's max_length before capture."
)
SAMPLE_RETRIES = MetricSpec(
    "hsx_sample_retries",
    "counter",
    "Capture attempts that failed validation, by reason (a first failure is retried, a second rejects).",
    label="reason",
)
ENGINE_ERRORS = MetricSpec(
    "hsx_engine_errors", "counter", "Engine requests that failed, by kind of failure.", label="kind"
)
UNITS_PROCESSED = MetricSpec(
    "hsx_units_processed",
    "counter",
    "Work units a worker finished, by outcome (committed, lease_lost, released, failed).",
    label="outcome",
)

METRICS: tuple[MetricSpec, ...] = (
    ENGINE_REQUEST_SECONDS,
    DUMP_WAIT_SECONDS,
    BYTES_WRITTEN,
    SAMPLES_TRUNCATED,
    SAMPLE_RETRIES,
    ENGINE_ERRORS,
    UNITS_PROCESSED,
)


def redis_key(spec: MetricSpec, namespace: str) -> str:
    """``hsx:metrics:<queue name>:<metric>``: deployments (and test runs) sharing a Redis stay apart."""
    return f"{KEY_PREFIX}{namespace}:{spec.name}"


def bucket_field(bound: float) -> str:
    return f"le:{bound:g}"


class _Accumulator:
    """Totals not yet flushed: {redis key: {field: amount}}."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: dict[str, dict[str, float]] = {}
        self.last_flush = time.monotonic()
        self.retry_at = 0.0
        self.last_error_log = 0.0
        self.redis: Any = None
        self.redis_url: str | None = None
        self.namespace: str | None = None

    def add(self, spec: MetricSpec, fields: Iterable[tuple[str, float]]) -> None:
        with self.lock:
            target = self.pending.setdefault(spec.name, {})
            for name, amount in fields:
                target[name] = target.get(name, 0.0) + amount

    def reset_after_fork(self) -> None:
        self.lock = threading.Lock()
        self.pending = {}
        self.redis = None
        self.last_flush = time.monotonic()


_acc = _Accumulator()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_acc.reset_after_fork)


def configure(redis_url: str | None, namespace: str | None = None) -> None:
    """Use this Redis and namespace (default: ``Settings.redis_url`` and ``Settings.queue_name``, read at
    the first flush). Tests and tools call it; the worker needs not."""
    with _acc.lock:
        _acc.redis_url = redis_url
        _acc.namespace = namespace
        _acc.redis = None


def _target() -> tuple[Any, str]:
    if _acc.redis is None or _acc.namespace is None:
        from redis import Redis

        from hsx.settings import get_settings

        url = _acc.redis_url or get_settings().redis_url
        _acc.namespace = _acc.namespace or get_settings().queue_name
        _acc.redis = Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT_SECONDS, socket_connect_timeout=REDIS_TIMEOUT_SECONDS
        )
    return _acc.redis, _acc.namespace


def flush() -> bool:
    """Add the pending totals to Redis now; True when nothing is left pending. Never raises."""
    with _acc.lock:
        batch, _acc.pending = _acc.pending, {}
        _acc.last_flush = time.monotonic()
    if not batch:
        return True
    try:
        connection, namespace = _target()
        specs = {spec.name: spec for spec in METRICS}
        pipe = connection.pipeline(transaction=True)
        for metric, fields in batch.items():
            for name, amount in fields.items():
                pipe.hincrbyfloat(redis_key(specs[metric], namespace), name, amount)
        pipe.execute()
        return True
    except Exception as exc:  # noqa: BLE001 - telemetry must never raise into the worker
        now = time.monotonic()
        with _acc.lock:
            for key, fields in batch.items():  # keep them for the next try
                target = _acc.pending.setdefault(key, {})
                for name, amount in fields.items():
                    target[name] = target.get(name, 0.0) + amount
            _acc.retry_at = now + RETRY_AFTER_SECONDS
            _acc.redis = None
            should_log = now - _acc.last_error_log > 60
            if should_log:
                _acc.last_error_log = now
        if should_log:
            log.warning("telemetry not flushed to Redis (kept for later): %s", exc.__class__.__name__)
        return False


def _maybe_flush() -> None:
    now = time.monotonic()
    if now - _acc.last_flush >= FLUSH_INTERVAL_SECONDS and now >= _acc.retry_at:
        flush()


def _count(spec: MetricSpec, amount: float, label_value: str | None = None) -> None:
    if amount <= 0:
        return
    field = (label_value or "unknown") if spec.label else VALUE_FIELD
    _acc.add(spec, [(field, float(amount))])
    _maybe_flush()


def _observe(spec: MetricSpec, seconds: float) -> None:
    seconds = max(0.0, float(seconds))
    fields = [(bucket_field(b), 1.0) for b in spec.buckets if seconds <= b]
    fields += [(SUM_FIELD, seconds), (COUNT_FIELD, 1.0)]
    _acc.add(spec, fields)
    _maybe_flush()


# --- what the worker calls ------------------------------------------------------------------------------


def engine_request(seconds: float) -> None:
    """One prefill request took ``seconds`` (successful or not)."""
    _observe(ENGINE_REQUEST_SECONDS, seconds)


def dump_wait(seconds: float) -> None:
    """The worker waited ``seconds`` for a request's dump to appear (found or not)."""
    _observe(DUMP_WAIT_SECONDS, seconds)


def bytes_written(n: int) -> None:
    """A shard of ``n`` bytes was written."""
    _count(BYTES_WRITTEN, n)


def samples_truncated(n: int = 1) -> None:
    """``n`` samples were cut to the job's max_length."""
    _count(SAMPLES_TRUNCATED, n)


def sample_retried(reason: str) -> None:
    """A capture attempt failed validation with ``reason`` (it is retried, or the sample rejected)."""
    _count(SAMPLE_RETRIES, 1, reason)


def engine_error(kind: str) -> None:
    """An engine request failed: ``kind`` is e.g. ``unavailable``, ``rejected``, ``timeout``."""
    _count(ENGINE_ERRORS, 1, kind)


def unit_finished(outcome: str) -> None:
    """A unit ended: ``committed``, ``lease_lost``, ``released`` or ``failed``."""
    _count(UNITS_PROCESSED, 1, outcome)


# --- what the API reads -----------------------------------------------------------------------------------


def read_all(connection: Any, namespace: str) -> dict[str, Mapping[str, float]]:
    """Every pushed metric's hash, decoded: {metric name: {field: value}}."""
    pipe = connection.pipeline(transaction=False)
    for spec in METRICS:
        pipe.hgetall(redis_key(spec, namespace))
    out: dict[str, Mapping[str, float]] = {}
    for spec, raw in zip(METRICS, pipe.execute(), strict=True):
        out[spec.name] = {
            (k.decode() if isinstance(k, bytes) else str(k)): float(v) for k, v in (raw or {}).items()
        }
    return out
