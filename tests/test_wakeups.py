"""Waking workers: a job with claimable units gets one wake-up per idle worker, so they join at once.

Real Redis and RQ's own worker registry; the workers are registered, not run (what is measured is what
the queue holds for them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from rq import Worker

from hsx.server.jobs.queue import queue_for, queued_wakeups, wake_idle_workers
from hsx.server.settings import Settings
from tests.fixtures.jobs import running_job


@pytest.fixture
def settings(redis_url: str) -> Iterator[Settings]:
    settings = Settings(redis_url=redis_url, queue_name=f"hsx-test-wake-{uuid.uuid4().hex[:8]}")
    yield settings
    queue_for(settings).empty()


def register(settings: Settings, states: list[str]) -> list[Worker]:
    connection = Redis.from_url(settings.redis_url)
    queue = queue_for(settings, connection)
    workers = []
    for state in states:
        worker = Worker([queue], connection=connection, name=f"hsx-test-{uuid.uuid4().hex[:10]}")
        worker.register_birth()
        worker.set_state(state)
        workers.append(worker)
    return workers


def test_every_idle_worker_gets_a_wake_up_and_none_twice(settings: Settings) -> None:
    workers = register(settings, ["idle", "idle", "idle", "busy", "idle"])
    try:
        assert wake_idle_workers(settings, "job-a", claimable=100) == 4
        assert queued_wakeups(settings, "job-a") == 4
        # The wake-ups already waiting cover the idle workers: a second claim adds none.
        assert wake_idle_workers(settings, "job-a", claimable=99) == 0
        # Fewer units than idle workers: one wake-up per unit.
        assert wake_idle_workers(settings, "job-b", claimable=2) == 2
        assert wake_idle_workers(settings, "job-c", claimable=0) == 0
        assert queued_wakeups(settings, "job-c") == 0
    finally:
        for worker in workers:
            worker.register_death()


def test_a_job_with_work_gets_one_wake_up_when_no_worker_is_registered(settings: Settings) -> None:
    # A worker may be starting; the reconciler keeps the job covered either way.
    assert wake_idle_workers(settings, "job-a", claimable=5) == 1
    assert wake_idle_workers(settings, "job-a", claimable=5) == 0
    assert queued_wakeups(settings, "job-a") == 1


def test_workers_that_start_late_find_the_work_waiting(
    db_url: str, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo
    from workers.reconciler import reconcile_once, wake_for_a_new_worker

    settings = settings.model_copy(update={"database_url": db_url, "dump_dir": str(tmp_path / "dumps")})
    job_id = running_job(db_url, tmp_path / "out", units=6)
    with session_scope(db_url) as session:  # a unit in hand; five claimable
        assert repo.claim_unit(session, job_id, "host:1@a", 60, time.time()) is not None
    # The two workers idle when that unit was claimed were woken then.
    workers = register(settings, ["idle", "idle"])
    try:
        assert wake_idle_workers(settings, job_id, claimable=5) == 2
        # A third starts: one more wake-up, for it; a second look adds none.
        assert wake_for_a_new_worker(settings) == 1
        assert queued_wakeups(settings, job_id) == 3
        assert wake_for_a_new_worker(settings) == 0
        # Three more registered since, none of them woken: the reconciler's pass covers them.
        workers += register(settings, ["idle", "idle", "idle"])
        assert reconcile_once(settings)["woken"] == 2  # five claimable units, three waiting
        assert queued_wakeups(settings, job_id) == 5
    finally:
        for worker in workers:
            worker.register_death()
