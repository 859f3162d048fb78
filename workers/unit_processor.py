"""Turns one work unit's records into a validated shard: encode, prefill, check the dump, stream it in.

Prefills run on a pool of threads (``concurrency`` in flight); the calling thread takes finished captures
in sample order and streams each into the shard (:class:`workers.shards.ShardStream`). How far ahead the
prefills may run is bounded by a count and by the bytes of dumps waiting in shared memory, so neither the
worker's memory nor the dump directory grows with the unit.

A capture that fails a check is retried once under a fresh rid, then rejected with its reason; it never
enters a shard. Engine outages are not a sample's fault: they propagate and the job runner decides, and so
does an engine that breaks the protocol (:class:`EngineUnfit`: a reply without ``cached_tokens``, dumps in
another dtype than it reported). A prefill that times out while the engine still answers is sent once
more, then rejected as ``engine_timeout`` (a retriable reason).

What each record is sent as, or why it is rejected before it is sent, is :mod:`workers.sample_encoding`'s.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hsx.contract import RID_PREFIX
from hsx.engine.client import (
    DumpMissing,
    EngineClient,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    EngineUnfit,
)
from hsx.engine.dumps import DumpFile, delete_dump, open_dump, validate_open_dump
from hsx.engine.validation import DTYPE_MISMATCH, ENGINE_TIMEOUT, SampleRejected
from hsx.safetensors_io import DTYPE_SIZES
from hsx.server import telemetry
from hsx.server.ingest import Record
from hsx.server.jobs.repository import ClaimedUnit, LiveCounts
from hsx.server.jobs.unit_results import RejectionRow, TruncationRow
from workers.job_plan import JobPlan
from workers.sample_encoding import SampleEncoder
from workers.shards import ShardInfo, ShardStream

if TYPE_CHECKING:
    from workers.chat import ChatEncoder

log = logging.getLogger(__name__)

SAMPLE_ATTEMPTS = 2


class UnitAborted(Exception):
    """The lease was lost, the job was stopped or the worker is shutting down: drop the unit's work."""


@dataclass
class UnitResult:
    """A unit's results, filled in as it goes (the lease's heartbeat reads :meth:`live` meanwhile)."""

    shard: ShardInfo | None = None
    rejections: list[RejectionRow] = field(default_factory=list)
    truncations: list[TruncationRow] = field(default_factory=list)
    samples_done: int = 0
    tokens: int = 0
    state_bytes: int = 0
    # Where the collecting thread's time went (seconds): waiting for an answer or its dump, copying dumps
    # into the shard, closing the shard; and when the engine answered the unit's last prefill (monotonic).
    # The unit's log line carries them, so a slow job shows whether the engine or the copy held it back.
    # Of the copying, ``write_s`` went to writing the shard (os.write and the write-behind's waits on the
    # disk); of the closing, ``fsync_s`` to its fsync.
    waiting_s: float = 0.0
    copying_s: float = 0.0
    closing_s: float = 0.0
    write_s: float = 0.0
    fsync_s: float = 0.0
    last_answer: float = 0.0

    def live(self) -> LiveCounts:
        return LiveCounts(self.samples_done, len(self.rejections), self.tokens)


@dataclass
class _Pending:
    index: int
    input_ids: list[int]
    loss_mask: list[int]
    future: Future[_Sent | RejectionRow]
    dump_bytes: int
    record_id: str | None = None
    truncation: TruncationRow | None = None


@dataclass(frozen=True)
class _Sent:
    """A prefill the engine answered; its dump may still be on its way."""

    rid: str
    cached_tokens: int
    answered_at: float = 0.0  # time.monotonic()


