"""Turns one work unit's samples into a validated shard: encode, prefill, read the dump, validate, append.

A sample that fails validation is retried once under a fresh rid, then rejected with its reason; it never
enters a shard. Engine outages are not a sample's fault: they propagate and the job runner decides.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from hsx.contract import RID_PREFIX, EngineInfo
from hsx.jobs.repository import ClaimedUnit, RejectionRow
from workers.chat import ChatEncoder, EncodeError
from workers.dataset import RawSample, RecordFormat, SampleError, iter_samples
from workers.engine_client import Dump, DumpMissing, EngineClient, EngineRejected
from workers.shards import ShardBuilder
from workers.validation import SampleRejected, validate_dump

log = logging.getLogger(__name__)

SAMPLE_ATTEMPTS = 2


class UnitAborted(Exception):
    """The lease was lost, the job was stopped or the worker is shutting down: drop the unit's work."""


@dataclass
class UnitResult:
    builder: ShardBuilder
    rejections: list[RejectionRow] = field(default_factory=list)
    samples_done: int = 0
    tokens: int = 0


@dataclass
class PendingSample:
    index: int
    input_ids: list[int]
    loss_mask: list[int]
    future: Future[Dump | RejectionRow]


class UnitProcessor:
    def __init__(
        self,
        client: EngineClient,
        info: EngineInfo,
        encoder: ChatEncoder,
        dump_dir: str,
        dump_wait_seconds: float,
        concurrency: int,
        namespace_cache_per_request: bool,
    ) -> None:
        self.client = client
        self.info = info
        self.encoder = encoder
        self.dump_dir = dump_dir
        self.dump_wait_seconds = dump_wait_seconds
        self.concurrency = max(1, concurrency)
        self.namespace_cache_per_request = namespace_cache_per_request

    def new_builder(self) -> ShardBuilder:
        aux = self.info.hf_indices[:-1]
        return ShardBuilder(self.info.hidden_size, self.info.dtype, aux, self.info.hf_indices[-1])

    def process(
        self,
        unit: ClaimedUnit,
        dataset_path: str,
        record_format: RecordFormat,
        should_stop: Callable[[], bool],
    ) -> UnitResult:
        result = UnitResult(builder=self.new_builder())
        window: list[PendingSample] = []
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="prefill") as pool:
            try:
                for index, raw in iter_samples(
                    dataset_path, unit.sample_start, unit.sample_end, record_format=record_format
                ):
                    if should_stop():
                        raise UnitAborted("lease lost or job stopped")
                    encoded = self._encode(index, raw)
                    if isinstance(encoded, RejectionRow):
                        result.rejections.append(encoded)
                        continue
                    ids, mask = encoded
                    fut = pool.submit(self._capture, unit, index, ids)
                    window.append(PendingSample(index, ids, mask, fut))
                    # Keep a bounded number of dumps in flight: each one holds the sample's states in memory.
                    while len(window) >= 2 * self.concurrency:
                        self._collect(window.pop(0), result)
                while window:
                    self._collect(window.pop(0), result)
            except BaseException:
                for pending in window:
                    pending.future.cancel()
                raise
        result.rejections.sort(key=lambda r: r.sample_index)
        return result

    def _encode(self, index: int, raw: RawSample) -> tuple[list[int], list[int]] | RejectionRow:
        if isinstance(raw, SampleError):
            return RejectionRow(index, raw.reason, raw.detail)
        try:
            sample = self.encoder.encode(raw)
        except EncodeError as exc:
            return RejectionRow(index, exc.reason, exc.detail)
        return sample.input_ids, sample.loss_mask

    def _collect(self, pending: PendingSample, result: UnitResult) -> None:
        outcome = pending.future.result()
        if isinstance(outcome, RejectionRow):
            result.rejections.append(outcome)
            return
        result.builder.add(pending.index, pending.input_ids, pending.loss_mask, outcome.states)
        result.samples_done += 1
        result.tokens += len(pending.input_ids)

    def _capture(self, unit: ClaimedUnit, index: int, ids: list[int]) -> Dump | RejectionRow:
        last: SampleRejected | None = None
        for _ in range(SAMPLE_ATTEMPTS):
            rid = (
                f"{RID_PREFIX}{unit.job_id[:8]}-u{unit.unit_index}a{unit.attempt}"
                f"-s{index}-{uuid.uuid4().hex[:8]}"
            )
            extra_key = rid if self.namespace_cache_per_request else None
            try:
                response = self.client.prefill(ids, rid, extra_key=extra_key)
            except EngineRejected as exc:
                return RejectionRow(index, "engine_rejected", str(exc))
            try:
                meta_info = response.get("meta_info", {})
                dump = self.client.read_dump(self.dump_dir, rid, self.dump_wait_seconds)
                validate_dump(
                    dump,
                    ids,
                    int(meta_info.get("cached_tokens", 0) or 0),
                    self.info.hf_indices,
                    self.info.hidden_size,
                )
                return dump
            except DumpMissing as exc:
                last = SampleRejected("dump_missing", str(exc))
                log.info("sample %s: no dump for %s: %s", index, rid, exc)
            except SampleRejected as exc:
                last = exc
                log.info("sample %s attempt failed validation: %s (%s)", index, exc.reason, exc.detail)
            finally:
                self.client.delete_dump(self.dump_dir, rid)
        assert last is not None
        return RejectionRow(index, last.reason, last.detail)
