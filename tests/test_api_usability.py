"""What a new user of the jobs API runs into: where the created job is, bounded documents and paginated
shards, strict options, JSON bodies, 409 for cancelling a finished job (race included), one error shape for
server errors, time zones on every timestamp, and dataset roots that say what they are and how to set them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.jobs.documents import SHARDS_IN_DOCUMENT
from app.jobs.service import JobService
from hsx.errors import Conflict
from tests.fixtures.stack import REPO, TEST_TOKEN, Stack, make_stack

SHORT = REPO / "tests" / "data" / "short_chats.jsonl"
AUTH = {"Authorization": f"Bearer {TEST_TOKEN}"}
NO_ENGINE = "http://127.0.0.1:9"

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def _utc(text: str) -> datetime:
    stamp = datetime.fromisoformat(text)
    assert stamp.utcoffset() == timedelta(0), text
    return stamp


@postgres_only
def test_submit_answers_with_the_location_of_the_job(stack: Stack) -> None:
    body = {"dataset_uri": str(SHORT), "options": {"samples_per_shard": 8}}
    created = stack.client.post("/jobs", json=body, headers={"Idempotency-Key": "where-is-it"})
    assert created.status_code == 201, created.text
    location = created.headers["location"]
    assert location == f"/jobs/{created.json()['id']}"
    assert stack.client.get(location).json()["id"] == created.json()["id"]
    again = stack.client.post("/jobs", json=body, headers={"Idempotency-Key": "where-is-it"})
    assert (again.status_code, again.headers["location"]) == (200, location)


@postgres_only
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_length": "100"}, "max_length"),
        ({"max_length": 100.0}, "max_length"),
        ({"samples_per_shard": "4"}, "samples_per_shard"),
        ({"chat_template": "yes"}, "chat_template"),
        ({"chat_template": 1}, "chat_template"),
        ({"aux_layers": ["1", "2"]}, "aux_layers"),
    ],
)
def test_options_are_strict(stack: Stack, options: dict[str, Any], field: str) -> None:
    response = stack.client.post("/jobs", json={"dataset_uri": str(SHORT), "options": options})
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid_request"
    assert f"options.{field}" in response.json()["detail"]


@postgres_only
def test_a_body_not_declared_as_json_is_415_naming_the_header(stack: Stack) -> None:
    body = json.dumps({"dataset_uri": str(SHORT)})
    for headers in (
        {"Content-Type": "application/x-www-form-urlencoded"},  # what curl -d sends
        {"Content-Type": "text/plain; charset=utf-8"},
        {},
    ):
        response = stack.client.post("/jobs", content=body, headers=headers)
        assert response.status_code == 415, response.text
        assert response.json()["error"] == "unsupported_media_type"
        assert "Content-Type: application/json" in response.json()["detail"]
    # JSON under its own name or a +json type is read.
    for headers in (
        {"Content-Type": "application/json; charset=utf-8"},
        {"Content-Type": "application/x+json"},
    ):
        assert stack.client.post("/jobs", content=body, headers=headers).status_code == 201


def test_cancelling_a_finished_job_is_409_even_when_it_finishes_during_the_request(stack: Stack) -> None:
    from hsx.server.db.models import JobState
    from hsx.server.db.session import session_factory
    from hsx.server.jobs import repository as repo

    url = stack.env["HSX_DATABASE_URL"]
    job_id = stack.submit(SHORT)["id"]
    # The API's session has read the job as queued; the job then succeeds behind its back.
    api_session = session_factory(url)()
    worker_session = session_factory(url)()
    try:
        service = JobService(api_session, stack.settings)
        assert service.get(job_id).state == JobState.queued.value
        assert repo.set_job_state(worker_session, job_id, JobState.succeeded, repo.ACTIVE_STATES)
        worker_session.commit()
        with pytest.raises(Conflict) as caught:
            service.cancel(job_id)
        assert caught.value.error == "job_finished" and "succeeded" in caught.value.detail
    finally:
        api_session.close()
        worker_session.close()
    response = stack.client.post(f"/jobs/{job_id}/cancel")
    assert (response.status_code, response.json()["error"]) == (409, "job_finished")
    assert stack.job(job_id)["state"] == "succeeded"

    other = stack.submit(SHORT)["id"]
    cancelled = stack.client.post(f"/jobs/{other}/cancel")
    assert (cancelled.status_code, cancelled.json()["state"]) == (200, "cancelled")
    assert stack.client.post(f"/jobs/{other}/cancel").status_code == 409


def test_timestamps_are_utc_with_an_offset_on_every_backend(stack: Stack) -> None:
    before = datetime.now(timezone.utc)
    job_id = stack.submit(SHORT)["id"]
    stack.client.post(f"/jobs/{job_id}/cancel")
    doc = stack.job(job_id)
    created, finished = _utc(doc["created_at"]), _utc(doc["finished_at"])
    assert before - timedelta(seconds=5) <= created <= finished <= datetime.now(timezone.utc)
    [listed] = [j for j in stack.client.get("/jobs").json()["items"] if j["id"] == job_id]
    assert listed["created_at"] == doc["created_at"]


@postgres_only
def test_the_job_shows_a_few_shards_and_pages_through_all(synthetic_stack: Stack) -> None:
    stack = synthetic_stack
    job = stack.submit(SHORT, samples_per_shard=1)  # one shard per sample
    assert stack.run_burst() == 0, stack.logs()
    doc = stack.wait(job["id"], timeout=120)
    assert doc["state"] == "succeeded", (doc, stack.logs())
    total = doc["progress"]["samples_done"]
    assert total > SHARDS_IN_DOCUMENT
    shards = doc["shards"]
    assert shards["total"] == total and len(shards["items"]) == SHARDS_IN_DOCUMENT
    assert shards["href"] == f"/jobs/{job['id']}/shards"

    pages: list[dict[str, Any]] = []
    offset = 0
    while True:
        page = stack.client.get(shards["href"], params={"limit": 4, "offset": offset}).json()
        assert (page["total"], page["limit"], page["offset"]) == (total, 4, offset)
        if not page["items"]:
            break
        pages.extend(page["items"])
        offset += len(page["items"])
    assert len(pages) == total and len({s["path"] for s in pages}) == total
    assert pages[:SHARDS_IN_DOCUMENT] == shards["items"]
    manifest = json.loads(Path(doc["manifest"]).read_text())
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in pages]
    assert stack.client.get(shards["href"], params={"limit": 0}).status_code == 422


def test_server_errors_use_the_error_shape_and_name_the_database_problem(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.main import create_app
    from hsx.server.settings import get_settings

    # A database nobody migrated: what a user gets when `hsx api` runs elsewhere than `hsx db upgrade`.
    make_stack(
        f"sqlite:///{tmp_path / 'never-migrated.sqlite3'}", redis_url, NO_ENGINE, tmp_path, monkeypatch
    )
    try:
        client = TestClient(create_app(), headers=AUTH, raise_server_exceptions=False)
        for response in (
            client.post("/jobs", json={"dataset_uri": str(SHORT)}),
            client.get("/jobs"),
            client.get("/jobs/00000000-0000-0000-0000-000000000000"),
        ):
            assert response.status_code == 500, response.text
            assert response.headers["content-type"] == "application/json"
            body = response.json()
            assert set(body) == {"error", "detail"} and body["error"] == "database_error"
            assert "no such table" in body["detail"] and "hsx db upgrade" in body["detail"]
    finally:
        get_settings.cache_clear()


@postgres_only
def test_a_path_outside_the_roots_names_the_roots_and_the_setting(stack: Stack) -> None:
    response = stack.client.post("/jobs", json={"dataset_uri": "/etc/hostname"})
    assert (response.status_code, response.json()["error"]) == (403, "path_outside_roots")
    detail = response.json()["detail"]
    assert "HSX_DATASET_ROOTS" in detail
    for root in stack.settings.resolved_dataset_roots:
        assert str(root) in detail


def test_dataset_roots_take_a_plain_path_a_comma_list_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    from hsx.server.settings import Settings

    for value, expected in (
        ("/tmp/x", [Path("/tmp/x")]),
        ("/tmp/x, /srv/data ,", [Path("/tmp/x"), Path("/srv/data")]),
        ('["/tmp/x", "/srv/data"]', [Path("/tmp/x"), Path("/srv/data")]),
    ):
        monkeypatch.setenv("HSX_DATASET_ROOTS", value)
        assert Settings().dataset_roots == expected
    monkeypatch.setenv("HSX_ALLOWED_BUCKETS", "a-bucket,another")
    assert Settings().allowed_buckets == ["a-bucket", "another"]


def test_a_plain_dataset_root_does_not_break_commands(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "HSX_DATASET_ROOTS": str(tmp_path),
        "HSX_DATABASE_URL": f"sqlite:///{tmp_path / 'db'}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "db", "upgrade"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_default_dataset_roots_leave_out_a_broad_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.server.settings import Settings

    monkeypatch.delenv("HSX_DATASET_ROOTS", raising=False)
    data_dir = tmp_path / "data"
    for broad in ("/", "/tmp"):
        monkeypatch.chdir(broad)
        assert Settings(data_dir=data_dir).resolved_dataset_roots == [data_dir.resolve()]
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    assert Settings(data_dir=data_dir).resolved_dataset_roots == [project.resolve(), data_dir.resolve()]
