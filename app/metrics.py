"""``GET /metrics``: Prometheus text for the whole deployment in one scrape.

Everything is read at scrape time, so any number of API replicas answer the same:

* the job table: jobs by state, samples done and rejected (by reason), tokens and tokens/s of running
  jobs (and the tokens/s generated for running regenerate jobs), work units by state, live leases, shards
  and their bytes;
* RQ: queue depth, wake-ups that failed (their function raised) apart from those cut short (their work
  horse or worker died: the job table counts those units' horse deaths and their leases end; the queue
  itself lost nothing), and registered workers;
* what the workers pushed through Redis (:mod:`hsx.server.telemetry`): engine request latency and dump wait
  (histograms), bytes written, truncations, sample retries, engine errors, units by outcome, tokens
  generated.

A source that cannot be read is reported as ``hsx_scrape_error{source=...} 1`` and its metrics are left out
(an absent series, not a false zero), so a database outage does not also hide the queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session

from app.deps import SessionDep, SettingsDep
from app.jobs.schemas import ErrorOut
from hsx.server import telemetry
from hsx.server.db.models import Job
from hsx.server.jobs import queries
from hsx.server.jobs.queue import queue_for
from hsx.server.redis_clients import redis_connection
from hsx.server.regenerate import repository as regen_repo
from hsx.server.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(tags=["metrics"])


@dataclass
class QueueStats:
    depth: int
    failed: int
    workers: int
    interrupted: int = 0


# How RQ words the failure of a job whose function never raised: its work horse was killed (a fault, the
# OOM killer, a crash of the process), its worker died and another worker's cleanup found it abandoned, or
# it was stopped. RQ files these in its failed registry too.
INTERRUPTED_MARKS = ("Work-horse terminated unexpectedly", "AbandonedJobError", "Job stopped by user")


def failed_registry_counts(connection: Any, queue: Any) -> tuple[int, int]:
    """(really failed, interrupted) among the failed registry's entries, from each one's last result, read
    in one round trip. An entry whose result has expired counts as failed: nothing says otherwise."""
    from rq.results import Result

    ids = queue.failed_job_registry.get_job_ids()
    pipe = connection.pipeline(transaction=False)
    for job_id in ids:
        pipe.xrevrange(Result.get_key(job_id), "+", "-", count=1)  # type: ignore[no-untyped-call]
    interrupted = 0
    for job_id, entries in zip(ids, pipe.execute(), strict=True):
        if not entries:
            continue
        result_id, payload = entries[0]
        result = Result.restore(job_id, result_id.decode(), payload, connection=connection)
        if any(mark in (result.exc_string or "") for mark in INTERRUPTED_MARKS):
            interrupted += 1
    return len(ids) - interrupted, interrupted


@dataclass(frozen=True)
class ActiveJob:
    id: str
    state: str
    samples_total: int
    samples_handled: int
    tokens: int
    started_at: datetime | None
    generated_tokens: int = 0  # a regenerate job's: tokens generated for its kept texts

    @classmethod
    def of(cls, job: Job) -> ActiveJob:
        handled = job.samples_done + job.samples_rejected
        started = queries.aware(job.started_at)
        return cls(job.id, job.state, job.samples_total, handled, int(job.tokens_done), started)


@dataclass
class Snapshot:
    totals: queries.Totals | None = None
    active: list[ActiveJob] = field(default_factory=list)
    queue: QueueStats | None = None
    pushed: dict[str, Any] | None = None
    errors: dict[str, bool] = field(default_factory=dict)


def take_snapshot(session: Session, settings: Settings) -> Snapshot:
    snap = Snapshot(errors={"database": False, "redis": False})
    try:
        snap.totals = queries.totals(session, time.time())
        active = [ActiveJob.of(job) for job in queries.active_jobs(session)]
        generated = regen_repo.generated_tokens_by_job(session, [job.id for job in active])
        snap.active = [replace(job, generated_tokens=generated.get(job.id, 0)) for job in active]
    except Exception as exc:  # noqa: BLE001 - a scrape reports a broken source, it does not fail
        log.warning("metrics: database unreadable: %s", exc.__class__.__name__)
        snap.errors["database"] = True
    try:
        from rq import Worker

        connection = redis_connection(settings)
        queue = queue_for(settings, connection)
        failed, interrupted = failed_registry_counts(connection, queue)
        snap.queue = QueueStats(
            depth=queue.count,
            failed=failed,
            workers=Worker.count(connection=connection, queue=queue),
            interrupted=interrupted,
        )
        snap.pushed = telemetry.read_all(connection, settings.queue_name)
    except Exception as exc:  # noqa: BLE001
        log.warning("metrics: Redis unreadable: %s", exc.__class__.__name__)
        snap.errors["redis"] = True
    return snap


def tokens_per_second(active: list[ActiveJob], now: datetime, generated: bool = False) -> float:
    """Captured (or, with ``generated``, generated) tokens per second of the running jobs, summed."""
    rate = 0.0
    for job in active:
        if job.state == "running" and job.started_at is not None:
            tokens = job.generated_tokens if generated else job.tokens
            rate += tokens / max((now - job.started_at).total_seconds(), 1e-6)
    return rate


class SnapshotCollector(Collector):
    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        snap = self.snap
        errors = GaugeMetricFamily(
            "hsx_scrape_error", "1 when a source of these metrics could not be read.", labels=["source"]
        )
        for source, failed in sorted(snap.errors.items()):
            errors.add_metric([source], 1.0 if failed else 0.0)
        yield errors
        if snap.totals is not None:
            yield from self._job_table(snap.totals, snap.active)
        if snap.queue is not None:
            yield GaugeMetricFamily("hsx_queue_depth", "Wake-ups waiting in the RQ queue.", snap.queue.depth)
            yield GaugeMetricFamily(
                "hsx_queue_failed",
                "Wake-ups whose function raised (RQ's failed registry).",
                snap.queue.failed,
            )
            yield GaugeMetricFamily(
                "hsx_queue_interrupted",
                "Wake-ups in RQ's failed registry that did not fail: their work horse or worker died.",
                snap.queue.interrupted,
            )
            yield GaugeMetricFamily("hsx_workers", "Workers registered with RQ.", snap.queue.workers)
        if snap.pushed is not None:
            yield from self._pushed(snap.pushed)

    @staticmethod
    def _job_table(t: queries.Totals, active: list[ActiveJob]) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("hsx_jobs", "Jobs by state.", labels=["state"])
        for state, n in sorted(t.jobs_by_state.items()):
            jobs.add_metric([state], n)
        yield jobs
        yield CounterMetricFamily("hsx_samples_done", "Samples written into shards.", t.samples_done)
        rejected = CounterMetricFamily(
            "hsx_samples_rejected", "Samples rejected, by reason.", labels=["reason"]
        )
        for reason, n in sorted(t.rejections_by_reason.items()):
            rejected.add_metric([reason], n)
        yield rejected
        yield CounterMetricFamily("hsx_tokens", "Tokens of samples written into shards.", t.tokens)
        yield GaugeMetricFamily(
            "hsx_tokens_per_second",
            "Tokens per second of running jobs, each since it started, summed.",
            tokens_per_second(active, datetime.now(timezone.utc)),
        )
        yield GaugeMetricFamily(
            "hsx_generated_tokens_per_second",
            "Tokens per second generated for the kept texts of running regenerate jobs, each since it "
            "started, summed.",
            tokens_per_second(active, datetime.now(timezone.utc), generated=True),
        )
        progress = GaugeMetricFamily(
            "hsx_job_progress_ratio", "Handled / total samples of queued and running jobs.", labels=["job_id"]
        )
        for job in active:
            progress.add_metric([job.id], job.samples_handled / job.samples_total if job.samples_total else 0)
        yield progress
        units = GaugeMetricFamily("hsx_work_units", "Work units by state.", labels=["state"])
        for state, n in sorted(t.units_by_state.items()):
            units.add_metric([state], n)
        yield units
        yield GaugeMetricFamily(
            "hsx_live_leases", "Work units leased now with an unexpired lease.", t.live_leases
        )
        yield CounterMetricFamily("hsx_shards", "Shards committed.", t.shards)
        yield CounterMetricFamily("hsx_shard_bytes", "Bytes of committed shards.", t.shard_bytes)

    @staticmethod
    def _pushed(pushed: dict[str, Any]) -> Iterator[Metric]:
        for spec in telemetry.METRICS:
            values = pushed.get(spec.name, {})
            if spec.kind == "histogram":
                count = values.get(telemetry.COUNT_FIELD, 0.0)
                buckets = [(f"{b:g}", values.get(telemetry.bucket_field(b), 0.0)) for b in spec.buckets]
                buckets.append(("+Inf", count))
                yield HistogramMetricFamily(
                    spec.name, spec.help, buckets=buckets, sum_value=values.get(telemetry.SUM_FIELD, 0.0)
                )
            elif spec.label is None:
                yield CounterMetricFamily(spec.name, spec.help, values.get(telemetry.VALUE_FIELD, 0.0))
            else:
                family = CounterMetricFamily(spec.name, spec.help, labels=[spec.label])
                for label_value, amount in sorted(values.items()):
                    family.add_metric([label_value], amount)
                yield family


def render(snap: Snapshot) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snap))
    return generate_latest(registry)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, 401: {"model": ErrorOut}},
)
def metrics(session: SessionDep, settings: SettingsDep) -> Response:
    return Response(render(take_snapshot(session, settings)), media_type=CONTENT_TYPE_LATEST)
