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
    put_at = time.monotonic()
    cache.put("a", b"two")
    while cache.get("a") is not None:  # fresh until the TTL has passed, then gone
        assert time.monotonic() - put_at < 10, "the entry never expired"
        time.sleep(0.01)
    assert time.monotonic() - put_at >= 0.2
    off = DocumentCache(ttl=0)
    off.put("a", b"x")
    assert off.get("a") is None


def test_polls_share_a_rendering_and_cancel_shows_at_once(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo
    from hsx.server.settings import get_settings

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


def test_a_stale_document_is_served_at_once_while_one_rendering_runs() -> None:
    import asyncio
    import threading

    cache = DocumentCache(ttl=0.05, max_stale=10)
    renders: list[int] = []
    release = threading.Event()

    def render() -> bytes:
        renders.append(1)
        if len(renders) > 1:
            release.wait(5)  # a slow job table
        return f"v{len(renders)}".encode()

    async def scenario() -> None:
        assert await cache.fetch("a", render) == b"v1"  # nothing cached: rendered now
        assert await cache.fetch("a", render) == b"v1"  # fresh
        while cache.get("a") is not None:  # until the entry is past its TTL
            await asyncio.sleep(0.005)
        # Stale: the polls are answered at once with v1, and only one rendering starts for all of them.
        polls = await asyncio.gather(*(cache.fetch("a", render) for _ in range(20)))
        for _ in range(1000):  # until the one background rendering has started (it waits on the job table)
            if len(renders) == 2:
                break
            await asyncio.sleep(0.005)
        polls += await asyncio.gather(*(cache.fetch("a", render) for _ in range(20)))
        assert set(polls) == {b"v1"} and len(renders) == 2
        release.set()
        for _ in range(100):
            if cache.get("a") == b"v2":
                break
            await asyncio.sleep(0.01)
        assert await cache.fetch("a", render) == b"v2"

    asyncio.run(scenario())


def test_a_rendering_older_than_a_change_is_not_kept_and_errors_reach_the_poller() -> None:
    import asyncio
    import threading

    cache = DocumentCache(ttl=30)
    started, release = threading.Event(), threading.Event()

    def slow_before_cancel() -> bytes:
        started.set()
        release.wait(5)
        return b"before the cancel"

    def failing() -> bytes:
        raise LookupError("no job a")

    async def scenario() -> None:
        pending = asyncio.ensure_future(cache.fetch("a", slow_before_cancel))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        cache.forget("a")  # the job was cancelled through this API meanwhile
        release.set()
        assert await pending == b"before the cancel"  # that poll began before the cancel
        assert cache.get("a") is None  # but it is not what later polls get
        with pytest.raises(LookupError):
            await cache.fetch("b", failing)
        assert cache.get("b") is None

    asyncio.run(scenario())


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_hsx_status_exits_with_the_state_of_a_job_that_ended_while_polls_got_the_kept_document(
    db_url: str,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job that finished seconds earlier: a poll may still get "running" from the cache, but ``hsx
    status`` (one look, whose exit code says whether the job is over) reads the job table."""
    import json

    from hsx.cli.api_client import EXIT_SUCCEEDED
    from hsx.cli.main import main
    from hsx.server.db.models import JobState
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo
    from tests.fixtures.jobs import running_job
    from tests.fixtures.live_server import serve_in_thread
    from tests.fixtures.stack import make_stack

    # No engine is asked anything here; the job is written straight into the table.
    stack = make_stack(
        db_url, redis_url, "http://127.0.0.1:9", tmp_path, monkeypatch, job_document_ttl_seconds="60"
    )
    job_id = running_job(db_url, tmp_path / "out", units=1)
    assert stack.job(job_id)["state"] == "running"  # rendered, and kept for the next polls
    with session_scope(db_url) as session:  # a worker finalizes it, behind the API's back
        assert repo.set_job_state(session, job_id, JobState.succeeded, (JobState.running.value,))
    assert stack.job(job_id)["state"] == "running"  # a poll may be the kept document
    capsys.readouterr()
    with serve_in_thread(stack.client.app) as url:
        code = main(["status", job_id, "--api-url", url, "--json"])
    assert json.loads(capsys.readouterr().out)["state"] == "succeeded"
    assert code == EXIT_SUCCEEDED
    assert stack.job(job_id)["state"] == "succeeded"  # the look's rendering is what polls get now
