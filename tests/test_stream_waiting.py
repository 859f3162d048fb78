"""A lease that finds nothing waits at the API (``wait_seconds``) and answers on the stream's news: the item
a unit's commit adds, the job's end, a cancel, a reader leaving. Each test makes the lease's own re-read of
the table (``RECHECK_SECONDS``) longer than the test, so an answer that came at all came from the news, and
counts how often the lease read the table: once before the news and once after it. A lease that has not
answered by half its wait did not hear the news (its wait would answer at the end, with a last read). A
worker waiting for room under a consume job's cap waits on the same news, and is tested the same way.

Real synthetic engine, real PostgreSQL/SQLite and Redis; the API through its real app in this process, the
job runner in this process as a work horse would run it."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from tests.fixtures.stack import Stack
from tests.fixtures.synthetic import Synthetic, write_pretokenized
from tests.test_streams import ack, consumer, lease, run_worker

LONG = 60.0  # longer than any of these tests: nothing here is answered by a recheck
WAIT = 30.0  # the longest wait a lease may ask for
# A lease that answers within this long answered on news: its wait (WAIT) had not run out.
ON_NEWS = WAIT / 2


class Looks:
    """Counts the lease's reads of the table (StreamService.lease) and what each found."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from hsx.server.streams.service import StreamService

        self.found: list[int] = []
        self.lock = threading.Lock()
        real = StreamService.lease

        def counted(service: StreamService, *args: Any, **kwargs: Any) -> Any:
            answer = real(service, *args, **kwargs)
            with self.lock:
                self.found.append(len(answer.items))
            return answer

        monkeypatch.setattr(StreamService, "lease", counted)

    def count(self) -> int:
        with self.lock:
            return len(self.found)


class WaitingLease(threading.Thread):
    """A lease call with ``wait_seconds`` in a thread of its own; ``answer`` once it returned."""

    def __init__(self, stack: Stack, job_id: str, consumer_id: str, wait: float = WAIT) -> None:
        super().__init__(daemon=True)
        self.stack, self.job_id, self.consumer_id, self.wait = stack, job_id, consumer_id, wait
        self.answer: dict[str, Any] | None = None

    def run(self) -> None:
        url = f"/jobs/{self.job_id}/consumers/{self.consumer_id}/leases"
        resp = self.stack.client.post(url, json={"max_items": 1, "wait_seconds": self.wait})
        assert resp.status_code == 200, resp.text
        self.answer = dict(resp.json())


def listeners(stack: Stack, job_id: str) -> int:
    from hsx.server.jobs.queue import redis_connection
    from hsx.server.streams.news import news_channel

    channel = news_channel(stack.settings, job_id)
    return int(dict(redis_connection(stack.settings).pubsub_numsub(channel))[channel.encode()])


def wait_until(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def start_waiting(stack: Stack, job_id: str, consumer_id: str, looks: Looks) -> WaitingLease:
    """A waiting lease that has joined the job's news and read the table once (finding nothing)."""
    before = looks.count()
    waiting = WaitingLease(stack, job_id, consumer_id)
    waiting.start()
    wait_until(lambda: listeners(stack, job_id) == 1 and looks.count() == before + 1, "the lease waits")
    assert looks.found[-1] == 0
    return waiting


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> Looks:
    from hsx.server.streams import news

    monkeypatch.setattr(news, "RECHECK_SECONDS", LONG)
    return Looks(monkeypatch)


def test_a_waiting_lease_hands_out_a_unit_the_moment_it_commits(
    synth: tuple[Stack, Synthetic], looks: Looks
) -> None:
    from hsx.streams.reader import item_samples, manifest_for

    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 2)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume")["id"]
    reader = consumer(stack, job_id, name="rank0")
    waiting = start_waiting(stack, job_id, reader, looks)
    assert waiting.is_alive() and waiting.answer is None
    run_worker(engine.url, job_id)  # commits the one unit, and the job succeeds
    waiting.join(ON_NEWS)
    assert waiting.answer is not None, "the lease did not answer on the commit's news"
    # One read before the news, one after it: nothing polled the table in between.
    assert looks.found == [0, 1]
    items = waiting.answer["items"]
    assert [i["unit_index"] for i in items] == [0] and waiting.answer["end_of_stream"] is False
    doc = stack.job(job_id)
    assert [s.index for s in item_samples(items[0], manifest_for(doc))] == [0, 1]
    assert ack(stack, job_id, reader, items)["acked"] == [items[0]["id"]]
    # With everything acknowledged the stream's end is said at once, not after the wait.
    end = stack.client.post(
        f"/jobs/{job_id}/consumers/{reader}/leases", json={"max_items": 1, "wait_seconds": WAIT}
    ).json()
    assert end["end_of_stream"] is True and end["items"] == [] and looks.found == [0, 1, 0]


