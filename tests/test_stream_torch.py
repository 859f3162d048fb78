"""``hsx.torch_data.JobStream`` follows a consume job through the real API while a real worker process
runs it: DataLoader workers split the shards with no sample twice and get every sample's states as
bfloat16 whether the job stores bf16 or fp8, the training loop acknowledges after
each optimizer step (and the shards go), the stream ends when the job has succeeded, and a cancelled job
raises instead of looking like the end of the data."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import TEST_TOKEN, Stack, make_stack
from tests.fixtures.synthetic import Engines, Synthetic, expected_tensors, write_pretokenized

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


@pytest.fixture
def synth(
    db_url: str, redis_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Stack, Synthetic]]:
    from hsx.server.settings import get_settings

    engine = engines.start()
    stack = make_stack(db_url, redis_url, engine.url, tmp_path, monkeypatch)
    try:
        yield stack, engine
    finally:
        stack.stop_workers()
        get_settings.cache_clear()


@postgres_only
@pytest.mark.parametrize(("state_dtype", "cap"), [("engine", 110_000), ("fp8_e4m3", 75_000)])
def test_dataloader_workers_split_a_running_job_and_ack_after_each_step(
    synth: tuple[Stack, Synthetic], state_dtype: str, cap: int
) -> None:
    from app.main import create_app
    from hsx.torch_data import JobStream, collate_samples

    stack, _engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [48] * 12)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    # About four shards' worth of cap for six shards: the job only finishes if the trainer acknowledges as
    # it goes. (The cap must hold what the DataLoader prefetches: workers x prefetch_factor batches.)
    options: dict[str, Any] = {"retention": "consume", "buffer_cap_bytes": cap, "state_dtype": state_dtype}
    job_id = stack.submit(data, samples_per_shard=2, **options)["id"]
    stack.start_worker()
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[int] = []
    with serve_in_thread(create_app()) as api:
        stream = JobStream(api, job_id, token=TEST_TOKEN, poll_seconds=0.1)
        loader = DataLoader(
            stream, batch_size=2, num_workers=2, prefetch_factor=1, collate_fn=collate_samples, timeout=120
        )
        for batch in loader:
            for row, index in enumerate(batch["index"].tolist()):
                length = int(batch["lengths"][row])
                ids = records[index]["input_ids"]
                assert batch["input_ids"][row, :length].tolist() == ids
                for name, want in expected_tensors(ids, state_dtype).items():
                    assert batch[name].dtype == torch.bfloat16, (name, batch[name].dtype)
                    assert torch.equal(batch[name][row, :length], want), (index, name)
            loss = model(batch["hidden_state"].float()).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            stream.ack(batch)
            seen += batch["index"].tolist()
            shard_bytes = [s["bytes"] for s in stack.client.get(f"/jobs/{job_id}/shards").json()["items"]]
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", (doc, stack.logs())
    assert sorted(seen) == list(range(12)), seen  # every sample once, across both DataLoader workers
    stream_doc = doc["stream"]
    assert stream_doc["items_acked"] == 6 and stream_doc["buffered_bytes"] == 0, stream_doc
    assert {c["name"] for c in stream_doc["consumers"]} == {"trainer-rank0-worker0", "trainer-rank0-worker1"}
    stack.wait_deleted(job_id)
    assert not list(Path(doc["output_dir"]).glob("shard-*.safetensors"))  # acknowledged, so deleted
    assert 0 < max(shard_bytes) * 4 <= cap < sum(shard_bytes), shard_bytes


@postgres_only
def test_a_cancelled_job_raises_rather_than_ending_the_stream(synth: tuple[Stack, Synthetic]) -> None:
    from app.main import create_app
    from hsx.torch_data import JobStream, JobStreamError

    stack, _engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [48] * 8)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume", buffer_cap_bytes=1)["id"]
    stack.start_worker()
    with serve_in_thread(create_app()) as api:
        samples = iter(JobStream(api, job_id, token=TEST_TOKEN, poll_seconds=0.1))
        first = next(samples)
        assert first["hidden_state"].shape[1] == 32
        assert stack.client.post(f"/jobs/{job_id}/cancel").status_code == 200
        with pytest.raises(JobStreamError, match="cancelled"):
            for _ in samples:
                pass


def _stream_client(kind: str, api: str, outage_seconds: float, tmp: Path) -> tuple[Any, type[Exception]]:
    """The trainer's JobStream or the SpecForge feeder: both call the API through one retry rule."""
    if kind == "trainer":
        from hsx.torch_data import JobStream, JobStreamError

        return JobStream(api, "j", token="t", outage_seconds=outage_seconds), JobStreamError
    from hsx.integrations.specforge.feeder import FeedError, SpecForgeFeeder

    feeder = SpecForgeFeeder(
        api, "j", tmp / "refs.jsonl", tmp / "store", "s", token="t", outage_seconds=outage_seconds
    )
    return feeder, FeedError


