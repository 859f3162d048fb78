"""What the stream promises, in one small module the API, the workers and trainers all import (standard
library only): how long a lease may wait at the API for an item, and the retention modes. (The claim rule
that throttles workers under a consume job's cap is the server's: :mod:`hsx.server.streams.budget`.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

# The retention modes (docs/streaming.md), spelled here once: the job option (hsx.server.job_options) takes
# its type from these, and a trainer reads a job document's options against them.
Retention = Literal["keep", "consume"]
KEEP: Retention = "keep"
CONSUME: Retention = "consume"

# A lease waits at most this long for an item before it answers empty: well inside any client's read
# timeout and a proxy's idle one.
LEASE_WAIT_MAX_SECONDS = 30.0
# The clients' default (JobStream, the SpecForge feeder): one call covers most gaps between two commits.
LEASE_WAIT_SECONDS = 10.0
# A waiting lease's answer must come back this long before the client's read timeout runs out.
LEASE_WAIT_MARGIN_SECONDS = 5.0


def lease_wait(seconds: float | None, read_timeout: float) -> float:
    """A client's lease wait, checked: within the API's bound and shorter than the client's own read
    timeout (a wait the client gives up on first would look like an outage). ``None`` takes the default,
    shortened to fit a short read timeout (0, polling, where none fits): a client that only set a short
    timeout must still work; a wait asked for explicitly that does not fit is an error."""
    if seconds is None:
        return max(0.0, min(LEASE_WAIT_SECONDS, read_timeout - LEASE_WAIT_MARGIN_SECONDS))
    if not 0 <= seconds <= LEASE_WAIT_MAX_SECONDS:
        raise ValueError(f"wait_seconds must be within 0 and {LEASE_WAIT_MAX_SECONDS:g}, not {seconds:g}")
    if seconds and seconds + LEASE_WAIT_MARGIN_SECONDS > read_timeout:
        raise ValueError(
            f"wait_seconds {seconds:g} must be at least {LEASE_WAIT_MARGIN_SECONDS:g} s shorter than timeout "
            f"{read_timeout:g}"
        )
    return float(seconds)


def consumes(options: Mapping[str, Any] | None) -> bool:
    """Whether a job's stored options (``GET /jobs/{id}``'s ``options``) ask for ``consume`` retention; a
    job without the option keeps its output, as :class:`hsx.server.job_options.JobOptions` reads it."""
    return (options or {}).get("retention") == CONSUME
