"""The claim rule of a consume job: whether a worker may claim another unit under the job's byte cap,
counting what is on disk and in flight (docs/streaming.md)."""

from __future__ import annotations

from dataclasses import dataclass


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
