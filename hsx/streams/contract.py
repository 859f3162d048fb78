"""What the stream promises, in one small module the API, the workers and trainers all import (standard
library only): the rule that decides whether a worker may claim another unit, and how long a lease may
wait at the API for an item. (The retention modes are the job option's: :mod:`hsx.job_options`.)"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Budget:
    """A consume job's bytes on disk, as the claim rule counts them. The API records acknowledgements and
    the workers delete acknowledged shards, so a shard counts from its commit until its file is gone."""

    cap_bytes: int
    stored_bytes: int  # committed shards not deleted yet, the acknowledged ones still on disk included
    acked_stored_bytes: int  # of those, acknowledged: the next worker or reconciler pass deletes them
    leased_units: int  # units workers hold now (their shards are being written)
    unit_bytes: int  # what one unit's shard is expected to take

    @property
    def in_flight_bytes(self) -> int:
        return self.leased_units * self.unit_bytes

    @property
    def buffered_bytes(self) -> int:
        """Committed and not acknowledged: what the consumers have yet to take."""
        return self.stored_bytes - self.acked_stored_bytes

    def may_claim(self) -> bool:
        """One more unit fits under the cap, counting every shard still on disk. With nothing stored and
        nothing in flight a unit is always allowed, so a cap smaller than one unit slows the job down to
        one unit at a time, never stops it; while a unit's size is unknown (no projection, no shard yet)
        only that one goes."""
        return self._fits(self.stored_bytes)

    def may_claim_once_deleted(self) -> bool:
        """One more unit would fit once the acknowledged shards are deleted: worth waking a worker for
        (it deletes them before it claims)."""
        return self._fits(self.buffered_bytes)

    def _fits(self, held_bytes: int) -> bool:
        if held_bytes == 0 and self.leased_units == 0:
            return True
        if self.unit_bytes <= 0:
            return False
        return held_bytes + self.in_flight_bytes + self.unit_bytes <= self.cap_bytes
