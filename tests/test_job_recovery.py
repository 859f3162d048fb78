"""Jobs that never hang: a unit that keeps failing ends after a bounded number of attempts with its reason
in the job document; a failure no retry heals ends the job at once; an engine at fault (down, unfit)
leaves the work to healthy workers; a finished job resumes with ``POST /jobs/{id}/retry`` without ever
publishing a sample twice.

Real synthetic engines (separate processes), real PostgreSQL/SQLite and Redis; the job runner runs in this
process, one per engine, as a worker's work horse would.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.jobs import running_job
from tests.fixtures.stack import REPO, Stack, make_stack
from tests.fixtures.synthetic import Engines, Synthetic, tokenizer_copy, write_pretokenized

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
CHATS = REPO / "data" / "sample_chats.jsonl"


def runner(url: str, unchecked: bool = False, **overrides: Any) -> Any:
    """The job runner of a worker whose engine is at ``url`` (``unchecked``: let in past the preflight and
    the cache rule, see tests.fixtures.unchecked_runner)."""
    from hsx.server.settings import get_settings
    from tests.fixtures.unchecked_runner import UncheckedRunner
    from workers.job_runner import JobRunner

    def make(job_id: str) -> JobRunner:
        settings = get_settings().model_copy(update={"engine_url": url, **overrides})
        return (UncheckedRunner if unchecked else JobRunner)(job_id, settings)

    return make


def unit_rows(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from hsx.server.db.models import WorkUnit
    from hsx.server.db.session import session_scope

    with session_scope(stack.env["HSX_DATABASE_URL"]) as session:
        rows = session.scalars(
            select(WorkUnit).where(WorkUnit.job_id == job_id).order_by(WorkUnit.unit_index)
        )
        return [
            {
                "index": u.unit_index,
                "state": u.state,
                "attempt": u.attempt,
                "failures": u.failures,
                "owner": u.lease_owner,
                "done": u.samples_done,
                "rejected": u.samples_rejected,
                "indices": u.sample_indices,
            }
            for u in rows
        ]


def published(doc: dict[str, Any]) -> list[int]:
    from hsx.loader import iter_samples

    return [s.index for s in iter_samples(doc["output_dir"], verify_checksums=True)]


def rejections(stack: Stack, job_id: str) -> dict[int, dict[str, Any]]:
    items = stack.client.get(f"/jobs/{job_id}/rejections", params={"limit": 1000}).json()["items"]
    return {r["sample_index"]: r for r in items}


# --- a unit that keeps failing -----------------------------------------------------------------------------


def test_each_committed_unit_logs_where_its_time_went(
    synth: tuple[Stack, Synthetic], caplog: pytest.LogCaptureFixture
) -> None:
    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 6)
    job_id = stack.submit(data, samples_per_shard=3)["id"]
    with caplog.at_level(logging.INFO, logger="workers"):
        outcome = runner(engine.url)(job_id).run()
    assert stack.job(job_id)["state"] == "succeeded", outcome
    claims = [r for r in caplog.records if "claimed unit" in r.getMessage()]
    units = [r for r in caplog.records if getattr(r, "tail_s", None) is not None]
    assert len(claims) == len(units) == 2
    for record in units:
        names = ("claim_s", "room_wait_s", "waiting_s", "copying_s", "write_s", "closing_s", "fsync_s")
        timing = {name: getattr(record, name) for name in (*names, "commit_s")}
        assert all(value >= 0 for value in timing.values()), timing
        assert timing["copying_s"] > 0 and timing["commit_s"] > 0 and timing["claim_s"] > 0, timing
        # Writing is part of the copy, the fsync part of the closing; a keep job never waits for room.
        assert timing["write_s"] <= timing["copying_s"], timing
        assert timing["fsync_s"] <= timing["closing_s"], timing
        assert timing["room_wait_s"] == 0, timing
        # From the last answer to the commit: at least the copy of that sample and the commit.
        assert record.tail_s >= timing["commit_s"], (record.tail_s, timing)


def test_an_unexpected_error_ends_the_unit_after_three_attempts_and_a_retry_resumes_it(
    synth: tuple[Stack, Synthetic],
) -> None:
    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 6)
    job_id = stack.submit(data, samples_per_shard=3)["id"]
    assert runner(engine.url)(job_id).run(max_units=1).more_work
    # The records file becomes unreadable in a way no code path expects: every attempt at unit 1 fails.
    moved = data.rename(stack.tmp / "aside.jsonl")
    data.mkdir()
    outcome = runner(engine.url)(job_id).run()
    assert not outcome.more_work and "failed for good" in outcome.summary, outcome
    doc = stack.job(job_id)
    assert doc["state"] == "failed"
    assert doc["error"].startswith("unit 1 failed 3 time(s); last: IsADirectoryError"), doc["error"]
    assert [(u["unit_index"], u["failures"]) for u in doc["units_failed"]] == [(1, 3)]
    assert "IsADirectoryError" in doc["units_failed"][0]["error"]
    assert [(u["state"], u["attempt"]) for u in unit_rows(stack, job_id)] == [("done", 1), ("failed", 3)]
    # The cause goes away; the job resumes where it stopped.
    data.rmdir()
    moved.rename(data)
    resumed = stack.client.post(f"/jobs/{job_id}/retry")
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["state"] == "running" and resumed.json()["units_failed"] == []
    assert resumed.json()["error"] is None
    runner(engine.url)(job_id).run()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", doc
    assert sorted(published(doc)) == list(range(6))
    assert [u["state"] for u in unit_rows(stack, job_id)] == ["done", "done"]
    again = stack.client.post(f"/jobs/{job_id}/retry")
    assert again.status_code == 409 and again.json()["error"] == "nothing_to_retry", again.text


@postgres_only
def test_a_dataset_deleted_after_submit_fails_the_job_at_once(synth: tuple[Stack, Synthetic]) -> None:
    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [30] * 4)
    job_id = stack.submit(data, samples_per_shard=2)["id"]
    runner(engine.url)(job_id).run(max_units=1)
    data.unlink()
    runner(engine.url)(job_id).run()
    doc = stack.job(job_id)
    assert doc["state"] == "failed"
    assert "dataset not_found" in doc["error"] and "gone since the job was prepared" in doc["error"]
    assert [(u["unit_index"], u["failures"]) for u in doc["units_failed"]] == [(1, 1)]
    assert [u["attempt"] for u in unit_rows(stack, job_id)] == [1, 1], "no attempt after the first"


@postgres_only
def test_a_base_model_tokenizer_with_chat_template_true_fails_the_job_saying_why(
    db_url: str,
    redis_url: str,
    engines: Engines,
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = tokenizer_copy(model_dir, tmp_path / "base-tokenizer", template=None)
    engine = engines.start("--tokenizer", str(base))
    stack = make_stack(db_url, redis_url, engine.url, tmp_path, monkeypatch)
    job_id = stack.submit(CHATS, samples_per_shard=8)["id"]
    runner(engine.url)(job_id).run()
    doc = stack.job(job_id)
    assert doc["state"] == "failed", doc
    assert "no chat template" in doc["error"] and "chat_template=false" in doc["error"], doc["error"]
    assert [u["failures"] for u in doc["units_failed"]] == [1]
    assert doc["output"]["projection_exact"] is False, "chat records: the size is an estimate"


# --- an engine at fault --------------------------------------------------------------------------------


class _NotAnEngine(http.server.BaseHTTPRequestHandler):
    """A stock server without the hsx plugin: healthy, and 404 for /hsx/info."""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def plain_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAnEngine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@postgres_only
def test_an_engine_without_hsx_info_takes_no_unit_and_a_healthy_one_finishes(
    synth: tuple[Stack, Synthetic], plain_server: str
) -> None:
    stack, engine = synth
    job_id = stack.submit(write_pretokenized(stack.tmp / "d.jsonl", [30] * 4), samples_per_shard=2)["id"]
    refused = runner(plain_server)(job_id).run()
    assert not refused.more_work and "unfit" in refused.summary, refused
    doc = stack.job(job_id)
    assert doc["state"] == "queued" and doc["progress"]["units_total"] == 0
    [entry] = doc["engines"]
    assert (entry["url"], entry["state"]) == (plain_server, "unfit")
    assert "404" in entry["reason"] and "not an hsx engine" in entry["reason"], entry
    runner(engine.url)(job_id).run()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", doc
    assert {e["url"]: e["state"] for e in doc["engines"]} == {plain_server: "unfit", engine.url: "ok"}
    assert {u["owner"].rsplit("@", 1)[1] for u in unit_rows(stack, job_id)} == {engine.url}


@postgres_only
def test_a_job_no_fit_engine_serves_fails_after_the_window_naming_the_engines(
    db_url: str, redis_url: str, plain_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fleet: other engines may join, so the submission waits for one instead of a 422 (test_api_usability).
    stack = make_stack(
        db_url,
        redis_url,
        plain_server,
        tmp_path,
        monkeypatch,
        no_fit_engine_seconds="0.3",
        engine_fleet="true",
    )
    job_id = stack.submit(write_pretokenized(tmp_path / "d.jsonl", [30] * 2))["id"]
    first_try = time.monotonic()
    runner(plain_server)(job_id).run()
    assert stack.job(job_id)["state"] == "queued", "the first refusal waits for a healthy worker"
    # Each later try is refused too; the job gives up once the window has passed, not before.
    while stack.job(job_id)["state"] == "queued":
        assert time.monotonic() - first_try < 60, "the job never gave up"
        time.sleep(0.05)
        runner(plain_server)(job_id).run()
    assert time.monotonic() - first_try >= 0.3
    doc = stack.job(job_id)
    assert doc["state"] == "failed"
    assert doc["error"].startswith("no fit engine for 0.3s") and plain_server in doc["error"], doc["error"]


@postgres_only
def test_an_engine_whose_dumps_break_its_own_dtype_is_refused_and_gives_its_unit_back(
    db_url: str, redis_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    liar = engines.start("--reported-dtype", "float16")
    stack = make_stack(db_url, redis_url, liar.url, tmp_path, monkeypatch, engine_fleet="true")
    job_id = stack.submit(write_pretokenized(tmp_path / "d.jsonl", [30] * 4), samples_per_shard=2)["id"]
    # The preflight reads a dump and sees the dtype differ from what the engine reports.
    refused = runner(liar.url)(job_id).run()
    assert "preflight" in refused.summary and ".dtype" in refused.summary, refused
    assert stack.job(job_id)["progress"]["units_total"] == 0, "refused before preparing"
    # Past the preflight (let in unchecked), the first dump gives it away: the unit goes back untouched.
    outcome = runner(liar.url, unchecked=True)(job_id).run()
    assert "unfit" in outcome.summary and "dumps BF16" in outcome.summary, outcome
    doc = stack.job(job_id)
    assert doc["state"] == "running" and doc["shards"]["total"] == 0 and doc["rejections"] == {}
    assert [(u["state"], u["attempt"], u["failures"]) for u in unit_rows(stack, job_id)] == [
        ("pending", 1, 0),
        ("pending", 0, 0),
    ]
    assert "dumps BF16" in doc["engines"][0]["reason"]


@postgres_only
def test_a_brief_engine_outage_is_ridden_out_and_a_long_one_gives_the_unit_back(
    synth: tuple[Stack, Synthetic], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine freezes (SIGSTOP) right after a unit is claimed: prefills time out. Back within the
    client's retries, the samples are sent again and nothing is lost; gone longer, the unit is released."""
    from hsx.server.faults import crash_point as real_crash_point

    stack, engine = synth
    frozen: list[float] = []

    def freeze_after_claim(name: str, thaw_after: float) -> None:
        real_crash_point(name)
        if name == "after_claim" and not frozen:
            frozen.append(time.monotonic())
            engine.stop()
            if thaw_after:
                threading.Timer(thaw_after, engine.resume).start()

    data = write_pretokenized(stack.tmp / "d.jsonl", [30] * 4)
    job_id = stack.submit(data, samples_per_shard=4)["id"]
    monkeypatch.setattr("workers.unit_loop.crash_point", lambda n: freeze_after_claim(n, 2.5))
    runner(engine.url, engine_timeout_seconds=1.0, engine_retries=4)(job_id).run()
    doc = stack.job(job_id)
    assert frozen and doc["state"] == "succeeded", doc
    assert doc["progress"]["samples_done"] == 4 and doc["rejections"] == {}
    assert [e["state"] for e in doc["engines"]] == ["ok"]

    frozen.clear()
    second = stack.submit(data, samples_per_shard=4)["id"]
    monkeypatch.setattr("workers.unit_loop.crash_point", lambda n: freeze_after_claim(n, 0))
    try:
        outcome = runner(engine.url, engine_timeout_seconds=1.0, engine_retries=1)(second).run()
    finally:
        engine.resume()
    assert "engine unavailable" in outcome.summary, outcome
    doc = stack.job(second)
    assert doc["state"] == "running" and doc["engines"][0]["state"] == "unavailable", doc
    assert [(u["state"], u["failures"]) for u in unit_rows(stack, second)] == [("pending", 0)]
    monkeypatch.setattr("workers.unit_loop.crash_point", real_crash_point)
    runner(engine.url)(second).run()
    assert stack.job(second)["state"] == "succeeded"


