"""Who may call the API, and how much a request may send.

Token policy, :func:`require_token`:

* A token is configured (``HSX_API_TOKEN`` or ``HSX_API_TOKEN_FILE``): every request needs
  ``Authorization: Bearer <token>``, loopback clients included, whatever ``HSX_AUTH_DISABLED`` says (a
  configured token is never silently ignored).
* No token and ``HSX_AUTH_DISABLED=true``: open to every client. An explicit opt-in for a trusted network.
* No token otherwise: loopback clients are served without one and everyone else gets 401. The embedded
  single-machine demo (API on 127.0.0.1) works with no setup, while an API exposed on a network by mistake
  refuses strangers instead of running open. A request that carries forwarding headers (``X-Forwarded-For``,
  ``Forwarded``, ``X-Real-IP``) came through a proxy and never counts as local, unless trusted proxies are
  configured (``HSX_FORWARDED_ALLOW_IPS``, which ``hsx api`` hands to uvicorn; without it uvicorn ignores
  those headers).
* A token that is configured but empty (``HSX_API_TOKEN=""``, an empty token file) or a token file that
  cannot be read: 503, failing closed rather than open. ``hsx api`` refuses to start in that case, and
  refuses to listen on a non-loopback address with no token at all (:func:`serving_refusal`).

The token is compared in constant time and never logged or echoed back.

:class:`BodySizeLimitMiddleware` caps request bodies without buffering them: a declared ``Content-Length``
over the limit is refused before the app runs, and a streamed (chunked) body is counted as the app reads it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.deps import SettingsDep
from hsx.errors import PayloadTooLarge, ServiceUnavailable, Unauthorized
from hsx.server.settings import Settings, TokenConfigError

log = logging.getLogger(__name__)

_CHALLENGE = {"WWW-Authenticate": "Bearer"}
_FORWARDING_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip")


def serving_refusal(host: str, settings: Settings) -> str | None:
    """Why the API must not start listening on ``host`` with ``settings``; None when it may."""
    try:
        token = settings.token()
    except TokenConfigError as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot read the API token file {settings.api_token_file}: {exc.strerror}"
    if token or settings.auth_disabled or _is_loopback_host(host):
        return None
    return (
        f"refusing to serve on {host} without an API token: set HSX_API_TOKEN_FILE (or HSX_API_TOKEN), "
        "or HSX_AUTH_DISABLED=true to serve every client on a trusted network"
    )


def _is_loopback_host(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


async def require_token(request: Request, settings: SettingsDep) -> None:
    """FastAPI dependency enforcing the token policy above; raises :class:`~hsx.errors.HsxError`. Async
    (it only compares strings and reads a small file): a sync one costs every request a thread-pool hop."""
    try:
        expected = settings.token()
    except TokenConfigError as exc:
        log.error("%s", exc)
        raise ServiceUnavailable("the API token is configured but empty", error="auth_unavailable") from None
    except OSError as exc:
        # The path is configuration, not a secret; the file's content is never touched here.
        log.error("cannot read the API token file %s: %s", settings.api_token_file, exc.strerror)
        raise ServiceUnavailable(
            "the API token is configured but cannot be read", error="auth_unavailable"
        ) from None
    if expected:
        presented = _bearer_credentials(request.headers.get("authorization"))
        # Starlette decodes header bytes as latin-1; encoding back gives the bytes the client sent.
        if presented is None or not hmac.compare_digest(
            presented.encode("latin-1"), expected.encode("utf-8")
        ):
            raise Unauthorized("a valid bearer token is required", headers=_CHALLENGE)
        return
    if settings.auth_disabled or _is_loopback_client(request, settings):
        return
    raise Unauthorized(
        "no API token is configured, so only local clients are served (requests relayed by a proxy are not "
        "local unless HSX_FORWARDED_ALLOW_IPS names it); set HSX_API_TOKEN_FILE "
        "(or HSX_AUTH_DISABLED=true on a trusted network)",
        headers=_CHALLENGE,
    )


def _bearer_credentials(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, credentials = header.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() != "bearer" or not credentials:
        return None
    return credentials


def _is_loopback_client(request: Request, settings: Settings) -> bool:
    if request.client is None:  # a Unix socket or an in-process call: no address to vouch for
        return False
    if not settings.forwarded_allow_ips and any(name in request.headers for name in _FORWARDING_HEADERS):
        return False  # relayed by a proxy nobody said to trust: the real client is somewhere else
    try:
        address = ipaddress.ip_address(request.client.host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class _BodyTooLarge(PayloadTooLarge):
    """Raised from ``receive`` once the streamed body passes the limit."""


class BodySizeLimitMiddleware:
    """Pure ASGI middleware answering 413 ``payload_too_large`` for bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            declared = _declared_length(scope)
        except ValueError:
            await _send_error(send, 400, "bad_request", "the Content-Length header is not a number")
            return
        if declared is not None and declared > self.max_bytes:
            await _send_error(send, 413, "payload_too_large", self._detail())
            return

        received = 0
        exceeded = False
        response_started = False
        answered = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            if exceeded:
                raise _BodyTooLarge(self._detail())
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise _BodyTooLarge(self._detail())
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started, answered
            if exceeded:
                # The app may catch the error and answer for itself (FastAPI turns a failed body read into
                # a 400); whatever it sends is replaced by the 413.
                if not response_started and not answered:
                    answered = True
                    await _send_error(send, 413, "payload_too_large", self._detail())
                return
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            if response_started:
                raise  # too late to answer; the server drops the connection
        if exceeded and not response_started and not answered:
            await _send_error(send, 413, "payload_too_large", self._detail())

    def _detail(self) -> str:
        return f"the request body is over the limit of {self.max_bytes} bytes"


def _declared_length(scope: Scope) -> int | None:
    """The Content-Length the client declared, if any; ValueError when it is not a number."""
    lengths = [value for name, value in scope.get("headers", ()) if name.lower() == b"content-length"]
    if not lengths:
        return None
    texts = [value.decode("latin-1").strip() for value in lengths]
    # int() alone would take "+5" and "1_0"; a Content-Length is digits only.
    if not all(text.isascii() and text.isdigit() for text in texts):
        raise ValueError("Content-Length is not a number")
    return max(int(text) for text in texts)


async def _send_error(send: Send, status: int, error: str, detail: str) -> None:
    body = json.dumps({"error": error, "detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                # The unread rest of the body would otherwise be parsed as the next request.
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
