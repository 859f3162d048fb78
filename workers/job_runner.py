"""One wake-up of a worker for one job: check the engine, prepare or start the job if needed, then lease
units one after another, process each and commit it fenced, until no unit is left to claim.

Every step that records results names the attempt that owns the unit's lease, so a worker that was frozen
or lost can never commit, and a unit's shard and rejections are recorded exactly once. Each claim that
leaves more work behind makes sure a wake-up is waiting in the queue, so every idle worker joins in.

How a unit's attempt can end:

* committed, or its lease lost (nothing written; another attempt has the unit);
* the engine does not answer or is unfit (:mod:`workers.engine_gate`): the unit goes back untouched for
  healthy workers and this worker takes no more units of the job in this wake-up;
* a failure no retry heals (the dataset is gone or changed, the disk is full, no usable tokenizer): the
  unit and the job fail at once, with the reason, while this attempt still holds the lease;
* any other error: counted on the unit, which goes back to be tried again; at ``HSX_UNIT_MAX_FAILURES``
  the unit fails and the job with it, saying why (``GET /jobs/{id}``; ``POST /jobs/{id}/retry`` resumes).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from hsx import layout
from hsx.contract import EngineInfo
from hsx.engine import fitness as engine_fitness
from hsx.engine.client import EngineClient, EngineUnavailable, EngineUnfit
from hsx.server import telemetry
from hsx.server.db.models import JobState
from hsx.server.db.session import retry_db, session_scope
from hsx.server.faults import crash_point
from hsx.server.ingest import DatasetError, UnitRange, read_unit_records
from hsx.server.job_options import JobOptions
from hsx.server.jobs import engines_met, queries, recovery
from hsx.server.jobs import repository as repo
from hsx.server.jobs.finalize import finalize_if_complete
from hsx.server.jobs.publication import publish_committed
from hsx.server.jobs.queue import wake_idle_workers
from hsx.server.jobs.repository import ClaimedUnit
from hsx.server.logging_setup import log_context
from hsx.server.settings import Settings
from hsx.server.streams import service as stream_service
from hsx.server.streams.deletion import BackgroundDeletion
from hsx.server.streams.news import ITEM, announce
from hsx.server.streams.room import wait_for_room
from hsx.streams.contract import CONSUME
from workers.engine_gate import EngineGate, Refusal, static_problem
from workers.job_prepare import JobPreparer
from workers.job_view import JobView, Outcome
from workers.lease import LeaseKeeper
from workers.record_stage import RecordStage, UnitRecord
from workers.regeneration.stage import record_stage
from workers.shards import ShardWriteError
from workers.unit_commit import commit_unit, staged_path
from workers.unit_processor import UnitAborted, UnitProcessor, UnitResult

log = logging.getLogger(__name__)

# Set in a work horse when its worker is asked to stop: the unit in hand finishes, no new one is claimed.
SHUTDOWN = threading.Event()
_TOKENIZERS: dict[str, Any] = {}


def lease_owner(pid: int, engine_url: str) -> str:
    """This host's owner string for process ``pid`` (format: hsx.layout.lease_owner)."""
    return layout.lease_owner(socket.gethostname(), pid, engine_url)


class TokenizerMissing(Exception):
    """Chat records arrived and no usable tokenizer loads (none at the engine's model path or
    HSX_TOKENIZER_PATH, or one without the chat template the job asks for)."""


def _rounded(timing: dict[str, float]) -> dict[str, float]:
    return {name: round(value, 3) for name, value in timing.items()}


def load_tokenizer(path: str) -> Any:
    """One tokenizer per path for the life of the process (a work horse runs many units)."""
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


