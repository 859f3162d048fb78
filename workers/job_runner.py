"""One wake-up of a worker for one job: prepare or start the job if needed, then lease units one after
another, process each and commit it fenced, until no unit is left to claim.

Every step that records results names the attempt that owns the unit's lease, so a worker that was frozen
or lost can never commit, and a unit's shard and rejections are recorded exactly once. Each claim that
leaves more work behind makes sure a wake-up is waiting in the queue, so every idle worker joins in.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.exc import OperationalError

from hsx import telemetry
from hsx.contract import EngineInfo, eagle3_aux_layer_ids
from hsx.db.models import Job, JobState
from hsx.db.session import session_scope
from hsx.fsutil import fsync_dir
from hsx.jobs import repository as repo
from hsx.jobs.finalize import finalize_if_complete
from hsx.jobs.queue import enqueue_wakeups, queued_wakeups
from hsx.jobs.repository import ClaimedUnit, ShardRow
from hsx.logging_setup import log_context
from hsx.settings import Settings
from workers.dataset import DatasetError
from workers.engine_client import EngineClient, EngineUnavailable
from workers.faults import crash_point
from workers.lease import LeaseKeeper
from workers.records import UnitRange, prepare, read_unit
from workers.shards import ShardWriteError, data_sha256
from workers.unit_processor import UnitAborted, UnitProcessor, UnitResult

log = logging.getLogger(__name__)

# Set in a work horse when its worker is asked to stop: the unit in hand finishes, no new one is claimed.
SHUTDOWN = threading.Event()
_TOKENIZERS: dict[str, Any] = {}


def lease_owner(pid: int, engine_url: str) -> str:
    """Who holds a lease: the process and the engine it feeds, so a dead horse's leases can be found and
    units can be counted per engine."""
    return f"{socket.gethostname()}:{pid}@{engine_url}"


def shard_path(output_dir: str, unit_index: int) -> Path:
    return Path(output_dir) / f"shard-{unit_index:05d}.safetensors"


def staged_path(output_dir: str, unit_index: int, attempt: int) -> Path:
    return Path(output_dir) / f".shard-{unit_index:05d}.a{attempt}.staged"


class TokenizerMissing(Exception):
    """Chat records arrived and the engine's model path (or HSX_TOKENIZER_PATH) holds no tokenizer."""


@dataclass
class Outcome:
    summary: str
    more_work: bool


@dataclass(frozen=True)
class JobView:
    """What a runner needs of the job row, read once per wake-up."""

    state: str
    options: dict[str, Any]
    engine: dict[str, Any] | None
    dataset_path: str
    output_dir: str
    records_path: str | None
    records_bytes: int | None
    units_total: int

    @classmethod
    def of(cls, job: Job) -> JobView:
        return cls(
            job.state,
            dict(job.options),
            job.engine,
            job.dataset_path,
            job.output_dir,
            job.records_path,
            job.records_bytes,
            job.units_total,
        )


def _retry_db(fn: Any, attempts: int = 8) -> Any:
    """Ride out a database restart: the operation is idempotent or fenced, so retrying is safe."""
    delay = 0.5
    for i in range(attempts):
        try:
            return fn()
        except OperationalError as exc:
            if i == attempts - 1:
                raise
            log.warning("database unavailable (%s); retrying in %.1fs", exc.__class__.__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 8.0)
    raise AssertionError("unreachable")


def engine_compatible(job_engine: dict[str, Any], info: EngineInfo) -> str | None:
    for key in ("num_layers", "hidden_size", "hf_indices", "dtype", "final_state"):
        if job_engine.get(key, "post" if key == "final_state" else None) != getattr(info, key):
            return f"engine {key}={getattr(info, key)!r} but the job started with {job_engine.get(key)!r}"
    return None


def load_tokenizer(path: str) -> Any:
    """One tokenizer per path for the life of the process (a work horse runs many units)."""
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


