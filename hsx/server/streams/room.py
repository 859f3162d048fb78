"""Room under a consume job's cap, signalled through Redis: an acknowledgement pushes a token, and a worker
that found the cap full blocks on the list for a while instead of leaving the job (a work horse started
afresh for every acknowledgement costs more than the unit it writes). Best effort both ways: the claim rule
in the database decides, a lost token costs a wait, and a worker that gives up is woken by the queue."""

from __future__ import annotations

import logging

from hsx.server.redis_clients import redis_connection, waiting_connection
from hsx.server.settings import Settings

log = logging.getLogger(__name__)

ROOM_PREFIX = "hsx-room-"
# Tokens nobody waited for are dropped after this long, so a later wait is not woken by stale room.
ROOM_TTL_SECONDS = 30


def room_key(settings: Settings, job_id: str) -> str:
    return f"{ROOM_PREFIX}{settings.queue_name}-{job_id}"


def signal_room(settings: Settings, job_id: str, count: int = 1) -> None:
    try:
        redis = redis_connection(settings)
        key = room_key(settings, job_id)
        pipe = redis.pipeline()
        pipe.lpush(key, *(["1"] * max(1, count)))
        pipe.expire(key, ROOM_TTL_SECONDS)
        pipe.execute()
    except Exception as exc:  # noqa: BLE001 - the queue's wake-up and the reconciler cover a lost token
        log.warning("could not signal room for job %s: %s", job_id, exc)


def wait_for_room(settings: Settings, job_id: str, seconds: float) -> bool:
    """Block until an acknowledgement signals room, at most ``seconds``; True when one did. The wait holds a
    connection whose socket timeout outlasts it (:func:`~hsx.server.redis_clients.waiting_connection`): on the
    short calls' pool, a wait longer than their bound ended in a Redis timeout."""
    if seconds <= 0:
        return False
    wait = max(1, round(seconds))
    try:
        redis = waiting_connection(settings, wait)
        return redis.blpop([room_key(settings, job_id)], timeout=wait) is not None
    except Exception as exc:  # noqa: BLE001 - waiting is an optimisation: give the job up, the queue wakes us
        log.warning("could not wait for room in job %s: %s", job_id, exc)
        return False
