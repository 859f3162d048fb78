"""Operator routes: liveness, readiness and the engine safety check."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from app.deps import SessionDep, SettingsDep
from app.jobs import admission
from app.jobs.schemas import ErrorOut, VerifyOut
from app.verification import verify_on_worker
from hsx.contract import EngineInfo
from hsx.engine import fitness as engine_fitness
from hsx.engine.client import EngineClient, EngineError, EngineUnfit
from hsx.server.jobs import queries
from hsx.server.redis_clients import redis_connection
from hsx.server.settings import Settings

health_router = APIRouter(tags=["health"])
verify_router = APIRouter(tags=["verify"])

# How long /readyz waits for a preflight it has not yet got a result of; it answers "checking" after that.
PREFLIGHT_WAIT_SECONDS = 3.0


@health_router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@health_router.get("/readyz")
def readyz(session: SessionDep, settings: SettingsDep) -> JSONResponse:
    """Ready when the database, Redis and a fit engine answer: fit as ``POST /jobs`` judges it, so that
    ready means a job would be accepted. With one engine that is the preflight (``hsx verify``, the
    failed checks in ``engine_failed_checks``); in a fleet (HSX_ENGINE_FLEET) other engines may serve the
    jobs, so only an engine that is no hsx engine of this protocol is unfit. ``engine_notes`` says what
    is left unchecked (a prefix cache in a fleet, say), ``engine_unfit_for_jobs`` which active jobs the
    engine could not serve (another model than theirs): informative, they do not make the API unready."""
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
    readiness = engine_readiness(session, settings)
    checks["engine"] = readiness.state
    if readiness.failed_checks:
        body["engine_failed_checks"] = readiness.failed_checks
    if readiness.notes:
        body["engine_notes"] = readiness.notes
    if readiness.unfit_for_jobs:
        body["engine_unfit_for_jobs"] = readiness.unfit_for_jobs
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse({"ready": ok, "checks": checks, **body}, status_code=200 if ok else 503)


@dataclass
class EngineReadiness:
    state: str  # "ok", "unfit: why", "checking: ..." or "error: why"
    failed_checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unfit_for_jobs: dict[str, str] = field(default_factory=dict)


def engine_readiness(session: Session, settings: Settings) -> EngineReadiness:
    """Whether the configured engine is fit as POST /jobs judges it, and why not."""
    try:
        with EngineClient(settings.engine_url, timeout=5, retries=0) as client:
            info = client.info()
    except EngineUnfit as exc:
        return EngineReadiness(f"unfit: {exc}")
    except EngineError as exc:
        return EngineReadiness(f"error: {exc}")
    problem = engine_fitness.protocol_problem(info)
    readiness = EngineReadiness(f"unfit: {problem}" if problem else "ok")
    readiness.notes = engine_fitness.unreported_identity(info)
    if not problem and not settings.engine_fleet:
        _judge_preflight(readiness, settings, info)
    elif info.prefix_cache:
        readiness.notes.append(f"prefix cache on: {engine_fitness.PREFIX_CACHE_PROBLEM}")
    for job in queries.active_jobs(session, limit=100):
        reason = engine_fitness.unfit_reason(info, dict(job.options), job.engine)
        if reason:
            readiness.unfit_for_jobs[job.id] = reason
    return readiness


def _judge_preflight(readiness: EngineReadiness, settings: Settings, info: EngineInfo) -> None:
    """The preflight POST /jobs runs (and keeps) for this engine: refused is unfit, naming the checks."""
    try:
        checked = admission.preflight_within(settings, info, PREFLIGHT_WAIT_SECONDS)
    except Exception as exc:  # noqa: BLE001 - readiness reports, never raises
        readiness.state = f"error: the preflight failed to run: {exc.__class__.__name__}: {exc}"
        return
    if checked is None:
        readiness.state = "checking: the preflight (hsx verify) is running; ask again in a few seconds"
    elif checked.refused:
        readiness.state = (
            "unfit: the engine failed the preflight, so POST /jobs refuses jobs (engine_failed_checks; "
            "HSX_ENGINE_FLEET=true would queue them for other engines)"
        )
        readiness.failed_checks = list(checked.failed)
    elif checked.failed:  # only checks that may be the API's own view: POST /jobs accepts, so ready
        readiness.notes.extend(f"preflight inconclusive here: {check}" for check in checked.failed)


@verify_router.post(
    "/verify",
    response_model=VerifyOut,
    responses={
        401: {"model": ErrorOut},
        413: {"model": ErrorOut},
        503: {"model": VerifyOut, "description": "A check failed, or the queue is unavailable (ErrorOut)"},
        504: {"model": ErrorOut, "description": "No worker ran the check in time"},
    },
)
async def verify(settings: SettingsDep, reference: bool = False) -> JSONResponse:
    """Known prompts in; ``cached_tokens == 0``, dumped count == prompt length and ids equal out. Run by a
    worker, which sees the engine's dumps (the API does not), and answered through the queue.
    ``reference=true``: once those pass, each dump's values are also compared with a transformers forward
    on the worker (``<prompt>.reference_cosine``; the engine's model must be a local directory there)."""
    report = await run_in_threadpool(verify_on_worker, settings, reference)
    return JSONResponse(report, status_code=200 if report.get("ok") else 503)