class UnitProcessor:
    def __init__(self, client: EngineClient, plan: JobPlan, chat: Callable[[], ChatEncoder]) -> None:
        self.client = client
        self.plan = plan
        self.info = plan.info
        self.encoder = SampleEncoder(plan, chat)
        self.dump_dir = plan.dump_dir
        self.concurrency = plan.concurrency
        self.dtype = plan.state_dtype
        self.tensors = plan.tensors
        self.bytes_per_token = self.info.hidden_size * DTYPE_SIZES[self.dtype] * len(self.tensors)
        self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="prefill")

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def process(
        self,
        unit: ClaimedUnit,
        records: Iterable[tuple[int, Record, str | None]],
        staged_path: Path,
        should_stop: Callable[[], bool],
        result: UnitResult | None = None,
    ) -> UnitResult:
        """Encode, prefill, check and stream every ``(index, record, record_id)`` into one shard."""
        result = UnitResult() if result is None else result
        window: collections.deque[_Pending] = collections.deque()
        stream: ShardStream | None = None
        inflight = 0
        try:
            for index, raw, record_id in records:
                if should_stop():
                    raise UnitAborted("lease lost or job stopped")
                encoded = self.encoder.encode(index, raw, record_id)
                if isinstance(encoded, RejectionRow):
                    result.rejections.append(encoded)
                    continue
                ids = encoded.input_ids
                size = len(ids) * self.bytes_per_token
                # Bounded look-ahead: each finished capture waits in shared memory until it is streamed.
                while window and (
                    len(window) >= 4 * self.concurrency or inflight + size > self.plan.max_inflight_dump_bytes
                ):
                    pending = window.popleft()
                    inflight -= pending.dump_bytes
                    stream = self._collect(pending, result, stream, unit, staged_path)
                future = self.pool.submit(self._prefill, unit, index, ids, record_id)
                window.append(
                    _Pending(index, ids, encoded.loss_mask, future, size, record_id, encoded.truncation)
                )
                inflight += size
            while window:
                if should_stop():
                    raise UnitAborted("lease lost or job stopped")
                stream = self._collect(window.popleft(), result, stream, unit, staged_path)
            if stream is not None:
                closing = time.monotonic()
                try:
                    result.shard = stream.finish()
                finally:
                    result.closing_s += time.monotonic() - closing
                    result.write_s, result.fsync_s = stream.write_s, stream.fsync_s
        except BaseException:
            for pending in window:
                pending.future.cancel()
            for pending in window:
                with contextlib.suppress(BaseException):
                    outcome = pending.future.result()
                    if isinstance(outcome, _Sent):
                        delete_dump(self.dump_dir, outcome.rid)
            if stream is not None:
                stream.discard()
            raise
        result.rejections.sort(key=lambda r: r.sample_index)
        return result

    def _collect(
        self,
        pending: _Pending,
        result: UnitResult,
        stream: ShardStream | None,
        unit: ClaimedUnit,
        staged_path: Path,
    ) -> ShardStream | None:
        waiting = time.monotonic()
        sent = pending.future.result()
        if isinstance(sent, _Sent):
            result.last_answer = max(result.last_answer, sent.answered_at)
        outcome = self._dump_of(unit, pending, sent)
        copying = time.monotonic()
        result.waiting_s += copying - waiting
        if isinstance(outcome, RejectionRow):
            result.rejections.append(outcome)
            return stream
        try:
            if stream is None:
                stream = ShardStream(
                    staged_path,
                    dtype=self.dtype,
                    dump_tensors=self.tensors,
                    capacity=unit.sample_end - unit.sample_start,
                    write_behind=self.plan.write_behind,
                    store_fp8=self.plan.store_fp8,
                )
            counted = outcome.meta.non_finite is not None and all(
                name in outcome.meta.non_finite for name in self.tensors
            )
            copied = stream.add(
                pending.index,
                np.asarray(pending.input_ids, dtype=np.int32),
                np.asarray(pending.loss_mask, dtype=np.uint8),
                outcome.fd,
                outcome.state_specs(),
                check_every_chunk=not counted,
            )
        except SampleRejected as exc:
            result.rejections.append(RejectionRow(pending.index, exc.reason, exc.detail, pending.record_id))
            return stream
        except BaseException:
            if stream is not None:  # made here, so the caller does not know it yet
                stream.discard()
            raise
        finally:
            self._drop(outcome)
            result.copying_s += time.monotonic() - copying
            if stream is not None:
                result.write_s = stream.write_s
        if pending.truncation is not None:
            result.truncations.append(pending.truncation)
        result.tokens += len(pending.input_ids)
        result.state_bytes += copied
        result.samples_done += 1
        return stream

    def _drop(self, dump: DumpFile) -> None:
        dump.close()
        delete_dump(self.dump_dir, dump.meta.rid)

    def _prefill(
        self, unit: ClaimedUnit, index: int, ids: list[int], record_id: str | None = None
    ) -> _Sent | RejectionRow:
        """On a prefill thread: send the prompt and return as soon as the engine answers. Waiting for the
        dump happens in order on the collecting thread, so these threads keep the engine busy."""
        rid = (
            f"{RID_PREFIX}{unit.job_id[:8]}-u{unit.unit_index}a{unit.attempt}-s{index}-{uuid.uuid4().hex[:8]}"
        )
        extra_key = rid if self.plan.cache_namespace_per_request else None
        started = time.monotonic()
        try:
            response = self.client.prefill(ids, rid, extra_key=extra_key)
        except EngineRejected as exc:
            telemetry.engine_error("rejected")
            return RejectionRow(index, "engine_rejected", str(exc), record_id)
        except EngineTimeout as exc:
            telemetry.engine_error("timeout")
            if not self.client.alive():
                raise EngineUnavailable(f"{exc}; the engine no longer answers") from exc
            # The engine answers, so this prompt is what it is stuck on: this sample's problem.
            return RejectionRow(index, ENGINE_TIMEOUT, str(exc), record_id)
        finally:
            telemetry.engine_request(time.monotonic() - started)
        return _Sent(rid, reported_cached_tokens(response), time.monotonic())

    def _dump_of(
        self, unit: ClaimedUnit, pending: _Pending, sent: _Sent | RejectionRow
    ) -> DumpFile | RejectionRow:
        """The checked dump of a prefill; a capture that fails a check is sent once more under a new rid
        (here, synchronously: it is rare), then rejected with the reason of its last try."""
        last = SampleRejected("dump_missing", "no attempt made")
        for attempt in range(SAMPLE_ATTEMPTS):
            if attempt:
                sent = self._prefill(unit, pending.index, pending.input_ids, pending.record_id)
            if isinstance(sent, RejectionRow):
                if sent.reason != ENGINE_TIMEOUT:
                    return sent
                last = SampleRejected(sent.reason, sent.detail)
                telemetry.sample_retried(last.reason)
                continue
            opened = self._open_checked(pending, sent)
            if isinstance(opened, DumpFile):
                return opened
            last = opened
            telemetry.sample_retried(last.reason)
            log.info("sample %s: %s (%s)", pending.index, last.reason, last.detail)
        return RejectionRow(pending.index, last.reason, last.detail, pending.record_id)

    def _open_checked(self, pending: _Pending, sent: _Sent) -> DumpFile | SampleRejected:
        dump: DumpFile | None = None
        started = time.monotonic()
        try:
            dump = open_dump(self.dump_dir, sent.rid, self.plan.dump_wait_seconds)
            telemetry.dump_wait(time.monotonic() - started)
            failure = validate_open_dump(dump, pending.input_ids, sent.cached_tokens, self.info).first_failure
            if failure is None:
                return dump
            if failure.reason == DTYPE_MISMATCH:
                # Every dump of this engine will be so: its states are not what it says they are.
                raise EngineUnfit(failure.detail)
            raise SampleRejected(failure.reason or DTYPE_MISMATCH, failure.detail)
        except DumpMissing as exc:
            problem = SampleRejected("dump_missing", str(exc))
        except SampleRejected as exc:
            problem = exc
        except BaseException:
            if dump is not None:
                dump.close()
            delete_dump(self.dump_dir, sent.rid)
            raise
        if dump is not None:
            dump.close()
        delete_dump(self.dump_dir, sent.rid)
        return problem


def reported_cached_tokens(response: dict[str, object]) -> int:
    """``meta_info.cached_tokens`` of a ``/generate`` reply. Its absence is the engine's fault, never 0:
    without it, a prefix-cache hit could not be told from a full prefill."""
    meta_info = response.get("meta_info")
    value = meta_info.get("cached_tokens") if isinstance(meta_info, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise EngineUnfit(
            f"the engine's /generate reply has no usable meta_info.cached_tokens ({value!r}): "
            "a reused cached prefix could not be detected"
        )
    return value
