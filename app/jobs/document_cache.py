"""A short-lived cache of rendered job documents, per API process.

Dashboards and ``hsx watch`` poll ``GET /jobs/{id}`` many times a second across a fleet; rendering a job
costs several queries, and the answer changes only as units commit. Within ``ttl`` seconds a poll gets the
bytes the last one rendered; anything this process changes about a job (cancel, retry) drops its entry at
once. Workers' progress reaches pollers at most ``ttl`` late.
"""

from __future__ import annotations

import threading
import time

_MAX_ENTRIES = 4096


class DocumentCache:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._entries: dict[str, tuple[float, bytes]] = {}
        self._lock = threading.Lock()

    def get(self, job_id: str) -> bytes | None:
        if self.ttl <= 0:
            return None
        with self._lock:
            entry = self._entries.get(job_id)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, job_id: str, document: bytes) -> None:
        if self.ttl <= 0:
            return
        now = time.monotonic()
        with self._lock:
            if len(self._entries) >= _MAX_ENTRIES:
                self._entries = {k: v for k, v in self._entries.items() if v[0] >= now}
            self._entries[job_id] = (now + self.ttl, document)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._entries.pop(job_id, None)
