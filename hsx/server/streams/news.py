"""A stream's news, through Redis pub/sub: the one signal of "this job's stream changed" (a unit's commit,
which adds an item; an acknowledgement, which may end another reader's stream, free items or make room under
a consume job's cap; a consumer leaving; the job ending). Two kinds of waiter hear it, and neither is polled:

* a lease that finds nothing, in an API process (:func:`wait_for`): a consumer polling every 20 ms cost the
  API 7 to 10 times a keep job's CPU in empty leases (bench/RESULTS.md, issue 26);
* a worker whose claim the cap refused (:func:`wait_blocking`): it waits for room in its work horse instead
  of leaving the job, since a horse started afresh for every acknowledgement costs more than the unit it
  writes.

Best effort both ways: news is only a reason to look again, the tables decide (the claim rule, the lease),
and a waiter looks again at least every ``RECHECK_SECONDS`` whatever it hears, so lost news, a lease that
ran out and a job that failed are all seen within that.

In an API process, the waiting leases of one job share one subscription (:class:`_Listener`). News of a
new item wakes one of them, the one that has waited longest: an item goes to one consumer, and waking every
waiter for each commit made N consumers read the table N times an item. News of room wakes no lease (only a
worker waits for it); any other news wakes them all. A waiting worker subscribes on its own blocking
connection and looks again on any news but an item's (a commit adds to the buffer, it frees nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis import asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.client import PubSub

from hsx.server.redis_clients import redis_connection, waiting_connection
from hsx.server.settings import Settings

log = logging.getLogger(__name__)

NEWS_PREFIX = "hsx-stream-news-"
# How long a waiter trusts the news: at most this long between two reads of the tables.
RECHECK_SECONDS = 1.0
# What a message says: one more item to hand out (one waiting lease looks, no worker), acknowledgements that
# may have made room under the cap (every waiting worker looks, no lease), or anything else (everyone looks).
ITEM = "item"
ROOM = "room"
ANY = "any"

Answer = TypeVar("Answer")


def news_channel(settings: Settings, job_id: str) -> str:
    return f"{NEWS_PREFIX}{settings.queue_name}-{job_id}"


def announce(settings: Settings, job_id: str, news: str = ANY) -> None:
    """Tell the job's waiting leases to look again: one of them for ``ITEM``, all of them otherwise. Call it
    after the change has committed."""
    try:
        redis_connection(settings).publish(news_channel(settings, job_id), news)
    except Exception as exc:  # noqa: BLE001 - a waiting lease looks again within RECHECK_SECONDS anyway
        log.warning("could not announce news of job %s's stream: %s", job_id, exc)


async def wait_for(
    settings: Settings,
    job_id: str,
    seconds: float,
    look: Callable[[], Awaitable[Answer]],
    worth_waiting: Callable[[Answer], bool],
) -> Answer:
    """``look()`` until its answer is not ``worth_waiting`` on, or ``seconds`` have passed: once at once,
    then on news for it and at least every ``RECHECK_SECONDS``. The waiter joins the job's listener (which
    is subscribed by then) before the first look, so news that comes between a look and the wait is not
    missed: it marks the waiter, whose next wait ends at once."""
    deadline = time.monotonic() + seconds
    # A Redis that hangs delays the first look by a recheck at most, as lost news would.
    listener = await _Listener.join(settings, job_id, min(seconds, RECHECK_SECONDS))
    waiter = asyncio.Event()
    if listener is not None:
        listener.add(waiter)
    try:
        answer = await look()
        while worth_waiting(answer) and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.wait(), min(left, RECHECK_SECONDS))
            if listener is not None:
                listener.requeue(waiter)  # clears it, and puts it last in line for the next item
            answer = await look()
        return answer
    finally:
        if listener is not None:
            await listener.leave(waiter)


class _Listener:
    """One subscription to one job's news in one event loop, shared by the leases that wait on it; it ends
    when the last of them leaves. A broken connection ends it too: its waiters go on looking every recheck,
    and the next lease to wait starts a new one."""

    # Per event loop, held weakly (a pool's connections belong to the loop that opened them, and a loop
    # that is gone, a test's or a restarted server's, takes its listeners and clients with it).
    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _Listener]] = (
        weakref.WeakKeyDictionary()
    )
    _clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, aioredis.Redis]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, channel: str, pubsub: aioredis.client.PubSub, job_id: str) -> None:
        self.channel, self.pubsub, self.job_id = channel, pubsub, job_id
        self.waiters: list[asyncio.Event] = []  # longest waiting first
        self.task: asyncio.Task[None] | None = None

    @classmethod
    async def join(cls, settings: Settings, job_id: str, within: float) -> _Listener | None:
        """The job's listener in this loop, subscribed; None when Redis cannot be reached, or does not
        confirm the subscription within ``within`` seconds."""
        loop = asyncio.get_running_loop()
        channel = news_channel(settings, job_id)
        listeners = cls._by_loop.setdefault(loop, {})
        listener = listeners.get(channel)
        if listener is not None:
            return listener
        pubsub = cls._client(loop, settings).pubsub()
        try:
            async with asyncio.timeout(within):
                await pubsub.subscribe(channel)
        except Exception as exc:  # noqa: BLE001 - without Redis the wait falls back to looking every recheck
            log.warning("could not listen for news of job %s's stream: %s", job_id, exc)
            await _close(pubsub)
            return None
        # Another lease of the same job may have subscribed meanwhile: keep one listener.
        if (existing := listeners.get(channel)) is not None:
            await _close(pubsub)
            return existing
        listener = listeners[channel] = cls(channel, pubsub, job_id)
        listener.task = loop.create_task(listener._read())
        return listener

    @classmethod
    def _client(cls, loop: asyncio.AbstractEventLoop, settings: Settings) -> aioredis.Redis:
        """Connections of the news' own, apart from the short calls' pool. Each read of a subscription names
        its own timeout (``get_message``), so the socket timeout bounds only connecting and subscribing:
        a lease must not wait on a Redis that hangs longer than a short call would (without one, a lease
        waited for as long as Redis hung)."""
        clients = cls._clients.setdefault(loop, {})
        bound = settings.redis_timeout_seconds
        key = f"{settings.redis_url} {bound}"
        if (client := clients.get(key)) is None:
            client = clients[key] = aioredis.Redis.from_url(
                settings.redis_url,
                socket_timeout=bound,
                socket_connect_timeout=bound,
                retry=AsyncRetry(NoBackoff(), 0),
            )
        return client

    def add(self, waiter: asyncio.Event) -> None:
        self.waiters.append(waiter)

    def requeue(self, waiter: asyncio.Event) -> None:
        waiter.clear()
        if waiter in self.waiters:
            self.waiters.remove(waiter)
            self.waiters.append(waiter)

    async def leave(self, waiter: asyncio.Event) -> None:
        if waiter in self.waiters:
            self.waiters.remove(waiter)
        if not self.waiters:
            await self._stop()

    def _deliver(self, news: str) -> None:
        if news == ROOM:
            return  # room under the cap is for waiting workers: it hands no lease anything
        if news == ITEM:
            # The one waiting longest that is not already woken: it looks, and takes the item or leaves it
            # to a recheck (another API process's waiter may have taken it first).
            for waiter in self.waiters:
                if not waiter.is_set():
                    waiter.set()
                    return
            return
        for waiter in self.waiters:
            waiter.set()

    async def _read(self) -> None:
        try:
            while True:
                # A subscription's own confirmation comes back as None here: keep waiting for real news.
                message = await self.pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=RECHECK_SECONDS
                )
                if message is not None:
                    self._deliver(_news_of(message))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the waiters go on by looking every recheck
            log.warning("lost the news of job %s's stream: %s", self.job_id, exc)
            self._forget()
            await _close(self.pubsub)

    def _forget(self) -> None:
        listeners = self._by_loop.get(asyncio.get_running_loop(), {})
        if listeners.get(self.channel) is self:
            del listeners[self.channel]

    async def _stop(self) -> None:
        self._forget()
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # it is going either way
                await self.task
        await _close(self.pubsub)


async def _close(pubsub: aioredis.client.PubSub) -> None:
    """Unsubscribe and hand the connection back to the pool (a broken one is dropped, not reused)."""
    try:
        await pubsub.aclose()
    except Exception as exc:  # noqa: BLE001 - closing a broken connection is no error of the lease
        log.debug("closing the news connection: %s", exc)


def _news_of(message: dict[str, object]) -> str:
    data = message.get("data")
    return data.decode() if isinstance(data, bytes) else str(data)


# --- a worker's wait, blocking ----------------------------------------------------------------------------


def wait_blocking(
    settings: Settings,
    job_id: str,
    seconds: float,
    held_back: Callable[[], bool],
) -> bool:
    """:func:`wait_for` for a thread that may block (a work horse waiting for room under the cap): ask
    ``held_back()`` until it says False, or ``seconds`` have passed, and return its last answer; once at
    once, then on news other than an item's and at least every ``RECHECK_SECONDS``. The subscription is
    confirmed before the first look, so news that comes during a look is read by the next wait, which ends
    at once."""
    if seconds <= 0:
        return held_back()
    deadline = time.monotonic() + seconds
    subscription = _subscribe(settings, job_id, min(seconds, RECHECK_SECONDS))
    try:
        held = held_back()
        while held and (left := deadline - time.monotonic()) > 0:
            subscription = _hear(subscription, job_id, min(left, RECHECK_SECONDS))
            held = held_back()
        return held
    finally:
        if subscription is not None:
            _close_blocking(subscription)


def _subscribe(settings: Settings, job_id: str, within: float) -> PubSub | None:
    """The job's news on a connection of the wait's own
    (:func:`~hsx.server.redis_clients.waiting_connection`), whose socket timeout outlasts each of the wait's
    reads (a recheck at most) by the short calls' bound: a read ends on its own terms, never in a Redis
    timeout, and a Redis that hangs costs connecting and subscribing a recheck and the bound at most. None
    when the subscription is not confirmed within ``within``."""
    pubsub = waiting_connection(settings, RECHECK_SECONDS).pubsub()
    try:
        pubsub.subscribe(news_channel(settings, job_id))
        if pubsub.get_message(timeout=within) is None:
            raise TimeoutError(f"the subscription was not confirmed within {within:g}s")
    except Exception as exc:  # noqa: BLE001 - without Redis the wait falls back to looking every recheck
        log.warning("could not listen for news of job %s's stream: %s", job_id, exc)
        _close_blocking(pubsub)
        return None
    return pubsub


def _hear(subscription: PubSub | None, job_id: str, seconds: float) -> PubSub | None:
    """Return when news that may make room comes, or after ``seconds``. Everything else that has come by
    then is read too, so one look answers all of it. Without a subscription, or once it breaks, just the
    recheck's pause."""
    if subscription is None:
        time.sleep(seconds)
        return None
    until = time.monotonic() + seconds
    try:
        while (left := until - time.monotonic()) > 0:
            message = subscription.get_message(ignore_subscribe_messages=True, timeout=left)
            if message is not None and _news_of(message) != ITEM:
                while subscription.get_message(ignore_subscribe_messages=True, timeout=0.0) is not None:
                    pass
                break
        return subscription
    except Exception as exc:  # noqa: BLE001 - the wait goes on by looking every recheck
        log.warning("lost the news of job %s's stream: %s", job_id, exc)
        _close_blocking(subscription)
        return None


def _close_blocking(pubsub: PubSub) -> None:
    try:
        pubsub.close()
    except Exception as exc:  # noqa: BLE001 - closing a broken connection is no error of the wait
        log.debug("closing the news connection: %s", exc)
