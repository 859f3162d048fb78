"""``/metrics``: Prometheus text that a real parser reads, counters that move while a real job runs, worker
telemetry pushed through Redis, and a scrape that survives a broken source."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.stack import REPO, Stack

SAMPLE = REPO / "tests" / "data" / "short_chats.jsonl"
postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def all_shards(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    page = stack.client.get(f"/jobs/{job_id}/shards", params={"limit": 1000}).json()
    assert page["total"] == len(page["items"])
    return list(page["items"])


def scrape(stack: Stack) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted labels: value}}, through prometheus_client's own parser."""
    resp = stack.client.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(metrics: dict[str, Any], name: str, **labels: str) -> float:
    return float(metrics[name][tuple(sorted(labels.items()))])


@postgres_only
def test_metrics_parse_and_counters_move_during_a_job(stack: Stack) -> None:
    before = scrape(stack)
    expected = {
        "hsx_jobs",
        "hsx_samples_done_total",
        "hsx_tokens_total",
        "hsx_tokens_per_second",
        "hsx_live_leases",
        "hsx_queue_depth",
        "hsx_workers",
        "hsx_shard_bytes_total",
        "hsx_engine_request_seconds_bucket",
        "hsx_dump_wait_seconds_count",
        "hsx_bytes_written_total",
        "hsx_samples_truncated_total",
        "hsx_scrape_error",
    }
    assert expected <= set(before), expected - set(before)
    assert value(before, "hsx_scrape_error", source="database") == 0
    assert value(before, "hsx_scrape_error", source="redis") == 0
    done_before = value(before, "hsx_samples_done_total")

    job = stack.submit(SAMPLE, samples_per_shard=2)
    queued = scrape(stack)
    assert value(queued, "hsx_jobs", state="queued") == 1
    assert value(queued, "hsx_queue_depth") >= 1  # the job's wake-ups wait in this test's own queue
    assert value(queued, "hsx_job_progress_ratio", job_id=job["id"]) == 0

    worker = stack.start_worker(burst=True)
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        seen.append(scrape(stack))
        if stack.job(job["id"])["state"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.3)
    assert worker.wait(60) == 0, stack.logs()
    doc = stack.job(job["id"])
    assert doc["state"] == "succeeded", (doc, stack.logs())
    after = scrape(stack)
    seen.append(after)

    done = [value(m, "hsx_samples_done_total") for m in seen]
    assert done == sorted(done), "a counter went backwards"
    assert done[-1] - done_before == doc["progress"]["samples_done"] > 0
    assert len(set(done)) >= 2, "the counter never moved while scraped"
    assert any(value(m, "hsx_jobs", state="running") == 1 for m in seen), "never saw the job running"
    assert value(after, "hsx_jobs", state="succeeded") == 1 and value(after, "hsx_jobs", state="running") == 0
    assert value(after, "hsx_tokens_total") == doc["progress"]["tokens"]
    shards = all_shards(stack, doc["id"])
    assert value(after, "hsx_shards_total") == len(shards)
    assert value(after, "hsx_shard_bytes_total") == sum(s["bytes"] for s in shards)
    assert value(after, "hsx_work_units", state="done") == doc["progress"]["units_total"]
    assert value(after, "hsx_live_leases") == 0
    rejected = sum(v for v in after.get("hsx_samples_rejected_total", {}).values())
    assert rejected == doc["progress"]["samples_rejected"]
    assert (("job_id", job["id"]),) not in after.get("hsx_job_progress_ratio", {})  # only active jobs


@postgres_only
def test_worker_telemetry_moves_during_a_job(synthetic_stack: Stack) -> None:
    stack = synthetic_stack
    before = scrape(stack)
    job = stack.submit(SAMPLE, samples_per_shard=4)
    assert stack.run_burst() == 0, stack.logs()
    doc = stack.wait(job["id"], timeout=60)
    assert doc["state"] == "succeeded", doc
    after = scrape(stack)
    requests = value(after, "hsx_engine_request_seconds_count") - value(
        before, "hsx_engine_request_seconds_count"
    )
    assert requests >= doc["progress"]["samples_done"]
    assert value(after, "hsx_dump_wait_seconds_count") > value(before, "hsx_dump_wait_seconds_count")
    written = value(after, "hsx_bytes_written_total") - value(before, "hsx_bytes_written_total")
    assert written == sum(s["bytes"] for s in all_shards(stack, doc["id"]))


