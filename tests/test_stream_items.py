"""A stream item is written by the unit's commit, in its transaction (a commit hook): it exists the moment
its shard does, and a commit that fails writes neither. The end-of-stream rule holds while
acknowledgements race it on PostgreSQL (READ COMMITTED); shards committed before items were written at
commit get theirs from the migration; SQLite's claim check opens its transaction with BEGIN IMMEDIATE.

Real PostgreSQL and SQLite; units are committed through the job repository as a worker commits them, with
shard rows whose files these tests never read."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.fixtures.jobs import running_job

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from hsx.server.jobs.unit_results import CommitHook, CommittedUnit


def commit_units(db_url: str, job_id: str, count: int, hooks: Sequence[CommitHook] | None = None) -> None:
    """Claim and commit ``count`` units of the job as a worker does, each with a shard row, through the
    stream's commit hook."""
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo
    from hsx.server.jobs import unit_results
    from hsx.server.streams.service import record_item

    for _ in range(count):
        with session_scope(db_url) as session:
            unit = repo.claim_unit(session, job_id, "host:1@http://engine", 60, time.time())
        assert unit is not None
        with session_scope(db_url) as session:
            shard = unit_results.ShardRow(
                f"/nowhere/{job_id}/shard-{unit.unit_index:05d}", "0" * 64, 1000, 4, 40
            )
            chosen = (record_item,) if hooks is None else hooks
            assert unit_results.commit_unit(
                session, unit, time.time(), shard, [], 4, 40, lambda: None, (), chosen
            )


def items_of(db_url: str, job_id: str) -> list[tuple[int, int, int]]:
    from sqlalchemy import select

    from hsx.server.db.models import Shard
    from hsx.server.db.session import session_scope
    from hsx.server.db.stream_models import StreamItem

    with session_scope(db_url) as session:
        rows = session.execute(
            select(StreamItem.unit_index, StreamItem.bytes, Shard.id)
            .join(Shard, Shard.id == StreamItem.shard_id)
            .where(StreamItem.job_id == job_id)
            .order_by(StreamItem.unit_index)
        ).all()
    return [(int(u), int(b), int(s)) for u, b, s in rows]


def test_a_units_commit_writes_its_item_and_a_commit_that_fails_writes_neither(
    db_url: str, tmp_path: Path
) -> None:
    from sqlalchemy import func, select

    from hsx.server.db.models import Shard, UnitState, WorkUnit
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo

    job_id = running_job(db_url, tmp_path / "out", units=3)
    commit_units(db_url, job_id, 2)
    # Before any consumer asked: every committed shard is an item already, with its unit and size.
    assert [(u, b) for u, b, _ in items_of(db_url, job_id)] == [(0, 1000), (1, 1000)]

    def refuse(_session: Session, _committed: CommittedUnit) -> None:
        raise RuntimeError("a hook refused")

    with pytest.raises(RuntimeError, match="a hook refused"):
        commit_units(db_url, job_id, 1, hooks=(refuse,))
    with session_scope(db_url) as session:
        assert session.scalar(select(func.count()).select_from(Shard).where(Shard.job_id == job_id)) == 2
        last = session.scalars(
            select(WorkUnit).where(WorkUnit.job_id == job_id, WorkUnit.unit_index == 2)
        ).one()
        assert last.state == UnitState.leased.value  # the commit rolled back whole: the unit is not done
        job = repo.get_job(session, job_id)
        assert job is not None and job.units_done == 2
    assert len(items_of(db_url, job_id)) == 2


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_the_stream_never_ends_early_while_acknowledgements_race_the_end_of_stream_check(
    db_url: str, tmp_path: Path
) -> None:
    """A reader of another group holds one item for good, so the stream must stay open for this group
    whatever it acknowledges meanwhile. Four threads acknowledge the group's items one per transaction
    while another asks, again and again, what is left outside the group and whether the stream ended."""
    from hsx.server.db.models import JobState
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo
    from hsx.server.settings import get_settings
    from hsx.server.streams import item_counts as counts
    from hsx.server.streams.service import StreamService

    units = 160
    job_id = running_job(db_url, tmp_path / "out", units=units)
    commit_units(db_url, job_id, units)
    with session_scope(db_url) as session:
        assert repo.set_job_state(session, job_id, JobState.succeeded, [JobState.running.value])
    settings = get_settings()
    with session_scope(db_url) as session:
        service = StreamService(session, settings)
        outsider = service.register(job_id, "outsider", 3600, group="other").id
        holder = service.register(job_id, "holder", 3600, group="trainer").id
        asker = service.register(job_id, "asker", 3600, group="trainer").id
        assert len(service.lease(job_id, outsider, 1).items) == 1
        held = service.lease(job_id, holder, units).items
    assert len(held) == units - 1
    done = threading.Event()
    seen: list[int] = []
    ended: list[bool] = []

    def ack(part: list[tuple[int, int]]) -> None:
        for delivery in part:
            with session_scope(db_url) as session:
                assert StreamService(session, settings).ack(job_id, holder, [delivery]).acked

    def ask() -> None:
        while not done.is_set():
            with session_scope(db_url) as session:
                seen.append(counts.unacked_outside_group(session, job_id, "trainer", time.time()))
            with session_scope(db_url) as session:
                ended.append(StreamService(session, settings).lease(job_id, asker, 1).end_of_stream)

    deliveries = [(i.id, i.delivery) for i in held]
    ackers = [threading.Thread(target=ack, args=(deliveries[n::4],)) for n in range(4)]
    asker_thread = threading.Thread(target=ask)
    asker_thread.start()
    for thread in ackers:
        thread.start()
    for thread in ackers:
        thread.join(120)
    done.set()
    asker_thread.join(30)
    assert len(seen) > 20, len(seen)  # the checks ran while the acknowledgements did
    assert set(seen) == {1}, sorted(set(seen))
    assert not any(ended)
    with session_scope(db_url) as session:
        assert counts.item_counts(session, job_id, time.time()).acked == units - 1