@postgres_only
def test_a_shard_written_after_its_lease_was_taken_is_removed_at_once(
    synth: tuple[Stack, Synthetic], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unit's shard is whole, but before the commit another worker takes the lease (this one was
    frozen past it): the attempt stops, and its staged shard goes with it, not at a later sweep."""
    from hsx.server.db.session import session_scope
    from hsx.server.faults import crash_point as real_crash_point
    from hsx.server.jobs import repository as repo

    stack, engine = synth
    job_id = stack.submit(write_pretokenized(stack.tmp / "d.jsonl", [30] * 2), samples_per_shard=2)["id"]
    output = Path(stack.job(job_id)["output_dir"])
    staged_then: list[str] = []

    def lease_taken_after_the_shard(name: str) -> None:
        real_crash_point(name)
        if name != "mid_unit" or staged_then:
            return
        staged_then.extend(p.name for p in output.glob("*.staged"))
        with session_scope(stack.env["HSX_DATABASE_URL"]) as session:
            # Another worker's claim, an hour on: this attempt's lease has long run out by then.
            assert repo.claim_unit(session, job_id, "other-host:1@x", 3600, time.time() + 3600) is not None
        deadline = time.monotonic() + 30
        while any(t.name.startswith("lease-") and t.is_alive() for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the heartbeat never found the lease gone"
            time.sleep(0.05)

    monkeypatch.setattr("workers.unit_pipeline.crash_point", lease_taken_after_the_shard)
    outcome = runner(engine.url)(job_id).run()
    assert staged_then == [".shard-00000.a1.staged"], staged_then
    assert "stopped before commit" in outcome.summary, outcome
    assert sorted(p.name for p in output.iterdir()) == [], "the dropped shard is gone, nothing committed"
    assert [(u["state"], u["attempt"], u["owner"]) for u in unit_rows(stack, job_id)] == [
        ("leased", 2, "other-host:1@x")
    ]


@postgres_only
def test_a_unit_that_kills_every_work_horse_fails_the_job_at_the_bound(
    synth: tuple[Stack, Synthetic],
) -> None:
    stack, _engine = synth
    job_id = stack.submit(write_pretokenized(stack.tmp / "d.jsonl", [30] * 2), samples_per_shard=2)["id"]
    # Every horse dies in the unit; three deaths are the bound here (HSX_UNIT_MAX_HORSE_DEATHS).
    worker = stack.start_worker({"HSX_CRASH_AT": "mid_unit", "HSX_UNIT_MAX_HORSE_DEATHS": "3"})
    doc = stack.wait(job_id, timeout=120)
    assert doc["state"] == "failed", (doc, stack.logs())
    assert doc["error"].startswith("unit 0 failed 3 time(s); last: the work horse holding it died"), doc
    assert [u["attempt"] for u in unit_rows(stack, job_id)] == [3]
    assert worker.poll() is None


# --- retries ---------------------------------------------------------------------------------------------


@postgres_only
def test_retry_reruns_engine_side_rejections_and_publishes_each_sample_once(
    db_url: str,
    redis_url: str,
    engine_cache: Any,
    engine_nocache: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefix-caching engine (let in on purpose) leaves cached_tokens rejections; a retry on a safe
    engine keeps those samples in a shard of their own and drops their rejections in the same commit."""
    from hsx.server.db.session import session_scope
    from hsx.server.jobs.repository import get_job

    # Conversations of their own (the cache engine is shared by the session): a system prompt they share
    # makes the cache hit, a tag no other test uses keeps other tests' prompts from hitting it.
    tag = uuid.uuid4().hex[:8]
    sample = tmp_path / "shared_prefix.jsonl"
    with sample.open("w") as fh:
        for i in range(6):
            system = f"[{tag}] You are a patient tutor who explains every step of the arithmetic in detail."
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"What is {i} plus {i + 3}?"},
                {"role": "assistant", "content": f"{i} plus {i + 3} is {2 * i + 3}."},
            ]
            fh.write(json.dumps({"messages": messages}) + "\n")
    stack = make_stack(db_url, redis_url, engine_cache.url, tmp_path, monkeypatch, engine_fleet="true")
    job_id = stack.submit(sample, samples_per_shard=32, cache_namespace_per_request=False)["id"]
    try:
        runner(engine_cache.url, unchecked=True)(job_id).run()
    finally:
        # Every chat prompt shares its first tokens with these: other tests' prompts must not hit them.
        httpx.post(f"{engine_cache.url}/flush_cache", timeout=30).raise_for_status()
    first = stack.job(job_id)
    assert first["state"] == "succeeded"
    before = rejections(stack, job_id)
    cached = sorted(i for i, r in before.items() if r["reason"] == "cached_tokens")
    kept = published(first)
    assert cached and kept, (before, kept)
    retried = stack.client.post(f"/jobs/{job_id}/retry")
    assert retried.status_code == 200, retried.text
    assert retried.json()["progress"]["units_total"] == 2 and retried.json()["manifest"] is None
    assert stack.client.post(f"/jobs/{job_id}/retry").json()["error"] == "job_active"
    runner(engine_nocache.url)(job_id).run()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", doc
    after = rejections(stack, job_id)
    indices = published(doc)
    assert len(indices) == len(set(indices)), "a sample published twice"
    assert set(indices) == set(kept) | set(cached)
    assert set(after) == set(before) - set(cached) and set(after).isdisjoint(indices)
    assert doc["progress"]["samples_done"] == len(indices)
    assert doc["progress"]["samples_rejected"] == len(after)
    rows = unit_rows(stack, job_id)
    assert rows[1]["indices"] == cached and sum(u["rejected"] for u in rows) == len(after)
    assert sum(u["done"] for u in rows) == len(indices)
    with session_scope(db_url) as session:
        job = get_job(session, job_id)
        assert job is not None and job.samples_done + job.samples_rejected == job.samples_total
    manifest = json.loads(Path(doc["manifest"]).read_text())
    assert (manifest["counts"]["samples"], manifest["counts"]["rejected"]) == (len(indices), len(after))
    assert len(manifest["shards"]) == 2
    assert stack.client.post(f"/jobs/{job_id}/retry").json()["error"] == "nothing_to_retry"


