"""Request and response shapes of the stream routes (docs/streaming.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hsx.streams.contract import LEASE_WAIT_MAX_SECONDS

# Item ids and deliveries are 32-bit columns: a larger number names no item, and is refused as input
# rather than reaching the database (PostgreSQL would answer "integer out of range").
ROW_INT_MAX = 2**31 - 1
# A lease names at most this many received deliveries (a consumer holds far fewer at once).
SEEN_MAX = 1000
# The answers are read from the stream library's own types by attribute (hsx.server.streams.views'
# ConsumerView, hsx.server.streams.service's LeaseAnswer, AckAnswer and StreamStatus,
# hsx.server.streams.repository's LeasedItem): a field is named once, there, and described here.
_FROM_LIBRARY = ConfigDict(from_attributes=True)


class ConsumerCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field("consumer", min_length=1, max_length=200, description="Shown on the job: rank, host.")
    group: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="One trainer's consumers (every rank and DataLoader worker) share a group; the stream "
        "ends for them once every shard is acknowledged or leased within it. Default: a group of its own.",
    )
    lease_seconds: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="How long a leased item stays this consumer's without an acknowledgement; default "
        "HSX_STREAM_LEASE_SECONDS. Longer than the slowest optimizer step over one item.",
    )


class ConsumerOut(BaseModel):
    model_config = _FROM_LIBRARY

    id: str
    job_id: str
    name: str
    group: str
    lease_seconds: float
    leased_items: int = Field(description="Items it holds under a live lease.")
    leased_bytes: int
    items_acked: int
    bytes_acked: int
    idle_seconds: float = Field(description="Since its last lease or acknowledgement call.")


class ConsumerPage(BaseModel):
    items: list[ConsumerOut]


class Delivery(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: int = Field(ge=1, le=ROW_INT_MAX)
    delivery: int = Field(ge=1, le=ROW_INT_MAX)


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    max_items: int = Field(1, ge=1, le=1000)
    seen: list[Delivery] | None = Field(
        None,
        max_length=SEEN_MAX,
        description="The deliveries this consumer has received and may still hold. Given (even empty), the "
        "items it holds under a live lease but is not listed here come first in the answer, the same "
        "delivery with its lease renewed: a lease whose answer was lost (a restart, a cut connection) is "
        "handed over at once rather than when it runs out. Left out: only new leases.",
    )
    wait_seconds: float = Field(
        0.0,
        ge=0.0,
        le=LEASE_WAIT_MAX_SECONDS,
        description="With nothing to hand out, wait up to this long for an item (a unit's commit, a lease "
        "running out, another reader leaving) or the stream's end before answering, instead of answering "
        "empty at once: a consumer that waits here need not poll. 0: answer at once.",
    )


class LeasedItemOut(BaseModel):
    model_config = _FROM_LIBRARY

    id: int
    delivery: int = Field(description="Name it when acknowledging: a later delivery of the item is another.")
    unit_index: int
    path: str = Field(description="On the workers' filesystem (read it where that is shared).")
    uri: str | None = Field(
        None,
        description="s3://bucket/key of the shard in the job's object store (HSX_OUTPUT_URI): an item of "
        "such a job is handed out only once its object is there.",
    )
    sha256: str = Field(description="Of the shard's data section (docs/format.md).")
    header_sha256: str | None = Field(description="Of its length prefix and header.")
    bytes: int
    samples: int
    tokens: int
    lease_expires: float = Field(description="Epoch seconds.")


class LeaseOut(BaseModel):
    model_config = _FROM_LIBRARY

    job_state: str
    items: list[LeasedItemOut]
    end_of_stream: bool = Field(
        description="The job succeeded and every shard is acknowledged or leased to this consumer's group."
    )
    error: str | None = Field(None, description="Why the job failed or was cancelled.")


class AckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    items: list[Delivery] = Field(min_length=1, max_length=1000)


class RefusedAck(BaseModel):
    model_config = _FROM_LIBRARY

    id: int
    delivery: int
    reason: str


class AckOut(BaseModel):
    model_config = _FROM_LIBRARY

    acked: list[int] = Field(description="Items whose named delivery is acknowledged now.")
    repeated: list[int] = Field(
        description="Of acked: deliveries this consumer had acknowledged in an earlier call (a retry whose "
        "answer was lost); accepted, not counted again."
    )
    refused: list[RefusedAck] = Field(
        description="Deliveries this consumer does not hold (an older delivery of the item, or one leased "
        "to another consumer after this lease ran out)."
    )


class StreamConsumerStatus(BaseModel):
    model_config = _FROM_LIBRARY

    id: str
    name: str
    leased_items: int
    leased_bytes: int
    items_acked: int
    idle_seconds: float


class StreamStatus(BaseModel):
    model_config = _FROM_LIBRARY

    retention: str
    cap_bytes: int | None = Field(description="consume: the byte cap; keep: none.")
    buffered_bytes: int = Field(description="Committed and not acknowledged.")
    stored_bytes: int = Field(
        description="Committed and not deleted yet: on the workers' disk, acknowledged shards the workers "
        "have yet to delete included. The cap counts these plus the units in flight."
    )
    in_flight_bytes: int = Field(description="Units workers hold now, at the expected unit size.")
    unit_bytes: int = Field(description="What one unit's shard is expected to take.")
    waiting_on_consumers: bool = Field(description="Work is left, and the cap holds it until consumers ack.")
    items_ready: int
    items_leased: int
    items_acked: int
    lag_bytes: int = Field(description="Committed bytes no consumer holds yet.")
    consumers: list[StreamConsumerStatus]