class JobRunner:
    def __init__(self, job_id: str, settings: Settings) -> None:
        self.job_id = job_id
        self.settings = settings
        self.db_url = settings.resolved_database_url
        self.owner = lease_owner(os.getpid(), settings.engine_url)
        self.client = EngineClient(
            settings.engine_url, timeout=settings.engine_timeout_seconds, retries=settings.engine_retries
        )
        self.gate = EngineGate(job_id, settings, settings.engine_url)
        # The identity this wake-up's preflight passed for (the job's start verifies before preparing).
        self._verified_identity: str | None = None
        self._stage: RecordStage | None = None

    # --- job lifecycle -------------------------------------------------------------------------------

    def _load(self) -> JobView | None:
        with session_scope(self.db_url) as session:
            job = repo.get_job(session, self.job_id)
            return None if job is None else JobView.of(job, self.settings)

    def _refused(self, refusal: Refusal) -> Outcome:
        ended = f"; the job failed: {refusal.job_failed}" if refusal.job_failed else ""
        return Outcome(f"engine {refusal.state}: {refusal.reason}{ended}", False)

    def run(self, max_units: int | None = None) -> Outcome:
        job = self._load()
        if job is None:
            return Outcome("no such job", False)
        if JobState(job.state).is_final:
            return Outcome(f"job is {job.state}", False)
        try:
            info = self.client.info()
        except EngineUnfit as exc:
            return self._refused(self.gate.refuse(engines_met.UNFIT, str(exc)))
        except EngineUnavailable as exc:
            return self._refused(self.gate.refuse(engines_met.UNAVAILABLE, str(exc)))
        problem = static_problem(info, job.options, job.engine)
        if problem:
            return self._refused(self.gate.refuse(engines_met.UNFIT, problem, info))
        if job.state == JobState.queued.value:
            # Verified before the dataset is prepared: an unfit engine leaves the job to another worker.
            refusal = self._verify(info)
            if refusal is not None:
                return self._refused(refusal)
            if job.units_total == 0 and not self._prepare(job, info):
                return Outcome("job is being prepared by another worker, or failed", False)
            self._start(info)
            job = self._load()
            if job is None or job.records_path is None:
                return Outcome("job vanished while it was prepared", False)
        refusal = self._join(job, info)
        if refusal is not None:
            return self._refused(refusal)
        processor = self._processor(info, job.options)
        # A per-record stage before capture, when the job's options ask for one (regeneration).
        self._stage = record_stage(
            job.options,
            self.db_url,
            self.client,
            lambda: self._chat_encoder(info, job.options).tokenizer,
            self.settings.engine_concurrency,
        )
        try:
            return self._unit_loop(job, processor, info, max_units)
        finally:
            processor.close()

    def _prepare(self, job: JobView, info: EngineInfo) -> bool:
        preparer = JobPreparer(self.job_id, self.settings, self.owner)
        return preparer.prepare(
            job.dataset_path, job.output_dir, job.options, info, lambda: self._chat_encoder(info, job.options)
        )

    def _start(self, info: EngineInfo) -> None:
        """Move the (verified, prepared) job from queued to running, bound to this engine's identity. A
        worker that loses this race joins the job like any other, checked against the winner's engine."""
        record = self._engine_record(info)
        with session_scope(self.db_url) as session:
            repo.set_job_state(session, self.job_id, JobState.running, [JobState.queued.value], engine=record)
        self._verified_identity = engine_fitness.identity_digest(info, self._worker_side(record))

    def _join(self, job: JobView, info: EngineInfo) -> Refusal | None:
        """A running job: this engine (and tokenizer) must be the job's, and verified once for it."""
        record = self._engine_record(info)
        worker_side = self._worker_side(record)
        if job.engine:
            problems = engine_fitness.identity_problems(job.engine, info, worker_side)
            if problems:
                return self.gate.refuse(engines_met.UNFIT, "; ".join(problems), info)
        identity = engine_fitness.identity_digest(info, worker_side)
        verified = self._verified_identity == identity or self.gate.verified(identity)
        if not verified:
            refusal = self._verify(info)
            if refusal is not None:
                return refusal
        self.gate.accept(info, identity)
        return None

    def _verify(self, info: EngineInfo) -> Refusal | None:
        from hsx.engine.verify import run_verification

        report = run_verification(self.settings.engine_url, dump_dir=self._dump_dir(info))
        if report.ok:
            return None
        failed = [c for c in report.checks if not c.ok]
        reasons = "; ".join(f"{c.name}: expected {c.expected}, got {c.actual}" for c in failed[:4])
        return self.gate.refuse(engines_met.UNFIT, f"engine failed the preflight check: {reasons}", info)

    @staticmethod
    def _worker_side(record: dict[str, Any]) -> dict[str, Any]:
        return {
            "tokenizer": record.get("tokenizer"),
            "chat_template_sha256": record.get("chat_template_sha256"),
        }

    def _engine_record(self, info: EngineInfo) -> dict[str, Any]:
        """What the job is bound to: the engine's model and layers, the tokenizer and its chat template."""
        from hsx.contract import canonical_state_dtype
        from workers.chat import chat_template_sha256, tokenizer_identity

        record = info.to_dict()
        record["state_dtype"] = canonical_state_dtype(info.dtype)
        try:
            tokenizer = self._tokenizer(info)
        except (OSError, ValueError) as exc:
            # Pre-tokenized data needs none; a chat record then fails the job saying so (TokenizerMissing).
            record.update(tokenizer={"error": f"no tokenizer at {info.model_path!r}: {exc}"[:500]})
            record.update(chat_template_sha256="")
            return record
        record.update(
            tokenizer=tokenizer_identity(tokenizer), chat_template_sha256=chat_template_sha256(tokenizer)
        )
        return record

    def _tokenizer(self, info: EngineInfo) -> Any:
        return load_tokenizer(self.settings.tokenizer_path or info.model_path)

    def _dump_dir(self, info: EngineInfo) -> str:
        return self.settings.dump_dir or info.dump_dir

    def _chat_encoder(self, info: EngineInfo, options: JobOptions) -> Any:
        """The job's encoder, without a length limit (the processor applies the job's truncation)."""
        from workers.chat import ChatEncoder

        path = self.settings.tokenizer_path or info.model_path
        try:
            tokenizer = self._tokenizer(info)
        except (OSError, ValueError) as exc:
            raise TokenizerMissing(
                f"chat records need a tokenizer, and none loads from {path!r} (set HSX_TOKENIZER_PATH, "
                f"or send pre-tokenized records): {exc}"
            ) from exc
        try:
            return ChatEncoder(tokenizer, options.chat_template, None)
        except ValueError as exc:  # a base model's tokenizer has no chat template
            raise TokenizerMissing(
                f"the tokenizer at {path!r} cannot encode this job's chat records: {exc} (submit with "
                "chat_template=false, or pre-tokenized records)"
            ) from exc

    # --- units ------------------------------------------------------------------------------------------

    def _unit_loop(
        self, job: JobView, processor: UnitProcessor, info: EngineInfo, max_units: int | None
    ) -> Outcome:
        # This host holds the shards: it deletes what consumers acknowledged, which is what makes room under
        # a consume job's cap (the API only records acknowledgements).
        deletion = BackgroundDeletion(self.db_url, self.job_id, self.settings)
        try:
            return self._units(job, processor, info, max_units, deletion)
        finally:
            deletion.wait()  # no thread outlives the loop

    def _units(
        self,
        job: JobView,
        processor: UnitProcessor,
        info: EngineInfo,
        max_units: int | None,
        deletion: BackgroundDeletion,
    ) -> Outcome:
        # Seconds before the next unit: waiting for the deletion, claiming it, waiting for room under a
        # consume job's cap, waking other workers. The unit's log line carries them beside its own
        # (bench/harness.py's timeline).
        before = {"delete_s": 0.0, "claim_s": 0.0, "room_wait_s": 0.0, "wake_s": 0.0}
        consume, done_here = job.options.retention == CONSUME, 0
        tight = False  # the cap has refused a claim: from then on delete before each claim, not beside a unit
        while max_units is None or done_here < max_units:
            if SHUTDOWN.is_set():
                return Outcome(f"stopping after {done_here} unit(s)", True)
            deleting = time.monotonic()
            deletion.wait()
            if tight:
                deletion.now()
            before["delete_s"] += time.monotonic() - deleting
            claiming = time.monotonic()
            unit, capped = retry_db(lambda: self._claim())
            before["claim_s"] += time.monotonic() - claiming
            if capped:
                tight, deleting = True, time.monotonic()
                freed = deletion.now()  # the room the cap wants may be acknowledged shards still on disk
                before["delete_s"] += time.monotonic() - deleting
                if freed:
                    continue
                waiting = time.monotonic()
                room = wait_for_room(self.settings, self.job_id, self.settings.stream_room_wait_seconds)
                before["room_wait_s"] += time.monotonic() - waiting
                if room:
                    continue
                # No wake-up is queued: the acknowledgement that makes room wakes a worker (backpressure).
                summary = f"{done_here} unit(s); waiting for consumers under the byte cap"
                with log_context(job_id=self.job_id):
                    log.info("job %s: %s", self.job_id, summary, extra=_rounded(before))
                return Outcome(summary, False)
            if unit is None:
                finished = retry_db(lambda: self._finalize())
                return Outcome(f"{done_here} unit(s); no unit left to claim", not finished)
            crash_point("after_claim")
            if consume and not tight:
                deletion.start()
            waking = time.monotonic()
            self._wake_more()
            before["wake_s"] = time.monotonic() - waking
            with log_context(job_id=unit.job_id, unit=unit.unit_index, attempt=unit.attempt):
                log.info("job %s: claimed unit %s", self.job_id, unit.unit_index)
                outcome = self._run_unit(unit, job, processor, info)
                timing = {**_rounded(before), **(outcome.timing or {})}
                log.info("job %s: %s", self.job_id, outcome.summary, extra=timing)
                before = dict.fromkeys(before, 0.0)
            telemetry.flush()  # a looping horse's numbers show up unit by unit, not when it exits
            done_here += 1
            if not outcome.more_work:
                return outcome
        return Outcome(f"{done_here} unit(s)", True)

    def _claim(self) -> tuple[ClaimedUnit | None, bool]:
        """The next unit, or None; and whether a consume job's byte cap held a claimable one back."""
        with session_scope(self.db_url) as session:
            if queries.job_state(session, self.job_id) != JobState.running.value:
                return None, False
            now = time.time()
            if not stream_service.may_claim(session, self.job_id, self.settings, now):
                # Nothing left to claim is no wait: the job may be ready to finalize.
                return None, queries.claimable_count(session, self.job_id, now) > 0
            return repo.claim_unit(session, self.job_id, self.owner, self.settings.lease_seconds, now), False

    def _wake_more(self) -> None:
        """Keep a wake-up waiting for every idle worker while units are claimable, so they all join at
        once (best effort: the reconciler keeps one queued from the job table whatever Redis lost)."""
        try:
            with session_scope(self.db_url) as session:
                claimable = stream_service.wakeable_units(session, self.job_id, self.settings, time.time())
            wake_idle_workers(self.settings, self.job_id, claimable)
        except Exception as exc:  # noqa: BLE001 - waking others is never worth failing this unit
            log.warning("could not wake more workers for job %s: %s", self.job_id, exc)

    def _finalize(self) -> bool:
        finished = finalize_if_complete(self.db_url, self.job_id)
        if finished:
            announce(self.settings, self.job_id)  # waiting leases learn that the stream ends
        return finished

    def _processor(self, info: EngineInfo, options: JobOptions) -> UnitProcessor:
        return UnitProcessor(
            self.client,
            info,
            lambda: self._chat_encoder(info, options),
            self._dump_dir(info),
            self.settings.dump_wait_seconds,
            self.settings.engine_concurrency,
            options.cache_namespace_per_request,
            self.settings.max_inflight_dump_bytes,
            options.max_length,
            options.truncation,
            self.settings.shard_write_behind_bytes,
            store_fp8=options.stores_fp8,
        )

    def _run_unit(
        self, unit: ClaimedUnit, job: JobView, processor: UnitProcessor, info: EngineInfo
    ) -> Outcome:
        if unit.byte_start is None or unit.byte_end is None or job.records_path is None:
            return self._fail_for_good(unit, "the unit has no record range (a job made before schema 0002?)")
        result = UnitResult()
        keeper = LeaseKeeper(
            self.db_url, unit, self.settings.lease_seconds, self.settings.heartbeat_seconds, result.live
        )
        span = UnitRange(unit.sample_start, unit.sample_end, unit.byte_start, unit.byte_end)
        staged = staged_path(job.output_dir, unit.unit_index, unit.attempt)
        try:
            with keeper:
                # A regenerate job takes prompts with no answer yet: it generates one.
                answered = job.options.regenerate is None
                records = read_unit_records(
                    job.records_path, job.records_bytes, span, job.options.format, answered
                )
                held: Iterable[UnitRecord] = (r for r in records if unit.holds(r[0]))
                if self._stage is not None:
                    held = self._stage.run(unit, held, lambda: keeper.should_stop)
                processor.process(unit, held, staged, lambda: keeper.should_stop, result)
                crash_point("mid_unit")
                if keeper.should_stop:
                    # The shard is whole but will not be committed: it goes now, not at the reconciler's
                    # next look at old staged files (after the job may have finished).
                    staged.unlink(missing_ok=True)
                    raise UnitAborted("stopped before commit")
                committing = time.monotonic()
                committed = self._commit(unit, result, job.output_dir)
                committed_at = time.monotonic()
        except UnitAborted as exc:
            self._release(unit)
            telemetry.unit_finished("released")
            return Outcome(f"unit {unit.unit_index} released: {exc}", False)
        except (EngineUnavailable, EngineUnfit) as exc:
            # This engine's fault, not the unit's: healthy workers take it from here.
            self._release(unit)
            self._wake_more()
            telemetry.engine_error("unavailable" if isinstance(exc, EngineUnavailable) else "unfit")
            telemetry.unit_finished("released")
            state = engines_met.UNAVAILABLE if isinstance(exc, EngineUnavailable) else engines_met.UNFIT
            return self._refused(self.gate.refuse(state, str(exc), info))
        except ShardWriteError as exc:
            return self._fail_for_good(unit, f"could not write shard for unit {unit.unit_index}: {exc}")
        except DatasetError as exc:
            return self._fail_for_good(unit, f"dataset {exc.reason}: {exc.detail}")
        except TokenizerMissing as exc:
            return self._fail_for_good(unit, str(exc))
        except Exception as exc:  # noqa: BLE001 - any other cause: counted, and bounded by the setting
            log.exception("unit %s attempt %s failed", unit.unit_index, unit.attempt)
            return self._count_failure(unit, f"{type(exc).__name__}: {exc}")
        telemetry.unit_finished("committed" if committed else "lease_lost")
        if not committed:
            return Outcome(f"unit {unit.unit_index} lease lost; nothing committed", True)
        if job.destination:
            publish_committed(self.db_url, self.job_id, unit.id, self.settings)
        announce(self.settings, self.job_id, ITEM)  # the longest-waiting lease hands the new item out now
        timing = {
            "waiting_s": result.waiting_s,
            "copying_s": result.copying_s,
            "closing_s": result.closing_s,
            "write_s": result.write_s,
            "fsync_s": result.fsync_s,
            "commit_s": committed_at - committing,
            # From the engine's answer to the unit's last prefill to the unit's commit.
            "tail_s": committed_at - result.last_answer if result.last_answer else 0.0,
        }
        return Outcome(
            f"unit {unit.unit_index}: {result.samples_done} samples, {len(result.rejections)} rejected, "
            f"{len(result.truncations)} truncated",
            True,
            _rounded(timing),
        )

    def _fail_for_good(self, unit: ClaimedUnit, reason: str) -> Outcome:
        """The unit and its job fail with ``reason``, only while this attempt still holds the lease."""
        telemetry.unit_finished("failed")

        def fail() -> bool:
            with session_scope(self.db_url) as session:
                return recovery.fail_unit_and_job(session, unit, reason, time.time())

        if retry_db(fail):
            log.error("job %s failed: %s", self.job_id, reason)
            return Outcome(reason, False)
        log.warning(
            "unit %s: %s, but the lease was lost meanwhile; not failing the job", unit.unit_index, reason
        )
        return Outcome(f"unit {unit.unit_index} lease lost", True)

    def _count_failure(self, unit: ClaimedUnit, reason: str) -> Outcome:
        telemetry.unit_finished("failed")
        limit = max(1, self.settings.unit_max_failures)

        def count() -> recovery.FailureCount:
            with session_scope(self.db_url) as session:
                return recovery.count_unit_failure(session, unit, reason, limit)

        counted = retry_db(count)
        if counted.unit_failed:
            log.error(
                "job %s failed: unit %s failed %d times: %s",
                self.job_id,
                unit.unit_index,
                counted.failures,
                reason,
            )
            return Outcome(f"unit {unit.unit_index} failed for good: {reason}", False)
        return Outcome(f"unit {unit.unit_index} failed ({counted.failures}/{limit}): {reason}", True)

    def _release(self, unit: ClaimedUnit) -> None:
        try:
            with session_scope(self.db_url) as session:
                repo.release_unit(session, unit)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            log.warning("could not release unit %s: %s", unit.id, exc)

    def _commit(self, unit: ClaimedUnit, result: UnitResult, output_dir: str) -> bool:
        return commit_unit(self.db_url, unit, result, output_dir, hooks=(stream_service.record_item,))