def test_a_stale_attempt_can_neither_fail_the_job_nor_count_a_failure(db_url: str, tmp_path: Path) -> None:
    """``_fail`` acting for a unit checks the lease: an attempt whose lease was taken does nothing."""
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import queries, recovery
    from hsx.server.jobs import repository as repo

    job_id = running_job(db_url, tmp_path, units=1)
    now = time.time()
    with session_scope(db_url) as session:
        stale = repo.claim_unit(session, job_id, "host:1@a", 0.01, now)
    with session_scope(db_url) as session:  # claimed when the first lease has lapsed
        current = repo.claim_unit(session, job_id, "host:2@b", 60, now + 1)
    assert stale is not None and current is not None and current.attempt == stale.attempt + 1
    with session_scope(db_url) as session:
        assert not recovery.fail_unit_and_job(session, stale, "stale", time.time())
        assert not recovery.count_unit_failure(session, stale, "stale", 1).recorded
    with session_scope(db_url) as session:
        assert queries.job_state(session, job_id) == "running"
        counted = recovery.count_unit_failure(session, current, "real", 3)
    assert counted.recorded and counted.failures == 1 and not counted.unit_failed
    with session_scope(db_url) as session:
        assert queries.job_state(session, job_id) == "running"
        assert queries.unit_counts(session, job_id) == {"pending": 1}


def test_migrations_match_the_models(tmp_path: Path) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from hsx.server.db.migrate import downgrade, upgrade
    from hsx.server.db.models import Base
    from hsx.server.db.session import engine_for

    url = f"sqlite:///{tmp_path / 'm.sqlite3'}"
    upgrade(url)
    downgrade(url, "0002")
    upgrade(url)
    with engine_for(url).connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diffs == [], diffs


@pytest.mark.parametrize(
    "reply",
    [{"meta_info": {}}, {"meta_info": {"cached_tokens": None}}, {"meta_info": {"cached_tokens": -1}}, {}],
)
def test_a_reply_without_cached_tokens_makes_the_engine_unfit_not_zero(reply: dict[str, Any]) -> None:
    """Without the count, a prefix-cache hit could not be told from a full prefill: never read as 0."""
    from hsx.engine.client import EngineUnfit
    from workers.unit_processor import reported_cached_tokens

    with pytest.raises(EngineUnfit, match="cached_tokens"):
        reported_cached_tokens(reply)
    assert reported_cached_tokens({"meta_info": {"cached_tokens": 0}}) == 0
