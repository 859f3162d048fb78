"""Crash safety: whatever dies, freezes or fills up, every sample ends exactly once (in one shard or in the
rejections with a reason), and a recovered job's output equals an uninterrupted run's, read back sample by
sample. Real worker processes, a real engine, real PostgreSQL/SQLite and Redis; the faults are real signals,
real restarts and a really full filesystem.

Faults that behave the same on both databases run on PostgreSQL only; the claim/commit race runs on both.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from tests.conftest import REDIS_URL
from tests.fixtures.jobs import running_job
from tests.fixtures.kills import end_unit_lease, freeze_holding_a_lease, live_lease, owner_pid, units
from tests.fixtures.ports import reserved_port
from tests.fixtures.processes import children, gone, signal_pids, wait_gone
from tests.fixtures.shared import once_per_session
from tests.fixtures.stack import REPO, Stack, make_stack

T = TypeVar("T")

# Heartbeats and the reconciler act within a second. Leases are the stack's, far longer than any test: a
# lease ends when a test ends it (end_unit_lease), or when a worker finds its horse dead.
FAST = {"heartbeat_seconds": "0.5", "reconcile_seconds": "0.5"}
# The engine takes about half a second a sample on this CPU: few, short samples; every unit keeps some.
SAMPLES = 12
PER_SHARD = 3
MALFORMED = frozenset({4})  # not JSON: rejected as malformed_json
NO_ANSWER = frozenset({9})  # no assistant turn: rejected as no_assistant_turn

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


# --- datasets and read-back -------------------------------------------------------------------------------


def write_chats(
    path: Path, total: int, malformed: frozenset[int] = MALFORMED, no_answer: frozenset[int] = NO_ANSWER
) -> Path:
    """Short, distinct conversations (fast on the CPU engine), and records that must be rejected."""
    with path.open("w", encoding="utf-8") as fh:
        for i in range(total):
            if i in malformed:
                fh.write('{"messages": [{"role": "user", "content": "cut off\n')
                continue
            messages = [{"role": "user", "content": f"Item {i}: what is {i} plus {i % 7}?"}]
            if i not in no_answer:
                messages.append({"role": "assistant", "content": f"{i + i % 7}."})
            fh.write(json.dumps({"messages": messages}) + "\n")
    return path


@dataclass(frozen=True)
class Output:
    """A job's output as read back from its shards (index -> ids, mask, final, aux), and its rejections."""

    samples: dict[int, tuple[np.ndarray[Any, Any], ...]]
    rejected: dict[int, str]

    def first(self, n: int) -> Output:
        """The output of the dataset's first ``n`` samples (each sample's states depend on it alone)."""
        return Output(
            {i: v for i, v in self.samples.items() if i < n},
            {i: r for i, r in self.rejected.items() if i < n},
        )


def read_output(stack: Stack, doc: dict[str, Any]) -> Output:
    from hsx.loader import iter_samples

    samples: dict[int, tuple[np.ndarray[Any, Any], ...]] = {}
    for s in iter_samples(doc["output_dir"], verify_checksums=True):
        assert s.index not in samples, f"sample {s.index} is in the output twice"
        samples[s.index] = (s.input_ids, s.loss_mask, s.hidden_state, s.aux_hidden_state)
    rejected: dict[int, str] = {}
    while True:
        page = stack.client.get(
            f"/jobs/{doc['id']}/rejections", params={"offset": len(rejected), "limit": 1000}
        )
        assert page.status_code == 200, page.text
        items = page.json()["items"]
        if not items:
            return Output(samples, rejected)
        for r in items:
            assert r["sample_index"] not in rejected, f"sample {r['sample_index']} rejected twice"
            assert r["reason"] and r["detail"], r
            rejected[r["sample_index"]] = r["reason"]


