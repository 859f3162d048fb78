"""One wake-up of a worker for one job: start the job if needed, lease a unit, process it, commit it fenced.

Every step that records results names the attempt that owns the unit's lease, so a worker that was frozen
or lost can never commit, and a unit's shard and rejections are recorded exactly once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.exc import OperationalError

from hsx.contract import EngineInfo, eagle3_aux_layer_ids
from hsx.db.models import JobState
from hsx.db.session import session_scope
from hsx.fsutil import fsync_dir
from hsx.jobs import repository as repo
from hsx.jobs.finalize import finalize_if_complete
from hsx.jobs.repository import ClaimedUnit, ShardRow
from hsx.settings import Settings
from workers.engine_client import EngineClient, EngineUnavailable
from workers.faults import crash_point
from workers.lease import LeaseKeeper
from workers.shards import ShardWriteError
from workers.unit_processor import UnitAborted, UnitProcessor, UnitResult

log = logging.getLogger(__name__)

# Set by the worker's SIGTERM handler: finish nothing new, release the unit in hand.
SHUTDOWN = threading.Event()


def lease_owner(pid: int, engine_url: str) -> str:
    """Who holds a lease: the process and the engine it feeds, so a dead horse's leases can be found and
    units can be counted per engine."""
    return f"{socket.gethostname()}:{pid}@{engine_url}"


def shard_path(output_dir: str, unit_index: int) -> Path:
    return Path(output_dir) / f"shard-{unit_index:05d}.safetensors"


def staged_path(output_dir: str, unit_index: int, attempt: int) -> Path:
    return Path(output_dir) / f".shard-{unit_index:05d}.a{attempt}.staged"


@dataclass
class Outcome:
    summary: str
    more_work: bool


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
    for key in ("num_layers", "hidden_size", "hf_indices", "dtype"):
        if job_engine.get(key) != getattr(info, key):
            return f"engine {key}={getattr(info, key)!r} but the job started with {job_engine.get(key)!r}"
    return None


class JobRunner:
    def __init__(self, job_id: str, settings: Settings, preflight: bool = True) -> None:
        self.job_id = job_id
        self.settings = settings
        self.db_url = settings.resolved_database_url
        self.preflight = preflight
        self.owner = lease_owner(os.getpid(), settings.engine_url)
        self._tokenizer_cache: Any = None
        self.client = EngineClient(
            settings.engine_url, timeout=settings.engine_timeout_seconds, retries=settings.engine_retries
        )

    # --- job lifecycle -------------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        log.error("job %s failed: %s", self.job_id, reason)
        with session_scope(self.db_url) as session:
            repo.set_job_state(session, self.job_id, JobState.failed, repo.ACTIVE_STATES, error=reason)

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

        tokenizer = self._tokenizer(info)
        record = info.to_dict()
        record.update(
            tokenizer=tokenizer_identity(tokenizer),
            chat_template_sha256=chat_template_sha256(tokenizer),
            state_dtype=canonical_state_dtype(info.dtype),
        )
        return record

    def _tokenizer(self, info: EngineInfo) -> Any:
        from transformers import AutoTokenizer

        if self._tokenizer_cache is None:
            self._tokenizer_cache = AutoTokenizer.from_pretrained(
                self.settings.tokenizer_path or info.model_path
            )
        return self._tokenizer_cache

    def _dump_dir(self, info: EngineInfo) -> str:
        return self.settings.dump_dir or info.dump_dir

    def run_one(self) -> Outcome:
        with session_scope(self.db_url) as session:
            job = repo.get_job(session, self.job_id)
            if job is None:
                return Outcome("no such job", False)
            state, options, engine_rec = job.state, dict(job.options), job.engine
            dataset_path, output_dir = job.dataset_path, job.output_dir
        if JobState(state).is_final:
            return Outcome(f"job is {state}", False)
        try:
            info = self.client.info()
        except EngineUnavailable as exc:
            self._fail(f"engine unavailable: {exc}")
            return Outcome("engine unavailable", False)
        if state == JobState.queued.value:
            if not self._start(options, info):
                return Outcome("preflight failed", False)
        elif engine_rec is not None and (problem := engine_compatible(engine_rec, info)):
            # A worker colocated with a different engine must not mix its states into this job.
            log.error("job %s: %s", self.job_id, problem)
            return Outcome(problem, False)
        unit = _retry_db(lambda: self._claim())
        if unit is None:
            _retry_db(lambda: self._finalize())
            return Outcome("no unit left", False)
        crash_point("after_claim")
        return self._run_unit(unit, info, options, dataset_path, output_dir)

    def _claim(self) -> ClaimedUnit | None:
        with session_scope(self.db_url) as session:
            if repo.job_state(session, self.job_id) != JobState.running.value:
                return None
            return repo.claim_unit(session, self.job_id, self.owner, self.settings.lease_seconds, time.time())

    def _finalize(self) -> bool:
        return finalize_if_complete(self.db_url, self.job_id)

    # --- one unit ---------------------------------------------------------------------------------------

    def _processor(self, info: EngineInfo, options: dict[str, Any]) -> UnitProcessor:
        from workers.chat import ChatEncoder

        tokenizer = self._tokenizer(info)
        encoder = ChatEncoder(tokenizer, bool(options.get("chat_template", True)), options.get("max_length"))
        return UnitProcessor(
            self.client,
            info,
            encoder,
            self._dump_dir(info),
            self.settings.dump_wait_seconds,
            self.settings.engine_concurrency,
            bool(options.get("cache_namespace_per_request", True)),
        )

    def _run_unit(
        self, unit: ClaimedUnit, info: EngineInfo, options: dict[str, Any], dataset_path: str, output_dir: str
    ) -> Outcome:
        keeper = LeaseKeeper(self.db_url, unit, self.settings.lease_seconds, self.settings.heartbeat_seconds)
        try:
            with keeper:
                processor = self._processor(info, options)
                result = processor.process(
                    unit,
                    dataset_path,
                    options.get("format", "auto"),
                    lambda: keeper.should_stop or SHUTDOWN.is_set(),
                )
                crash_point("mid_unit")
                if keeper.should_stop or SHUTDOWN.is_set():
                    raise UnitAborted("stopped before commit")
                committed = self._commit(unit, result, output_dir)
        except UnitAborted as exc:
            self._release(unit)
            return Outcome(f"unit {unit.unit_index} released: {exc}", False)
        except EngineUnavailable as exc:
            self._release(unit)
            self._fail(f"engine unavailable after {self.settings.engine_retries} retries: {exc}")
            return Outcome("engine unavailable", False)
        except ShardWriteError as exc:
            self._release(unit)
            self._fail(f"could not write shard for unit {unit.unit_index}: {exc}")
            return Outcome("shard write failed", False)
        if not committed:
            return Outcome(f"unit {unit.unit_index} lease lost; nothing committed", True)
        done = _retry_db(lambda: self._finalize())
        return Outcome(
            f"unit {unit.unit_index}: {result.samples_done} samples, {len(result.rejections)} rejected",
            not done,
        )

    def _release(self, unit: ClaimedUnit) -> None:
        try:
            with session_scope(self.db_url) as session:
                repo.release_unit(session, unit)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            log.warning("could not release unit %s: %s", unit.id, exc)

    def _commit(self, unit: ClaimedUnit, result: UnitResult, output_dir: str) -> bool:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        final = shard_path(output_dir, unit.unit_index)
        staged = staged_path(output_dir, unit.unit_index, unit.attempt)
        shard: ShardRow | None = None
        if result.samples_done:
            written = result.builder.write(staged)
            crash_point("after_shard_staged")
            shard = ShardRow(str(final), written.sha256, written.bytes, written.samples, written.tokens)

        def publish() -> None:
            if shard is not None:
                if staged.exists():
                    os.replace(staged, final)
                    fsync_dir(final.parent)
                elif _sha256_of(final) != shard.sha256:
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


def _sha256_of(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    except FileNotFoundError:
        return None
    return digest.hexdigest()
