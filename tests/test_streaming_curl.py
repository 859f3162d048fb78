"""docs/streaming.md's curl walk-through, run as written: the real curl binary against the real API under
uvicorn, a real worker and the reference engine, on one small consume job whose cap lets one unit in at a
time, so the job only finishes because the walk-through acknowledges. As a person pastes it: quiet on a
fresh clone, no scratch file left behind, and a job that stops ends the loop, not the shell."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import REPO, TEST_TOKEN, Stack
from tests.test_readme_curl import check_setup_block, setup_block

MARKER = "<!-- stream walk-through: tests/test_streaming_curl.py runs the next block as it is written -->"
SHORT = REPO / "tests" / "data" / "short_chats.jsonl"

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def walkthrough() -> str:
    doc = (REPO / "docs" / "streaming.md").read_text(encoding="utf-8")
    assert doc.count(MARKER) == 1, "docs/streaming.md must hold the walk-through marker once"
    after = doc.split(MARKER, 1)[1].lstrip("\n")
    assert after.startswith("```bash\n"), "the marker must be followed by a ```bash block"
    return after[len("```bash\n") :].split("\n```", 1)[0]


def shell_env(stack: Stack, api: str, scratch: Path) -> dict[str, str]:
    """What the setup block sets, and a TMPDIR of the test's own (to see that the scratch folder goes)."""
    scratch.mkdir()
    return {
        **os.environ,
        **stack.env,
        "API": api,
        "TOKEN": TEST_TOKEN,
        "DATASET": str(SHORT),
        "TMPDIR": str(scratch),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def test_the_setup_block_is_quiet_on_a_fresh_clone(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "streaming.md").read_text(encoding="utf-8")
    check_setup_block(setup_block(doc, MARKER), tmp_path)


@postgres_only
def test_streaming_curl_walkthrough_runs_as_written(stack: Stack, tmp_path: Path) -> None:
    from app.main import create_app

    assert shutil.which("curl"), "the walk-through needs the curl binary"
    stack.start_worker()
    here, scratch = tmp_path / "here", tmp_path / "tmp"
    here.mkdir()
    with serve_in_thread(create_app()) as api:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", walkthrough()],
            env=shell_env(stack, api, scratch),
            cwd=here,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, (done.stdout, done.stderr, stack.logs())
    # Nothing left where the reader stands, and the scratch folder removed.
    assert (list(here.iterdir()), list(scratch.iterdir())) == ([], []), done.stderr
    *leases, doc = (json.loads(line) for line in done.stdout.splitlines() if line.strip())
    assert doc["state"] == "succeeded", (doc, stack.logs())
    items = [item for lease in leases for item in lease["items"]]
    assert len(items) == doc["shards"]["total"] > 1
    assert sorted(i["unit_index"] for i in items) == sorted({i["unit_index"] for i in items})
    assert sum(i["samples"] for i in items) == doc["progress"]["samples_done"] > 0
    stream = doc["stream"]
    assert stream["retention"] == "consume" and stream["cap_bytes"] == 1
    assert stream["buffered_bytes"] == 0 and stream["items_acked"] == len(items)
    assert [c["name"] for c in stream["consumers"]] == ["curl"]
    stack.wait_deleted(doc["id"])
    assert not any(Path(i["path"]).exists() for i in items)  # acknowledged, so deleted


@postgres_only
def test_a_job_that_stops_ends_the_loop_not_the_shell(stack: Stack, tmp_path: Path) -> None:
    """Pasted into a shell, the walk-through must not close it when the job fails or is cancelled: with
    no worker the job waits; once the consumer is registered the test cancels it, and the shell goes on
    past the walk-through, having shown the cancelled job."""
    from app.main import create_app

    here, scratch = tmp_path / "here", tmp_path / "tmp"
    here.mkdir()
    with serve_in_thread(create_app()) as api:
        shell = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", f"{walkthrough()}\necho the shell goes on"],
            env=shell_env(stack, api, scratch),
            cwd=here,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            job_id = _job_with_a_consumer(stack, shell)
            assert stack.client.post(f"/jobs/{job_id}/cancel").status_code == 200
            out, err = shell.communicate(timeout=120)
        finally:
            if shell.poll() is None:
                shell.kill()
                shell.communicate()
    assert shell.returncode == 0, (out, err)
    *shown, last = out.splitlines()
    assert last == "the shell goes on", out
    assert json.loads(shown[-1])["state"] == "cancelled", out
    assert (list(here.iterdir()), list(scratch.iterdir())) == ([], []), err


def _job_with_a_consumer(stack: Stack, shell: subprocess.Popen[str], timeout: float = 120.0) -> str:
    """The walk-through's job once its consumer is registered (the loop is leasing then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and shell.poll() is None:
        jobs = stack.client.get("/jobs").json()["items"]
        if jobs and stack.client.get(f"/jobs/{jobs[0]['id']}").json()["stream"]["consumers"]:
            return str(jobs[0]["id"])
        time.sleep(0.1)
    raise AssertionError(f"no job with a consumer: the shell exited {shell.poll()}")
