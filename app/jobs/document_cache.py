"""A short-lived cache of rendered job documents, per API process.

Dashboards and ``hsx watch`` poll ``GET /jobs/{id}`` many times a second across a fleet; rendering a job
costs several queries, and the answer changes only as units commit. Within ``ttl`` seconds a poll gets the
bytes the last one rendered. After that, up to ``max_stale`` seconds, a poll still gets them at once while
one rendering for that job runs in the background: a poll never waits on the job table while a job is
watched, which is what keeps the API's tail latency low on a host whose cores the workers keep busy.
Anything this process changes about a job (cancel, retry) drops its entry at once, and a rendering begun
before the change is not kept. Workers' progress reaches pollers at most ``ttl`` plus one rendering late,
and up to ``max_stale`` late while a watched job's renderings are slow.

A single look whose answer must be the job table's (``hsx status``, whose exit code says whether the job is
over) asks with ``Cache-Control: no-cache`` (:func:`wants_fresh`) and gets :meth:`DocumentCache.fresh`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool

_MAX_ENTRIES = 4096


def wants_fresh(cache_control: str | None) -> bool:
    """Whether a request's ``Cache-Control`` asks for the job table's answer rather than a kept one."""
    directives = (cache_control or "").lower().split(",")
    return any(d.strip() in ("no-cache", "no-store", "max-age=0") for d in directives)


class DocumentCache:
    def __init__(self, ttl: float, max_stale: float | None = None) -> None:
        self.ttl = ttl
        self.max_stale = max(ttl, 20 * ttl if max_stale is None else max_stale)
        self._entries: dict[str, tuple[float, bytes]] = {}  # job id -> (rendered at, document)
        self._generations: dict[str, int] = {}  # bumped by forget(): older renderings are not kept
        self._renders: dict[str, asyncio.Task[bytes]] = {}  # at most one rendering per job at a time
        self._lock = threading.Lock()  # forget() comes from sync endpoints, on other threads

    def get(self, job_id: str) -> bytes | None:
        """The document while it is fresh (within ``ttl``), else None."""
        if self.ttl <= 0:
            return None
        with self._lock:
            entry = self._entries.get(job_id)
        if entry is None or time.monotonic() - entry[0] >= self.ttl:
            return None
        return entry[1]

    def put(self, job_id: str, document: bytes, generation: int | None = None) -> None:
        if self.ttl <= 0:
            return
        now = time.monotonic()
        with self._lock:
            if generation is not None and generation != self._generations.get(job_id, 0):
                return  # the job changed through this API while this was rendered
            if len(self._entries) >= _MAX_ENTRIES:
                self._entries = {k: v for k, v in self._entries.items() if now - v[0] < self.max_stale}
            self._entries[job_id] = (now, document)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._entries.pop(job_id, None)
            self._generations[job_id] = self._generations.get(job_id, 0) + 1

    async def fetch(self, job_id: str, render: Callable[[], bytes]) -> bytes:
        """The job's document: fresh from the cache, stale from it while a background rendering runs, or
        rendered now (``render`` runs on a worker thread; its errors reach this caller)."""
        if self.ttl <= 0:
            return await run_in_threadpool(render)
        with self._lock:
            entry = self._entries.get(job_id)
        if entry is not None:
            age = time.monotonic() - entry[0]
            if age < self.ttl:
                return entry[1]
            if age < self.max_stale:
                self._rendering(job_id, render)
                return entry[1]
        # shield: one poller that goes away must not cancel the rendering the others wait for.
        return await asyncio.shield(self._rendering(job_id, render))

    async def fresh(self, job_id: str, render: Callable[[], bytes]) -> bytes:
        """The job's document rendered now, whatever is kept; the polls after it get this rendering."""
        with self._lock:
            generation = self._generations.get(job_id, 0)
        document = await run_in_threadpool(render)
        self.put(job_id, document, generation)
        return document

    def _rendering(self, job_id: str, render: Callable[[], bytes]) -> asyncio.Task[bytes]:
        task = self._renders.get(job_id)
        if task is not None and task.get_loop() is not asyncio.get_running_loop():
            task = None  # left by an event loop that has ended (a test client's); never awaited across loops
        if task is None:
            with self._lock:
                generation = self._generations.get(job_id, 0)
            task = asyncio.create_task(self._render(job_id, render, generation))
            self._renders[job_id] = task
            task.add_done_callback(lambda done: self._rendered(job_id, done))
        return task

    async def _render(self, job_id: str, render: Callable[[], bytes], generation: int) -> bytes:
        document = await run_in_threadpool(render)
        self.put(job_id, document, generation)
        return document

    def _rendered(self, job_id: str, task: asyncio.Task[bytes]) -> None:
        if self._renders.get(job_id) is task:
            del self._renders[job_id]
        if not task.cancelled() and task.exception() is not None:
            # Rendering failed (the job is gone, the database is down): the next poll renders and says so.
            with self._lock:
                self._entries.pop(job_id, None)
