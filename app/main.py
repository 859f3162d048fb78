"""The hsx API: jobs, operator checks, one error shape."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from app.exports.endpoints import router as exports_router
from app.jobs.endpoints import router as jobs_router
from app.ops import health_router, verify_router
from app.security import BodySizeLimitMiddleware, require_token
from hsx.errors import HsxError
from hsx.settings import get_settings

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

    app.include_router(health_router)
    protected = [Depends(require_token)]
    app.include_router(jobs_router, dependencies=protected)
    app.include_router(exports_router, dependencies=protected)
    app.include_router(verify_router, dependencies=protected)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    return app


app = create_app()
