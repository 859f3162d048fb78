"""``hsx worker`` as a user starts it: the installed console script (``.venv/bin/hsx``) in a fresh
interpreter, not forked from the tests' warm parent (tests/fixtures/warm_processes.py), which has its
imports done in another order and whose children leave through ``os._exit``. ``--burst`` runs a job to the
end and exits by itself; ``--processes 2`` runs a job and, on SIGTERM, exits with every process it forked.
The job's samples are the dataset's. A process that does not exit within a generous bound fails the test
(a hang, not a timing)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.processes import kill_session
from tests.fixtures.stack import Stack
from tests.fixtures.synthetic import write_pretokenized

pytestmark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
HSX = Path(sys.executable).parent / "hsx"  # the console script pip installed beside this interpreter
EXIT_BOUND_SECONDS = 120  # generous: only a process that hangs takes this long


@contextlib.contextmanager
def console_worker(stack: Stack, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``hsx worker ARGS`` through the console script, in a session of its own (killed if still there)."""
    assert HSX.is_file() and os.access(HSX, os.X_OK), f"no console script at {HSX}"
    log = (stack.tmp / "console-worker.log").open("ab")
    proc = subprocess.Popen(
        [str(HSX), "worker", *args],
        cwd=stack.tmp,  # anywhere: a user's shell is not in the checkout
        env={**os.environ, **stack.env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        kill_session(proc.pid)  # the worker, the processes it forked and their horses, gone by pid
        proc.wait()
        log.close()


def worker_log(stack: Stack) -> str:
    return (stack.tmp / "console-worker.log").read_text(errors="replace")[-4000:]


def assert_samples_are_the_dataset(doc: dict[str, object], dataset: Path) -> None:
    from hsx.loader import iter_samples

    lines = [json.loads(line) for line in dataset.read_text().splitlines()]
    got = {s.index: s.input_ids.tolist() for s in iter_samples(str(doc["output_dir"]), verify_checksums=True)}
    assert got == {i: line["input_ids"] for i, line in enumerate(lines)}


def processes_in_group(pgid: int) -> set[int]:
    """Live processes of a process group (zombies are gone: their parent only has to reap them)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    found.add(int(entry.name))
    return found


def test_a_burst_worker_started_from_the_console_script_runs_the_job_and_exits(
    synthetic_stack: Stack, tmp_path: Path
) -> None:
    dataset = write_pretokenized(tmp_path / "d.jsonl", [40] * 12)
    job_id = synthetic_stack.submit(dataset, samples_per_shard=4)["id"]
    with console_worker(synthetic_stack, "--burst") as worker:
        try:
            code = worker.wait(EXIT_BOUND_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"hsx worker --burst did not exit\n{worker_log(synthetic_stack)}")
    assert code == 0, worker_log(synthetic_stack)
    assert not processes_in_group(worker.pid), "a process of the worker outlived it"
    doc = synthetic_stack.job(job_id)
    assert doc["state"] == "succeeded", (doc, worker_log(synthetic_stack))
    assert_samples_are_the_dataset(doc, dataset)


def test_two_worker_processes_from_the_console_script_run_the_job_and_all_exit_on_sigterm(
    synthetic_stack: Stack, tmp_path: Path
) -> None:
    from rq import Worker

    from hsx.server.jobs.queue import queue_for

    dataset = write_pretokenized(tmp_path / "d.jsonl", [40] * 24)
    with console_worker(synthetic_stack, "--processes", "2") as parent:
        queue = queue_for(synthetic_stack.settings)
        deadline = time.monotonic() + EXIT_BOUND_SECONDS
        while len(Worker.all(queue=queue)) < 2:
            assert parent.poll() is None, worker_log(synthetic_stack)
            assert time.monotonic() < deadline, f"two workers never registered\n{worker_log(synthetic_stack)}"
            time.sleep(0.1)
        job_id = synthetic_stack.submit(dataset, samples_per_shard=4)["id"]
        doc = synthetic_stack.wait(job_id, timeout=EXIT_BOUND_SECONDS)
        assert doc["state"] == "succeeded", (doc, worker_log(synthetic_stack))
        forked = processes_in_group(parent.pid) - {parent.pid}
        assert len(forked) >= 2, forked  # the two workers it forked, in its group
        parent.send_signal(signal.SIGTERM)
        try:
            code = parent.wait(EXIT_BOUND_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"hsx worker --processes 2 did not exit on SIGTERM\n{worker_log(synthetic_stack)}")
    assert code == 0, worker_log(synthetic_stack)
    assert not processes_in_group(parent.pid), "a forked worker outlived its parent"
    assert_samples_are_the_dataset(doc, dataset)
