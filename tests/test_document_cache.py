"""The poll cache of GET /jobs/{id}: repeated polls within the TTL get the same rendering, a change made
through this API (cancel) shows at once, and a TTL of 0 renders every request."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.jobs.document_cache import DocumentCache
from tests.fixtures.stack import REPO, Stack

SAMPLE = REPO / "tests" / "data" / "short_chats.jsonl"


def test_entries_expire_and_can_be_forgotten() -> None:
    cache = DocumentCache(ttl=0.2)
    cache.put("a", b"one")
    assert cache.get("a") == b"one" and cache.get("b") is None
    cache.forget("a")
    assert cache.get("a") is None
    cache.put("a", b"two")
    time.sleep(0.25)
    assert cache.get("a") is None
    off = DocumentCache(ttl=0)
    off.put("a", b"x")
    assert off.get("a") is None


def test_polls_share_a_rendering_and_cancel_shows_at_once(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hsx.db.session import session_scope
    from hsx.jobs import repository as repo
    from hsx.settings import get_settings

    monkeypatch.setenv("HSX_JOB_DOCUMENT_TTL_SECONDS", "30")
    get_settings.cache_clear()
    job = stack.submit(SAMPLE, samples_per_shard=4)
    first = stack.client.get(f"/jobs/{job['id']}").content
    with session_scope(get_settings().resolved_database_url) as session:
        # A change the API did not make (a worker's) is not seen until the entry expires...
        repo.get_job(session, job["id"]).error = "written behind the API's back"  # type: ignore[union-attr]
    assert stack.client.get(f"/jobs/{job['id']}").content == first
    # ...but the API's own changes are.
    assert stack.client.post(f"/jobs/{job['id']}/cancel").status_code == 200
    after = stack.client.get(f"/jobs/{job['id']}").json()
    assert after["state"] == "cancelled" and after["error"] == "cancelled by request"
