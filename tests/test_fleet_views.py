"""The fleet views answer where the work is: a job's units with the worker and engine holding each, the
workers busy now, and the engines fed (the configured one first, probed; the others from the leases).
Real PostgreSQL/SQLite; the leases are taken and committed through the repository as workers do."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from tests.fixtures.jobs import running_job
from tests.fixtures.stack import make_stack

# Nothing listens on the discard port: the configured engine is probed and found down at once.
DOWN_ENGINE = "http://127.0.0.1:9"
ENGINE_A, ENGINE_B = "http://engine-a:8000", "http://engine-b:8000"


def test_units_workers_and_engines_show_who_holds_what(
    db_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import repository as repo
    from hsx.server.jobs import unit_results

    stack = make_stack(db_url, redis_url, DOWN_ENGINE, tmp_path, monkeypatch)
    job_id = running_job(db_url, tmp_path / "out", units=3)
    with session_scope(db_url) as session:
        assert repo.claim_unit(session, job_id, f"host-a:11@{ENGINE_A}", 60, time.time()) is not None
    with session_scope(db_url) as session:
        done = repo.claim_unit(session, job_id, f"host-b:22@{ENGINE_B}", 60, time.time())
        assert done is not None
        assert unit_results.commit_unit(session, done, time.time(), None, [], 4, 40, lambda: None)

    page = stack.client.get(f"/jobs/{job_id}/units")
    assert page.status_code == 200, page.text
    units = page.json()
    assert (units["total"], units["leased"], units["workers_busy"]) == (3, 1, 1)
    held, committed, pending = units["items"]
    assert (held["state"], held["worker"], held["engine"]) == ("leased", "host-a:11", ENGINE_A)
    assert 0 < held["lease_seconds_left"] <= 60
    assert (committed["state"], committed["engine"], committed["lease_seconds_left"]) == (
        "done",
        ENGINE_B,
        None,
    )
    assert (committed["samples_done"], committed["tokens"]) == (4, 40)
    assert (pending["state"], pending["worker"], pending["engine"]) == ("pending", None, None)

    workers = stack.client.get("/workers").json()
    assert workers == [{"worker": "host-a:11", "engine": ENGINE_A, "leases": 1, "units": [f"{job_id}/0"]}]

    engines = stack.client.get("/engines").json()
    assert [e["url"] for e in engines] == [DOWN_ENGINE, ENGINE_A, ENGINE_B]
    configured, fed_now, fed_before = engines
    assert configured["configured"] and configured["healthy"] is False and configured["info"] is None
    assert (fed_now["configured"], fed_now["live_leases"], fed_now["units_done_last_hour"]) == (False, 1, 0)
    assert (fed_before["live_leases"], fed_before["units_done_last_hour"]) == (0, 1)

    missing = stack.client.get(f"/jobs/{uuid.uuid4()}/units")
    assert missing.status_code == 404 and missing.json()["error"] == "job_not_found", missing.text


def test_a_lease_that_ran_out_shows_no_holder_busy(
    db_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit still marked leased whose lease has run out is claimable again: the views say so as the claim
    rule does (the one SQL predicate of unit liveness), with no seconds left and no worker busy."""
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import queries
    from hsx.server.jobs import repository as repo

    stack = make_stack(db_url, redis_url, DOWN_ENGINE, tmp_path, monkeypatch)
    job_id = running_job(db_url, tmp_path / "out", units=2)
    claimed_at = time.time() - 120  # a 60 s lease taken two minutes ago: it ran out a minute ago
    with session_scope(db_url) as session:
        assert repo.claim_unit(session, job_id, f"host-a:11@{ENGINE_A}", 60, claimed_at) is not None
    with session_scope(db_url) as session:
        assert queries.claimable_count(session, job_id, time.time()) == 2

    units = stack.client.get(f"/jobs/{job_id}/units").json()
    assert (units["total"], units["leased"], units["workers_busy"]) == (2, 0, 0), units
    lapsed = units["items"][0]
    assert (lapsed["state"], lapsed["worker"], lapsed["lease_seconds_left"]) == ("leased", "host-a:11", None)
    assert stack.client.get("/workers").json() == []
