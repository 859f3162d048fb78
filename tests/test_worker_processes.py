"""Many worker processes on one job: every one of them takes part, and the output is exact.

`hsx worker --processes N` starts N worker processes; a job wakes one worker, and each claim that leaves
claimable units behind keeps a wake-up waiting, so all of them hold leases at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.stack import REPO, Stack, make_stack

PROCESSES = 3


@pytest.fixture
def synthetic_stack(
    db_url: str, redis_url: str, engine_synthetic: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    stack = make_stack(db_url, redis_url, engine_synthetic.url, tmp_path, monkeypatch, engine_concurrency="2")
    yield stack
    stack.stop_workers()


def registered_workers(stack: Stack) -> int:
    from rq import Worker

    from hsx.jobs.queue import queue_for

    queue = queue_for(stack.settings)
    return len(Worker.all(queue=queue))


def live_leases(db_url: str, job_id: str) -> int:
    from hsx.db.session import session_scope
    from hsx.jobs import queries

    with session_scope(db_url) as session:
        return queries.live_lease_count(session, job_id, time.time())


def test_every_worker_process_holds_a_lease_and_nothing_is_lost(
    synthetic_stack: Stack, db_url: str, tmp_path: Path
) -> None:
    from hsx.loader import OutputReader

    samples, per_unit = 1800, 150
    dataset = tmp_path / "pretokenized.jsonl"
    with dataset.open("w") as fh:
        for i in range(samples):
            ids = [100 + (i * 7 + j) % 5000 for j in range(48 + i % 17)]
            fh.write(json.dumps({"input_ids": ids, "loss_mask": [j % 2 for j in range(len(ids))]}) + "\n")
    log = open(tmp_path / "workers.log", "ab")  # noqa: SIM115 - owned by the child
    workers = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "worker", "--processes", str(PROCESSES)],
        env={**os.environ, **synthetic_stack.env},
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    synthetic_stack.workers.append(workers)
    deadline = time.monotonic() + 120
    while registered_workers(synthetic_stack) < PROCESSES:
        assert time.monotonic() < deadline, "the worker processes never registered"
        time.sleep(0.2)
    job = synthetic_stack.submit(dataset, samples_per_shard=per_unit)
    most = 0
    while (doc := synthetic_stack.job(job["id"]))["state"] in ("queued", "running"):
        most = max(most, live_leases(db_url, job["id"]))
        time.sleep(0.05)
    assert doc["state"] == "succeeded", (doc, (tmp_path / "workers.log").read_text()[-3000:])
    assert most == PROCESSES, f"at most {most} of {PROCESSES} processes held a lease at once"
    reader = OutputReader(doc["output_dir"], verify_checksums=True)
    indices = [sample.index for sample in reader]
    assert sorted(indices) == list(range(samples)), "every sample once, none twice"
    assert doc["progress"]["units_total"] == samples // per_unit
    # The horses ran the job's units in turn (several units per wake-up), and the job says it ran on the
    # synthetic engine.
    assert reader.manifest.engine["backend"] == "synthetic"