def test_shards_committed_before_items_were_written_at_commit_get_theirs_from_the_migration(
    tmp_path: Path,
) -> None:
    from sqlalchemy import text

    from hsx.server.db.migrate import upgrade
    from hsx.server.db.session import session_scope

    url = f"sqlite:///{tmp_path / 'old.sqlite3'}"
    upgrade(url, "0005_unit_publication")
    job_id = running_job(url, tmp_path / "out", units=3)
    with session_scope(url) as session:
        for unit_index in (0, 2):  # two units committed by the older version: shards, no items
            unit_id = session.execute(
                text("SELECT id FROM work_units WHERE job_id = :j AND unit_index = :u"),
                {"j": job_id, "u": unit_index},
            ).scalar_one()
            row = {"j": job_id, "u": unit_id, "k": f"{job_id}/{unit_index}", "p": f"/old/{unit_index}"}
            session.execute(
                text(
                    "INSERT INTO shards (job_id, unit_id, key, path, sha256, bytes, samples, tokens, "
                    "created_at) VALUES (:j, :u, :k, :p, :h, :b, 4, 40, CURRENT_TIMESTAMP)"
                ),
                {**row, "h": "0" * 64, "b": 100 + unit_index},
            )
    upgrade(url)
    assert [(u, b) for u, b, _ in items_of(url, job_id)] == [(0, 100), (2, 102)]
    upgrade(url)  # a second run adds nothing
    assert len(items_of(url, job_id)) == 2


def test_sqlites_claim_check_takes_the_write_lock_as_its_transaction_opens(tmp_path: Path) -> None:
    from sqlalchemy import update

    from hsx.server.db.migrate import upgrade
    from hsx.server.db.models import Job
    from hsx.server.db.session import session_scope
    from hsx.server.settings import get_settings
    from hsx.server.streams import repository as streams
    from hsx.server.streams.service import may_claim

    path = tmp_path / "claims.sqlite3"
    url = f"sqlite:///{path}"
    upgrade(url)
    job_id = running_job(url, tmp_path / "out", units=2)
    with session_scope(url) as session:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(options={"retention": "consume", "buffer_cap_bytes": 1})
        )
    with session_scope(url) as session:
        assert may_claim(session, job_id, get_settings(), time.time())
        # Until this transaction ends, no other writer gets in: the check and the claim after it see the
        # database as it is, and two workers cannot both take the last room under the cap.
        other = sqlite3.connect(path, timeout=0, isolation_level=None)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
        other.close()
    with session_scope(url) as session:
        streams.touch_consumer(session, "nobody", 0.0)  # a write: this transaction is open already
        with pytest.raises(RuntimeError, match="BEGIN IMMEDIATE must open the transaction"):
            streams.lock_job(session, job_id)


