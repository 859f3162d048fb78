"""What the stream promises, in one small module the API, the workers and trainers all import (standard
library only): the retention modes, and the rule that decides whether a worker may claim another unit."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

Retention = Literal["keep", "consume"]
KEEP: Retention = "keep"
CONSUME: Retention = "consume"


class ClaimWait(enum.Enum):
    """What a claim answers when a consume job's byte cap holds its next unit back."""

    CONSUMERS = "consumers"


@dataclass(frozen=True)
class Budget:
    """A consume job's bytes on disk, as the claim rule counts them."""

    cap_bytes: int
    buffered_bytes: int  # committed shards not acknowledged yet
    leased_units: int  # units workers hold now (their shards are being written)
    unit_bytes: int  # what one unit's shard is expected to take

    @property
    def in_flight_bytes(self) -> int:
        return self.leased_units * self.unit_bytes

    def may_claim(self) -> bool:
        """One more unit fits under the cap. With nothing buffered and nothing in flight a unit is always
        allowed, so a cap smaller than one unit slows the job down to one unit at a time, never stops it;
        while a unit's size is unknown (no projection, no shard yet) only that one goes."""
        if self.buffered_bytes == 0 and self.leased_units == 0:
            return True
        if self.unit_bytes <= 0:
            return False
        return self.buffered_bytes + self.in_flight_bytes + self.unit_bytes <= self.cap_bytes
