"""The hsx API: jobs, operator checks, one error shape."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError, ProgrammingError, SQLAlchemyError
from starlette.exceptions import HTTPException

from app.exports.endpoints import router as exports_router
from app.fleet.endpoints import router as fleet_router
from app.jobs.endpoints import router as jobs_router
from app.metrics import router as metrics_router
from app.ops import health_router, verify_router
from app.security import BodySizeLimitMiddleware, require_token
from app.streams.endpoints import router as streams_router
from app.ui import DashboardFiles
from hsx.errors import HsxError
from hsx.server.settings import get_settings

log = logging.getLogger(__name__)


def create_app() -> FastAPI:
    settings = get_settings()
    app = FastAPI(title="hsx", version="0.1.0", description="Verified EAGLE-3 hidden-state extraction jobs")

    @app.exception_handler(HsxError)
    async def _hsx_error(_request: Request, exc: HsxError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers or None)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        # Raised by the framework itself (unknown route, wrong method, a body that is not UTF-8): same shape.
        try:
            error = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_").replace("-", "_")
        except ValueError:
            error = "http_error"
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return JSONResponse(
            {"error": error, "detail": detail}, status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', '')}"
            for err in exc.errors()[:10]
        )
        return JSONResponse({"error": "invalid_request", "detail": problems}, status_code=422)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this answer; the client gets the one error shape, not text.
        return JSONResponse(internal_error_body(exc), status_code=500)

    app.include_router(health_router)
    protected = [Depends(require_token)]
    app.include_router(jobs_router, dependencies=protected)
    app.include_router(exports_router, dependencies=protected)
    app.include_router(streams_router, dependencies=protected)
    app.include_router(verify_router, dependencies=protected)
    app.include_router(fleet_router, dependencies=protected)
    app.include_router(metrics_router, dependencies=protected)
    # The dashboard's files hold no data and are served to anyone; every call the page makes needs the token.
    app.mount("/ui", DashboardFiles(), name="ui")
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    return app


def internal_error_body(exc: Exception) -> dict[str, str]:
    """The 500 answer: what failed, without a traceback; a database failure says what the database said."""
    if isinstance(exc, SQLAlchemyError):
        said = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        reason = said[0][:200] if said else type(exc).__name__
        hint = ""
        if isinstance(exc, OperationalError | ProgrammingError):
            hint = "; is it reachable, and migrated (hsx db upgrade with the API's HSX_DATABASE_URL)?"
        return {"error": "database_error", "detail": f"the database failed: {reason}{hint}"}
    return {
        "error": "internal_error",
        "detail": f"the server failed ({type(exc).__name__}); the API log has the details",
    }


app = create_app()