def test_a_lease_that_finds_nothing_takes_no_write_lock_and_one_that_leases_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting leases read the table on every commit's news: one that hands nothing out must not queue for
    SQLite's one write lock behind the workers' claims and commits (it used to write the consumer's last
    contact first). Another connection holds the lock; the empty lease answers all the same, and records
    its contact only once ``TOUCH_SECONDS`` have passed. A lease that does hand an item out writes.

    The stream service's clock is the test's: the lease comes within ``TOUCH_SECONDS`` of the registration
    because the test says so, however long the calls take on a loaded host."""
    import types

    from hsx.server.db.migrate import upgrade
    from hsx.server.db.session import session_scope
    from hsx.server.settings import get_settings
    from hsx.server.streams import repository as streams
    from hsx.server.streams.service import TOUCH_SECONDS, StreamService

    clock = [1_700_000_000.0]
    monkeypatch.setattr("hsx.server.streams.service.time", types.SimpleNamespace(time=lambda: clock[0]))
    path = tmp_path / "leases.sqlite3"
    url = f"sqlite:///{path}"
    upgrade(url)
    job_id = running_job(url, tmp_path / "out", units=2)
    with session_scope(url) as session:
        consumer = StreamService(session, get_settings()).register(job_id, "reader", 60)
        consumer_id, registered = consumer.id, consumer.last_seen

    def lease_in_thread() -> list[object]:
        answers: list[object] = []

        def run() -> None:
            with session_scope(url) as session:
                answers.append(StreamService(session, get_settings()).lease(job_id, consumer_id, 1))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        # Inside SQLite's 30 s busy timeout: a lease that wanted the lock is still waiting; one that did not
        # has answered long before, however loaded the host.
        thread.join(20)
        return answers

    def last_seen() -> float:
        with session_scope(url) as session:
            found = streams.get_consumer(session, job_id, consumer_id)
            assert found is not None
            return float(found.last_seen)

    holder = sqlite3.connect(path, timeout=0, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        answers = lease_in_thread()
        assert len(answers) == 1 and answers[0].items == []  # type: ignore[attr-defined]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert last_seen() == registered  # within TOUCH_SECONDS of the last contact: not written
    clock[0] += TOUCH_SECONDS
    assert lease_in_thread()[0].items == []  # type: ignore[attr-defined]
    assert last_seen() == registered + TOUCH_SECONDS  # a second later, written
    commit_units(url, job_id, 1)
    clock[0] += TOUCH_SECONDS / 10
    assert len(lease_in_thread()[0].items) == 1  # type: ignore[attr-defined]
    assert last_seen() == clock[0]  # a lease that hands an item out records the contact with it


@pytest.mark.parametrize(
    ("stored", "acked", "leased", "woken", "why"),
    [
        (400, 100, 0, True, "the cap holds the next unit back until the acknowledged shard goes"),
        (300, 100, 1, True, "the cap holds it back, though a worker holds a unit"),
        (100, 100, 0, True, "one fits, and no worker holds a unit of the job"),
        (100, 100, 1, False, "one fits and a worker holds a unit: it claims the next itself"),
        (400, 0, 0, False, "nothing acknowledged: deleting frees nothing"),
    ],
)
def test_an_acknowledgement_wakes_workers_only_where_the_cap_held_them_or_none_works(
    stored: int, acked: int, leased: int, woken: bool, why: str
) -> None:
    from hsx.server.streams.budget import Budget
    from hsx.server.streams.service import worth_waking

    room = Budget(
        cap_bytes=400, stored_bytes=stored, acked_stored_bytes=acked, leased_units=leased, unit_bytes=100
    )
    assert worth_waking(room) is woken, why
