"""The API on a host of its own: it sees neither the job output nor the engine's dumps (nor the exports),
as docker-compose.yml deploys it. A job is submitted and polled, streamed to a consumer, exported and the
engine verified, all through the API: every file is opened by a worker, and the API answers from the job
table and the queue.

The API runs as a process of its own in a mount namespace of its own (``unshare -m``) with each of those
directories hidden under an empty, read-only tmpfs; the worker, in this namespace, sees them as they are.
Real processes, PostgreSQL, Redis, the synthetic engine."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.stack import REPO, TEST_TOKEN, Stack, make_stack
from tests.fixtures.synthetic import Engines, Synthetic, write_pretokenized
from tests.test_stream_deletion import Consumer, can_unshare, wait_for

pytestmark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
SAMPLES, TOKENS, PER_SHARD = 6, 40, 2


@pytest.fixture
def split(
    db_url: str, redis_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Stack, Synthetic]]:
    from hsx.server.settings import get_settings

    engine = engines.start()
    made = make_stack(
        db_url, redis_url, engine.url, tmp_path, monkeypatch,
        exports_dir=str(tmp_path / "exports"), dump_dir=str(engine.dump_dir), verify_wait_seconds="120",
    )  # fmt: skip
    try:
        yield made, engine
    finally:
        made.stop_workers()
        get_settings.cache_clear()


def blind_api(hidden: list[Path], port_file: Path) -> list[str]:
    """``hsx api`` in a mount namespace where every path of ``hidden`` is an empty read-only tmpfs, on a port
    it binds itself and writes to ``port_file``."""
    from hsx.cli.local_stack import hsx_command

    mounts = " && ".join(
        f"mount -t tmpfs -o size=1m,mode=0555 hsx-elsewhere {shlex.quote(str(p))}" for p in hidden
    )
    api = shlex.join(hsx_command("api", "--port", "0", "--port-file", str(port_file)))
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"{mounts} && exec {api}"]


def test_submit_poll_stream_export_and_verify_with_an_api_that_sees_no_output_and_no_dumps(
    split: tuple[Stack, Synthetic],
) -> None:
    from hsx.cli.local_stack import local_stack, wait_http, wait_port_file

    stack, engine = split
    if not can_unshare():
        pytest.skip("needs `unshare --mount` (root, or CAP_SYS_ADMIN) to give the API its own view")
    dataset = write_pretokenized(stack.tmp / "d.jsonl", [TOKENS] * SAMPLES)
    records = [json.loads(line) for line in dataset.read_text().splitlines()]
    hidden = [Path(stack.env["HSX_OUTPUT_DIR"]), Path(engine.dump_dir), Path(stack.env["HSX_EXPORTS_DIR"])]
    for path in hidden:
        path.mkdir(parents=True, exist_ok=True)
    port_file = stack.tmp / "api.port"
    with local_stack(stack.tmp / "api-logs") as procs:
        proc = procs.start("api", blind_api(hidden, port_file), env={**stack.env, "PYTHONPATH": str(REPO)})
        api = f"http://127.0.0.1:{wait_port_file(port_file, 60, proc)}"
        wait_http(f"{api}/healthz", 60, proc)
        # What the API sees of each directory, read through its own mount namespace: nothing.
        marker = Path(engine.dump_dir) / "marker"
        marker.write_text("workers see this")
        for path in hidden:
            assert not list(Path(f"/proc/{proc.pid}/root{path}").iterdir()), path
        marker.unlink()
        http = httpx.Client(base_url=api, timeout=180, headers={"Authorization": f"Bearer {TEST_TOKEN}"})

        # Submit and poll, while a consumer streams the shards as they commit.
        submitted = http.post(
            "/jobs", json={"dataset_uri": str(dataset), "options": {"samples_per_shard": PER_SHARD}}
        )
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["id"]
        stack.start_worker()
        consumer = Consumer(api, job_id, "trainer0")
        consumer.start()
        wait_for(
            lambda: http.get(f"/jobs/{job_id}").json()["state"] in ("succeeded", "failed"),
            180,
            "the job",
            stack,
        )
        doc = http.get(f"/jobs/{job_id}").json()
        assert doc["state"] == "succeeded", (doc, stack.logs())
        consumer.join(120)
        assert consumer.error is None, (consumer.error, stack.logs())
        assert sorted(consumer.samples) == list(range(SAMPLES))
        assert all(consumer.samples[i] == records[i]["input_ids"] for i in range(SAMPLES))

        # Export: judged on the rows, made by the worker, its state a row.
        base = f"/jobs/{job_id}/exports"
        refused = http.post(
            base, json={"format": "speculators"}
        )  # the synthetic engine keeps no pre-norm state
        assert refused.status_code == 400 and refused.json()["error"] == "export_not_possible", refused.text
        created = http.post(base, json={"format": "modelopt"})
        assert created.status_code == 202, created.text
        export = created.json()
        assert http.post(base, json={"format": "modelopt"}).json()["id"] == export["id"]
        deadline = time.monotonic() + 120
        while (got := http.get(f"{base}/{export['id']}").json())["state"] in ("queued", "running"):
            assert time.monotonic() < deadline, (got, stack.logs())
            time.sleep(0.1)
        assert got["state"] == "succeeded" and got["attempts"] == 1, (got, stack.logs())
        assert got["report"]["counts"]["samples"] == SAMPLES
        assert (Path(got["dest"]) / "hsx_export.json").is_file()  # on the workers' side
        assert not Path(f"/proc/{proc.pid}/root{got['dest']}").exists()  # not on the API's
        assert [e["id"] for e in http.get(base).json()["items"]] == [export["id"]]

        # Verify: run by the worker, which reads the dumps, answered through the queue.
        verified = http.post("/verify")
        assert verified.status_code == 200, (verified.text, stack.logs())
        checks = {c["name"]: c for c in verified.json()["checks"]}
        for label in ("prompt_a", "prompt_b"):
            assert checks[f"{label}.cached_tokens"]["ok"] and checks[f"{label}.cached_tokens"]["actual"] == 0
            dumped = checks[f"{label}.dumped_tokens"]
            assert dumped["ok"] and dumped["actual"] == checks[f"{label}.prompt_tokens"]["expected"], dumped


def test_verify_with_no_worker_says_why_instead_of_hanging(
    db_url: str, redis_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.server.settings import get_settings

    engine = engines.start()
    stack = make_stack(db_url, redis_url, engine.url, tmp_path, monkeypatch, verify_wait_seconds="1")
    try:
        started = time.monotonic()
        answer = stack.client.post("/verify")
        assert answer.status_code == 504, answer.text
        assert answer.json()["error"] == "verify_unanswered" and "no worker" in answer.json()["detail"]
        assert time.monotonic() - started < 10
        # The check was taken back: a worker that starts later does not run it for nobody.
        from hsx.server.jobs.queue import queue_for

        assert queue_for(get_settings()).count == 0
    finally:
        get_settings.cache_clear()


def test_verify_with_reference_matches_the_dumped_values_on_the_worker(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a reference can run (the reference engine's model, on the worker's disk), ``?reference=true``
    also holds every dumped state to a transformers forward of the same tokens."""
    from hsx.server.settings import get_settings

    stack = make_stack(
        db_url, redis_url, engine_nocache.url, tmp_path, monkeypatch, verify_wait_seconds="240"
    )
    try:
        stack.start_worker()
        answer = stack.client.post("/verify", params={"reference": "true"})
        assert answer.status_code == 200, (answer.text, stack.logs())
        checks = {c["name"]: c for c in answer.json()["checks"]}
        for label in ("prompt_a", "prompt_b"):
            assert checks[f"{label}.cached_tokens"]["ok"] and checks[f"{label}.dumped_tokens"]["ok"]
            cosine = checks[f"{label}.reference_cosine"]
            assert cosine["ok"] and cosine["actual"], cosine
    finally:
        stack.stop_workers()
        get_settings.cache_clear()
