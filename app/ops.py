"""Operator routes: liveness, readiness and the engine safety check."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from app.deps import SessionDep, SettingsDep
from app.jobs.schemas import ErrorOut, VerifyOut
from hsx import engine_fitness
from hsx.engine_client import EngineClient, EngineError, EngineUnfit
from hsx.jobs import queries
from hsx.jobs.queue import redis_connection
from hsx.settings import Settings

health_router = APIRouter(tags=["health"])
verify_router = APIRouter(tags=["verify"])


@health_router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@health_router.get("/readyz")
def readyz(session: SessionDep, settings: SettingsDep) -> JSONResponse:
    """Ready when the database, Redis and a fit engine answer. ``engine`` says why an engine is unfit;
    ``engine_notes`` what it leaves unchecked, and ``engine_unfit_for_jobs`` which active jobs it could
    not serve (another model than theirs, say): informative, they do not make the API unready."""
    checks: dict[str, str] = {}
    body: dict[str, object] = {}
    try:
        queries.ping(session)
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - readiness reports, never raises
        checks["database"] = f"error: {exc.__class__.__name__}"
    try:
        redis_connection(settings).ping()
        checks["redis"] = "ok"
    except Exception as exc:  # noqa: BLE001
        checks["redis"] = f"error: {exc.__class__.__name__}"
    checks["engine"], notes, unfit = engine_readiness(session, settings)
    if notes:
        body["engine_notes"] = notes
    if unfit:
        body["engine_unfit_for_jobs"] = unfit
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse({"ready": ok, "checks": checks, **body}, status_code=200 if ok else 503)


def engine_readiness(session: Session, settings: Settings) -> tuple[str, list[str], dict[str, str]]:
    """``ok`` or why the configured engine is unfit; notes; why it could not serve each active job."""
    try:
        with EngineClient(settings.engine_url, timeout=5, retries=0) as client:
            info = client.info()
    except EngineUnfit as exc:
        return f"unfit: {exc}", [], {}
    except EngineError as exc:
        return f"error: {exc}", [], {}
    problem = engine_fitness.protocol_problem(info)
    notes = engine_fitness.unreported_identity(info)
    if info.prefix_cache:
        notes.append(f"prefix cache on: {engine_fitness.PREFIX_CACHE_PROBLEM}")
    unfit: dict[str, str] = {}
    for job in queries.active_jobs(session, limit=100):
        reason = engine_fitness.unfit_reason(info, dict(job.options), job.engine)
        if reason:
            unfit[job.id] = reason
    return (f"unfit: {problem}" if problem else "ok"), notes, unfit


@verify_router.post(
    "/verify",
    response_model=VerifyOut,
    responses={401: {"model": ErrorOut}, 413: {"model": ErrorOut}, 503: {"model": VerifyOut}},
)
async def verify(settings: SettingsDep) -> JSONResponse:
    """Known prompts in; ``cached_tokens == 0``, dumped count == prompt length and ids equal out."""
    from hsx.verify import run_verification

    report = await run_in_threadpool(run_verification, settings.engine_url, settings.dump_dir or None)
    return JSONResponse(report.to_dict(), status_code=200 if report.ok else 503)