def test_a_waiting_lease_learns_of_a_cancel_and_of_the_end_another_readers_ack_brings(
    synth: tuple[Stack, Synthetic], looks: Looks
) -> None:
    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 2)
    job_id = stack.submit(data, samples_per_shard=2)["id"]
    run_worker(engine.url, job_id)
    assert stack.job(job_id)["state"] == "succeeded"
    # A reader of another group holds the one shard, so this reader's stream stays open until it is
    # acknowledged (or its lease runs out and the shard comes here).
    holder = consumer(stack, job_id, name="holder", group="a")
    held = lease(stack, job_id, holder)["items"]
    assert len(held) == 1
    second = consumer(stack, job_id, name="second", group="b")
    waiting = start_waiting(stack, job_id, second, looks)
    ack(stack, job_id, holder, held)
    waiting.join(ON_NEWS)
    assert waiting.answer is not None and waiting.answer["end_of_stream"] is True, waiting.answer
    assert looks.found[-2:] == [0, 0]

    cancelled = stack.submit(data, samples_per_shard=2)["id"]
    reader = consumer(stack, cancelled, name="reader")
    waiting = start_waiting(stack, cancelled, reader, looks)
    assert stack.client.post(f"/jobs/{cancelled}/cancel").status_code == 200
    waiting.join(ON_NEWS)
    assert waiting.answer is not None, "the lease did not answer on the cancel's news"
    assert waiting.answer["job_state"] == "cancelled" and waiting.answer["items"] == []
    assert waiting.answer["end_of_stream"] is False  # a trainer never takes a cancel for the end of its data


def test_a_reader_that_leaves_hands_its_shard_to_a_waiting_lease(
    synth: tuple[Stack, Synthetic], looks: Looks
) -> None:
    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40] * 2)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume")["id"]
    run_worker(engine.url, job_id)
    # Of another group: a shard held by the reader's own group would end its stream at once.
    leaving = consumer(stack, job_id, name="leaving", group="a")
    held = lease(stack, job_id, leaving)["items"]
    staying = consumer(stack, job_id, name="staying", group="b")
    waiting = start_waiting(stack, job_id, staying, looks)
    assert stack.client.delete(f"/jobs/{job_id}/consumers/{leaving}").status_code == 204
    waiting.join(ON_NEWS)
    assert waiting.answer is not None, "the lease did not answer on the reader's leaving"
    assert [(i["id"], i["delivery"]) for i in waiting.answer["items"]] == [(held[0]["id"], 2)]


