"""Faults while a consume job streams, with real processes: a consumer SIGKILLed while it holds a lease
(its shard is delivered again, to another consumer), an hsx worker and its work horse SIGKILLed while the
horse holds a unit's lease (the unit runs a second attempt), a consumer that never comes back (the job
waits, says so, and deletes nothing unacknowledged), the API process SIGKILLed and started again on its
port while trainers (``JobStream`` in processes of their own) lease and acknowledge, and a private Redis
SIGKILLed and started again while workers and trainers run. Each time every sample is acknowledged exactly
once, and what the readers acknowledged (read before their acknowledgement; the shards are gone after it)
is the dataset's tokens with the states of an uninterrupted run of the same dataset, sample for sample.
The cap holds throughout: the buffered bytes are sampled from the job table the whole time. A lease runs
out when the test says so (it ends the lease in the table), never on a guess at the clock."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.cli.local_stack import LocalStack, local_stack
from tests.fixtures.kills import end_lease, end_unit_lease, freeze_holding_a_lease, units
from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.processes import kill_session, signal_pids, wait_gone
from tests.fixtures.sample_records import read_records, record_of_sample
from tests.fixtures.stack import REPO, TEST_TOKEN, Stack, make_stack
from tests.fixtures.synthetic import Engines, Synthetic, write_pretokenized

pytestmark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
SAMPLES = 16


@pytest.fixture
def synth(
    db_url: str, redis_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Stack, Synthetic]]:
    from hsx.server.settings import get_settings

    engine = engines.start()
    stack = make_stack(db_url, redis_url, engine.url, tmp_path, monkeypatch, stream_room_wait_seconds="2")
    try:
        yield stack, engine
    finally:
        stack.stop_workers()
        get_settings.cache_clear()


class BufferWatch(threading.Thread):
    """The peak of committed-but-unacknowledged bytes plus units in flight, from the job table."""

    def __init__(self, db_url: str, job_id: str) -> None:
        super().__init__(daemon=True)
        self.db_url, self.job_id, self.peak = db_url, job_id, 0
        self.stopped = threading.Event()

    def run(self) -> None:
        from hsx.server.db.session import session_scope
        from hsx.server.streams.item_counts import buffered_bytes

        while not self.stopped.wait(0.05):
            with session_scope(self.db_url) as session:
                held = buffered_bytes(session, self.job_id)
            self.peak = max(self.peak, held)


def start_consumer(stack: Stack, api: str, job_id: str, record: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.fixtures.stream_consumer", api, job_id, TEST_TOKEN, str(record), *args],
        cwd=REPO,
        env={**os.environ, **stack.env, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=(stack.tmp / f"{record.stem}.err").open("a"),
        text=True,
        start_new_session=True,
    )


@contextlib.contextmanager
def trainers(
    stack: Stack, api: str, job_id: str, records: list[Path], *args: str
) -> Iterator[list[subprocess.Popen[str]]]:
    """``hsx.torch_data.JobStream`` in processes of their own (tests/fixtures/stream_trainer.py), one
    group; any still running at the end are killed."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.fixtures.stream_trainer",
                api,
                job_id,
                TEST_TOKEN,
                str(r),
                "run",
                *args,
            ],
            cwd=REPO,
            env={**os.environ, **stack.env, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
            stderr=(stack.tmp / f"{r.stem}.err").open("a"),
            text=True,
            start_new_session=True,
        )
        for r in records
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            kill_session(proc.pid)  # with any loader process it started, gone by pid
            proc.wait()


def wait_until(check: Callable[[], object], timeout: float, what: str, stack: Stack) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{stack.logs()}"
        time.sleep(0.05)


def acked_samples(*records: Path) -> list[int]:
    return [r["index"] for r in read_records(*records)]


def dataset(stack: Stack) -> Path:
    return stack.tmp / "d.jsonl"


