"""The one retry policy: how often and after what pause a failed call is tried again.

The engine client (an engine that does not answer, or answers 5xx) and the workers' database calls (a
PostgreSQL restart) both ride out a brief outage with it; each says which failures are worth another try.
Only calls that are idempotent or fenced are retried, so a second try never does the work twice.
Standard library only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; the pause before try ``k`` (from 1) is ``base_delay * 2**(k-1)``, at most
    ``max_delay`` seconds."""

    attempts: int
    base_delay: float
    max_delay: float

    def pause(self, retry: int) -> float:
        """The pause before the ``retry``-th retry (1 for the first)."""
        return float(min(max(0.0, self.base_delay) * 2.0 ** (retry - 1), self.max_delay))

    def call(
        self,
        fn: Callable[[], T],
        retry_on: tuple[type[BaseException], ...],
        what: str,
        sleep: Callable[[float], None] = time.sleep,
    ) -> T:
        """``fn()``, tried again after a failure of one of ``retry_on``; the last failure is raised."""
        tries = max(1, self.attempts)
        for attempt in range(tries):
            try:
                return fn()
            except retry_on as exc:
                if attempt == tries - 1:
                    raise
                delay = self.pause(attempt + 1)
                log.warning(
                    "%s failed (%s: %s); retry %d in %.1fs", what, type(exc).__name__, exc, attempt + 1, delay
                )
                sleep(delay)
        raise AssertionError("unreachable")


# A database restart takes seconds to a minute: about a minute of tries in all.
DATABASE = RetryPolicy(attempts=8, base_delay=0.5, max_delay=8.0)


def engine_policy(retries: int, backoff: float) -> RetryPolicy:
    """The engine client's: ``retries`` retries after the first try (HSX_ENGINE_RETRIES)."""
    return RetryPolicy(attempts=max(0, retries) + 1, base_delay=backoff, max_delay=30.0)
