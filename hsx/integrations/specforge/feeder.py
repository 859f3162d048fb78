"""``hsx feed specforge JOB``: feed a running hsx job into SpecForge 0.2.0's own disaggregated stream,
so SpecForge's online consumer trains from it with no hsx code on its side (layout:
:mod:`hsx.integrations.specforge.feed_layout`; docs/streaming.md, "SpecForge's own stream").

The feeder is an hsx stream consumer like any trainer. It leases one committed shard at a time, writes
each sample's features into the shared feature directory, appends the samples' refs to the channel, and
acknowledges the shard to hsx only once the trainer is done with every sample of it: the sample's position
in the channel is below the trainer's consumed counter, or its feature file is gone (released). Until then
the shard stays leased, so its bytes count against the job's cap. The feeder leases no more while
``window`` refs are appended but not consumed, so SpecForge's backpressure holds hsx's workers back
exactly as a slow hsx consumer does.

A failed or cancelled job becomes the channel's ``.failed`` sentinel (the trainer raises); a succeeded
one, once every shard is fed, ``.closed`` (the trainer ends when drained). Given the trainer's YAML, the
feeder writes the schedule ``specforge train`` waits for (:mod:`hsx.integrations.specforge.schedule`). A
restarted feeder continues the same channel: refs already appended are not appended again, and the old
hsx consumer's leases are handed back first so its shards come back at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hsx.integrations.specforge import feed_layout as layout
from hsx.integrations.specforge.feed_args import DEFAULT_LEASE_SECONDS, DEFAULT_WINDOW, resolve_target
from hsx.integrations.specforge.schedule import (
    SCHEDULE_SUFFIX,
    TrainerConfigError,
    TrainerRun,
    dtype_problem,
    num_prompts,
    schedule_record,
)
from hsx.manifest import Manifest
from hsx.streams.api_calls import call_api
from hsx.streams.contract import LEASE_WAIT_MAX_SECONDS
from hsx.streams.reader import item_samples, manifest_for

log = logging.getLogger(__name__)

# How often the feeder reads the job's document while it streams: rejections can make it too short.
PROGRESS_CHECK_SECONDS = 5.0


class FeedError(RuntimeError):
    """The feeder cannot go on (the API refused it, the channel belongs to another job)."""


@dataclass
class HeldItem:
    """A leased hsx shard whose samples are fed, waiting for the trainer to finish them."""

    item_id: int
    delivery: int
    sample_ids: list[str]


@dataclass
class FeedResult:
    outcome: str  # closed | failed | trainer_done | trainer_failed
    appended: int = 0  # refs this run appended
    acked_items: int = 0
    reason: str | None = None
    peak_in_flight: int = 0  # refs appended but not consumed, at most, as the feeder saw it


@dataclass
class SpecForgeFeeder:
    api_url: str
    job_id: str
    channel_path: Path
    store_root: Path
    store_id: str
    token: str | None = None
    window: int = DEFAULT_WINDOW
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    poll_seconds: float = 0.5
    verify_checksums: bool = True
    timeout: float = 60.0
    # How long an unreachable API (connection errors, 5xx: a restart) is retried before the feed fails.
    outage_seconds: float = 600.0
    name: str = "specforge-feeder"
    should_stop: Callable[[], bool] = field(default=lambda: False)
    # Where features go; default: SharedDirFeatureStore's layout under store_root/store_id.
    sink: layout.FeatureSink | None = None
    # The trainer's run YAML as read by specforge_schedule: the schedule record is written from it.
    trainer: TrainerRun | None = None
    prompts: int | None = None  # distinct conversations, when the trainer runs more than one epoch

    def __post_init__(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.Client(base_url=self.api_url.rstrip("/"), headers=headers, timeout=self.timeout)
        self.channel = layout.RefChannel(self.channel_path)
        self.features = self.sink or layout.FeatureDir(self.store_root, self.store_id)
        self.position = {ref["sample_id"]: n for n, ref in enumerate(self.channel.refs)}
        self.held: dict[int, HeldItem] = {}
        self.consumer_id = ""
        self.required: int | None = None  # refs the schedule promised the trainer (total_steps x quantum)
        self.spare = 0  # samples the job may reject and still fill the schedule (its tail past a window)
        self._next_check = 0.0

    # -- the API ------------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        path = f"/jobs/{self.job_id}{path}"
        return call_api(self._http, method, path, body, self.outage_seconds, FeedError)

    def _register(self) -> None:
        previous = self.channel.read_sidecar(layout.HSX_CONSUMER)
        if previous:
            # A feeder of this channel stopped without finishing: its shards go back to the queue now
            # rather than after its lease (an hour by default); a consumer already gone is fine.
            try:
                self._call("DELETE", f"/consumers/{previous}")
            except FeedError as exc:
                log.info("previous feeder consumer %s not closed: %s", previous, exc)
        body = {"name": self.name, "lease_seconds": self.lease_seconds}
        self.consumer_id = str(self._call("POST", "/consumers", body)["id"])
        self.channel.write_sidecar(layout.HSX_CONSUMER, self.consumer_id)

    def _started(self) -> dict[str, Any] | str:
        """The job's document once a worker has prepared and started it, or why it never will."""
        while True:
            doc = self._call("GET", "")
            if doc["state"] in ("failed", "cancelled"):
                return _broken(self.job_id, doc["state"], doc.get("error"))
            if doc.get("engine"):
                return dict(doc)
            if self.should_stop():
                return "feeder stopped before the job started"
            time.sleep(self.poll_seconds)

    def _publish_schedule(self, run: TrainerRun, samples_total: int, dtype: str | None = None) -> str | None:
        """Write ``<channel>.schedule.json`` for the job's samples; or why the trainer cannot have one."""
        try:
            problem = dtype_problem(dtype) if dtype else None
            if problem is not None or run.fixed_horizon:  # a fixed horizon: the consumer reads no record
                return problem and f"hsx job {self.job_id}: {problem}"
            record = schedule_record(run, num_prompts(run, samples_total, self.prompts))
        except TrainerConfigError as exc:
            return f"hsx job {self.job_id}: {exc}"
        self.required = int(record["total_steps"]) * run.quantum
        self.spare = samples_total - self.required
        text = json.dumps(record, sort_keys=True)
        existing = self.channel.read_sidecar(SCHEDULE_SUFFIX)
        if existing is None:
            self.channel.write_sidecar(SCHEDULE_SUFFIX, text)
        elif json.loads(existing) != record:
            # A restart with another config: refuse to feed, but leave the channel (and its trainer) be.
            self._leave()
            raise FeedError(f"{self.channel_path} already holds the schedule {existing}, not {text}")
        return None

    def _short(self, rejected: int | None = None) -> str | None:
        """Why the stream cannot give the trainer the steps its schedule promised, if it cannot."""
        if self.required is None:
            return None
        if rejected is not None and rejected > self.spare:
            return (
                f"hsx job {self.job_id} rejected {rejected} samples (GET /jobs/{{id}}/rejections): the "
                f"trainer's schedule needs {self.required} of them, which leaves room for {self.spare}"
            )
        if rejected is None and self.channel.appended < self.required:
            return (
                f"hsx job {self.job_id} gave {self.channel.appended} samples; the trainer's schedule "
                f"needs {self.required}"
            )
        return None

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> FeedResult:
        self._check_channel()
        self._register()
        started = self._started()
        if isinstance(started, str):
            self.channel.fail(started)
            self._leave()
            return FeedResult("failed", reason=started)
        manifest, engine = manifest_for(started), started["engine"]
        reason = None
        if manifest.final_state == "pre":
            reason = (
                "SpecForge's EAGLE-3 trainer takes the post-norm final state as its target; this job "
                "captured only the pre-norm one (final_state 'pre')"
            )
        elif self.trainer is not None:
            total = int(started["progress"]["samples_total"])
            reason = self._publish_schedule(self.trainer, total, manifest.dtype)
        if reason is not None:
            # Before any ref: a consumer waiting for the schedule record raises with this reason.
            self.channel.fail(reason)
            self._leave()
            return FeedResult("failed", reason=reason)
        meta = {
            "hsx_job": self.job_id,
            "target_model_version": str(engine.get("model_path", "unknown")),
            "tokenizer_version": str((engine.get("tokenizer") or {}).get("sha256", "unknown")),
        }
        result = FeedResult("closed")
        try:
            self._loop(manifest, meta, result)
        except BaseException as exc:
            # The trainer must not take a broken feeder for the end of its data.
            if not isinstance(exc, KeyboardInterrupt):
                self.channel.fail(f"hsx feeder failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._leave()
        return result

    def _loop(self, manifest: Manifest, meta: dict[str, Any], result: FeedResult) -> None:
        leased_all = False  # the job succeeded and every shard was leased to us (and fed) at least once
        while True:
            stopped = self.channel.consumer_stopped()
            if stopped is not None:
                result.outcome = "trainer_done" if stopped == "done" else "trainer_failed"
                result.reason = None if stopped == "done" else stopped
                return
            consumed = self.channel.consumed()
            result.acked_items += self._settle(consumed)
            in_flight = self.channel.appended - consumed
            result.peak_in_flight = max(result.peak_in_flight, in_flight)
            if not leased_all and self.required is not None and time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + PROGRESS_CHECK_SECONDS
                ended = self._ended()
                if ended is not None:
                    self.channel.fail(ended)
                    result.outcome, result.reason = "failed", ended
                    return
            if leased_all:
                if not self.held:
                    return
            elif in_flight < max(self.window, self.channel.quantum()) and not self.should_stop():
                # The lease waits at the API for the next item instead of this loop sleeping: an item is
                # fed the moment it commits, and the trainer's progress is still read every poll.
                body = {"max_items": 1, "wait_seconds": min(self.poll_seconds, LEASE_WAIT_MAX_SECONDS)}
                answer = self._call("POST", f"/consumers/{self.consumer_id}/leases", body)
                if answer["job_state"] in ("failed", "cancelled"):
                    reason = _broken(self.job_id, answer["job_state"], answer.get("error"))
                    self.channel.fail(reason)
                    result.outcome, result.reason = "failed", reason
                    return
                for item in answer["items"]:
                    result.appended += self._feed_item(item, manifest, meta)
                if answer["end_of_stream"] and not answer["items"]:
                    short = self._short()
                    if short is not None:  # closed, the trainer would end steps short without a word
                        self.channel.fail(short)
                        result.outcome, result.reason = "failed", short
                        return
                    leased_all = True
                    if not self.channel.is_closed():
                        self.channel.close()
                if answer["items"] or not answer["end_of_stream"]:
                    continue  # fed, or waited a poll's length at the API
            elif not leased_all:
                # The window is full, so no lease call would tell us the job broke: ask it.
                ended = self._ended()
                if ended is not None:
                    self.channel.fail(ended)
                    result.outcome, result.reason = "failed", ended
                    return
            if self.should_stop():
                result.outcome, result.reason = "stopped", "feeder asked to stop"
                return
            time.sleep(self.poll_seconds)

    def _ended(self) -> str | None:
        """Why the stream must stop: the job failed, or rejected more samples than the schedule allows."""
        doc = self._call("GET", "")
        if doc["state"] in ("failed", "cancelled"):
            return _broken(self.job_id, doc["state"], doc.get("error"))
        return self._short(int(doc["progress"]["samples_rejected"]))

    def _feed_item(self, item: dict[str, Any], manifest: Manifest, meta: dict[str, Any]) -> int:
        item_id, delivery = int(item["id"]), int(item["delivery"])
        if item_id in self.held:  # our own lease ran out and came back: the samples are out already
            self.held[item_id].delivery = delivery
            return 0
        refs: list[dict[str, Any]] = []
        sample_ids: list[str] = []
        consumed = self.channel.consumed()
        for sample in item_samples(item, manifest, self.verify_checksums):
            sid = layout.sample_id(self.job_id, sample.index)
            sample_ids.append(sid)
            if sid in self.position:  # appended before a restart
                if self.position[sid] >= consumed and not self.features.exists(sid):
                    # Mooncake: the objects went with the old feeder's memory segment; put them again.
                    self.features.write(sid, layout.eagle3_tensors(sample, manifest.dtype))
                continue
            tensors = layout.eagle3_tensors(sample, manifest.dtype)
            self.features.write(sid, tensors)
            sample_meta = {**meta, "hsx_sample": sample.index, "hsx_unit": int(item["unit_index"])}
            refs.append(layout.sample_ref(sid, self.features, tensors, self.job_id, sample_meta))
        self.features.sync()  # the files' renames are durable before any ref names them
        first = self.channel.appended
        self.channel.append(refs)
        for n, ref in enumerate(refs):
            self.position[ref["sample_id"]] = first + n
        self.held[item_id] = HeldItem(item_id, delivery, sample_ids)
        return len(refs)

    def _done_with(self, sid: str, consumed: int) -> bool:
        """The trainer has counted the sample consumed, or released (deleted) its features."""
        return self.position[sid] < consumed or not self.features.exists(sid)

    def _settle(self, consumed: int) -> int:
        """Acknowledge the held shards the trainer is done with; returns how many hsx took."""
        done = [h for h in self.held.values() if all(self._done_with(s, consumed) for s in h.sample_ids)]
        if not done:
            return 0
        body = {"items": [{"id": h.item_id, "delivery": h.delivery} for h in done]}
        answer = self._call("POST", f"/consumers/{self.consumer_id}/acks", body)
        for refused in answer.get("refused", []):
            log.warning("hsx refused the acknowledgement of item %s: %s", refused["id"], refused["reason"])
        for h in done:
            # Acknowledged (or no longer ours): the trainer counted these consumed, so a copy its store
            # retained is garbage now.
            for sid in h.sample_ids:
                self.features.remove(sid)
            del self.held[h.item_id]
        return len(answer.get("acked", []))

    def _check_channel(self) -> None:
        for ref in self.channel.refs[:1]:
            owner = (ref.get("metadata") or {}).get("hsx_job")
            if owner != self.job_id:
                raise FeedError(f"{self.channel_path} carries job {owner}'s refs, not {self.job_id}'s")
        failure = self.channel.read_sidecar(layout.FAILED)
        if failure is not None:
            raise FeedError(f"{self.channel_path} has failed already ({failure}); use a fresh channel")

    def _leave(self) -> None:
        """Hand back what is still leased (the trainer stopped, or the job ended) and close the client."""
        try:
            if self.consumer_id:
                self._call("DELETE", f"/consumers/{self.consumer_id}")
        except FeedError as exc:
            log.warning("could not close hsx consumer %s: %s", self.consumer_id, exc)
        finally:
            self._http.close()
            self.features.close()


def _broken(job_id: str, state: str, error: str | None) -> str:
    """The reason the trainer raises with: SpecForge puts it in its "producer failed" error."""
    return f"hsx job {job_id} {state}: {error or 'no reason given'}"


def run_feed_command(args: argparse.Namespace, token: str | None) -> int:
    try:
        target = resolve_target(args)
    except TrainerConfigError as exc:
        print(f"hsx feed: {exc}")
        return 2
    sink = None
    if target.backend == "mooncake":
        from hsx.integrations.specforge.mooncake import MooncakeFeatures, MooncakeSetup

        setup = MooncakeSetup(
            master=str(target.mooncake_master),
            metadata_server=str(target.mooncake_metadata),
            local_hostname=target.mooncake_host,
            segment_bytes=args.mooncake_segment_bytes,
        )
        sink = MooncakeFeatures(setup, target.store_id)
    feeder = SpecForgeFeeder(
        api_url=args.api_url,
        job_id=args.job_id,
        channel_path=target.channel,
        store_root=target.store_root or Path("."),
        store_id=target.store_id,
        token=token,
        window=args.window,
        lease_seconds=args.lease_seconds,
        poll_seconds=args.poll_seconds,
        sink=sink,
        trainer=target.trainer,
        prompts=args.prompts,
    )
    try:
        result = feeder.run()
    except FeedError as exc:
        print(f"hsx feed: {exc}")
        return 2
    print(
        f"hsx feed specforge: {result.outcome}; {result.appended} refs appended, "
        f"{result.acked_items} shards acknowledged" + (f"; {result.reason}" if result.reason else "")
    )
    return 0 if result.outcome in ("closed", "trainer_done") else 1