def consume_job(stack: Stack, spp: int = 2, units_under_cap: float = 2.5) -> tuple[str, int]:
    """A consume job whose cap holds about ``units_under_cap`` of its units."""
    data = write_pretokenized(dataset(stack), [48] * SAMPLES)
    unit = 2 * 48 * 4 * 32 * 2 * spp // 2  # a shard's states, roughly: enough to scale the cap by
    cap = int(unit * units_under_cap)
    return stack.submit(data, samples_per_shard=spp, retention="consume", buffer_cap_bytes=cap)["id"], cap


def largest_shard(stack: Stack, job_id: str) -> int:
    return max(s["bytes"] for s in stack.client.get(f"/jobs/{job_id}/shards").json()["items"])


def uninterrupted_records(stack: Stack, spp: int = 2) -> dict[int, dict[str, Any]]:
    """The test's dataset as a keep job that the job runner runs in this process from start to end, with no
    fault (the test's workers stopped first, so none takes a unit of it): each sample as read back."""
    from hsx.loader import iter_samples
    from workers.job_runner import JobRunner

    stack.stop_workers()
    job_id = str(stack.submit(dataset(stack), samples_per_shard=spp)["id"])
    runner = JobRunner(job_id, stack.settings)
    while runner.run(max_units=1).more_work:
        pass
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", doc
    return {s.index: record_of_sample(s) for s in iter_samples(doc["output_dir"], verify_checksums=True)}


def assert_samples_as_written(stack: Stack, *records: Path) -> None:
    """Every sample acknowledged exactly once, each with the dataset's tokens and exactly the ids, mask and
    states an uninterrupted run of the dataset gives (compared after the readers are done)."""
    got = read_records(*records)
    assert sorted(r["index"] for r in got) == list(range(SAMPLES)), [r["index"] for r in got]
    lines = [json.loads(line) for line in dataset(stack).read_text().splitlines()]
    reference = uninterrupted_records(stack)
    assert sorted(reference) == list(range(SAMPLES))
    for record in got:
        index = record["index"]
        assert record["input_ids"] == lines[index]["input_ids"], f"sample {index}: not the dataset's tokens"
        assert record == reference[index], f"sample {index} differs from the uninterrupted run's"


def test_a_consumer_killed_holding_a_lease_loses_nothing_and_repeats_nothing(
    synth: tuple[Stack, Synthetic],
) -> None:
    from app.main import create_app
    from hsx.server.db.session import session_scope
    from hsx.server.db.stream_models import StreamItem

    stack, _engine = synth
    db_url = stack.env["HSX_DATABASE_URL"]
    job_id, cap = consume_job(stack)
    watch = BufferWatch(db_url, job_id)
    watch.start()
    stack.start_worker()
    first, second = stack.tmp / "first.jsonl", stack.tmp / "second.jsonl"
    with serve_in_thread(create_app()) as api:
        doomed = start_consumer(stack, api, job_id, first, "--hold-after", "2")
        assert doomed.stdout is not None
        held = json.loads(doomed.stdout.readline())["holding"]
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait()
        end_lease(db_url, StreamItem, held, delivery=1)  # the dead consumer's lease runs out
        survivor = start_consumer(stack, api, job_id, second)
        assert survivor.wait(180) == 0, stack.logs()
    watch.stopped.set()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", (doc, stack.logs())
    assert len(acked_samples(first)) == 4  # two shards acknowledged before the kill
    # The shard the killed consumer held was delivered a second time, to the survivor, which acknowledged it.
    with session_scope(db_url) as session:
        again = session.get(StreamItem, held)
        assert again is not None and again.delivery == 2 and again.acked_at is not None
    assert watch.peak <= cap + largest_shard(stack, job_id), (watch.peak, cap)
    stack.wait_deleted(job_id)
    wait_until(lambda: not shards_on_disk(doc), 30, "the acknowledged shards to go", stack)
    assert_samples_as_written(stack, first, second)  # none lost, none twice, each as written


