"""One options model for the API, the job table and the workers (hsx/server/job_options.py): requests are
strict, rows written by older versions (fields missing, nulls stored) are read with today's defaults, and the
unit size has one name and one default (HSX_SAMPLES_PER_SHARD, with HSX_SAMPLES_PER_UNIT as an old alias)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.fixtures.stack import REPO, Stack, make_stack

CHATS = REPO / "tests" / "data" / "short_chats.jsonl"  # short: what is tested is the row, not the engine
postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def test_a_stored_row_of_an_older_version_takes_todays_defaults() -> None:
    from hsx.server.job_options import JobOptions

    old = {"max_length": None, "truncation": None, "format": "sharegpt", "a_removed_option": 1}
    options = JobOptions.from_stored(old, samples_per_shard=5)
    assert options.max_length == 4096 and options.truncation == "truncate"
    assert options.format == "sharegpt" and options.chat_template is True
    assert options.cache_namespace_per_request is True and options.aux_layers is None
    assert options.unit_size == 5
    assert JobOptions.from_stored({"samples_per_shard": 3}, samples_per_shard=5).unit_size == 3
    assert JobOptions.from_stored(None).samples_per_shard is None
    with pytest.raises(ValueError, match="not resolved"):
        _ = JobOptions.from_stored({}).unit_size
    # A value of the wrong type is refused, as on submit: reading a row never guesses.
    with pytest.raises(ValidationError):
        JobOptions.from_stored({"max_length": "4096"})


def test_requests_stay_strict() -> None:
    from hsx.server.job_options import JobOptions

    for bad in ({"max_length": "100"}, {"chat_template": "yes"}, {"samples_per_shard": 0}, {"typo": 1}):
        with pytest.raises(ValidationError):
            JobOptions.model_validate(bad)


def test_the_unit_size_setting_has_one_name_and_reads_the_old_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from hsx.server.settings import Settings

    monkeypatch.delenv("HSX_SAMPLES_PER_SHARD", raising=False)
    monkeypatch.delenv("HSX_SAMPLES_PER_UNIT", raising=False)
    assert Settings().samples_per_shard == 64
    monkeypatch.setenv("HSX_SAMPLES_PER_UNIT", "7")
    assert Settings().samples_per_shard == 7
    monkeypatch.setenv("HSX_SAMPLES_PER_SHARD", "9")
    assert Settings().samples_per_shard == 9, "the current name wins over the deprecated one"
    assert not hasattr(Settings(), "samples_per_unit")


@postgres_only
def test_a_job_left_without_a_unit_size_gets_the_deployments(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = make_stack(db_url, redis_url, engine_nocache.url, tmp_path, monkeypatch, samples_per_shard="5")
    doc = stack.submit(CHATS)
    assert doc["options"]["samples_per_shard"] == 5, "recorded resolved, so the document says what runs"
    explicit = stack.submit(CHATS, samples_per_shard=3)
    assert explicit["options"]["samples_per_shard"] == 3
    # The same request under one key: the default filled in or written out is the same request.
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    first = stack.client.post("/jobs", json={"dataset_uri": str(CHATS)}, headers=key)
    again = stack.client.post(
        "/jobs", json={"dataset_uri": str(CHATS), "options": {"samples_per_shard": 5}}, headers=key
    )
    assert (first.status_code, again.status_code) == (201, 200) and first.json()["id"] == again.json()["id"]


def _old_row(stack: Stack, dataset: Path, options: dict[str, Any]) -> str:
    """A queued job as an older version wrote it, straight into the real job table."""
    from hsx.server.db.models import Job, JobState
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo

    job_id = str(uuid.uuid4())
    with session_scope(stack.settings.resolved_database_url) as session:
        repo.add_job(
            session,
            Job(
                id=job_id,
                state=JobState.queued.value,
                dataset_uri=str(dataset),
                dataset_path=str(dataset),
                options=options,
                request_hash="0" * 64,
                output_dir=str(stack.settings.resolved_output_dir / job_id),
                samples_total=0,
                units_total=0,
            ),
        )
    return job_id


@postgres_only
def test_a_worker_runs_a_job_row_written_by_an_older_version(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.server.settings import get_settings
    from workers.job_runner import JobRunner

    stack = make_stack(db_url, redis_url, engine_nocache.url, tmp_path, monkeypatch, samples_per_shard="4")
    # No unit size, no truncation, nulls where later versions write values: every field takes its default.
    job_id = _old_row(stack, CHATS, {"max_length": None, "format": None, "chat_template": None})
    assert JobRunner(job_id, get_settings()).run().more_work is False
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", doc
    assert doc["options"]["samples_per_shard"] == 4 and doc["options"]["max_length"] == 4096
    samples = doc["progress"]["samples_total"]
    assert doc["progress"]["units_total"] == -(-samples // 4) and doc["shards"]["total"] == -(-samples // 4)
    assert doc["progress"]["samples_rejected"] == 0 and doc["progress"]["samples_done"] == samples