def assert_exactly_once(stack: Stack, doc: dict[str, Any], total: int) -> Output:
    """Every sample in exactly one shard or one rejection; counters, rows, manifest and disk agree."""
    assert doc["state"] == "succeeded", (doc["state"], doc["error"], stack.logs())
    out = read_output(stack, doc)
    assert set(out.samples).isdisjoint(out.rejected), set(out.samples) & set(out.rejected)
    assert set(out.samples) | set(out.rejected) == set(range(total))
    progress = doc["progress"]
    assert (progress["samples_done"], progress["samples_rejected"]) == (len(out.samples), len(out.rejected))
    assert progress["units_done"] == progress["units_total"]
    assert progress["tokens"] == sum(len(v[0]) for v in out.samples.values())
    rows = units(stack.env["HSX_DATABASE_URL"], doc["id"])
    assert len(rows) == progress["units_total"] and all(u["state"] == "done" for u in rows), rows
    assert sum(u["samples_done"] for u in rows) == len(out.samples)
    assert sum(u["samples_rejected"] for u in rows) == len(out.rejected)
    shard_paths = [
        s["path"] for s in stack.client.get(f"/jobs/{doc['id']}/shards?limit=1000").json()["items"]
    ]
    assert len(shard_paths) == len(set(shard_paths)) == sum(1 for u in rows if u["samples_done"])
    manifest = json.loads(Path(doc["manifest"]).read_text())
    assert (manifest["counts"]["samples"], manifest["counts"]["rejected"]) == (
        len(out.samples),
        len(out.rejected),
    )
    # Nothing else under the output: no stray shard, staged file or temp file.
    on_disk = sorted(p.name for p in Path(doc["output_dir"]).iterdir())
    assert on_disk == sorted([*(Path(p).name for p in shard_paths), "manifest.json"]), on_disk
    return out


def assert_same_output(got: Output, want: Output) -> None:
    assert got.rejected == want.rejected
    assert sorted(got.samples) == sorted(want.samples)
    for index, arrays in want.samples.items():
        for name, a, b in zip(
            ("input_ids", "loss_mask", "hidden_state", "aux"), got.samples[index], arrays, strict=True
        ):
            assert a.shape == b.shape and np.array_equal(a, b), f"sample {index}: {name} differs"


# --- the job table, processes and waiting -----------------------------------------------------------------


def wait_until(check: Callable[[], T | None], timeout: float, what: str, stack: Stack | None = None) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{stack.logs() if stack else ''}")
        time.sleep(0.05)


Pick = Callable[[dict[str, Any]], "set[int] | None"]


def horse_of(worker: Any, exclude: frozenset[int] = frozenset()) -> Pick:
    """For ``freeze_holding_a_lease``: a unit (not one of ``exclude``) leased by a horse of this worker
    stops that horse alone."""

    def pick(unit: dict[str, Any]) -> set[int] | None:
        horse = owner_pid(unit["owner"])
        return {horse} if unit["index"] not in exclude and horse in children(worker.pid) else None

    return pick


def whole_worker(worker: Any) -> Pick:
    """For ``freeze_holding_a_lease``: a unit leased by a horse of this worker stops the worker, its
    reconciler and its horse (the worker's whole session)."""

    def pick(unit: dict[str, Any]) -> set[int] | None:
        return {worker.pid} if owner_pid(unit["owner"]) in children(worker.pid) else None

    return pick


def full_logs(stack: Stack) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(stack.tmp.glob("worker-*.log")))


# --- fixtures --------------------------------------------------------------------------------------------


def fast_stack(
    db_url: str, redis_url: str, engine: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch, **settings: str
) -> Stack:
    return make_stack(db_url, redis_url, engine.url, tmp, monkeypatch, **{**FAST, **settings})


@contextlib.contextmanager
def running(stack: Stack) -> Iterator[Stack]:
    try:
        yield stack
    finally:
        stack.stop_workers()  # every worker and horse it started, gone by pid
        from hsx.server.settings import get_settings

        get_settings.cache_clear()


