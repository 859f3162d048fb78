"""Several engine+worker pairs share one job: each worker is colocated with its own engine, the job table
hands out units, and no sample is lost or written twice. (On GPU hosts each pair is one GPU.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.engine import _spawn, _stop, _wait_healthy, engine_url
from tests.fixtures.stack import REPO, make_stack

SAMPLE = REPO / "tests" / "data" / "short_chats.jsonl"


@pytest.fixture
def second_engine(model_dir: Path, tmp_path: Path) -> Iterator[str]:
    process, port_file, _dumps, log_path = _spawn(model_dir, tmp_path, "second", ["--disable-prefix-cache"])
    try:
        url = engine_url(process, port_file, log_path)
        _wait_healthy(process, url, log_path)
        yield url
    finally:
        _stop(process)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_two_engine_worker_pairs_share_one_job(
    db_url: str,
    redis_url: str,
    engine_nocache: Any,
    second_engine: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hsx.loader import iter_samples
    from hsx.server.db.session import session_scope
    from hsx.server.jobs.queries import done_units_by_engine

    stack = make_stack(db_url, redis_url, engine_nocache.url, tmp_path, monkeypatch)
    rows = [line for line in SAMPLE.read_text().splitlines() if line.strip()]
    dataset = tmp_path / "three_times.jsonl"
    dataset.write_text("\n".join(rows * 3) + "\n")
    job = stack.submit(dataset, samples_per_shard=2)
    try:
        stack.start_worker({"HSX_ENGINE_URL": engine_nocache.url})
        stack.start_worker({"HSX_ENGINE_URL": second_engine})
        doc = stack.wait(job["id"], timeout=400)
    finally:
        stack.stop_workers()
    assert doc["state"] == "succeeded", (doc, stack.logs())
    with session_scope(db_url) as session:
        per_engine = done_units_by_engine(session, job["id"])
    assert set(per_engine) == {engine_nocache.url, second_engine}, per_engine
    assert (
        all(n >= 1 for n in per_engine.values())
        and sum(per_engine.values()) == doc["progress"]["units_total"]
    )
    indices = [s.index for s in iter_samples(doc["output_dir"])]
    assert len(indices) == len(set(indices)) == doc["progress"]["samples_done"]
    # Every record is valid and neither engine caches prefixes: all are done, none rejected.
    assert (doc["progress"]["samples_done"], doc["progress"]["samples_rejected"]) == (3 * len(rows), 0)
