"""The operator dashboard: static files served at ``/ui`` (``index.html``, ``app.js``, ``plot.js``,
``style.css``), no build step. The files hold no data; the page asks the API for everything with the user's
bearer token."""

from __future__ import annotations

from pathlib import Path

from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

UI_DIR = Path(__file__).resolve().parent

# The page runs only its own script and talks only to its own origin.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class DashboardFiles(StaticFiles):
    def __init__(self) -> None:
        super().__init__(directory=UI_DIR, html=True)

    async def get_response(self, path: str, scope: Scope) -> Response:
        if path.endswith(".py") or "__pycache__" in path:
            path = "__missing__"  # the package's own Python files are not part of the page
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response
