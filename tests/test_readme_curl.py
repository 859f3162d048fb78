"""The README's curl walk-through, run as written: the real curl binary against the real API under uvicorn,
a real worker and the reference engine, on one small job."""

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

MARKER = "<!-- curl walk-through: tests/test_readme_curl.py runs the next block as it is written -->"
SHORT = REPO / "tests" / "data" / "short_chats.jsonl"

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def walkthrough() -> str:
    """The fenced bash block right after the marker in README.md."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.count(MARKER) == 1, "the README must hold the walk-through marker once"
    after = readme.split(MARKER, 1)[1].lstrip("\n")
    assert after.startswith("```bash\n"), "the marker must be followed by a ```bash block"
    return after[len("```bash\n") :].split("\n```", 1)[0]


def setup_block(doc: str, marker: str) -> str:
    """The fenced bash block before a walk-through, that sets API, TOKEN and DATASET."""
    before = doc.split(marker, 1)[0]
    block = before.rsplit("```bash\n", 1)[1].split("\n```", 1)[0]
    assert block.startswith("API=") and "TOKEN=" in block, block
    return block


def run_setup(block: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The block pasted into a shell in ``cwd`` (strict, as a script would run it); prints the token."""
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", f'{block}\nprintf "%s" "$TOKEN"'],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def check_setup_block(block: str, cwd: Path) -> None:
    """On a fresh clone (no secrets/api_token) the token is empty and nothing is printed; where a
    deployment made the file, the token is its content."""
    fresh = run_setup(block, cwd)
    assert (fresh.returncode, fresh.stdout, fresh.stderr) == (0, "", ""), fresh
    (cwd / "secrets").mkdir()
    (cwd / "secrets" / "api_token").write_text("a-token\n", encoding="utf-8")
    deployed = run_setup(block, cwd)
    assert (deployed.returncode, deployed.stdout, deployed.stderr) == (0, "a-token", ""), deployed


def test_the_setup_block_is_quiet_on_a_fresh_clone(tmp_path: Path) -> None:
    check_setup_block(setup_block((REPO / "README.md").read_text(encoding="utf-8"), MARKER), tmp_path)


def test_the_walkthrough_uses_curl_for_each_step() -> None:
    script = walkthrough()
    for step in ('-X POST "$API/jobs"', '"$API/jobs/$JOB"', "/shards?", "/rejections?", '"$API/verify"'):
        assert step in script, step
    assert all(
        line.startswith(("curl", "JOB=$(curl", "until curl", "#", " ", "|")) for line in script.splitlines()
    )


@postgres_only
def test_readme_curl_walkthrough_runs_as_written(stack: Stack) -> None:
    from app.main import create_app

    curl = shutil.which("curl")
    assert curl, "the walk-through needs the curl binary"
    stack.start_worker()
    with serve_in_thread(create_app()) as api:
        env = {
            **os.environ,
            **stack.env,
            "API": api,
            "TOKEN": TEST_TOKEN,
            "DATASET": str(SHORT),
            # python3 in the walk-through is whatever the shell finds; here the one running the tests.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", walkthrough()],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, (done.stdout, done.stderr, stack.logs())
    doc, shards, rejections, verify = (json.loads(line) for line in done.stdout.splitlines() if line.strip())

    assert doc["state"] == "succeeded", (doc, stack.logs())
    total = sum(1 for line in SHORT.read_text().splitlines() if line.strip())
    progress = doc["progress"]
    assert progress["samples_total"] == total
    # Every record of the sample is valid and the engine has no prefix cache: nothing may be rejected.
    assert (progress["samples_done"], progress["samples_rejected"]) == (total, 0), progress
    assert shards["total"] == doc["shards"]["total"] == len(shards["items"]) == -(-total // 8)
    assert sum(s["samples"] for s in shards["items"]) == progress["samples_done"]
    assert all(len(s["sha256"]) == 64 and Path(s["path"]).is_file() for s in shards["items"])
    assert rejections["total"] == 0 and rejections["items"] == []
    assert verify["ok"] is True and verify["checks"]
