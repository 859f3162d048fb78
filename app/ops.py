"""Operator routes: liveness, readiness and the engine safety check."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import text

from app.deps import SessionDep, SettingsDep
from app.jobs.schemas import ErrorOut, VerifyOut
from hsx.jobs.queue import redis_connection

health_router = APIRouter(tags=["health"])
verify_router = APIRouter(tags=["verify"])


@health_router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@health_router.get("/readyz")
def readyz(session: SessionDep, settings: SettingsDep) -> JSONResponse:
    import httpx

    checks: dict[str, str] = {}
    try:
        session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - readiness reports, never raises
        checks["database"] = f"error: {exc.__class__.__name__}"
    try:
        redis_connection(settings).ping()
        checks["redis"] = "ok"
    except Exception as exc:  # noqa: BLE001
        checks["redis"] = f"error: {exc.__class__.__name__}"
    try:
        httpx.get(settings.engine_url.rstrip("/") + "/health", timeout=5).raise_for_status()
        checks["engine"] = "ok"
    except Exception as exc:  # noqa: BLE001
        checks["engine"] = f"error: {exc.__class__.__name__}"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)


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
