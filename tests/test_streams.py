"""A consume job feeds consumers while it runs: each committed shard is delivered to one consumer at a time,
re-delivered when a lease runs out (the test ends it in the table: no lease here runs out on the clock),
never again once acknowledged (the table refuses it), deleted only once
acknowledged, and by the workers, never by the API; the byte cap holds the workers back until consumers
acknowledge, and an acknowledgement wakes them through the queue.

Real synthetic engine (a separate process), real PostgreSQL/SQLite and Redis; the job runner runs in this
process as a work horse would, the API through its real app."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.kills import end_lease
from tests.fixtures.stack import Stack
from tests.fixtures.synthetic import Synthetic, write_pretokenized


def run_worker(url: str, job_id: str, wait: float = 0) -> Any:
    from hsx.server.settings import get_settings
    from workers.job_runner import JobRunner

    settings = get_settings().model_copy(update={"engine_url": url, "stream_room_wait_seconds": wait})
    return JobRunner(job_id, settings).run()


def consumer(stack: Stack, job_id: str, **body: Any) -> str:
    resp = stack.client.post(f"/jobs/{job_id}/consumers", json=body)
    assert resp.status_code == 201, resp.text
    assert resp.headers["Location"] == f"/jobs/{job_id}/consumers/{resp.json()['id']}"
    return str(resp.json()["id"])


def lease(
    stack: Stack, job_id: str, consumer_id: str, max_items: int = 10, seen: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"max_items": max_items}
    if seen is not None:
        body["seen"] = [{"id": i["id"], "delivery": i["delivery"]} for i in seen]
    resp = stack.client.post(f"/jobs/{job_id}/consumers/{consumer_id}/leases", json=body)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def ack(stack: Stack, job_id: str, consumer_id: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"items": [{"id": i["id"], "delivery": i["delivery"]} for i in items]}
    resp = stack.client.post(f"/jobs/{job_id}/consumers/{consumer_id}/acks", json=body)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def wakeups(stack: Stack, job_id: str) -> int:
    from hsx.server.jobs.queue import queued_wakeups

    return queued_wakeups(stack.settings, job_id)


def reconcile(stack: Stack) -> dict[str, int]:
    """A pass of the reconciler, as a worker host runs it (it deletes acknowledged shards first)."""
    from workers.reconciler import reconcile_once

    return reconcile_once(stack.settings)


def drain_wakeups(stack: Stack) -> None:
    from hsx.server.jobs.queue import queue_for

    queue_for(stack.settings).empty()


def test_a_consume_job_waits_at_its_cap_and_each_acknowledgement_lets_one_more_unit_in(
    synth: tuple[Stack, Synthetic],
) -> None:
    from hsx.streams.reader import item_samples, manifest_for

    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 5)
    # A cap of one byte: one unit at a time, never none (a cap below one unit slows the job, never stops it).
    job = stack.submit(data, samples_per_shard=1, retention="consume", buffer_cap_bytes=1)
    job_id = job["id"]
    assert job["options"]["retention"] == "consume" and job["options"]["buffer_cap_bytes"] == 1
    reader = consumer(stack, job_id, name="rank0")
    other = consumer(stack, job_id, name="rank1")
    seen: list[int] = []
    acked_path: Path | None = None
    for round_number in range(5):
        drain_wakeups(stack)
        outcome = run_worker(engine.url, job_id)
        # The worker deleted the shard acknowledged in the last round before it claimed this one.
        assert acked_path is None or not acked_path.exists()
        doc = stack.job(job_id)
        stream = doc["stream"]
        if round_number < 4:
            # One unit committed, the next one held back, and nothing queued to poll the job meanwhile.
            assert not outcome.more_work and "waiting for consumers" in outcome.summary, outcome
            assert doc["state"] == "running" and stream["waiting_on_consumers"] is True, stream
            assert wakeups(stack, job_id) == 0
        else:
            assert doc["state"] == "succeeded", doc
        assert stream["cap_bytes"] == 1 and stream["items_acked"] == round_number
        got = lease(stack, job_id, reader)
        assert len(got["items"]) == 1 and got["end_of_stream"] is False, got
        item = got["items"][0]
        assert stream["buffered_bytes"] == stream["stored_bytes"] == item["bytes"] > 0
        # The other consumer gets nothing: the one committed shard is leased.
        assert lease(stack, job_id, other)["items"] == []
        manifest = manifest_for(doc)
        seen += [s.index for s in item_samples(item, manifest)]
        assert Path(item["path"]).exists()
        done = ack(stack, job_id, reader, [item])
        assert done == {"acked": [item["id"]], "repeated": [], "refused": []}
        # The API recorded the acknowledgement and deleted nothing: the shard stays on disk, and counted,
        # until a worker deletes it; the acknowledgement woke a worker through the queue.
        acked_path = Path(item["path"])
        assert acked_path.exists()
        after = stack.job(job_id)["stream"]
        assert after["buffered_bytes"] == 0 and after["stored_bytes"] == item["bytes"], after
        if round_number < 4:
            assert wakeups(stack, job_id) >= 1
            assert stack.job(job_id)["stream"]["waiting_on_consumers"] is False
    assert sorted(seen) == list(range(5))
    # The job has succeeded: no worker claims again, and the reconciler deletes the last shard.
    assert acked_path is not None and acked_path.exists()
    assert reconcile(stack)["deleted"] == 1
    assert not acked_path.exists() and stack.job(job_id)["stream"]["stored_bytes"] == 0
    end = lease(stack, job_id, other)
    assert end["items"] == [] and end["end_of_stream"] is True and end["job_state"] == "succeeded"
    listed = stack.client.get(f"/jobs/{job_id}/consumers").json()["items"]
    assert [(c["name"], c["items_acked"], c["leased_items"]) for c in listed] == [
        ("rank0", 5, 0),
        ("rank1", 0, 0),
    ]


def test_a_lease_that_runs_out_goes_to_another_consumer_and_the_old_ack_is_refused(
    synth: tuple[Stack, Synthetic],
) -> None:
    from sqlalchemy import update
    from sqlalchemy.exc import IntegrityError

    from hsx.server.db.session import session_scope
    from hsx.server.db.stream_models import StreamItem

    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 4)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume")["id"]
    run_worker(engine.url, job_id)
    assert stack.job(job_id)["state"] == "succeeded"
    slow = consumer(stack, job_id, name="slow")
    fast = consumer(stack, job_id, name="fast")
    first = lease(stack, job_id, slow, max_items=1)["items"]
    assert [i["delivery"] for i in first] == [1]
    taken = lease(stack, job_id, fast, max_items=10)["items"]
    assert [i["unit_index"] for i in taken] == [1]  # the other is still leased
    # The job has succeeded, but a shard another reader holds keeps the stream open for this one.
    waiting = lease(stack, job_id, fast)
    assert waiting["items"] == [] and waiting["end_of_stream"] is False, waiting
    end_lease(stack.env["HSX_DATABASE_URL"], StreamItem, first[0]["id"], delivery=1)  # the slow one's ends
    again = lease(stack, job_id, fast, max_items=10)["items"]
    assert [(i["id"], i["delivery"]) for i in again] == [(first[0]["id"], 2)]
    # The first delivery's ack comes late: refused, the file stays for the delivery that holds it.
    late = ack(stack, job_id, slow, first)
    assert late["acked"] == [] and late["refused"][0]["id"] == first[0]["id"], late
    assert Path(first[0]["path"]).exists()
    assert ack(stack, job_id, fast, again + taken)["acked"] == sorted([first[0]["id"], taken[0]["id"]])
    # Acknowledged is final: no lease hands it out again, and the table refuses any update that would.
    assert lease(stack, job_id, slow)["items"] == []
    assert ack(stack, job_id, slow, again)["refused"][0]["reason"] == "not leased to this consumer"
    with pytest.raises(IntegrityError), session_scope(stack.env["HSX_DATABASE_URL"]) as session:
        session.execute(
            update(StreamItem)
            .where(StreamItem.id == first[0]["id"])
            .values(consumer_id=fast, lease_expires=1e12)
        )
    assert lease(stack, job_id, slow)["end_of_stream"] is True


def test_a_keep_job_can_be_followed_and_its_acknowledged_shards_stay(synth: tuple[Stack, Synthetic]) -> None:
    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 4)
    job_id = stack.submit(data, samples_per_shard=2)["id"]
    assert stack.job(job_id)["stream"] is None  # a keep job nobody reads shows no stream
    run_worker(engine.url, job_id)
    reader = consumer(stack, job_id)
    items = lease(stack, job_id, reader)["items"]
    assert len(items) == 2
    assert len(ack(stack, job_id, reader, items)["acked"]) == 2
    assert reconcile(stack)["deleted"] == 0
    assert all(Path(i["path"]).exists() for i in items)
    stream = stack.job(job_id)["stream"]
    assert stream["retention"] == "keep" and stream["cap_bytes"] is None and stream["items_acked"] == 2
    assert stream["waiting_on_consumers"] is False


def test_stream_requests_that_cannot_be_served_get_a_reason(synth: tuple[Stack, Synthetic]) -> None:
    stack, _engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 2)
    refused = stack.client.post("/jobs", json={"dataset_uri": str(data), "options": {"retention": "drop"}})
    assert refused.status_code == 422 and refused.json()["error"] == "invalid_request", refused.text
    zero = stack.client.post(
        "/jobs", json={"dataset_uri": str(data), "options": {"retention": "consume", "buffer_cap_bytes": 0}}
    )
    assert zero.status_code == 422, zero.text
    job_id = stack.submit(data, retention="consume")["id"]
    assert stack.job(job_id)["options"]["buffer_cap_bytes"] == stack.settings.stream_buffer_cap_bytes
    missing = stack.client.post(f"/jobs/{job_id}/consumers/nope/leases", json={"max_items": 1})
    assert missing.status_code == 404 and missing.json()["error"] == "consumer_not_found"
    assert stack.client.post("/jobs/nope/consumers", json={}).status_code == 404
    reader = consumer(stack, job_id)
    empty = stack.client.post(f"/jobs/{job_id}/consumers/{reader}/acks", json={"items": []})
    assert empty.status_code == 422
    # A cancelled job says so to a consumer (never an end of stream), and takes no new consumer.
    assert stack.client.post(f"/jobs/{job_id}/cancel").status_code == 200
    told = lease(stack, job_id, reader)
    assert told["job_state"] == "cancelled" and told["end_of_stream"] is False and told["error"]
    late = stack.client.post(f"/jobs/{job_id}/consumers", json={})
    assert late.status_code == 409 and late.json()["error"] == "job_not_streamable"
    assert stack.client.delete(f"/jobs/{job_id}/consumers/{reader}").status_code == 204
    assert stack.client.get(f"/jobs/{job_id}/consumers").json()["items"] == []


def test_a_worker_at_the_cap_blocks_until_an_acknowledgement_then_goes_on(
    synth: tuple[Stack, Synthetic],
) -> None:
    import threading

    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 3)
    job_id = stack.submit(data, samples_per_shard=1, retention="consume", buffer_cap_bytes=1)["id"]
    reader = consumer(stack, job_id)
    outcome: list[Any] = []
    worker = threading.Thread(target=lambda: outcome.append(run_worker(engine.url, job_id, wait=30)))
    started = time.monotonic()
    worker.start()
    acked = 0
    while acked < 3 and time.monotonic() - started < 60:
        items = lease(stack, job_id, reader)["items"]
        if items:
            time.sleep(0.3)  # the worker is held at the cap meanwhile
            assert stack.job(job_id)["stream"]["in_flight_bytes"] == 0
            acked += len(ack(stack, job_id, reader, items)["acked"])
        else:
            time.sleep(0.05)
    worker.join(30)
    # One wake-up, three units: the worker waited at the cap twice and went on at each acknowledgement.
    assert acked == 3 and outcome and "no unit left" in outcome[0].summary, outcome
    assert stack.job(job_id)["state"] == "succeeded"


def test_acknowledged_shards_go_at_the_reconciler_on_the_workers_host_and_nothing_else_does(
    synth: tuple[Stack, Synthetic],
) -> None:
    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 6)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume")["id"]
    run_worker(engine.url, job_id)
    reader = consumer(stack, job_id)
    first, second, third = lease(stack, job_id, reader)["items"]
    ack(stack, job_id, reader, [first, second])
    # Leases and acknowledgements delete nothing; the shards count against the cap until they are gone.
    assert lease(stack, job_id, reader)["items"] == []
    assert Path(first["path"]).exists() and Path(second["path"]).exists()
    assert stack.job(job_id)["stream"]["stored_bytes"] == first["bytes"] + second["bytes"] + third["bytes"]
    # A host that does not see the job's output (here: moved away meanwhile) deletes and records nothing.
    output = Path(first["path"]).parent
    output.rename(output.with_name("elsewhere"))
    assert reconcile(stack)["deleted"] == 0
    output.with_name("elsewhere").rename(output)
    # A pass that died after unlinking one file and before recording it: the next one records it.
    Path(second["path"]).unlink()
    assert reconcile(stack)["deleted"] == 2
    assert not Path(first["path"]).exists() and Path(third["path"]).exists()
    assert stack.job(job_id)["stream"]["stored_bytes"] == third["bytes"]
    assert reconcile(stack)["deleted"] == 0


def test_a_retried_acknowledgement_counts_once_and_a_lease_whose_answer_was_lost_comes_back_at_once(
    synth: tuple[Stack, Synthetic],
) -> None:
    from hsx.server.db.stream_models import StreamItem

    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 8)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume")["id"]
    run_worker(engine.url, job_id)
    reader = consumer(stack, job_id, name="reader")
    other = consumer(stack, job_id, name="other")
    # The answers of these leases are lost: the reader holds two items without knowing it. A lease without
    # `seen` hands out only new items; with it, held-but-unseen deliveries come first (the same delivery,
    # its lease renewed), and the rest of max_items is filled with new leases.
    lost = lease(stack, job_id, reader, max_items=1)["items"]
    plain = lease(stack, job_id, reader, max_items=1)["items"]
    again = lease(stack, job_id, reader, max_items=2, seen=plain)["items"]
    held = lost + plain
    assert [(i["id"], i["delivery"], i["unit_index"]) for i in again] == [
        (lost[0]["id"], 1, 0),
        (again[1]["id"], 1, 2),
    ]
    assert again[0]["lease_expires"] > lost[0]["lease_expires"]
    # What the reader holds is nobody else's: another consumer naming nothing gets only the last shard.
    last = lease(stack, job_id, other, seen=[])["items"]
    assert [i["unit_index"] for i in last] == [3]
    assert lease(stack, job_id, reader, seen=held + again[1:])["items"] == []
    too_many = [{"id": 1, "delivery": 1}] * 1001
    bounded = stack.client.post(f"/jobs/{job_id}/consumers/{reader}/leases", json={"seen": too_many})
    assert bounded.status_code == 422, bounded.text
    # The acknowledgement committed and its answer was lost: the retry is accepted, and counted once.
    first = ack(stack, job_id, reader, lost)
    assert first == {"acked": [lost[0]["id"]], "repeated": [], "refused": []}
    retried = ack(stack, job_id, reader, lost + plain)
    assert retried["acked"] == [lost[0]["id"], plain[0]["id"]] and retried["repeated"] == [lost[0]["id"]]
    assert retried["refused"] == []
    # Another consumer naming the same delivery is refused.
    assert [r["id"] for r in ack(stack, job_id, other, lost)["refused"]] == [lost[0]["id"]]
    # The other consumer's lease runs out and the item comes back to it as a new delivery: its
    # acknowledgement of the older delivery is refused, a repeated one of the newer accepted once.
    assert lease(stack, job_id, other, seen=last)["items"] == []  # still held: nothing new to hand out
    end_lease(stack.env["HSX_DATABASE_URL"], StreamItem, last[0]["id"], delivery=1)
    renewed = lease(stack, job_id, other, seen=last)["items"]
    assert [(i["id"], i["delivery"]) for i in renewed] == [(last[0]["id"], 2)], renewed
    assert ack(stack, job_id, other, last)["refused"][0]["id"] == last[0]["id"]
    assert ack(stack, job_id, other, renewed)["repeated"] == []
    assert ack(stack, job_id, other, renewed)["repeated"] == [last[0]["id"]]
    listed = {c["name"]: c for c in stack.client.get(f"/jobs/{job_id}/consumers").json()["items"]}
    assert (listed["reader"]["items_acked"], listed["reader"]["leased_items"]) == (2, 1)
    assert (listed["other"]["items_acked"], listed["other"]["leased_items"]) == (1, 0)
    assert stack.job(job_id)["stream"]["items_acked"] == 3