@pytest.fixture
def fast(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    with running(fast_stack(db_url, redis_url, engine_nocache, tmp_path, monkeypatch)) as s:
        yield s


def uninterrupted_output(engine: Any, tmp: Path, dataset: Path, total: int, per_shard: int) -> Output:
    """The output of an uninterrupted run of ``dataset``, by the real job runner in process (no worker)."""
    from hsx.server.db.migrate import upgrade
    from hsx.server.jobs.queue import queue_for
    from hsx.server.settings import get_settings
    from workers.job_runner import JobRunner

    with pytest.MonkeyPatch.context() as mp:
        s = make_stack(f"sqlite:///{tmp / 'hsx.sqlite3'}", REDIS_URL, engine.url, tmp, mp, **FAST)
        upgrade(s.env["HSX_DATABASE_URL"])
        job_id = str(s.submit(dataset, samples_per_shard=per_shard)["id"])
        runner = JobRunner(job_id, get_settings())
        while runner.run(max_units=1).more_work:
            pass
        queue_for(get_settings()).empty()  # type: ignore[no-untyped-call]
        out = assert_exactly_once(s, s.job(job_id), total)
    get_settings.cache_clear()
    return out


@pytest.fixture(scope="module")
def baseline(engine_nocache: Any, tmp_path_factory: pytest.TempPathFactory) -> Output:
    """The output of an uninterrupted run of the fault tests' dataset: one run per session, read by every
    test process (tests/fixtures/shared.py); each process's engine is the same model with the same flags."""

    def run(tmp: Path) -> Output:
        return uninterrupted_output(
            engine_nocache, tmp, write_chats(tmp / "chats.jsonl", SAMPLES), SAMPLES, PER_SHARD
        )

    out = once_per_session(tmp_path_factory, "faults-baseline", run)
    assert out.rejected == {
        **dict.fromkeys(MALFORMED, "malformed_json"),
        **dict.fromkeys(NO_ANSWER, "no_assistant_turn"),
    }
    return out


def submit(stack: Stack, total: int = SAMPLES, per_shard: int = PER_SHARD, name: str = "chats.jsonl") -> str:
    return str(stack.submit(write_chats(stack.tmp / name, total), samples_per_shard=per_shard)["id"])


# --- 1. a work horse killed mid-unit ---------------------------------------------------------------------


@postgres_only
def test_killed_work_horse_unit_is_retried_and_output_is_identical(fast: Stack, baseline: Output) -> None:
    db_url = fast.env["HSX_DATABASE_URL"]
    worker = fast.start_worker()
    job_id = submit(fast)
    killed: dict[int, int] = {}
    while len(killed) < 2:  # two units lose their horse while it holds their lease
        pick = horse_of(worker, exclude=frozenset(killed))
        held, frozen = freeze_holding_a_lease(db_url, job_id, pick, describe=fast.logs)
        signal_pids(frozen, signal.SIGKILL)
        killed[held["index"]] = held["attempt"]
        wait_gone(frozen)
    doc = fast.wait(job_id, timeout=180)
    assert_same_output(assert_exactly_once(fast, doc, SAMPLES), baseline)
    attempts = {u["index"]: u["attempt"] for u in units(db_url, job_id)}
    assert all(attempts[i] > a for i, a in killed.items()), (killed, attempts)
    assert worker.poll() is None, "the worker itself survives its horse"
    assert full_logs(fast).count("died (status 9); released 1 lease(s)") >= 2


# --- 2. a whole worker lost ------------------------------------------------------------------------------


@postgres_only
def test_lost_worker_lease_expires_and_another_worker_finishes(fast: Stack, baseline: Output) -> None:
    db_url = fast.env["HSX_DATABASE_URL"]
    first = fast.start_worker()
    job_id = submit(fast)
    held, frozen = freeze_holding_a_lease(db_url, job_id, whole_worker(first), describe=fast.logs)
    signal_pids(frozen, signal.SIGKILL)  # the worker, its reconciler and its horse, all at once
    first.wait(30)
    wait_gone(frozen)
    stuck = units(db_url, job_id)[held["index"]]
    assert (stuck["state"], stuck["attempt"], stuck["owner"]) == ("leased", held["attempt"], held["owner"])
    end_unit_lease(db_url, held)  # its time passes: nobody is left to renew it
    second = fast.start_worker()
    doc = fast.wait(job_id, timeout=180)
    assert_same_output(assert_exactly_once(fast, doc, SAMPLES), baseline)
    after = units(db_url, job_id)[held["index"]]
    assert after["attempt"] > held["attempt"] and owner_pid(after["owner"]) not in frozen
    assert second.poll() is None


# --- 3. a frozen worker ----------------------------------------------------------------------------------


@postgres_only
def test_frozen_worker_cannot_commit_after_its_lease_is_taken(fast: Stack, baseline: Output) -> None:
    db_url = fast.env["HSX_DATABASE_URL"]
    first = fast.start_worker()
    job_id = submit(fast)
    held, frozen = freeze_holding_a_lease(db_url, job_id, whole_worker(first), describe=fast.logs)
    try:
        # The lease runs out while the holder sleeps; another attempt takes the unit and commits it.
        end_unit_lease(db_url, held)
        fast.start_worker()
        taken = wait_until(
            lambda: (u := units(db_url, job_id)[held["index"]])["state"] == "done" and u,
            120,
            "the retake",
            fast,
        )
        assert taken["attempt"] > held["attempt"] and taken["owner"] != held["owner"]
    finally:
        signal_pids(frozen, signal.SIGCONT)
    horse = owner_pid(held["owner"])
    wait_until(lambda: gone(horse), 60, "the frozen horse to finish", fast)
    doc = fast.wait(job_id, timeout=180)
    assert_same_output(assert_exactly_once(fast, doc, SAMPLES), baseline)
    final = units(db_url, job_id)[held["index"]]
    assert (final["attempt"], final["owner"]) == (taken["attempt"], taken["owner"])
    logs = full_logs(fast)
    dropped = (
        f"unit {held['index']} attempt {held['attempt']} lost its lease; results dropped",
        f"lease on unit {held['id']} attempt {held['attempt']} lost",
    )
    assert any(line in logs for line in dropped), logs[-3000:]


# --- 4. Redis wiped mid-job ------------------------------------------------------------------------------


@postgres_only
def test_redis_wiped_mid_job_loses_nothing(
    db_url: str,
    engine_nocache: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    baseline: Output,
    kept_port: int,
) -> None:
    from hsx.cli.local_stack import LocalStack, redis_reachable, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("no redis-server binary to run a private Redis")
    private = LocalStack(tmp_path / "redis")
    try:
        # Never the shared server: this one is killed, and started again on its port (kept for it).
        url = private.start_redis(kept_port)
        port = url.rsplit(":", 1)[1].split("/")[0]
        with running(fast_stack(db_url, url, engine_nocache, tmp_path, monkeypatch)) as s:
            s.start_worker()
            s.start_worker()
            job_id = submit(s)
            wait_until(
                lambda: s.job(job_id)["progress"]["units_done"] >= 1 and live_lease(db_url, job_id),
                180,
                "a committed unit and another in progress",
                s,
            )
            _name, redis_proc = private.procs[-1]
            os.killpg(redis_proc.pid, signal.SIGKILL)
            redis_proc.wait(10)
            before = s.job(job_id)["progress"]["units_done"]
            assert s.job(job_id)["state"] == "running"
            # Down until a horse has finished its unit without Redis and its worker, reporting it, has met
            # the outage (its work loop ends on the Redis error, to start again once Redis answers).
            wait_until(
                lambda: s.job(job_id)["progress"]["units_done"] > before, 120, "a unit without Redis", s
            )
            wait_until(lambda: "worker loop ended" in full_logs(s), 120, "a worker to meet the outage", s)
            binary = redis_server_binary()
            assert binary is not None
            private.start(
                "redis-again",
                [binary, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            )
            wait_until(lambda: redis_reachable(url), 20, "the new Redis")
            doc = s.wait(job_id, timeout=240)
            assert_same_output(assert_exactly_once(s, doc, SAMPLES), baseline)
            assert all(w.poll() is None for w in s.workers), "workers ride out the Redis outage"
    finally:
        private.stop()


# --- 5. PostgreSQL restarted mid-job ---------------------------------------------------------------------


@contextlib.contextmanager
def private_postgres() -> Iterator[tuple[str, dict[str, str]]]:
    """A PostgreSQL of this test's own (the embedded one of scripts/embedded_services.py, on a port kept
    for it: it comes back on that port after its restart), so that restarting it cuts no other test's
    connections when the tests run in parallel."""
    with reserved_port() as port:
        yield from _private_postgres(port)


def _private_postgres(port: int) -> Iterator[tuple[str, dict[str, str]]]:
    # Not under pytest's tmp_path: as root PostgreSQL runs as nobody, who must reach the folder.
    folder = Path(tempfile.mkdtemp(prefix="hsx-pg-restart-"))
    folder.chmod(0o755)
    admin = f"postgresql://postgres@127.0.0.1:{port}/test"
    env = {**os.environ, "HSX_SERVICES_DIR": str(folder), "HSX_TEST_PG_ADMIN_URL": admin}
    env["HSX_TEST_REDIS_URL"] = REDIS_URL
    script = [sys.executable, str(REPO / "scripts" / "embedded_services.py")]
    try:
        started = subprocess.run([*script, "ensure"], env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stderr
        yield admin.replace("postgresql://", "postgresql+psycopg://", 1), env
    finally:
        subprocess.run([*script, "stop"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def test_postgres_restart_mid_job_completes(
    redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, baseline: Output
) -> None:
    from hsx.server.db.migrate import upgrade

    script = [sys.executable, str(REPO / "scripts" / "embedded_services.py"), "restart-postgres"]
    with private_postgres() as (db_url, env):
        upgrade(db_url)
        with running(fast_stack(db_url, redis_url, engine_nocache, tmp_path, monkeypatch)) as fast:
            fast.start_worker()
            job_id = submit(fast)
            wait_until(
                lambda: fast.job(job_id)["progress"]["units_done"] >= 1 and live_lease(db_url, job_id),
                180,
                "a committed unit and another in progress",
                fast,
            )
            restarted = subprocess.run(script, env=env, capture_output=True, text=True, timeout=120)
            assert restarted.returncode == 0 and "restarted PostgreSQL" in restarted.stderr, restarted.stderr
            doc = fast.wait(job_id, timeout=240)
            assert_same_output(assert_exactly_once(fast, doc, SAMPLES), baseline)


def terminate_open_transactions(db_url: str) -> int:
    """Cut the connections of this database that are inside a transaction, as a restart would."""
    from sqlalchemy import text

    from hsx.server.db.session import engine_for

    with engine_for(db_url).connect() as conn:
        return len(
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND state LIKE 'idle in transaction%'"
                )
            ).all()
        )


@postgres_only
def test_commit_retried_after_its_connection_drops_past_the_rename(
    fast: Stack, baseline: Output, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection dies between the shard's rename and the row commit: the commit is retried, and lands
    once. (In process, so that the drop happens at exactly that step: the fault hook cuts the connection.)"""
    from hsx.server.faults import crash_point as real_crash_point
    from hsx.server.settings import get_settings
    from workers.job_runner import JobRunner

    db_url = fast.env["HSX_DATABASE_URL"]
    job_id = submit(fast, total=PER_SHARD)  # one unit
    cut: list[int] = []

    def cut_connection(name: str) -> None:
        real_crash_point(name)
        if name == "before_row_commit" and not cut:
            cut.append(terminate_open_transactions(db_url))

    monkeypatch.setattr("workers.unit_commit.crash_point", cut_connection)
    runner = JobRunner(job_id, get_settings())
    while runner.run(max_units=1).more_work:
        pass
    assert cut and cut[0] >= 1, "the committing connection was cut"
    doc = fast.job(job_id)
    assert_same_output(assert_exactly_once(fast, doc, PER_SHARD), baseline.first(PER_SHARD))
    assert [u["attempt"] for u in units(db_url, job_id)] == [1], "the same attempt committed, once"


# --- 6. disk full ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*")) if directory.exists() else []


@postgres_only
def test_disk_full_while_writing_a_shard_fails_the_job_clearly(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.server.jobs.queue import queue_for
    from hsx.server.settings import get_settings
    from workers.reconciler import reconcile_once

    # The job is admitted without its size check: this is the disk filling up under a running job (another
    # writer, or a projection that fell short), which the check at prepare cannot foresee.
    with (
        tmpfs(tmp_path / "tiny", "64k") as out,
        running(
            fast_stack(
                db_url,
                redis_url,
                engine_nocache,
                tmp_path,
                monkeypatch,
                output_dir=str(tmp_path / "tiny"),
                check_output_space="false",
            )
        ) as s,
    ):
        job_id = submit(s)
        assert s.run_burst(timeout=180) == 0, s.logs()
        doc = s.job(job_id)
        assert doc["state"] == "failed", doc
        assert "could not write shard" in doc["error"] and "No space left on device" in doc["error"], doc
        assert leftovers(out / job_id) == [], "no shard, staged file or temp file is left behind"
        assert doc["shards"]["total"] == 0 and doc["manifest"] is None
        # Failed once and for all: one attempt at one unit, nothing queued, the reconciler leaves it be.
        assert sum(u["attempt"] for u in units(db_url, job_id)) == 1
        assert queue_for(get_settings()).count == 0
        assert reconcile_once(get_settings())["woken"] == 0
        assert s.job(job_id)["state"] == "failed"


@postgres_only
def test_disk_full_while_writing_the_manifest_fails_the_job_clearly(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All units are committed, then the disk fills before the manifest is written."""
    from hsx.server.settings import get_settings
    from workers.reconciler import reconcile_once

    # Reconcile rarely: the job must still be unfinished when the disk has been filled.
    with (
        tmpfs(tmp_path / "small", "16m") as out,
        running(
            fast_stack(
                db_url,
                redis_url,
                engine_nocache,
                tmp_path,
                monkeypatch,
                output_dir=str(out),
                reconcile_seconds="600",
            )
        ) as s,
    ):
        job_id = submit(s, total=PER_SHARD)  # one unit
        crash = {"HSX_CRASH_AT": "after_row_commit", "HSX_CRASH_ONCE_FILE": str(tmp_path / "crashed")}
        assert s.run_burst(timeout=180, extra_env=crash) == 0, s.logs()
        assert (tmp_path / "crashed").exists()
        doc = s.job(job_id)
        assert doc["state"] == "running" and doc["progress"]["units_done"] == 1, doc
        with contextlib.suppress(OSError), open(out / "filler", "wb") as fh:
            while True:
                fh.write(b"\0" * (1 << 16))
                fh.flush()
        reconcile_once(get_settings())
        doc = s.job(job_id)
        assert doc["state"] == "failed", doc
        assert "manifest" in doc["error"] and "No space left on device" in doc["error"], doc
        assert sorted(leftovers(out / job_id)) == [Path(doc["shards"]["items"][0]["path"]).name]
        reconcile_once(get_settings())  # no retry loop: the failed job is left alone
        assert s.job(job_id)["state"] == "failed"


# --- 7. a crash at each step of writing a unit -----------------------------------------------------------


@postgres_only
def test_a_crash_at_each_step_recovers_to_the_same_output(
    fast: Stack, baseline: Output, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker per crash point, each crashing once there; seven jobs, each equal to the baseline.

    Each crashing worker listens on a queue of its own, without a reconciler, and its job is submitted
    there: nothing else can hand its job to another worker or another job to it, so its first claim is
    its own job's and it reaches its crash point. (On one shared queue, wake-ups from reconcilers and
    preparing workers let some workers find nothing to claim and never crash.) A plain worker with the
    reconciler joins once every crash has happened and, with the crashed workers, finishes the jobs."""
    from rq import Worker

    from hsx.server.faults import POINTS
    from hsx.server.jobs.queue import queue_for
    from hsx.server.settings import get_settings

    markers = {point: fast.tmp / f"crashed-{point}" for point in POINTS}
    queues = {point: f"{fast.env['HSX_QUEUE_NAME']}-{point}" for point in POINTS}
    for point, marker in markers.items():
        crash = {"HSX_CRASH_AT": point, "HSX_CRASH_ONCE_FILE": str(marker), "HSX_QUEUE_NAME": queues[point]}
        fast.start_worker(crash, args=("--no-reconciler",))

    def listening(queue_name: str) -> bool:
        queue = queue_for(fast.settings.model_copy(update={"queue_name": queue_name}))
        return any(w.get_state() == "idle" for w in Worker.all(queue=queue))

    # Listening before their jobs exist: a worker that starts looks for jobs with work waiting.
    wait_until(lambda: all(listening(q) for q in queues.values()), 240, "every worker to listen", fast)
    total = 2 * PER_SHARD  # two units a job
    jobs = []
    for i, point in enumerate(POINTS):
        monkeypatch.setenv("HSX_QUEUE_NAME", queues[point])  # the API enqueues the first wake-up there
        get_settings.cache_clear()
        jobs.append(submit(fast, total=total, name=f"chats-{i}.jsonl"))
    wait_until(lambda: all(m.exists() for m in markers.values()), 240, "every crash point", fast)
    fast.start_worker()  # on the stack's own queue, with the reconciler: it wakes what a crash left
    for job_id in jobs:
        doc = fast.wait(job_id, timeout=300)
        assert_same_output(assert_exactly_once(fast, doc, total), baseline.first(total))
    assert full_logs(fast).count(f"(status {137 << 8})") >= len(POINTS)  # os._exit(137), as waitpid says


# --- 8. many claimers, one unit each ---------------------------------------------------------------------

LONG_LEASE_SECONDS = 3600.0  # no lease runs out on its own: a stalled claimer's is ended by the test


def _claimer(db_url: str, job_id: str, stall: bool, marks: str, results: Any) -> None:
    """A worker stripped to the lease protocol: claim, (maybe stall past the lease), commit fenced."""
    from sqlalchemy import update

    from hsx.server.db.models import WorkUnit
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo
    from hsx.server.jobs import unit_results

    owner = f"{socket.gethostname()}:{os.getpid()}"
    done: list[tuple[int, int, bool]] = []
    claims = 0
    while True:
        with session_scope(db_url) as session:
            unit = repo.claim_unit(session, job_id, owner, LONG_LEASE_SECONDS, time.time())
        if unit is None:
            break
        claims += 1
        if stall and claims % 3 == 1:
            # Frozen past the lease: its time runs out before this commit, which must be refused. The test
            # ends it (the clock is not asked to), so no other claimer's lease can run out on a slow host.
            with session_scope(db_url) as session:
                session.execute(
                    update(WorkUnit)
                    .where(WorkUnit.id == unit.id, WorkUnit.attempt == unit.attempt)
                    .values(lease_expires=time.time() - 1)
                )

        def place(index: int = unit.unit_index) -> None:
            fd = os.open(os.path.join(marks, f"unit-{index}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)  # FileExistsError here would be a second placing of one unit

        n = unit.sample_end - unit.sample_start
        rejected = [unit_results.RejectionRow(unit.sample_start, "test_reason", "first sample of each unit")]
        shard = unit_results.ShardRow(
            f"{marks}/shard-{unit.unit_index}", "0" * 64, 100 * n, n - 1, 10 * (n - 1)
        )
        with session_scope(db_url) as session:
            ok = unit_results.commit_unit(
                session, unit, time.time(), shard, rejected, n - 1, 10 * (n - 1), place
            )
        done.append((unit.unit_index, unit.attempt, ok))
    results.put((os.getpid(), done))


def _race(db_url: str, tmp_path: Path, stall: bool) -> tuple[str, list[tuple[int, int, bool]]]:
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo

    per_unit, count = 4, 50
    job_id = running_job(db_url, tmp_path, units=count, per_unit=per_unit, dataset="race")
    marks = tmp_path / "published"
    marks.mkdir()
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_claimer, args=(db_url, job_id, stall, str(marks), results)) for _ in range(8)
    ]
    for p in procs:
        p.start()
    reports = [results.get(timeout=240) for _ in procs]
    outcomes = [row for _pid, rows in reports for row in rows]
    assert sum(1 for _pid, rows in reports if any(ok for *_, ok in rows)) > 1, "several claimers committed"
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    # Exactly once: one publication, one shard row, one set of rejections and counts per unit.
    assert sorted(p.name for p in marks.iterdir()) == sorted(f"unit-{i}" for i in range(count))
    committed = sorted(i for i, _a, ok in outcomes if ok)
    assert committed == list(range(count))
    with session_scope(db_url) as session:
        from sqlalchemy import func, select

        from hsx.server.db.models import Rejection, Shard

        assert session.scalar(select(func.count()).select_from(Shard).where(Shard.job_id == job_id)) == count
        keys = session.scalars(select(Shard.key).where(Shard.job_id == job_id)).all()
        assert len(set(keys)) == count
        rejected = session.scalars(select(Rejection.sample_index).where(Rejection.job_id == job_id)).all()
        assert sorted(rejected) == [i * per_unit for i in range(count)]
        stored = repo.get_job(session, job_id)
        assert stored is not None
        assert (stored.units_done, stored.samples_done, stored.samples_rejected) == (
            count,
            count * (per_unit - 1),
            count,
        )
    rows = units(db_url, job_id)
    assert all(u["state"] == "done" for u in rows)
    assert [u["samples_done"] for u in rows] == [per_unit - 1] * count
    return job_id, outcomes


def test_eight_claimers_fifty_units_each_processed_once(db_url: str, tmp_path: Path) -> None:
    job_id, outcomes = _race(db_url, tmp_path, stall=False)
    assert len(outcomes) == 50 and all(ok for *_, ok in outcomes)
    assert [u["attempt"] for u in units(db_url, job_id)] == [1] * 50


def test_stalled_claimers_lose_their_units_and_nothing_is_committed_twice(
    db_url: str, tmp_path: Path
) -> None:
    job_id, outcomes = _race(db_url, tmp_path, stall=True)
    refused = [(i, a) for i, a, ok in outcomes if not ok]
    assert refused, "stalled claimers must have been refused"
    rows = {u["index"]: u for u in units(db_url, job_id)}
    for index, attempt in refused:  # each refused attempt's unit was committed by a later attempt
        assert rows[index]["attempt"] > attempt
    assert len(outcomes) == 50 + len(refused)


@postgres_only
def test_real_workers_process_each_unit_once(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No lease can lapse (the stack's are far longer than any test), so every unit is claimed exactly once.
    stack = fast_stack(db_url, redis_url, engine_nocache, tmp_path, monkeypatch)
    with running(stack) as s:
        for _ in range(3):
            s.start_worker()
        job_id = submit(s, per_shard=2)
        doc = s.wait(job_id, timeout=300)
        assert_exactly_once(s, doc, SAMPLES)
        rows = units(db_url, job_id)
        assert len(rows) == SAMPLES // 2 and [u["attempt"] for u in rows] == [1] * len(rows)
        horses = {owner_pid(u["owner"]) for u in rows}
        assert len(horses) > 1, "several horses shared the work"
