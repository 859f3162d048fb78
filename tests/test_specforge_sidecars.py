"""What SpecForge's trainer writes beside the ref channel steers ``hsx publish specforge``
(docs/streaming.md), each written here by SpecForge's own ``StreamingRefChannel``: ``.consumer_quantum``
(refs per optimizer step) raises the publisher's window to it, so a trainer that needs more refs for a
step than the window allows is not left waiting; ``.consumer_done`` makes the publisher hand its leases
back at once (a new consumer leases them with no lease running out) and exit, deleting nothing that was
not acknowledged. The publisher runs in a thread against a real API, worker and synthetic engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import Stack
from tests.fixtures.synthetic import write_pretokenized
from tests.test_faults import wait_until
from tests.test_specforge_stream import PublisherThread

pytestmark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


@pytest.fixture
def api(synthetic_stack: Stack) -> Iterator[str]:
    from app.main import create_app

    with serve_in_thread(create_app()) as url:
        yield url


def refs_published(tmp: Path) -> int:
    refs = tmp / "control" / "refs.jsonl"
    return sum(1 for line in refs.read_text().splitlines() if line.strip()) if refs.exists() else 0


def committed_shards(stack: Stack, job_id: str) -> int:
    return int(stack.job(job_id)["shards"]["total"])


def channel(tmp: Path) -> object:
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

    (tmp / "control").mkdir(parents=True, exist_ok=True)
    return StreamingRefChannel(str(tmp / "control" / "refs.jsonl"))


def test_the_window_is_raised_to_the_trainers_quantum(
    synthetic_stack: Stack, api: str, tmp_path: Path
) -> None:
    stack = synthetic_stack
    data = write_pretokenized(tmp_path / "d.jsonl", [20] * 12)
    job_id = stack.submit(data, samples_per_shard=2)["id"]  # six shards of two samples
    stack.start_worker()
    wait_until(lambda: stack.job(job_id)["state"] == "succeeded", 120, "the job", stack)
    trainer = channel(tmp_path)
    trainer.publish_consumer_quantum(4)  # type: ignore[attr-defined]  # four refs per optimizer step
    publisher = PublisherThread(api, job_id, tmp_path, window=1)
    # Nothing is consumed: the publisher goes up to the quantum (two shards of two refs) and no further,
    # whatever the window of one says; with the window alone it would stop at one shard.
    wait_until(lambda: refs_published(tmp_path) >= 4, 60, "four refs published", stack)
    trainer.mark_consumer_done()  # type: ignore[attr-defined]
    result = publisher.join()
    assert result.outcome == "trainer_done", result
    assert result.published == refs_published(tmp_path) == 4 and result.peak_in_flight == 4, result
    assert committed_shards(stack, job_id) == 6  # there was more to publish: the quantum held it back


def test_a_trainer_done_makes_the_publisher_hand_its_shards_back_and_exit(
    synthetic_stack: Stack, api: str, tmp_path: Path
) -> None:
    stack = synthetic_stack
    data = write_pretokenized(tmp_path / "d.jsonl", [20] * 8)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume", buffer_cap_bytes=1)["id"]
    stack.start_worker()
    trainer = channel(tmp_path)
    publisher = PublisherThread(api, job_id, tmp_path, window=2)
    wait_until(lambda: refs_published(tmp_path) >= 2, 120, "a shard published", stack)
    trainer.mark_consumer_done()  # type: ignore[attr-defined]  # before consuming anything
    result = publisher.join()
    assert result.outcome == "trainer_done" and result.acked_items == 0, result
    doc = stack.job(job_id)
    assert doc["stream"]["consumers"] == [] and doc["stream"]["items_acked"] == 0, doc["stream"]
    # The shard it held is leased again at once by the next reader (no lease had to run out), and it is
    # still on disk: nothing unacknowledged was deleted.
    reader = stack.client.post(f"/jobs/{job_id}/consumers", json={"name": "next", "lease_seconds": 60})
    leases = f"/jobs/{job_id}/consumers/{reader.json()['id']}/leases"
    items = stack.client.post(leases, json={"max_items": 1}).json()["items"]
    assert len(items) == 1 and items[0]["delivery"] == 2 and Path(items[0]["path"]).exists(), items
    first_ref = json.loads((tmp_path / "control" / "refs.jsonl").read_text().splitlines()[0])
    assert first_ref["sample_id"] == f"{job_id}:00000000"
    assert items[0]["samples"] == 2 and Path(items[0]["path"]).name == "shard-00000.safetensors"
