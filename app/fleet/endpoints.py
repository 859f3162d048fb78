"""HTTP routes of the fleet views (the dashboard and ``hsx watch``). Routers hold no SQL and no rules: they
call the service."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from app.deps import SessionDep, SettingsDep
from app.fleet import schemas
from app.fleet.service import FleetService, probe
from app.jobs.schemas import ErrorOut

router = APIRouter(tags=["fleet"])

ERRORS: dict[int | str, dict[str, object]] = {401: {"model": ErrorOut}, 404: {"model": ErrorOut}}


@router.get("/jobs/{job_id}/units", response_model=schemas.UnitPage, responses=ERRORS)
def job_units(job_id: str, session: SessionDep, settings: SettingsDep) -> schemas.UnitPage:
    return FleetService(session, settings).units(job_id)


@router.get("/workers", response_model=list[schemas.WorkerOut], responses=ERRORS)
def workers(session: SessionDep, settings: SettingsDep) -> list[schemas.WorkerOut]:
    """Workers busy now: those holding a live lease, with the units they hold."""
    return FleetService(session, settings).workers()


@router.get("/engines", response_model=list[schemas.EngineOut], responses=ERRORS)
async def engines(session: SessionDep, settings: SettingsDep) -> list[schemas.EngineOut]:
    """The engine this API verifies against (probed) and every engine a worker fed recently (as reported
    by the leases; not probed, since the API may not reach them)."""
    found = await run_in_threadpool(FleetService(session, settings).engines)
    configured = found[0]
    configured.healthy, configured.info = await probe(settings.engine_url)
    return found
