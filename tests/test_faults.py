"""Crash safety: whatever dies, freezes or fills up, every sample ends exactly once (in one shard or in the
rejections with a reason), and a recovered job's output equals an uninterrupted run's, read back sample by
sample. Real worker processes, a real engine, real PostgreSQL/SQLite and Redis; faults are real signals,
real restarts and a real full filesystem.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from tests.conftest import REDIS_URL
from tests.fixtures.stack import Stack, make_stack

T = TypeVar("T")

# Fast leases so that expiry, heartbeats and the reconciler act within seconds.
FAST = {"lease_seconds": "3", "heartbeat_seconds": "0.5", "reconcile_seconds": "0.5"}
SAMPLES = 24
PER_SHARD = 6
MALFORMED = {5}  # not JSON: rejected as malformed_json
NO_ANSWER = {13}  # no assistant turn: rejected as no_assistant_turn

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


# --- datasets and read-back -------------------------------------------------------------------------------


def write_chats(
    path: Path, total: int, malformed: set[int] = MALFORMED, no_answer: set[int] = NO_ANSWER
) -> Path:
    """Short, distinct conversations (fast on the CPU engine), with a few records that must be rejected."""
    with path.open("w", encoding="utf-8") as fh:
        for i in range(total):
            if i in malformed:
                fh.write('{"messages": [{"role": "user", "content": "cut off\n')
                continue
            messages = [{"role": "user", "content": f"Item {i}: what is {i} plus {i % 7}?"}]
            if i not in no_answer:
                messages.append({"role": "assistant", "content": f"{i} plus {i % 7} is {i + i % 7}."})
            fh.write(json.dumps({"messages": messages}) + "\n")
    return path


@dataclass(frozen=True)
class Output:
    """A job's output as read back from its shards, and its rejections."""

    samples: dict[int, tuple[np.ndarray[Any, Any], ...]]
    rejected: dict[int, str]


def read_output(stack: Stack, doc: dict[str, Any]) -> Output:
    from hsx.loader import iter_samples

    samples: dict[int, tuple[np.ndarray[Any, Any], ...]] = {}
    for s in iter_samples(doc["output_dir"], verify_checksums=True):
        assert s.index not in samples, f"sample {s.index} is in the output twice"
        samples[s.index] = (s.input_ids, s.loss_mask, s.hidden_state, s.aux_hidden_state)
    rejected: dict[int, str] = {}
    offset = 0
    while True:
        page = stack.client.get(f"/jobs/{doc['id']}/rejections", params={"offset": offset, "limit": 1000})
        assert page.status_code == 200, page.text
        items = page.json()["items"]
        for r in items:
            assert r["sample_index"] not in rejected, f"sample {r['sample_index']} rejected twice"
            assert r["reason"] and r["detail"]
            rejected[r["sample_index"]] = r["reason"]
        offset += len(items)
        if not items:
            return Output(samples, rejected)


def assert_exactly_once(stack: Stack, doc: dict[str, Any], total: int) -> Output:
    """Every sample in exactly one shard or one rejection; counters, rows and the manifest agree."""
    assert doc["state"] == "succeeded", (doc["state"], doc["error"], stack.logs())
    out = read_output(stack, doc)
    assert set(out.samples).isdisjoint(out.rejected), set(out.samples) & set(out.rejected)
    assert set(out.samples) | set(out.rejected) == set(range(total))
    progress = doc["progress"]
    assert progress["samples_done"] == len(out.samples)
    assert progress["samples_rejected"] == len(out.rejected)
    assert progress["units_done"] == progress["units_total"]
    assert progress["tokens"] == sum(len(v[0]) for v in out.samples.values())
    rows = units(stack, doc["id"])
    assert all(u["state"] == "done" for u in rows), rows
    assert sum(u["samples_done"] for u in rows) == len(out.samples)
    assert sum(u["samples_rejected"] for u in rows) == len(out.rejected)
    shard_paths = [s["path"] for s in doc["shards"]]
    assert len(shard_paths) == len(set(shard_paths)) == sum(1 for u in rows if u["samples_done"])
    manifest = json.loads(Path(doc["manifest"]).read_text())
    assert manifest["counts"]["samples"] == len(out.samples)
    assert manifest["counts"]["rejected"] == len(out.rejected)
    on_disk = sorted(p.name for p in Path(doc["output_dir"]).iterdir())
    assert on_disk == sorted([*(Path(p).name for p in shard_paths), "manifest.json"]), on_disk
    return out


def assert_same_output(got: Output, want: Output) -> None:
    assert got.rejected == want.rejected
    assert sorted(got.samples) == sorted(want.samples)
    for index, arrays in want.samples.items():
        for name, a, b in zip(("input_ids", "loss_mask", "hidden", "aux"), got.samples[index], arrays):
            assert a.shape == b.shape and np.array_equal(a, b), f"sample {index}: {name} differs"


