"""The one error type the service raises on purpose, rendered as ``{"error": code, "detail": text}``.

Standard library only: workers and the engine plugin raise these too, without FastAPI. The API registers a
single exception handler that turns any :class:`HsxError` into a JSON response with :attr:`status_code`,
:meth:`body` and :attr:`headers`.

``error`` is a stable machine-readable code (clients branch on it); ``detail`` is for humans and may change.
"""

from __future__ import annotations

from collections.abc import Mapping


class HsxError(Exception):
    status_code: int = 500
    error: str = "internal_error"

    def __init__(self, detail: str, *, error: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(detail)
        self.detail = detail
        # Instance override of the class default, so one class can carry several precise codes.
        if error is not None:
            self.error = error
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, str]:
        return {"error": self.error, "detail": self.detail}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(error={self.error!r}, detail={self.detail!r})"


class BadRequest(HsxError):
    status_code = 400
    error = "bad_request"


class Unauthorized(HsxError):
    status_code = 401
    error = "unauthorized"


class Forbidden(HsxError):
    status_code = 403
    error = "forbidden"


class NotFound(HsxError):
    status_code = 404
    error = "not_found"


class Conflict(HsxError):
    status_code = 409
    error = "conflict"


class PayloadTooLarge(HsxError):
    status_code = 413
    error = "payload_too_large"


class UnsupportedMediaType(HsxError):
    status_code = 415
    error = "unsupported_media_type"


class ServiceUnavailable(HsxError):
    status_code = 503
    error = "service_unavailable"
