"""docs/streaming.md's curl walk-through, run as written: the real curl binary against the real API under
uvicorn, a real worker and the reference engine, on one small consume job whose cap lets one unit in at a
time, so the job only finishes because the walk-through acknowledges."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import REPO, TEST_TOKEN, Stack

MARKER = "<!-- stream walk-through: tests/test_streaming_curl.py runs the next block as it is written -->"
SHORT = REPO / "tests" / "data" / "short_chats.jsonl"

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def walkthrough() -> str:
    doc = (REPO / "docs" / "streaming.md").read_text(encoding="utf-8")
    assert doc.count(MARKER) == 1, "docs/streaming.md must hold the walk-through marker once"
    after = doc.split(MARKER, 1)[1].lstrip("\n")
    assert after.startswith("```bash\n"), "the marker must be followed by a ```bash block"
    return after[len("```bash\n") :].split("\n```", 1)[0]


@postgres_only
def test_streaming_curl_walkthrough_runs_as_written(stack: Stack, tmp_path: Path) -> None:
    from app.main import create_app

    assert shutil.which("curl"), "the walk-through needs the curl binary"
    stack.start_worker()
    with serve_in_thread(create_app()) as api:
        env = {
            **os.environ,
            **stack.env,
            "API": api,
            "TOKEN": TEST_TOKEN,
            "DATASET": str(SHORT),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", walkthrough()],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, (done.stdout, done.stderr, stack.logs())
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