@postgres_only
def test_telemetry_from_another_process_reaches_one_scrape(stack: Stack) -> None:
    """What a worker process pushes (through Redis, under its queue name) is what the API renders."""
    code = (
        "from hsx.server import telemetry\n"
        "for s in (0.004, 0.02, 0.3, 400.0): telemetry.engine_request(s)\n"
        "telemetry.dump_wait(0.07)\n"
        "telemetry.bytes_written(4096)\n"
        "telemetry.samples_truncated(3)\n"
        "telemetry.sample_retried('dump_missing'); telemetry.sample_retried('dump_missing')\n"
        "telemetry.engine_error('timeout')\n"
        "telemetry.unit_finished('committed')\n"
        "assert telemetry.flush()\n"
    )
    for _ in range(2):  # two "workers": their numbers add up
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env={**os.environ, **stack.env}, capture_output=True
        )
        assert done.returncode == 0, done.stderr
    m = scrape(stack)
    assert value(m, "hsx_engine_request_seconds_count") == 8
    assert value(m, "hsx_engine_request_seconds_sum") == pytest.approx(2 * 400.324)
    assert value(m, "hsx_engine_request_seconds_bucket", le="0.005") == 2
    assert value(m, "hsx_engine_request_seconds_bucket", le="0.5") == 6
    assert value(m, "hsx_engine_request_seconds_bucket", le="300") == 6
    assert value(m, "hsx_engine_request_seconds_bucket", le="+Inf") == 8
    assert value(m, "hsx_dump_wait_seconds_bucket", le="0.1") == 2
    assert value(m, "hsx_dump_wait_seconds_bucket", le="0.05") == 0
    assert value(m, "hsx_bytes_written_total") == 8192
    assert value(m, "hsx_samples_truncated_total") == 6
    assert value(m, "hsx_sample_retries_total", reason="dump_missing") == 4
    assert value(m, "hsx_engine_errors_total", kind="timeout") == 2
    assert value(m, "hsx_units_processed_total", outcome="committed") == 2


def test_telemetry_never_raises_and_keeps_totals_while_redis_is_away(redis_url: str) -> None:
    import uuid

    from redis import Redis

    from hsx.server import telemetry
    from tests.fixtures.ports import refused_port

    namespace = f"hsx-test-{uuid.uuid4().hex[:10]}"
    with refused_port() as closed:
        telemetry.configure(f"redis://127.0.0.1:{closed}/0", namespace)  # nothing listens there
        try:
            telemetry.bytes_written(100)
            started = time.monotonic()
            assert telemetry.flush() is False
            assert time.monotonic() - started < 5
            telemetry.bytes_written(20)
            telemetry.configure(redis_url, namespace)
            assert telemetry.flush() is True
            pushed = telemetry.read_all(Redis.from_url(redis_url), namespace)
            assert pushed["hsx_bytes_written"] == {"value": 120.0}
        finally:
            telemetry.configure(None, None)


@postgres_only
def test_scrape_reports_an_unreachable_redis_and_still_shows_the_job_table(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.server.settings import get_settings
    from tests.fixtures.ports import refused_port

    stack.submit(SAMPLE)
    with refused_port() as closed:
        monkeypatch.setenv("HSX_REDIS_URL", f"redis://127.0.0.1:{closed}/0")
        get_settings.cache_clear()
        m = scrape(stack)
    assert value(m, "hsx_scrape_error", source="redis") == 1
    assert value(m, "hsx_scrape_error", source="database") == 0
    assert value(m, "hsx_jobs", state="queued") == 1
    assert "hsx_queue_depth" not in m and "hsx_engine_request_seconds_count" not in m


@postgres_only
def test_metrics_need_the_token(stack: Stack) -> None:
    resp = stack.client.get("/metrics", headers={"Authorization": "Bearer wrong"})
    assert resp.status_code == 401 and resp.json()["error"] == "unauthorized"


@postgres_only
def test_failed_wakeups_count_only_what_really_failed(synthetic_stack: Stack) -> None:
    """A work horse killed mid-unit leaves its wake-up in RQ's failed registry, yet nothing failed: the
    unit is run again and the job succeeds. Only a wake-up whose function raised counts as failed."""
    stack = synthetic_stack
    from hsx.server.jobs.queue import EXTRACTION_TASK, queue_for

    job = stack.submit(SAMPLE, samples_per_shard=2)
    crash = {"HSX_CRASH_AT": "mid_unit", "HSX_CRASH_ONCE_FILE": str(stack.tmp / "crashed")}
    assert stack.run_burst(timeout=240, extra_env=crash) == 0, stack.logs()
    assert (stack.tmp / "crashed").exists(), "the horse never reached its crash point"
    assert stack.wait(job["id"], timeout=60)["state"] == "succeeded", stack.logs()
    queue = queue_for(stack.settings)
    killed = queue.failed_job_registry.count
    assert killed >= 1, "RQ filed the killed horse's wake-up as failed"
    m = scrape(stack)
    assert value(m, "hsx_queue_failed") == 0 and value(m, "hsx_queue_interrupted") == killed
    queue.enqueue(EXTRACTION_TASK)  # no job id: the function raises TypeError, a real failure
    assert stack.run_burst(timeout=240) == 0, stack.logs()
    m = scrape(stack)
    assert value(m, "hsx_queue_failed") == 1 and value(m, "hsx_queue_interrupted") == killed