def test_a_wait_without_news_still_reads_the_table_every_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis unreachable: the wait goes on by reading the table every RECHECK_SECONDS, and what a read
    finds is answered (a lease that ran out comes back this way too: nothing announces it)."""
    from hsx.server.settings import Settings
    from hsx.server.streams import news

    monkeypatch.setattr(news, "RECHECK_SECONDS", 0.05)
    settings = Settings(redis_url="redis://127.0.0.1:1/0")
    answers = iter([[], [], ["item"]])
    looked: list[float] = []

    async def look() -> list[str]:
        looked.append(time.monotonic())
        return next(answers)

    got = asyncio.run(news.wait_for(settings, "job", LONG, look, lambda found: not found))
    assert got == ["item"] and len(looked) == 3
    assert all(b - a >= 0.04 for a, b in zip(looked, looked[1:], strict=False))
    # And a wait that runs out answers what the last read found.
    assert asyncio.run(news.wait_for(settings, "job", 0.12, look_empty, lambda found: not found)) == []


async def look_empty() -> list[str]:
    return []


@pytest.mark.parametrize("wait", [-1, 30.5, "10"])
def test_a_wait_out_of_bounds_is_refused_naming_the_field(synth: tuple[Stack, Synthetic], wait: Any) -> None:
    stack, _ = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [40])
    job_id = stack.submit(data)["id"]
    reader = consumer(stack, job_id)
    resp = stack.client.post(
        f"/jobs/{job_id}/consumers/{reader}/leases", json={"max_items": 1, "wait_seconds": wait}
    )
    assert resp.status_code == 422, resp.text
    assert "wait_seconds" in resp.text


def test_a_client_wait_must_fit_its_own_read_timeout() -> None:
    from hsx.streams.contract import lease_wait
    from hsx.streams.torch_stream import JobStream

    assert lease_wait(10, 60) == 10.0 and lease_wait(0, 1) == 0.0
    with pytest.raises(ValueError, match="shorter than timeout"):
        JobStream("http://127.0.0.1:1", "job", wait_seconds=20, timeout=15)
    with pytest.raises(ValueError, match="within 0 and 30"):
        lease_wait(31, 120)


def test_the_default_wait_shortens_to_fit_a_short_read_timeout() -> None:
    """A trainer that only sets a short timeout (the stream-fault tests' trainers use 10 s) gets a wait that
    fits it, or polling where none fits: the default must never make JobStream refuse to start."""
    from hsx.streams.contract import LEASE_WAIT_SECONDS, lease_wait
    from hsx.streams.torch_stream import JobStream

    assert JobStream("http://127.0.0.1:1", "job").wait_seconds == LEASE_WAIT_SECONDS
    assert JobStream("http://127.0.0.1:1", "job", timeout=10).wait_seconds == 5.0
    assert JobStream("http://127.0.0.1:1", "job", timeout=4).wait_seconds == 0.0
    assert lease_wait(None, 60) == LEASE_WAIT_SECONDS


def test_news_of_an_item_wakes_the_longest_waiting_lease_and_other_news_wakes_all(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three leases of one job wait in one API process, on one shared subscription. News of one item makes
    one of them read the table, the one that has waited longest; news of anything else makes each read it.
    (Waking every waiter for each commit made N consumers read the table N times an item.)"""
    import uuid

    from hsx.server.settings import Settings
    from hsx.server.streams import news

    monkeypatch.setattr(news, "RECHECK_SECONDS", LONG)
    settings = Settings(redis_url=redis_url, queue_name=f"news-{uuid.uuid4().hex[:8]}")
    job_id = "job"
    channel = news.news_channel(settings, job_id)
    looked: dict[str, int] = {}
    release = asyncio.Event()

    def looker(name: str) -> Any:
        async def look() -> bool:
            looked[name] = looked.get(name, 0) + 1
            return release.is_set()

        return look

    async def scenario() -> dict[str, Any]:
        from redis import asyncio as aioredis

        waits = []
        for name in ("first", "second", "third"):
            waits.append(
                asyncio.create_task(news.wait_for(settings, job_id, LONG, looker(name), lambda d: not d))
            )
            while looked.get(name) != 1:  # joined, and read the table once: it waits from now on
                await asyncio.sleep(0.005)
        publisher = aioredis.Redis.from_url(redis_url)
        subscribers = dict(await publisher.pubsub_numsub(channel))[channel.encode()]
        await asyncio.to_thread(news.announce, settings, job_id, news.ITEM)

        # Until a waiter has read the table on the item's news (the state itself, not a guess at how long
        # delivery takes); one woken besides it would show in the counts at the end.
        async def a_look_on_the_news() -> None:
            while sum(looked.values()) == 3:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(a_look_on_the_news(), 10)
        after_item = dict(looked)
        release.set()
        await asyncio.to_thread(news.announce, settings, job_id)
        done = await asyncio.wait_for(asyncio.gather(*waits), 10)
        left = dict(await publisher.pubsub_numsub(channel))[channel.encode()]
        await publisher.aclose()
        return {"subscribers": subscribers, "after_item": after_item, "done": done, "left": left}

    got = asyncio.run(scenario())
    assert got["subscribers"] == 1  # one subscription for the three
    assert got["after_item"] == {"first": 2, "second": 1, "third": 1}
    assert got["done"] == [True, True, True] and looked == {"first": 3, "second": 2, "third": 2}
    assert got["left"] == 0  # the last to leave ended the subscription


def test_news_of_room_ends_a_workers_wait_for_room_at_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose claim the cap refused waits on the same news as the leases, on a blocking connection of
    its own: an acknowledgement's news makes it look at the table again now, not at its next recheck."""
    import uuid

    from hsx.server.settings import Settings
    from hsx.server.streams import news

    monkeypatch.setattr(news, "RECHECK_SECONDS", LONG)
    settings = Settings(redis_url=redis_url, queue_name=f"news-{uuid.uuid4().hex[:8]}")
    looked = threading.Event()
    room = threading.Event()
    looks: list[bool] = []

    def look() -> bool:
        looks.append(not room.is_set())
        looked.set()
        return looks[-1]  # held back until the room is made

    answers: list[bool] = []
    waiting = threading.Thread(
        target=lambda: answers.append(news.wait_blocking(settings, "job", 2 * LONG, look)),
        daemon=True,
    )
    started = time.monotonic()
    waiting.start()
    assert looked.wait(LONG), "the wait never looked"  # subscribed, and read the table once
    room.set()
    news.announce(settings, "job", news.ROOM)
    waiting.join(ON_NEWS)
    assert answers == [False], "the wait did not end on the news of room"
    assert looks == [True, False] and time.monotonic() - started < ON_NEWS
