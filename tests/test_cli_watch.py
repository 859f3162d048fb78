"""The operator's CLI as a user runs it: ``hsx submit --wait`` drawing a live bar in a real pseudo-terminal,
``--json`` for scripts, tables, and exit codes a script can rely on."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hsx.cli.api_client import (
    EXIT_ACTIVE,
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_REFUSED,
    EXIT_SUCCEEDED,
    EXIT_UNREACHABLE,
)
from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.ports import refused_port
from tests.fixtures.stack import REPO, Stack

SAMPLE = REPO / "tests" / "data" / "short_chats.jsonl"
postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


@pytest.fixture
def api_url(stack: Stack) -> Iterator[str]:
    with serve_in_thread(stack.client.app) as url:
        yield url


@pytest.fixture
def synthetic_api_url(synthetic_stack: Stack) -> Iterator[str]:
    with serve_in_thread(synthetic_stack.client.app) as url:
        yield url


def cli_env(stack: Stack) -> dict[str, str]:
    # PYTHONPATH: the CLI runs from the dataset's folder, as a user would, not from the repository.
    return {**os.environ, **stack.env, "PYTHONPATH": str(REPO), "COLUMNS": "140", "TERM": "xterm-256color"}


def hsx(stack: Stack, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hsx.cli", *args],
        cwd=cwd or REPO,
        env=cli_env(stack),
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_in_pty(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` with a pseudo-terminal as its stdin, stdout and stderr; return its exit code and screen
    output."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", "replace")


@postgres_only
def test_submit_wait_draws_a_bar_that_moves_to_completion(stack: Stack, api_url: str) -> None:
    stack.start_worker()
    code, screen = run_in_pty(
        [
            sys.executable,
            "-m",
            "hsx.cli",
            "submit",
            str(SAMPLE),
            "--wait",
            "--samples-per-shard",
            "2",
            "--interval",
            "0.2",
            "--api-url",
            api_url,
        ],
        env=cli_env(stack),
        cwd=REPO,
        timeout=240,
    )
    text = ANSI.sub("\n", screen)
    assert code == EXIT_SUCCEEDED, (text[-3000:], stack.logs())
    percents = [int(p) for p in re.findall(r"(\d{1,3})%\s+\d+/\d+ samples", text)]
    assert percents, text[-3000:]
    assert percents == sorted(percents), percents
    assert percents[-1] == 100 and len(set(percents)) >= 2, percents
    assert "tok/s" in text and "ETA" in text and "rejected" in text and "workers busy" in text
    total = sum(1 for line in SAMPLE.read_text().splitlines() if line.strip())
    assert f"{total}/{total} samples" in text
    assert "succeeded" in text  # the final table


@postgres_only
def test_submit_json_parses_and_a_relative_path_is_sent_absolute(
    synthetic_stack: Stack, synthetic_api_url: str
) -> None:
    stack, api_url = synthetic_stack, synthetic_api_url
    shutil.copy(SAMPLE, stack.tmp / "mine.jsonl")
    stack.start_worker()
    done = hsx(
        stack,
        "submit",
        "mine.jsonl",
        "--wait",
        "--json",
        "--interval",
        "0.3",
        "--samples-per-shard",
        "8",
        "--api-url",
        api_url,
        cwd=stack.tmp,
    )
    assert done.returncode == EXIT_SUCCEEDED, (done.stdout, done.stderr, stack.logs())
    doc = json.loads(done.stdout)
    assert doc["state"] == "succeeded"
    assert doc["dataset_uri"] == str((stack.tmp / "mine.jsonl").resolve())
    assert done.stderr == ""  # --json draws nothing

    status = hsx(stack, "status", doc["id"], "--json", "--api-url", api_url)
    assert status.returncode == EXIT_SUCCEEDED and json.loads(status.stdout)["id"] == doc["id"]
    table = hsx(stack, "status", doc["id"], "--api-url", api_url)
    assert table.returncode == EXIT_SUCCEEDED and doc["id"] in table.stdout and "succeeded" in table.stdout

    jobs = hsx(stack, "jobs", "--json", "--api-url", api_url)
    assert jobs.returncode == 0 and [j["id"] for j in json.loads(jobs.stdout)["items"]] == [doc["id"]]
    listed = hsx(stack, "jobs", "--state", "succeeded", "--api-url", api_url)
    assert listed.returncode == 0 and doc["id"] in listed.stdout


@postgres_only
def test_exit_codes_for_cancelled_failed_unknown_and_unreachable(stack: Stack, api_url: str) -> None:
    queued = stack.submit(SAMPLE)
    assert hsx(stack, "status", queued["id"], "--api-url", api_url).returncode == EXIT_ACTIVE
    stack.client.post(f"/jobs/{queued['id']}/cancel")
    assert hsx(stack, "status", queued["id"], "--api-url", api_url).returncode == EXIT_CANCELLED
    watched = hsx(stack, "watch", queued["id"], "--json", "--api-url", api_url)
    assert watched.returncode == EXIT_CANCELLED and json.loads(watched.stdout)["state"] == "cancelled"

    # The dataset is deleted between submit and prepare: the worker fails the job, saying so.
    gone = stack.tmp / "gone.jsonl"
    shutil.copy(SAMPLE, gone)
    failing = stack.submit(gone)
    gone.unlink()
    stack.start_worker()
    failed = hsx(stack, "watch", failing["id"], "--interval", "0.3", "--api-url", api_url)
    assert failed.returncode == EXIT_FAILED, (failed.stdout, failed.stderr, stack.logs())
    assert "dataset" in failed.stdout

    unknown = hsx(stack, "status", "no-such-job", "--api-url", api_url)
    assert unknown.returncode == EXIT_REFUSED and "job_not_found" in unknown.stderr
    unknown_json = hsx(stack, "watch", "no-such-job", "--json", "--api-url", api_url)
    assert unknown_json.returncode == EXIT_REFUSED
    assert json.loads(unknown_json.stdout)["error"] == "job_not_found"
    with refused_port() as closed:
        nobody = hsx(stack, "jobs", "--api-url", f"http://127.0.0.1:{closed}")
    assert nobody.returncode == EXIT_UNREACHABLE and "unreachable" in nobody.stderr
    refused = hsx(stack, "submit", "/etc/passwd", "--json", "--api-url", api_url)
    assert refused.returncode == EXIT_REFUSED and json.loads(refused.stdout)["error"] == "path_outside_roots"


@pytest.mark.parametrize("bad", ["0", "-5", "ten"])
def test_max_length_must_be_a_length_the_options_take(bad: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "submit", "x.jsonl", f"--max-length={bad}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == EXIT_REFUSED
    # JobOptions' own bound (hsx/cli/options.py checks each flag against its field).
    said = ("greater than or equal to 8", "whole number")
    assert "--max-length" in done.stderr and any(s in done.stderr for s in said), done.stderr
