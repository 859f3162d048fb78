"""Fail fast where the answer is known: with only an unfit engine configured, POST /jobs refuses the job with
a 422 naming the preflight's failed checks, instead of queueing it to fail after HSX_NO_FIT_ENGINE_SECONDS.
A fleet (HSX_ENGINE_FLEET=true), where other engines may join, keeps the wait, and the document says so.
``/readyz`` judges the engine as POST /jobs does: ready means a job would be accepted."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from hsx.server.settings import get_settings
from tests.fixtures.stack import REPO, Stack, make_stack

SHORT = REPO / "tests" / "data" / "short_chats.jsonl"
postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def settled_readyz(stack: Stack, timeout: float = 120.0) -> Any:
    """/readyz once its preflight has a result: it answers "checking" while the preflight runs."""
    deadline = time.monotonic() + timeout
    while True:
        ready = stack.client.get("/readyz")
        if not ready.json()["checks"]["engine"].startswith("checking") or time.monotonic() > deadline:
            return ready
        time.sleep(0.2)


def _nothing_queued(stack: Stack) -> None:
    from hsx.server.jobs.queue import queue_for

    assert stack.client.get("/jobs").json()["total"] == 0
    assert queue_for(stack.settings).count == 0


@postgres_only
def test_a_prefix_cached_engine_is_refused_at_submit_naming_the_failed_checks(
    db_url: str, redis_url: str, engine_cache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = make_stack(db_url, redis_url, engine_cache.url, tmp_path, monkeypatch)
    for options in ({}, {"cache_namespace_per_request": True}):
        refused = stack.client.post("/jobs", json={"dataset_uri": str(SHORT), "options": options})
        assert refused.status_code == 422, refused.text
        body = refused.json()
        assert body["error"] == "engine_unfit", body
        assert engine_cache.url in body["detail"] and "preflight" in body["detail"]
        # The checks that failed, by name: the cache is on and the second prompt came back cached.
        assert "prefix_cache: expected off" in body["detail"], body["detail"]
        assert "prompt_b.cached_tokens: expected 0" in body["detail"], body["detail"]
        assert "HSX_ENGINE_FLEET" in body["detail"]
    _nothing_queued(stack)

    monkeypatch.setenv("HSX_ENGINE_FLEET", "true")
    get_settings.cache_clear()
    queued = stack.submit(SHORT)
    assert queued["state"] == "queued" and queued["engine_wait"].startswith("fleet"), queued
    assert f"{stack.settings.no_fit_engine_seconds:g}s" in queued["engine_wait"]


@postgres_only
def test_readyz_is_unready_for_an_engine_that_post_jobs_refuses_and_names_the_failed_checks(
    db_url: str, redis_url: str, engine_cache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = make_stack(db_url, redis_url, engine_cache.url, tmp_path, monkeypatch)
    ready = settled_readyz(stack)
    body = ready.json()
    assert ready.status_code == 503 and body["ready"] is False, body
    assert body["checks"] == {"database": "ok", "redis": "ok", "engine": body["checks"]["engine"]}, body
    assert body["checks"]["engine"].startswith("unfit: the engine failed the preflight"), body
    failed = body["engine_failed_checks"]
    assert any(check.startswith("prefix_cache: expected off") for check in failed), failed
    assert any(check.startswith("prompt_b.cached_tokens: expected 0") for check in failed), failed
    # The same checks, the same answer as a submission gets.
    refused = stack.client.post("/jobs", json={"dataset_uri": str(SHORT)})
    assert (refused.status_code, refused.json()["error"]) == (422, "engine_unfit"), refused.text
    assert all(check in refused.json()["detail"] for check in failed), (failed, refused.json())

    # In a fleet a job is queued for other engines: ready, and the note says what this engine lacks.
    monkeypatch.setenv("HSX_ENGINE_FLEET", "true")
    get_settings.cache_clear()
    fleet = stack.client.get("/readyz")
    assert fleet.status_code == 200 and fleet.json()["checks"]["engine"] == "ok", fleet.text
    assert "engine_failed_checks" not in fleet.json()
    assert any(note.startswith("prefix cache on") for note in fleet.json()["engine_notes"]), fleet.text
    assert stack.submit(SHORT)["state"] == "queued"


@postgres_only
def test_a_fit_engine_passes_and_the_document_says_what_a_job_would_wait_for(stack: Stack) -> None:
    ready = settled_readyz(stack)
    assert ready.status_code == 200 and ready.json()["checks"]["engine"] == "ok", ready.text
    assert "engine_failed_checks" not in ready.json()
    job = stack.submit(SHORT)
    assert job["state"] == "queued"
    assert job["engine_wait"].startswith("single engine") and "refuses" in job["engine_wait"], job


@postgres_only
def test_a_server_that_is_no_hsx_engine_is_refused_unless_in_a_fleet(
    db_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.fixtures.live_server import serve_in_thread

    with serve_in_thread(_not_an_engine()) as url:
        stack = make_stack(db_url, redis_url, url, tmp_path, monkeypatch)
        refused = stack.client.post("/jobs", json={"dataset_uri": str(SHORT)})
        assert (refused.status_code, refused.json()["error"]) == (422, "engine_unfit"), refused.text
        assert "not an hsx engine" in refused.json()["detail"]
        _nothing_queued(stack)
        monkeypatch.setenv("HSX_ENGINE_FLEET", "true")
        get_settings.cache_clear()
        assert stack.submit(SHORT)["state"] == "queued"


def test_an_engine_that_does_not_answer_is_no_reason_to_refuse(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.server.db.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'hsx.sqlite3'}"
    upgrade(url)
    stack = make_stack(url, redis_url, "http://127.0.0.1:9", tmp_path, monkeypatch)
    assert stack.submit(SHORT)["state"] == "queued"


def _not_an_engine() -> Any:
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


@postgres_only
def test_the_preflight_judges_the_replies_and_opens_no_dump(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API has no view of the engine's dumps (docker-compose.yml mounts none into it): its preflight
    judges the engine's replies, has nothing dumped, and so leaves no dump behind for nobody to delete."""
    from app.jobs import admission

    blind = tmp_path / "not-the-engines-dumps"
    stack = make_stack(db_url, redis_url, engine_nocache.url, tmp_path, monkeypatch, dump_dir=str(blind))
    before = set(os.listdir(engine_nocache.dump_dir))
    admission._results.clear()
    assert stack.submit(SHORT)["state"] == "queued"
    [(_, result)] = admission._results.values()
    assert not result.refused and not result.failed, result
    assert set(os.listdir(engine_nocache.dump_dir)) == before  # the prompts were never captured
    assert not blind.exists()
    ready = settled_readyz(stack)
    assert ready.status_code == 200 and ready.json()["checks"]["engine"] == "ok", ready.text