def shards_on_disk(doc: dict[str, Any]) -> list[Path]:
    return list(Path(doc["output_dir"]).glob("shard-*.safetensors"))


def kill_a_worker_whose_horse_holds_a_lease(stack: Stack, job_id: str, worker: Any) -> dict[str, Any]:
    """SIGKILL a worker and its work horse at a moment the horse holds a unit's lease: the worker's session
    (the horse is in it) is stopped, its database sessions settle (a COMMIT in flight lands), and only then
    is the unit read; if it is still that attempt's lease they are killed, else they go on and another
    moment is picked (tests/fixtures/kills.py). Returns the unit as it was leased at the kill."""
    from tests.test_faults import whole_worker

    db_url = stack.env["HSX_DATABASE_URL"]
    held, frozen = freeze_holding_a_lease(db_url, job_id, whole_worker(worker), 60, describe=stack.logs)
    signal_pids(frozen, signal.SIGKILL)
    wait_gone(frozen)
    return held


def test_a_worker_killed_while_its_horse_holds_a_lease_loses_nothing(synth: tuple[Stack, Synthetic]) -> None:
    from app.main import create_app

    stack, engine = synth
    db_url = stack.env["HSX_DATABASE_URL"]
    job_id, cap = consume_job(stack)
    watch = BufferWatch(db_url, job_id)
    watch.start()
    worker = stack.start_worker()
    record = stack.tmp / "acked.jsonl"
    with serve_in_thread(create_app()) as api:
        reader = start_consumer(stack, api, job_id, record)
        wait_until(lambda: len(acked_samples(record)) >= 4, 120, "two shards acknowledged", stack)
        # The engine freezes, so the horse's next unit waits on it with its lease held: the kill comes
        # mid-unit, not between units.
        engine.stop()
        held = kill_a_worker_whose_horse_holds_a_lease(stack, job_id, worker)
        worker.wait(30)
        dead = units(db_url, job_id)[held["index"]]
        assert (dead["state"], dead["attempt"]) == ("leased", held["attempt"]), dead  # nobody committed it
        end_unit_lease(db_url, held)
        engine.resume()
        stack.start_worker()
        assert reader.wait(180) == 0, stack.logs()
    watch.stopped.set()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", (doc, stack.logs())
    redone = units(db_url, job_id)[held["index"]]
    assert redone["state"] == "done" and redone["attempt"] > held["attempt"], (held, redone)
    assert watch.peak <= cap + largest_shard(stack, job_id), (watch.peak, cap)
    assert_samples_as_written(stack, record)


def test_a_consumer_that_never_returns_holds_the_job_and_nothing_unacknowledged_is_deleted(
    synth: tuple[Stack, Synthetic],
) -> None:
    from app.main import create_app
    from hsx.server.jobs.queue import queued_wakeups
    from workers.reconciler import reconcile_once

    stack, _engine = synth
    job_id, cap = consume_job(stack)
    stack.start_worker()
    with serve_in_thread(create_app()) as api:
        hung = start_consumer(stack, api, job_id, stack.tmp / "hung.jsonl", "--hold-after", "1")
        assert hung.stdout is not None
        json.loads(hung.stdout.readline())
        waiting = functools.partial(waiting_with_nothing_in_flight, stack, job_id)
        wait_until(waiting, 60, "the job to wait on its consumer", stack)
        # The worker gave the job up (its wait for room on Redis is over): it is idle, runs no work horse,
        # and no wake-up is queued (an acknowledgement's wake-up, taken after the horse gave up, makes one
        # more horse that gives up too). A reconciler pass wakes nothing either: the cap is full.
        wait_until(lambda: worker_quiet(stack), 60, "the worker to give the job up", stack)
        doc = stack.job(job_id)
        assert reconcile_once(stack.settings)["woken"] == 0
        assert queued_wakeups(stack.settings, job_id) == 0 and worker_quiet(stack), stack.logs()
        later = stack.job(job_id)
        os.killpg(hung.pid, signal.SIGKILL)
        hung.wait()
    stream = later["stream"]
    assert later["state"] == "running" and stream["waiting_on_consumers"] is True, later
    assert later["progress"]["units_done"] == doc["progress"]["units_done"] < SAMPLES // 2
    assert stream["buffered_bytes"] <= cap + largest_shard(stack, job_id)
    assert stream["items_acked"] == 1 and stream["consumers"][0]["leased_items"] == 1
    # Every committed shard not acknowledged is still there, the one the hung consumer holds included.
    shards = stack.client.get(f"/jobs/{job_id}/shards").json()["items"]
    on_disk = {s["path"] for s in shards if Path(s["path"]).exists()}
    assert len(on_disk) == len(shards) - 1 and len(on_disk) >= 1