@pytest.mark.parametrize("kind", ["trainer", "specforge_feeder"])
def test_stream_clients_retry_an_unreachable_api_for_their_outage_window_and_a_4xx_not_at_all(
    kind: str, tmp_path: Path
) -> None:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    calls = {"flaky": 0, "gone": 0, "down": 0}
    app = FastAPI()

    @app.post("/jobs/j/flaky")
    def flaky() -> JSONResponse:
        calls["flaky"] += 1
        return JSONResponse({"ok": calls["flaky"]}, status_code=503 if calls["flaky"] < 3 else 200)

    @app.post("/jobs/j/gone")
    def gone() -> JSONResponse:
        calls["gone"] += 1
        return JSONResponse({"error": "consumer_not_found"}, status_code=404)

    @app.post("/jobs/j/down")
    def down() -> JSONResponse:
        calls["down"] += 1
        return JSONResponse({"error": "internal"}, status_code=500)

    with serve_in_thread(app) as api:
        client, failure = _stream_client(kind, api, 2, tmp_path)
        assert client._call("POST", "/flaky", {}) == {"ok": 3} and calls["flaky"] == 3
        with pytest.raises(failure, match="404"):
            client._call("POST", "/gone", {})
        assert calls["gone"] == 1
        with pytest.raises(failure, match="failed for 2 s: 500"):
            client._call("POST", "/down", {})
        assert calls["down"] >= 3
    # Nothing listens any more: connection errors are retried too, then raise.
    client, failure = _stream_client(kind, api, 0.5, tmp_path)
    with pytest.raises(failure, match="ConnectError"):
        client._call("POST", "/flaky", {})


def acked(stack: Stack, item_id: int) -> bool:
    from hsx.server.db.session import session_scope
    from hsx.server.db.stream_models import StreamItem

    with session_scope(stack.env["HSX_DATABASE_URL"]) as session:
        item = session.get(StreamItem, item_id)
        return item is not None and item.acked_at is not None


def committed_units(stack: Stack, job_id: str, units: int) -> None:
    deadline = time.monotonic() + 120
    while stack.job(job_id)["progress"]["units_done"] < units:
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.05)


@postgres_only
def test_a_delivery_another_consumer_acknowledged_meanwhile_is_skipped_not_raised(
    synth: tuple[Stack, Synthetic], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer holds a lease past its end before it reads the shard (a slow step, a long prefetch
    queue); the item goes to another consumer, which acknowledges it, and the shard is deleted. The late
    trainer skips that delivery instead of failing, and every sample is used exactly once."""
    from app.main import create_app
    from hsx.streams import reader
    from hsx.torch_data import JobStream

    stack, _engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [48] * 4)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume", buffer_cap_bytes=10**9)["id"]
    stack.start_worker()
    committed_units(stack, job_id, 2)
    other_got: list[int] = []
    late_item: list[int] = []
    real_open = reader.open_item
    with serve_in_thread(create_app()) as api:
        late = JobStream(api, job_id, token=TEST_TOKEN, name="late", lease_seconds=1, poll_seconds=0.05)
        other = JobStream(api, job_id, token=TEST_TOKEN, name="other", poll_seconds=0.05)
        others = iter(other)

        def open_after_the_lease_ran_out(item: dict[str, Any], *args: Any) -> Any:
            if not late_item:
                late_item.append(int(item["id"]))
                while time.time() <= float(item["lease_expires"]):  # the late trainer's lease runs out
                    time.sleep(0.05)
                shard = Path(item["path"])
                while not acked(stack, int(item["id"])):  # the other consumer takes it, uses it, acks it
                    sample = next(others)
                    other.ack([sample])
                    other_got.append(int(sample["index"]))
                while shard.exists():  # and a worker deletes it
                    time.sleep(0.05)
            return real_open(item, *args)

        monkeypatch.setattr(reader, "open_item", open_after_the_lease_ran_out)
        with caplog.at_level("WARNING", logger="hsx.streams.torch_stream"):
            late_got = [int(s["index"]) for s in late if late.ack([s]) >= 0]
        other_got += [int(s["index"]) for s in others if other.ack([s]) >= 0]
    assert late_item and f"delivery 1 of item {late_item[0]} skipped" in caplog.text, caplog.text
    assert sorted(late_got + other_got) == [0, 1, 2, 3], (late_got, other_got)
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded" and doc["stream"]["items_acked"] == 2, doc["stream"]


@postgres_only
def test_a_shard_gone_from_a_job_that_keeps_its_shards_raises(synth: tuple[Stack, Synthetic]) -> None:
    from app.main import create_app
    from hsx.torch_data import JobStream, JobStreamError

    stack, _engine = synth
    job_id = stack.submit(write_pretokenized(stack.tmp / "d.jsonl", [48] * 2), samples_per_shard=2)["id"]
    stack.start_worker()
    assert stack.wait(job_id)["state"] == "succeeded", stack.logs()
    for shard in Path(stack.job(job_id)["output_dir"]).glob("shard-*.safetensors"):
        shard.unlink()  # by hand: a keep job never deletes one
    with serve_in_thread(create_app()) as api:
        stream = JobStream(api, job_id, token=TEST_TOKEN, poll_seconds=0.05)
        with pytest.raises(JobStreamError, match="keeps its shards, yet .* is gone"):
            next(iter(stream))