class JobRunner:
    def __init__(self, job_id: str, settings: Settings, preflight: bool = True) -> None:
        self.job_id = job_id
        self.settings = settings
        self.db_url = settings.resolved_database_url
        self.preflight = preflight
        self.owner = lease_owner(os.getpid(), settings.engine_url)
        self.client = EngineClient(
            settings.engine_url, timeout=settings.engine_timeout_seconds, retries=settings.engine_retries
        )

    # --- job lifecycle -------------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        log.error("job %s failed: %s", self.job_id, reason)
        with session_scope(self.db_url) as session:
            repo.set_job_state(session, self.job_id, JobState.failed, repo.ACTIVE_STATES, error=reason)

    def _load(self) -> JobView | None:
        with session_scope(self.db_url) as session:
            job = repo.get_job(session, self.job_id)
            return None if job is None else JobView.of(job)

    @contextmanager
    def _prepare_lease(self) -> Iterator[threading.Event]:
        """Keeps the prepare lease alive while a large dataset is converted and scanned."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.settings.heartbeat_seconds):
                try:
                    with session_scope(self.db_url) as session:
                        repo.begin_prepare(
                            session, self.job_id, self.owner, self.settings.lease_seconds, time.time()
                        )
                except Exception as exc:  # noqa: BLE001 - the fence in record_prepared decides
                    log.warning("prepare heartbeat failed: %s", exc)

        thread = threading.Thread(target=beat, name="prepare-lease", daemon=True)
        thread.start()
        try:
            yield stop
        finally:
            stop.set()
            thread.join(timeout=self.settings.heartbeat_seconds + 5)

    def _prepare(self, job: JobView) -> bool:
        """Index the dataset and create the units, once per job; False when this worker did not."""
        with session_scope(self.db_url) as session:
            if not repo.begin_prepare(
                session, self.job_id, self.owner, self.settings.lease_seconds, time.time()
            ):
                return False
        per_unit = int(job.options.get("samples_per_shard") or self.settings.samples_per_unit)
        try:
            with self._prepare_lease():
                prepared = prepare(job.dataset_path, job.output_dir, per_unit, self.settings)
        except DatasetError as exc:
            self._fail(f"dataset {exc.reason}: {exc.detail}")
            return False
        except OSError as exc:
            self._fail(f"could not prepare the dataset {job.dataset_path}: {exc.strerror or exc}")
            return False
        if prepared.samples == 0:
            self._fail("the dataset holds no samples")
            return False
        units = [(u.sample_start, u.sample_end, u.byte_start, u.byte_end) for u in prepared.units]
        with session_scope(self.db_url) as session:
            done = repo.record_prepared(
                session, self.job_id, self.owner, prepared.path, prepared.bytes, units
            )
        log.info("job %s prepared: %d samples in %d units", self.job_id, prepared.samples, len(units))
        return bool(done)

    def _start(self, job_options: dict[str, Any], info: EngineInfo) -> bool:
        """Check the engine and move the job from queued to running; False (job failed) when unsafe."""
        wanted = job_options.get("aux_layers")
        if wanted is not None and list(wanted) != list(info.aux_layer_ids):
            self._fail(f"job asks for aux layers {wanted} but the engine captures {info.aux_layer_ids}")
            return False
        if wanted is None and info.aux_layer_ids != eagle3_aux_layer_ids(info.num_layers):
            log.info("engine captures non-default aux layers %s", info.aux_layer_ids)
        if self.preflight:
            from hsx.verify import run_verification

            report = run_verification(self.settings.engine_url, dump_dir=self._dump_dir(info))
            if not report.ok:
                failed = [c for c in report.checks if not c.ok]
                reasons = "; ".join(f"{c.name}: expected {c.expected}, got {c.actual}" for c in failed[:4])
                self._fail(f"engine failed the preflight check: {reasons}")
                return False
        with session_scope(self.db_url) as session:
            repo.set_job_state(
                session,
                self.job_id,
                JobState.running,
                [JobState.queued.value],
                engine=self._engine_record(info),
            )
        return True

    def _engine_record(self, info: EngineInfo) -> dict[str, Any]:
        """What the job is bound to: the engine's model and layers, the tokenizer and its chat template."""
        from workers.chat import chat_template_sha256, tokenizer_identity
        from workers.shards import canonical_state_dtype

        record = info.to_dict()
        record["state_dtype"] = canonical_state_dtype(info.dtype)
        try:
            tokenizer = self._tokenizer(info)
        except (OSError, ValueError) as exc:
            # Pre-tokenized data needs none; a chat record then fails the job saying so (_TokenizerMissing).
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

    def run_one(self) -> Outcome:
        """At most one unit (tests step a job with it)."""
        return self.run(max_units=1)

    def run(self, max_units: int | None = None) -> Outcome:
        job = self._load()
        if job is None:
            return Outcome("no such job", False)
        if JobState(job.state).is_final:
            return Outcome(f"job is {job.state}", False)
        try:
            info = self.client.info()
        except EngineUnavailable as exc:
            self._fail(f"engine unavailable: {exc}")
            return Outcome("engine unavailable", False)
        if job.state == JobState.queued.value:
            if job.units_total == 0:
                if not self._prepare(job):
                    return Outcome("job is being prepared by another worker, or failed", False)
                job = self._load()
                if job is None or job.records_path is None:
                    return Outcome("job vanished while it was prepared", False)
            if not self._start(job.options, info):
                return Outcome("preflight failed", False)
        elif job.engine is not None and (problem := engine_compatible(job.engine, info)):
            # A worker colocated with a different engine must not mix its states into this job.
            log.error("job %s: %s", self.job_id, problem)
            return Outcome(problem, False)
        processor = self._processor(info, job.options)
        try:
            return self._unit_loop(job, processor, max_units)
        finally:
            processor.close()

    def _unit_loop(self, job: JobView, processor: UnitProcessor, max_units: int | None) -> Outcome:
        done_here = 0
        while max_units is None or done_here < max_units:
            if SHUTDOWN.is_set():
                return Outcome(f"stopping after {done_here} unit(s)", True)
            unit = _retry_db(lambda: self._claim())
            if unit is None:
                finished = _retry_db(lambda: self._finalize())
                return Outcome(f"{done_here} unit(s); no unit left to claim", not finished)
            crash_point("after_claim")
            self._wake_more()
            with log_context(job_id=unit.job_id, unit=unit.unit_index, attempt=unit.attempt):
                outcome = self._run_unit(unit, job, processor)
            telemetry.flush()  # a looping horse's numbers show up unit by unit, not when it exits
            done_here += 1
            log.info("job %s: %s", self.job_id, outcome.summary)
            if not outcome.more_work:
                return outcome
        return Outcome(f"{done_here} unit(s)", True)

    def _claim(self) -> ClaimedUnit | None:
        with session_scope(self.db_url) as session:
            if repo.job_state(session, self.job_id) != JobState.running.value:
                return None
            return repo.claim_unit(session, self.job_id, self.owner, self.settings.lease_seconds, time.time())

    def _wake_more(self) -> None:
        """Keep one wake-up waiting while units are claimable, so idle workers join (best effort: the
        reconciler does the same from the job table whatever Redis lost)."""
        try:
            with session_scope(self.db_url) as session:
                claimable = repo.claimable_count(session, self.job_id, time.time())
            if claimable and queued_wakeups(self.settings, self.job_id) == 0:
                enqueue_wakeups(self.settings, self.job_id, 1)
        except Exception as exc:  # noqa: BLE001 - waking others is never worth failing this unit
            log.warning("could not wake more workers for job %s: %s", self.job_id, exc)

    def _finalize(self) -> bool:
        return finalize_if_complete(self.db_url, self.job_id)

    # --- one unit ---------------------------------------------------------------------------------------

    def _processor(self, info: EngineInfo, options: dict[str, Any]) -> UnitProcessor:
        def encoder() -> Any:
            from workers.chat import ChatEncoder

            try:
                tokenizer = self._tokenizer(info)
            except (OSError, ValueError) as exc:
                path = self.settings.tokenizer_path or info.model_path
                raise TokenizerMissing(
                    f"chat records need a tokenizer, and none loads from {path!r} (set HSX_TOKENIZER_PATH, "
                    f"or send pre-tokenized records): {exc}"
                ) from exc
            return ChatEncoder(tokenizer, bool(options.get("chat_template", True)), options.get("max_length"))

        return UnitProcessor(
            self.client,
            info,
            encoder,
            self._dump_dir(info),
            self.settings.dump_wait_seconds,
            self.settings.engine_concurrency,
            bool(options.get("cache_namespace_per_request", True)),
            self.settings.max_inflight_dump_bytes,
        )

    def _run_unit(self, unit: ClaimedUnit, job: JobView, processor: UnitProcessor) -> Outcome:
        if unit.byte_start is None or unit.byte_end is None or job.records_path is None:
            self._release(unit)
            self._fail(f"unit {unit.unit_index} has no record range (a job made before schema 0002?)")
            return Outcome("unit without records", False)
        keeper = LeaseKeeper(self.db_url, unit, self.settings.lease_seconds, self.settings.heartbeat_seconds)
        span = UnitRange(unit.sample_start, unit.sample_end, unit.byte_start, unit.byte_end)
        try:
            with keeper:
                records = read_unit(
                    job.records_path, job.records_bytes, span, job.options.get("format", "auto")
                )
                result = processor.process(
                    unit,
                    records,
                    staged_path(job.output_dir, unit.unit_index, unit.attempt),
                    lambda: keeper.should_stop,
                )
                crash_point("mid_unit")
                if keeper.should_stop:
                    raise UnitAborted("stopped before commit")
                committed = self._commit(unit, result, job.output_dir)
        except UnitAborted as exc:
            self._release(unit)
            telemetry.unit_finished("released")
            return Outcome(f"unit {unit.unit_index} released: {exc}", False)
        except EngineUnavailable as exc:
            self._release(unit)
            telemetry.engine_error("unavailable")
            telemetry.unit_finished("failed")
            self._fail(f"engine unavailable after {self.settings.engine_retries} retries: {exc}")
            return Outcome("engine unavailable", False)
        except ShardWriteError as exc:
            self._release(unit)
            telemetry.unit_finished("failed")
            self._fail(f"could not write shard for unit {unit.unit_index}: {exc}")
            return Outcome("shard write failed", False)
        except DatasetError as exc:
            self._release(unit)
            self._fail(f"dataset {exc.reason}: {exc.detail}")
            return Outcome("dataset unreadable", False)
        except TokenizerMissing as exc:
            self._release(unit)
            self._fail(str(exc))
            return Outcome("no tokenizer", False)
        telemetry.unit_finished("committed" if committed else "lease_lost")
        if not committed:
            return Outcome(f"unit {unit.unit_index} lease lost; nothing committed", True)
        return Outcome(
            f"unit {unit.unit_index}: {result.samples_done} samples, {len(result.rejections)} rejected",
            True,
        )

    def _release(self, unit: ClaimedUnit) -> None:
        try:
            with session_scope(self.db_url) as session:
                repo.release_unit(session, unit)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            log.warning("could not release unit %s: %s", unit.id, exc)

    def _commit(self, unit: ClaimedUnit, result: UnitResult, output_dir: str) -> bool:
        final = shard_path(output_dir, unit.unit_index)
        staged = staged_path(output_dir, unit.unit_index, unit.attempt)
        shard: ShardRow | None = None
        if result.shard is not None:
            telemetry.bytes_written(result.shard.bytes)
            crash_point("after_shard_staged")
            info = result.shard
            shard = ShardRow(
                str(final), info.sha256, info.bytes, info.samples, info.tokens, info.header_sha256
            )

        def publish() -> None:
            if shard is not None:
                if staged.exists():
                    os.replace(staged, final)
                    fsync_dir(final.parent)
                elif data_sha256(final) != shard.sha256:
                    # Not renamed by an earlier try of this commit (whose transaction was then lost).
                    raise ShardWriteError(final, None, f"the staged shard {staged.name} is gone")
                crash_point("after_rename")
            crash_point("before_row_commit")

        def attempt_commit() -> bool:
            try:
                with session_scope(self.db_url) as session:
                    return repo.commit_unit(
                        session,
                        unit,
                        time.time(),
                        shard,
                        result.rejections,
                        result.samples_done,
                        result.tokens,
                        publish,
                    )
            except OperationalError:
                # The commit may have landed before the connection dropped: ask before retrying.
                with session_scope(self.db_url) as session:
                    if repo.unit_committed_by(session, unit):
                        return True
                raise

        try:
            ok = bool(_retry_db(attempt_commit))
        finally:
            if staged.exists():
                staged.unlink()
        crash_point("after_row_commit")
        if not ok:
            log.warning("unit %s attempt %s lost its lease; results dropped", unit.unit_index, unit.attempt)
        return ok