def waiting_with_nothing_in_flight(stack: Stack, job_id: str) -> bool:
    stream = stack.job(job_id)["stream"]
    return bool(stream["waiting_on_consumers"] and stream["in_flight_bytes"] == 0)


def worker_quiet(stack: Stack) -> bool:
    """No wake-up anywhere on its way (queued, taken by a worker, or run by a horse) and the stack's one
    worker idle by RQ's registry. Read in the order a wake-up moves (the queue, RQ's intermediate queue
    between the worker's pop and its start, the started registry), so one in flight is seen wherever it
    is."""
    from rq.registry import StartedJobRegistry

    from hsx.server.jobs.queue import idle_workers, queue_for

    queue = queue_for(stack.settings)
    return (
        not queue.get_job_ids()
        and not queue.intermediate_queue.get_job_ids()
        and StartedJobRegistry(queue=queue).count == 0
        and idle_workers(stack.settings) == 1
    )


def assert_streamed_exactly_once(stack: Stack, job_id: str, cap: int, peak: int, *records: Path) -> None:
    """The job succeeded, the API counts every shard acknowledged once, the cap held, the shards go from
    the disk, and what the trainers acknowledged is every sample once, each as written (the dataset's
    tokens, an uninterrupted run's states)."""
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", (doc, stack.logs())
    consumers = stack.client.get(f"/jobs/{job_id}/consumers").json()["items"]
    assert sum(c["items_acked"] for c in consumers) == doc["shards"]["total"] == SAMPLES // 2, consumers
    assert doc["stream"]["items_acked"] == SAMPLES // 2 and doc["stream"]["buffered_bytes"] == 0
    assert peak <= cap + largest_shard(stack, job_id), (peak, cap)
    stack.wait_deleted(job_id)
    wait_until(lambda: not shards_on_disk(doc), 30, "the acknowledged shards to go", stack)
    assert_samples_as_written(stack, *records)


def test_the_api_killed_and_restarted_while_trainers_stream_loses_nothing_and_repeats_nothing(
    synth: tuple[Stack, Synthetic], kept_port: int
) -> None:
    from hsx.cli.local_stack import hsx_command, wait_http

    stack, _engine = synth
    job_id, cap = consume_job(stack)
    watch = BufferWatch(stack.env["HSX_DATABASE_URL"], job_id)
    watch.start()
    stack.start_worker()
    port = kept_port  # the API comes back on it: nobody else may take it meanwhile
    api = f"http://127.0.0.1:{port}"
    records = [stack.tmp / f"trainer-{n}.jsonl" for n in range(2)]
    with local_stack(stack.tmp / "api-logs") as procs:

        def serve(name: str) -> subprocess.Popen[bytes]:
            command = hsx_command("api", "--port", str(port))
            proc = procs.start(name, command, env={**stack.env, "PYTHONPATH": str(REPO)})
            wait_http(f"{api}/healthz", 60, proc)
            return proc

        # Trainers import torch meanwhile; until the API answers they retry, as after the restart.
        with trainers(stack, api, job_id, records) as running:
            first = serve("api-1")
            wait_until(lambda: len(acked_samples(*records)) >= 2, 120, "a shard acknowledged", stack)
            os.killpg(first.pid, signal.SIGKILL)  # mid-stream: the trainers lease and ack all the time
            first.wait()
            serve("api-2")
            for trainer in running:
                assert trainer.wait(120) == 0, (trainer_errors(stack), stack.logs())
    watch.stopped.set()
    # Both trainers met the dead API (a lease, an ack, the job's state that a trainer reads between leases,
    # or, for a trainer that was slower to import torch, its registration), retried, and carried on.
    for record in records:
        text = (stack.tmp / f"{record.stem}.err").read_text()
        failed_call = r"(GET|POST) /jobs/[0-9a-f-]{36}(/consumers(/[0-9a-f-]{36}/(leases|acks))?)? failed"
        assert re.search(failed_call, text), trainer_errors(stack)
    assert_streamed_exactly_once(stack, job_id, cap, watch.peak, *records)