# --- the job table, processes and waiting -----------------------------------------------------------------


def units(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from hsx.db.models import WorkUnit
    from hsx.db.session import session_scope

    with session_scope(stack.env["HSX_DATABASE_URL"]) as session:
        rows = session.scalars(
            select(WorkUnit).where(WorkUnit.job_id == job_id).order_by(WorkUnit.unit_index)
        )
        return [
            {
                "index": u.unit_index,
                "state": u.state,
                "attempt": u.attempt,
                "owner": u.lease_owner,
                "expires": u.lease_expires,
                "samples_done": u.samples_done,
                "samples_rejected": u.samples_rejected,
            }
            for u in rows
        ]


def owner_pid(owner: str) -> int:
    """The process that holds a lease: owners are ``host:pid``, optionally followed by ``@engine``."""
    host, _, pid = owner.split("@", 1)[0].rpartition(":")
    assert host == socket.gethostname(), owner
    return int(pid)


def wait_until(check: Callable[[], T | None], timeout: float, what: str, stack: Stack | None = None) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{stack.logs() if stack else ''}")
        time.sleep(0.05)


def live_lease(stack: Stack, job_id: str, owner_pids: set[int] | None = None) -> dict[str, Any] | None:
    """A unit leased right now (by one of ``owner_pids`` when given)."""
    now = time.time()
    for u in units(stack, job_id):
        if u["state"] == "leased" and u["expires"] and u["expires"] > now:
            if owner_pids is None or owner_pid(u["owner"]) in owner_pids:
                return u
    return None


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def signal_worker(proc: subprocess.Popen[bytes], sig: int) -> list[int]:
    """Signal a worker's whole process group and its horses' (a horse runs in a group of its own)."""
    horses = children(proc.pid)
    for pgid in [proc.pid, *horses]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
    return horses


def fast_stack(
    db_url: str, redis_url: str, engine: Any, tmp: Path, monkeypatch: pytest.MonkeyPatch, **settings: str
) -> Stack:
    return make_stack(db_url, redis_url, engine.url, tmp, monkeypatch, **{**FAST, **settings})


@pytest.fixture
def fast(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    s = fast_stack(db_url, redis_url, engine_nocache, tmp_path, monkeypatch)
    try:
        yield s
    finally:
        s.stop_workers()
        from hsx.settings import get_settings

        get_settings.cache_clear()


@pytest.fixture(scope="module")
def baseline(engine_nocache: Any, tmp_path_factory: pytest.TempPathFactory) -> Output:
    """The output of an uninterrupted run of the fault tests' dataset, by the real job runner in process."""
    from hsx.settings import get_settings
    from workers.job_runner import JobRunner

    tmp = tmp_path_factory.mktemp("baseline")
    with pytest.MonkeyPatch.context() as mp:
        s = make_stack(f"sqlite:///{tmp / 'hsx.sqlite3'}", REDIS_URL, engine_nocache.url, tmp, mp, **FAST)
        from hsx.db.migrate import upgrade

        upgrade(s.env["HSX_DATABASE_URL"])
        job = s.submit(write_chats(tmp / "chats.jsonl", SAMPLES), samples_per_shard=PER_SHARD)
        runner = JobRunner(job["id"], get_settings())
        while runner.run_one().more_work:
            pass
        from hsx.jobs.queue import queue_for

        queue_for(get_settings()).empty()
        out = assert_exactly_once(s, s.job(job["id"]), SAMPLES)
    get_settings.cache_clear()
    assert set(out.rejected) == MALFORMED | NO_ANSWER
    return out


def submit(stack: Stack, total: int = SAMPLES, per_shard: int = PER_SHARD, name: str = "chats.jsonl") -> str:
    return str(stack.submit(write_chats(stack.tmp / name, total), samples_per_shard=per_shard)["id"])


# --- 1. a work horse killed mid-unit ---------------------------------------------------------------------


def test_killed_work_horse_unit_is_retried_and_output_is_identical(fast: Stack, baseline: Output) -> None:
    worker = fast.start_worker()
    job_id = submit(fast)
    killed: list[int] = []
    for _ in range(2):  # two different units lose their horse mid-unit
        held = wait_until(
            lambda: (u := live_lease(fast, job_id)) and u["index"] not in killed and u, 120, "a lease", fast
        )
        os.kill(owner_pid(held["owner"]), signal.SIGKILL)
        killed.append(held["index"])
    doc = fast.wait(job_id, timeout=180)
    out = assert_exactly_once(fast, doc, SAMPLES)
    assert_same_output(out, baseline)
    attempts = {u["index"]: u["attempt"] for u in units(fast, job_id)}
    assert all(attempts[i] >= 2 for i in killed), attempts
    assert worker.poll() is None, "the worker itself must survive its horse"
    assert "died" in fast.logs()
