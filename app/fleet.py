"""Where the work is: a job's units and leases, the workers holding them and the engines they feed.

Read-only views for the dashboard and ``hsx watch``. A lease owner is ``host:pid@engine_url`` (see
``workers.job_runner.lease_owner``), which is how a lease names both its worker and its engine.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from app.deps import SessionDep, SettingsDep
from app.jobs.schemas import ErrorOut
from hsx import contract, job_stats
from hsx.errors import NotFound
from hsx.jobs import repository as repo
from hsx.layout import split_lease_owner

router = APIRouter(tags=["fleet"])

ERRORS: dict[int | str, dict[str, object]] = {401: {"model": ErrorOut}, 404: {"model": ErrorOut}}
# Engines that committed a unit this recently are listed even when no lease is live now.
RECENT_ENGINE_WINDOW = timedelta(hours=1)


class UnitOut(BaseModel):
    unit_index: int
    state: str
    attempt: int
    sample_start: int
    sample_end: int
    samples_done: int
    samples_rejected: int
    tokens: int
    worker: str | None
    engine: str | None
    lease_seconds_left: float | None
    finished_at: datetime | None


class UnitPage(BaseModel):
    items: list[UnitOut]
    total: int
    leased: int
    workers_busy: int


class WorkerOut(BaseModel):
    worker: str
    engine: str
    leases: int
    units: list[str]


class EngineOut(BaseModel):
    url: str
    configured: bool
    healthy: bool | None
    info: dict[str, object] | None
    live_leases: int
    units_done_last_hour: int


@router.get("/jobs/{job_id}/units", response_model=UnitPage, responses=ERRORS)
def job_units(job_id: str, session: SessionDep) -> UnitPage:
    if "\x00" in job_id or len(job_id) > 36 or repo.get_job(session, job_id) is None:
        raise NotFound(f"no job {job_id}", error="job_not_found")
    now = time.time()
    items: list[UnitOut] = []
    for u in job_stats.units_of(session, job_id):
        worker, engine = split_lease_owner(u.lease_owner)
        live = u.state == "leased" and u.lease_expires is not None and u.lease_expires >= now
        items.append(
            UnitOut(
                unit_index=u.unit_index,
                state=u.state,
                attempt=u.attempt,
                sample_start=u.sample_start,
                sample_end=u.sample_end,
                samples_done=u.samples_done,
                samples_rejected=u.samples_rejected,
                tokens=u.tokens,
                worker=worker,
                engine=engine,
                lease_seconds_left=round(u.lease_expires - now, 1) if live and u.lease_expires else None,
                finished_at=u.finished_at,
            )
        )
    leased = [i for i in items if i.lease_seconds_left is not None]
    return UnitPage(
        items=items, total=len(items), leased=len(leased), workers_busy=len({i.worker for i in leased})
    )


@router.get("/workers", response_model=list[WorkerOut], responses=ERRORS)
def workers(session: SessionDep) -> list[WorkerOut]:
    """Workers busy now: those holding a live lease, with the units they hold."""
    busy: dict[str, WorkerOut] = {}
    for lease in job_stats.live_leases(session, time.time()):
        worker, engine = split_lease_owner(lease.owner)
        key = lease.owner
        out = busy.setdefault(key, WorkerOut(worker=worker or "?", engine=engine or "?", leases=0, units=[]))
        out.leases += 1
        out.units.append(f"{lease.job_id}/{lease.unit_index}")
    return sorted(busy.values(), key=lambda w: w.worker)


@router.get("/engines", response_model=list[EngineOut], responses=ERRORS)
async def engines(session: SessionDep, settings: SettingsDep) -> list[EngineOut]:
    """The engine this API verifies against (probed) and every engine a worker fed recently (as reported
    by the leases; not probed, since the API may not reach them)."""
    since = datetime.now(timezone.utc) - RECENT_ENGINE_WINDOW
    leases = await run_in_threadpool(job_stats.live_leases, session, time.time())
    done = await run_in_threadpool(job_stats.done_units_by_owner, session, since)
    per_engine: dict[str, EngineOut] = {}

    def entry(url: str) -> EngineOut:
        return per_engine.setdefault(
            url,
            EngineOut(
                url=url, configured=False, healthy=None, info=None, live_leases=0, units_done_last_hour=0
            ),
        )

    configured = entry(settings.engine_url)
    configured.configured = True
    for lease in leases:
        entry(split_lease_owner(lease.owner)[1] or "?").live_leases += 1
    for owner, n in done.items():
        entry(split_lease_owner(owner)[1] or "?").units_done_last_hour += n
    configured.healthy, configured.info = await _probe(settings.engine_url)
    return sorted(per_engine.values(), key=lambda e: (not e.configured, e.url))


async def _probe(url: str) -> tuple[bool, dict[str, object] | None]:
    import httpx

    base = url.rstrip("/")
    try:
        async with httpx.AsyncClient(timeout=3) as client:
            health = await client.get(base + "/health")
            if health.status_code != 200:
                return False, None
            info = await client.get(base + contract.INFO_PATH)
            return True, info.json() if info.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return False, None
