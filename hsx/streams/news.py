"""A stream's news, through Redis pub/sub: what may change a lease's answer (a unit's commit, which adds an
item; an acknowledgement or a consumer leaving, which may end another reader's stream or free items; the
job ending). A lease that finds nothing waits for news instead of being polled: a consumer polling every
20 ms cost the API 7 to 10 times a keep job's CPU in empty leases (bench/RESULTS.md, issue 26).

Best effort both ways, as the room signal is (:mod:`hsx.streams.room`): news is only a reason to look
again, the table decides, and a waiting lease looks again at least every ``RECHECK_SECONDS`` whatever it
hears, so lost news, a lease that ran out and a job that failed are all seen within that."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis import asyncio as aioredis

from hsx.jobs.queue import redis_connection
from hsx.settings import Settings

log = logging.getLogger(__name__)

NEWS_PREFIX = "hsx-stream-news-"
# How long a waiting lease trusts the news: at most this long between two reads of the table.
RECHECK_SECONDS = 1.0

Answer = TypeVar("Answer")

# One asyncio client (and so one connection pool) per event loop and URL: a waiting lease's subscription
# borrows a connection from it and gives it back, instead of connecting afresh every lease.
_ASYNC_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, aioredis.Redis]] = (
    weakref.WeakKeyDictionary()
)


def news_channel(settings: Settings, job_id: str) -> str:
    return f"{NEWS_PREFIX}{settings.queue_name}-{job_id}"


def announce(settings: Settings, job_id: str) -> None:
    """Tell the job's waiting leases to look again. Call it after the change has committed."""
    try:
        redis_connection(settings).publish(news_channel(settings, job_id), "1")
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
    then on each piece of news and at least every ``RECHECK_SECONDS``. The channel is joined before the
    first look, so news that comes between a look and the wait is not missed."""
    deadline = time.monotonic() + seconds
    pubsub = _async_client(settings.redis_url).pubsub()
    try:
        try:
            await pubsub.subscribe(news_channel(settings, job_id))
            listening = True
        except Exception as exc:  # noqa: BLE001 - without Redis the wait falls back to looking every recheck
            log.warning("could not listen for news of job %s's stream: %s", job_id, exc)
            listening = False
        answer = await look()
        while worth_waiting(answer) and (left := deadline - time.monotonic()) > 0:
            pause = min(left, RECHECK_SECONDS)
            if listening:
                listening = await _next_news(pubsub, pause, job_id)
            else:
                await asyncio.sleep(pause)
            answer = await look()
        return answer
    finally:
        await _close(pubsub)


async def _next_news(pubsub: aioredis.client.PubSub, seconds: float, job_id: str) -> bool:
    """Wait for one message, at most ``seconds``. False when the connection broke (stop listening)."""
    end = time.monotonic() + seconds
    try:
        while (left := end - time.monotonic()) > 0:
            # A subscription's own confirmation comes back as None here: keep waiting for real news.
            if await pubsub.get_message(ignore_subscribe_messages=True, timeout=left) is not None:
                return True
        return True
    except Exception as exc:  # noqa: BLE001 - the wait goes on by looking every recheck
        log.warning("lost the news of job %s's stream: %s", job_id, exc)
        await asyncio.sleep(max(end - time.monotonic(), 0.0))
        return False


def _async_client(url: str) -> aioredis.Redis:
    # Keyed by the loop itself, held weakly: a pool's connections belong to the loop that opened them, and a
    # loop that is gone (a test's, a restarted server's) takes its clients with it.
    clients = _ASYNC_CLIENTS.setdefault(asyncio.get_running_loop(), {})
    client = clients.get(url)
    if client is None:
        client = clients[url] = aioredis.Redis.from_url(url, socket_connect_timeout=5)
    return client


async def _close(pubsub: aioredis.client.PubSub) -> None:
    """Unsubscribe and hand the connection back to the pool (a broken one is dropped, not reused)."""
    try:
        await pubsub.aclose()
    except Exception as exc:  # noqa: BLE001 - closing a broken connection is no error of the lease
        log.debug("closing the news connection: %s", exc)
