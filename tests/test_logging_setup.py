"""Structured logs: JSON lines with the job, unit, attempt and rid of the work in hand; no secret in them."""

from __future__ import annotations

import contextvars
import io
import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hsx.cli.local_stack import wait_http, wait_port_file
from hsx.server.logging_setup import ContextFilter, Redactor, StructuredFormatter, log_context
from tests.fixtures.stack import REPO

# Fixed, not random: test ids carry it, and xdist needs the same ids in every process.
TOKEN = "tok-5f1d0c3a9b7e4d2c8a6f1e0b3c5d7a9e"


@pytest.fixture
def capture() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(StructuredFormatter("json", Redactor([TOKEN])))
    handler.addFilter(ContextFilter())
    logger = logging.getLogger(f"hsx.test.{uuid.uuid4().hex[:6]}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_context_fields_ride_on_every_line_and_nest(capture: tuple[logging.Logger, io.StringIO]) -> None:
    log, stream = capture
    with log_context(job_id="j-1", unit=3, attempt=2):
        log.info("claimed")
        with log_context(rid="hsx-abc"):
            log.warning("dump %s missing", "x")
        log.info("committed", extra={"samples": 7})
    log.info("idle")
    got = lines(stream)
    assert (
        got[0]["job_id"] == "j-1" and got[0]["unit"] == 3 and got[0]["attempt"] == 2 and "rid" not in got[0]
    )
    assert got[1]["rid"] == "hsx-abc" and got[1]["msg"] == "dump x missing" and got[1]["level"] == "warning"
    assert got[2]["samples"] == 7 and "rid" not in got[2]
    assert "job_id" not in got[3]


def test_context_reaches_a_thread_pool_through_copy_context(
    capture: tuple[logging.Logger, io.StringIO],
) -> None:
    log, stream = capture
    with log_context(job_id="j-2", unit=0, attempt=1):
        ctx = contextvars.copy_context()
    thread = threading.Thread(target=ctx.run, args=(log.info, "from a prefill thread"))
    thread.start()
    thread.join()
    assert lines(stream)[0]["job_id"] == "j-2"


@pytest.mark.parametrize(
    "message",
    [
        f"token is {TOKEN}",
        f"headers={{'Authorization': 'Bearer {TOKEN}'}}",
        "dataset https://user:hunter2pass@example.com/d.jsonl",
        "postgresql+psycopg://hsx:s3cretpw@postgres:5432/hsx",
        "s3 https://b.s3.amazonaws.com/x.jsonl?X-Amz-Credential=AKIAXX&X-Amz-Signature=deadbeef99&x=1",
        "https://hf.co/d.jsonl?token=hf_abcdefgh123",
        "authorization: Basic dXNlcjpwYXNzd29yZA==",
    ],
)
def test_secrets_never_reach_a_line(capture: tuple[logging.Logger, io.StringIO], message: str) -> None:
    log, stream = capture
    log.info(message)
    try:
        raise RuntimeError(message)
    except RuntimeError:
        log.exception("failed")
    text = stream.getvalue()
    for secret in (TOKEN, "hunter2pass", "s3cretpw", "deadbeef99", "AKIAXX", "hf_abcdefgh123", "dXNlcjpw"):
        assert secret not in text
    assert "[redacted]" in text
    assert "x=1" in text or "X-Amz" not in message  # ordinary parameters stay


def test_text_format_is_key_value(capture: tuple[logging.Logger, io.StringIO]) -> None:
    log, stream = capture
    handler = log.handlers[0]
    handler.setFormatter(StructuredFormatter("text", Redactor([TOKEN])))
    with log_context(job_id="j-3", unit=1, attempt=1, rid="r 1"):
        log.info("hello")
    line = stream.getvalue().strip()
    assert line.endswith('hello job_id=j-3 unit=1 attempt=1 rid="r 1"'), line


def test_the_api_logs_json_lines_without_the_token(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    env = {
        **os.environ,
        "HSX_LOG_FORMAT": "json",
        "HSX_API_TOKEN": TOKEN,
        "HSX_DATA_DIR": str(tmp_path),
        "HSX_DATABASE_URL": f"sqlite:///{tmp_path}/x.sqlite3",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "api", "--port", "0", "--port-file", str(port_file)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        port = wait_port_file(port_file, 60, proc)  # type: ignore[arg-type] # text mode
        wait_http(f"http://127.0.0.1:{port}/healthz", 60, proc)  # type: ignore[arg-type]
        httpx.get(f"http://127.0.0.1:{port}/jobs", headers={"Authorization": f"Bearer {TOKEN}"})
        # uvicorn logs a request's access line before it sends the response, through a handler that
        # flushes each record: both lines are in the pipe by the time the calls return.
        httpx.get(f"http://127.0.0.1:{port}/jobs?token={TOKEN}")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    assert any(r["logger"] == "uvicorn.access" and "/jobs" in str(r["msg"]) for r in records), out
    assert TOKEN not in out
