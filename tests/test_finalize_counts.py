"""Finalizing reads the job row and then counts the units: the last unit can commit in between (its own
worker finalizing beside another one that read the row a moment earlier). The manifest must count what the
shards hold all the same. Real PostgreSQL and SQLite; the unit is committed through the job repository as a
worker commits it, exactly at the moment the finalizer counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.jobs import running_job


def commit_one(db_url: str, job_id: str, out: Path) -> None:
    """Claim and commit the job's next unit as a worker does: 4 samples, 40 tokens, a shard row in ``out``
    (the finalizer reads rows, never the files)."""
    import time

    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo
    from hsx.server.jobs import unit_results

    with session_scope(db_url) as session:
        unit = repo.claim_unit(session, job_id, "host:1@http://engine", 60, time.time())
    assert unit is not None
    with session_scope(db_url) as session:
        shard = unit_results.ShardRow(
            str(out / f"shard-{unit.unit_index:05d}.safetensors"), "0" * 64, 1000, 4, 40
        )
        assert unit_results.commit_unit(session, unit, time.time(), shard, [], 4, 40, lambda: None)


def test_a_unit_committed_while_the_job_finalizes_is_counted_in_the_manifest(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy import update

    from hsx.server.db.models import Job
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import finalize, queries
    from hsx.server.jobs import repository as repo

    out = tmp_path / "out"
    job_id = running_job(db_url, out, units=2)
    engine = {
        "state_dtype": "BF16",
        "dtype": "bfloat16",
        "num_layers": 4,
        "hidden_size": 8,
        "aux_layer_ids": [0, 1, 2],
        "hf_indices": [1, 2, 3, 4],
    }
    with session_scope(db_url) as session:  # what a worker records as the job starts
        session.execute(update(Job).where(Job.id == job_id).values(engine=engine))
    commit_one(db_url, job_id, out)
    real = queries.unit_counts
    committed: list[bool] = []

    def counted_after_the_last_commit(session: Any, job: str) -> Any:
        if not committed:  # the other worker's commit lands after this finalizer read the job row
            commit_one(db_url, job_id, out)
            committed.append(True)
        return real(session, job)

    monkeypatch.setattr(queries, "unit_counts", counted_after_the_last_commit)
    assert finalize.finalize_if_complete(db_url, job_id)
    assert committed
    with session_scope(db_url) as session:
        job = repo.get_job(session, job_id)
        assert job is not None and job.state == "succeeded"
        final = (job.samples_done, job.tokens_done)
    manifest = json.loads((out / finalize.MANIFEST_NAME).read_text())
    assert final == (8, 80)  # two units of 4 samples and 40 tokens each
    assert (manifest["counts"]["samples"], manifest["counts"]["tokens"]) == final
    assert sum(s["samples"] for s in manifest["shards"]) == final[0]
