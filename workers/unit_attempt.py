"""How one attempt at a claimed unit ends, and what each end does to the unit and the job:

* committed, or its lease lost (nothing written; another attempt has the unit);
* released untouched: the lease was lost or the job stopped before the commit, or the worker is stopping;
* the engine does not answer or is unfit (:mod:`workers.engine_gate`): the unit goes back untouched for
  healthy workers and this worker takes no more units of the job in this wake-up;
* a failure no retry heals (the dataset is gone or changed, the disk is full, no usable tokenizer): the
  unit and the job fail at once, with the reason, while this attempt still holds the lease;
* any other error: counted on the unit, which goes back to be tried again; at ``HSX_UNIT_MAX_FAILURES``
  the unit fails and the job with it, saying why (``GET /jobs/{id}``; ``POST /jobs/{id}/retry`` resumes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hsx.contract import EngineInfo
from hsx.engine.client import EngineUnavailable, EngineUnfit
from hsx.server import telemetry
from hsx.server.db.session import retry_db, session_scope
from hsx.server.ingest import DatasetError
from hsx.server.jobs import engines_met, recovery
from hsx.server.jobs import repository as repo
from hsx.server.jobs.repository import ClaimedUnit
from hsx.server.settings import Settings
from workers.engine_gate import EngineGate
from workers.job_tokenizer import TokenizerMissing
from workers.job_view import Outcome
from workers.shards import ShardWriteError
from workers.unit_pipeline import UnitPipeline
from workers.unit_processor import UnitAborted

log = logging.getLogger(__name__)


def rounded(timing: dict[str, float]) -> dict[str, float]:
    return {name: round(value, 3) for name, value in timing.items()}


class UnitAttempt:
    def __init__(
        self,
        job_id: str,
        settings: Settings,
        pipeline: UnitPipeline,
        gate: EngineGate,
        info: EngineInfo,
        wake_more: Callable[[], None],
    ) -> None:
        self.job_id = job_id
        self.settings = settings
        self.db_url = settings.resolved_database_url
        self.pipeline = pipeline
        self.gate = gate
        self.info = info
        self.wake_more = wake_more

    def run(self, unit: ClaimedUnit) -> Outcome:
        if not self.pipeline.readable(unit):
            return self._fail_for_good(unit, "the unit has no record range (a job made before schema 0002?)")
        try:
            done = self.pipeline.run(unit)
        except UnitAborted as exc:
            self._release(unit)
            telemetry.unit_finished("released")
            return Outcome(f"unit {unit.unit_index} released: {exc}", False)
        except (EngineUnavailable, EngineUnfit) as exc:
            # This engine's fault, not the unit's: healthy workers take it from here.
            self._release(unit)
            self.wake_more()
            telemetry.engine_error("unavailable" if isinstance(exc, EngineUnavailable) else "unfit")
            telemetry.unit_finished("released")
            state = engines_met.UNAVAILABLE if isinstance(exc, EngineUnavailable) else engines_met.UNFIT
            return self.gate.refuse(state, str(exc), self.info).outcome()
        except ShardWriteError as exc:
            return self._fail_for_good(unit, f"could not write shard for unit {unit.unit_index}: {exc}")
        except DatasetError as exc:
            return self._fail_for_good(unit, f"dataset {exc.reason}: {exc.detail}")
        except TokenizerMissing as exc:
            return self._fail_for_good(unit, str(exc))
        except Exception as exc:  # noqa: BLE001 - any other cause: counted, and bounded by the setting
            log.exception("unit %s attempt %s failed", unit.unit_index, unit.attempt)
            return self._count_failure(unit, f"{type(exc).__name__}: {exc}")
        telemetry.unit_finished("committed" if done.committed else "lease_lost")
        if not done.committed:
            return Outcome(f"unit {unit.unit_index} lease lost; nothing committed", True)
        result = done.result
        timing = {
            "waiting_s": result.waiting_s,
            "copying_s": result.copying_s,
            "closing_s": result.closing_s,
            "write_s": result.write_s,
            "fsync_s": result.fsync_s,
            "commit_s": done.commit_s,
            # From the engine's answer to the unit's last prefill to the unit's commit.
            "tail_s": done.committed_at - result.last_answer if result.last_answer else 0.0,
        }
        return Outcome(
            f"unit {unit.unit_index}: {result.samples_done} samples, {len(result.rejections)} rejected, "
            f"{len(result.truncations)} truncated",
            True,
            rounded(timing),
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