@pytest.fixture
def private_redis(
    db_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept_port: int
) -> Iterator[tuple[Stack, LocalStack, str]]:
    """A stack on a Redis of this test's own (never the shared one: this one is killed, and started again
    on its port, kept for it meanwhile)."""
    from hsx.server.settings import get_settings

    with local_stack(tmp_path / "redis") as private:
        url = private.start_redis(kept_port)
        stack = make_stack(
            db_url, url, engines.start().url, tmp_path, monkeypatch, stream_room_wait_seconds="2"
        )
        try:
            yield stack, private, url
        finally:
            stack.stop_workers()
            get_settings.cache_clear()


def test_redis_killed_and_restarted_while_workers_and_trainers_run_loses_nothing(
    private_redis: tuple[Stack, LocalStack, str],
) -> None:
    from app.main import create_app
    from hsx.cli.local_stack import redis_reachable, redis_server_binary
    from hsx.server.db.session import session_scope
    from hsx.server.streams import repository as streams_repository

    stack, private, url = private_redis
    job_id, cap = consume_job(stack)
    watch = BufferWatch(stack.env["HSX_DATABASE_URL"], job_id)
    watch.start()
    records = [stack.tmp / f"trainer-{n}.jsonl" for n in range(2)]
    # Each trainer takes a 0.1 s step per sample, so the job is still running when Redis dies.
    step = ("--step-seconds", "0.1")
    with serve_in_thread(create_app()) as api, trainers(stack, api, job_id, records, *step) as running:
        stack.start_worker()
        wait_until(lambda: len(acked_samples(*records)) >= 2, 120, "a shard acknowledged", stack)
        _name, redis_proc = private.procs[-1]
        os.killpg(redis_proc.pid, signal.SIGKILL)
        redis_proc.wait(10)
        killed = time.time()
        assert len(acked_samples(*records)) < SAMPLES, "the job outlives Redis"

        def served_since_kill() -> bool:
            # The call's own time, from the table: a call that began after the kill met no Redis.
            with session_scope(stack.env["HSX_DATABASE_URL"]) as session:
                seen = [c.last_seen for c in streams_repository.list_consumers(session, job_id)]
            return len(seen) == 2 and all(last > killed for last in seen)

        # The trainers carry on against the API while Redis is gone (it needs none to lease or ack).
        wait_until(served_since_kill, 30, "both trainers served without Redis", stack)
        binary = redis_server_binary()
        assert binary is not None
        port = url.rsplit(":", 1)[1].split("/")[0]
        private.start(
            "redis-again", [binary, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        )
        wait_until(lambda: redis_reachable(url), 20, "the new Redis", stack)
        for trainer in running:
            assert trainer.wait(120) == 0, (trainer_errors(stack), stack.logs())
    watch.stopped.set()
    assert all(w.poll() is None for w in stack.workers), "workers ride out the Redis outage"
    assert_streamed_exactly_once(stack, job_id, cap, watch.peak, *records)


def trainer_errors(stack: Stack) -> str:
    return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(stack.tmp.glob("trainer-*.err")))
