"""One API call as every stream client makes it (the trainer's JobStream, the SpecForge feeder): an
unreachable API or a 5xx is retried with backoff for a bounded outage window, a 4xx raises at once.
Retrying is safe on every stream route: a repeated acknowledgement is accepted once, and a lease whose
answer was lost is handed back through ``seen`` (docs/streaming.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx

log = logging.getLogger(__name__)

# An API back from a restart is found within this long.
MAX_PAUSE_SECONDS = 2.0


def call_api(
    client: httpx.Client,
    method: str,
    url: str,
    body: Mapping[str, Any] | None,
    outage_seconds: float,
    error: type[Exception],
) -> Any:
    """The answer's JSON (None for an empty body); raises ``error`` on a 4xx, or once the API has failed
    (connection errors, 5xx) for ``outage_seconds``."""
    deadline = time.monotonic() + outage_seconds
    pause = 0.2
    while True:
        try:
            resp = client.request(method, url, json=body)
        except httpx.TransportError as exc:
            failure = f"{exc.__class__.__name__}: {exc}"
        else:
            if resp.status_code < 400:
                return resp.json() if resp.content else None
            if resp.status_code < 500:
                raise error(f"{method} {url}: {resp.status_code} {resp.text[:500]}")
            failure = f"{resp.status_code} {resp.text[:500]}"
        if time.monotonic() + pause > deadline:
            raise error(f"{method} {url}: the API failed for {outage_seconds:.0f} s: {failure}")
        log.warning("%s %s failed (%s); retrying in %.1f s", method, url, failure, pause)
        time.sleep(pause)
        pause = min(pause * 2, MAX_PAUSE_SECONDS)
