"""A process's Redis connections, three kinds, so that a Redis that hangs costs each caller a known time.

* **Short calls** (a wake-up enqueued, stream news published, a readiness ping, a scrape):
  :func:`redis_connection`, one pool per URL and bound in a process. Connecting and each reply are cut at
  ``HSX_REDIS_TIMEOUT_SECONDS`` and nothing is retried, so a call to a Redis that does not answer fails
  after that long, and its caller degrades as it does for any Redis error (the job table decides; the
  reconciler and the table re-reads make up for a lost signal). The pool's socket timeout is pinned: RQ's
  ``Worker`` raises the socket timeout of the pool of any connection it is handed to its dequeue wait (415 s
  by default, ``Worker._set_connection``), and it is handed ours by ``Worker.all`` when counting idle
  workers; a horse forked afterwards inherits the pool's settings too.
* **Blocking waits** (a worker listening for its job's stream news while it waits for room under a consume
  job's cap): :func:`waiting_connection`, on connections of their own whose socket timeout is the longest
  read of the wait plus the bound, so a wait ends on its own terms, with no Redis timeout, however long
  the setting asks for.
* **RQ's own** (the worker's blocking pop for wake-ups, its heartbeats and command channel):
  :func:`rq_connection`, a fresh pool that RQ sets as it needs. RQ's calls on it may wait out a hung Redis
  (an idle worker's pop, a horse's start and end), and go on once it answers; the work in a horse never
  waits on them.

Stream news (:mod:`hsx.server.streams.news`) is heard by waiting leases in the API through redis' asyncio
client, on connections of its own: each read of a subscription names its own timeout, and connecting and
subscribing are bounded as a short call is.
"""

from __future__ import annotations

import threading
from typing import Any

from redis import ConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from hsx.server.settings import Settings

# The one key of a short-call pool's connection arguments that nobody may change after it is made.
_PINNED = "socket_timeout"


class _PinnedTimeout(dict[str, Any]):
    """A pool's connection arguments whose socket timeout stays what the pool was made with. Only writes
    through ``update`` and item assignment reach here: that is how RQ (and redis-py itself, for other keys)
    change a pool's arguments."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key != _PINNED:
            super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


_POOLS: dict[tuple[str, float, float], ConnectionPool] = {}
_POOLS_LOCK = threading.Lock()


def _no_retry() -> Retry:
    # Stated explicitly: a retried call would cost a multiple of the bound.
    return Retry(NoBackoff(), 0)


def _pool(url: str, socket_timeout: float, connect_timeout: float) -> ConnectionPool:
    """The process's pool for these arguments, made once, its socket timeout pinned. A fresh pool a call
    cost the API a TCP connect (and its teardown) for every wake-up and stream news an
    acknowledgement sends (about 14 ms of CPU a stream request, bench/RESULTS.md). redis-py's pool notices
    a fork and starts empty in the child, so a work horse never shares its parent's sockets."""
    key = (url, socket_timeout, connect_timeout)
    pool = _POOLS.get(key)
    if pool is None:
        with _POOLS_LOCK:
            pool = _POOLS.get(key)
            if pool is None:
                pool = ConnectionPool.from_url(
                    url,
                    socket_timeout=socket_timeout,
                    socket_connect_timeout=connect_timeout,
                    retry=_no_retry(),
                )
                pool.connection_kwargs = _PinnedTimeout(pool.connection_kwargs)
                _POOLS[key] = pool
    return pool


def redis_connection(settings: Settings) -> Redis:
    """A client for short calls: each gives up after ``HSX_REDIS_TIMEOUT_SECONDS`` of silence, whatever
    RQ has done in this process. Never for a blocking command (BLPOP, a subscription's reads)."""
    bound = settings.redis_timeout_seconds
    return Redis(connection_pool=_pool(settings.redis_url, bound, bound))


def waiting_timeout(settings: Settings, wait_seconds: float) -> float:
    """The socket timeout of a connection that serves a blocking wait of ``wait_seconds``: the wait, plus
    the bound for the reply that ends it."""
    return float(wait_seconds) + settings.redis_timeout_seconds


def waiting_connection(settings: Settings, wait_seconds: float) -> Redis:
    """A client for a blocking command that waits up to ``wait_seconds`` on the server, on a pool apart
    from the short calls' (one per wait length: the setting's, in practice)."""
    timeout = waiting_timeout(settings, wait_seconds)
    return Redis(connection_pool=_pool(settings.redis_url, timeout, settings.redis_timeout_seconds))


def rq_connection(settings: Settings) -> Redis:
    """A connection for RQ's ``Worker``, on a pool of its own made for each worker loop: RQ raises its
    socket timeout to 10 s above its blocking pop (to 415 s by default), which it may, since nothing else
    uses it. Connecting is bounded as a short call is."""
    return Redis(
        connection_pool=ConnectionPool.from_url(
            settings.redis_url, socket_connect_timeout=settings.redis_timeout_seconds, retry=_no_retry()
        )
    )
