"""Many worker processes on one job: every one of them takes part, and the output is exact.

`hsx worker --processes N` starts N worker processes; a job wakes one worker, and each claim that leaves
claimable units behind keeps a wake-up waiting, so all of them hold leases at once. The horses are held
mid-unit (HSX_HOLD_AT, hsx/server/faults.py) until each of the N processes has one there with its lease: if a
claim woke nobody, the held horses would be all there ever is, and the test would say which processes took
part. Then they are let go and the job runs to the end.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.fixtures.processes import children
from tests.fixtures.stack import Stack
from tests.fixtures.warm_processes import start_hsx

PROCESSES = 3


def registered_workers(stack: Stack) -> int:
    from rq import Worker

    from hsx.server.jobs.queue import queue_for

    queue = queue_for(stack.settings)
    return len(Worker.all(queue=queue))


def live_leases(db_url: str, job_id: str) -> int:
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import queries

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
    # ``hsx worker --processes 3`` forked from the tests' warm parent; it forks its three workers itself,
    # each with two requests in flight, as a fleet host runs them.
    hold = tmp_path / "hold"
    hold.mkdir()
    workers = start_hsx(
        ["worker", "--processes", str(PROCESSES)],
        {
            **os.environ,
            **synthetic_stack.env,
            "HSX_ENGINE_CONCURRENCY": "2",
            "HSX_HOLD_AT": "mid_unit",
            "HSX_HOLD_DIR": str(hold),
        },
        tmp_path / "workers.log",
    )
    synthetic_stack.workers.append(workers)
    deadline = time.monotonic() + 120
    while registered_workers(synthetic_stack) < PROCESSES:
        assert time.monotonic() < deadline, "the worker processes never registered"
        time.sleep(0.2)
    job = synthetic_stack.submit(dataset, samples_per_shard=per_unit)

    def holding() -> set[int]:
        """The worker processes (a horse's parent) of the horses held mid-unit, each holding its lease."""
        return {int(marker.read_text()) for marker in hold.glob("held-*[0-9]")}

    forked = children(workers.pid)  # the N worker processes
    deadline = time.monotonic() + 120
    while len(holding()) < PROCESSES:
        assert time.monotonic() < deadline, f"only {holding()} of worker processes {forked} took part"
        time.sleep(0.05)
    assert holding() == forked and len(forked) == PROCESSES
    assert live_leases(db_url, job["id"]) == PROCESSES  # all of them hold a lease at once
    (hold / "release").touch()
    doc = synthetic_stack.wait(job["id"], timeout=300)
    assert doc["state"] == "succeeded", (doc, (tmp_path / "workers.log").read_text()[-3000:])
    reader = OutputReader(doc["output_dir"], verify_checksums=True)
    indices = [sample.index for sample in reader]
    assert sorted(indices) == list(range(samples)), "every sample once, none twice"
    assert doc["progress"]["units_total"] == samples // per_unit
    # The horses ran the job's units in turn (several units per wake-up), and the job says it ran on the
    # synthetic engine.
    assert reader.manifest.engine["backend"] == "synthetic"
    # SIGTERM reaches every worker process (a warm shutdown of each), and the parent exits as they did.
    workers.terminate()
    assert workers.wait(30) == 0, (tmp_path / "workers.log").read_text()[-3000:]
    assert (tmp_path / "workers.log").read_text().count(": warm shut down requested") == PROCESSES
