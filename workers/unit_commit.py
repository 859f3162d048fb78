"""Committing a unit: place its staged shard under its final name and record the results, fenced by the
attempt that holds the lease, so a unit's shard and rejections are recorded exactly once whatever crashes
or retries happen in between."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy.exc import OperationalError

from hsx.layout import place_file, shard_data_sha256, shard_file_name, staged_shard_name
from hsx.server import telemetry
from hsx.server.db.session import retry_db, session_scope
from hsx.server.faults import crash_point
from hsx.server.jobs import unit_results
from hsx.server.jobs.repository import ClaimedUnit
from hsx.server.jobs.unit_results import CommitHook, ShardRow
from workers.shards import ShardWriteError
from workers.unit_processor import UnitResult

log = logging.getLogger(__name__)


def shard_path(output_dir: str, unit_index: int) -> Path:
    return Path(output_dir) / shard_file_name(unit_index)


def staged_path(output_dir: str, unit_index: int, attempt: int) -> Path:
    return Path(output_dir) / staged_shard_name(unit_index, attempt)


def commit_unit(
    db_url: str, unit: ClaimedUnit, result: UnitResult, output_dir: str, hooks: Sequence[CommitHook] = ()
) -> bool:
    """``hooks`` run inside the commit's transaction (:data:`hsx.server.jobs.unit_results.CommitHook`)."""
    final = shard_path(output_dir, unit.unit_index)
    staged = staged_path(output_dir, unit.unit_index, unit.attempt)
    shard: ShardRow | None = None
    if result.shard is not None:
        telemetry.bytes_written(result.shard.bytes)
        crash_point("after_shard_staged")
        info = result.shard
        shard = ShardRow(str(final), info.sha256, info.bytes, info.samples, info.tokens, info.header_sha256)

    def place() -> None:
        if shard is not None:
            if staged.exists():
                place_file(staged, final)
            elif shard_data_sha256(final) != shard.sha256:
                # Not renamed by an earlier try of this commit (whose transaction was then lost).
                raise ShardWriteError(final, None, f"the staged shard {staged.name} is gone")
            crash_point("after_rename")
        crash_point("before_row_commit")

    def attempt_commit() -> bool:
        try:
            with session_scope(db_url) as session:
                return unit_results.commit_unit(
                    session,
                    unit,
                    time.time(),
                    shard,
                    result.rejections,
                    result.samples_done,
                    result.tokens,
                    place,
                    result.truncations,
                    hooks,
                )
        except OperationalError:
            # The commit may have landed before the connection dropped: ask before retrying.
            with session_scope(db_url) as session:
                if unit_results.unit_committed_by(session, unit):
                    return True
            raise

    try:
        ok = bool(retry_db(attempt_commit))
    finally:
        if staged.exists():
            staged.unlink()
    crash_point("after_row_commit")
    if not ok:
        log.warning("unit %s attempt %s lost its lease; results dropped", unit.unit_index, unit.attempt)
    return ok
