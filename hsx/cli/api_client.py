"""How the ``hsx`` client commands talk to the API: one HTTP client for a command's life, the API's refusals
as :class:`ApiError`, the exit codes a script can rely on, and errors and JSON printed for a person or a
script."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.text import Text

from hsx.server.settings import get_settings

# Exit codes. 0 is "succeeded" (or, for commands that wait for nothing, "done as asked").
EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2  # bad arguments, or the API refused the request (4xx: bad dataset, unknown job, no token)
EXIT_CANCELLED = 3
EXIT_TIMEOUT = 4  # --timeout passed while the job was still queued or running
EXIT_UNREACHABLE = 5  # no answer from the API, or a 5xx
EXIT_ACTIVE = 6  # hsx status: the job is still queued or running

STATE_EXIT = {"succeeded": EXIT_SUCCEEDED, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED}


class ApiError(Exception):
    def __init__(self, code: int, message: str, doc: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.doc = doc


@dataclass
class Api:
    url: str
    headers: dict[str, str]
    timeout: float = 30.0
    # One client for the command's life: a fresh one per call (httpx.request) costs about 40 ms of CPU,
    # its TLS context, which a watch polling every second takes from the job on a small host.
    _client: httpx.Client | None = field(default=None, repr=False)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._client is None:
            self._client = httpx.Client()
        try:
            kwargs.setdefault("timeout", self.timeout)
            resp = self._client.request(method, self.url.rstrip("/") + path, headers=self.headers, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(EXIT_UNREACHABLE, f"API unreachable at {self.url}: {exc}") from exc
        try:
            doc = resp.json()
        except ValueError:
            doc = {"error": "not_json", "detail": resp.text[:500]}
        if resp.status_code >= 500:
            raise ApiError(EXIT_UNREACHABLE, f"API error {resp.status_code}", doc)
        if resp.status_code >= 400:
            raise ApiError(EXIT_REFUSED, f"refused ({resp.status_code})", doc)
        return doc


def api_at(url: str) -> Api:
    """The API at ``url``, sending the token of this host's settings (HSX_API_TOKEN or HSX_API_TOKEN_FILE)
    when there is one."""
    token = get_settings().token()
    return Api(url, {"Authorization": f"Bearer {token}"} if token else {})


def exit_code_for_state(state: str | None, waiting: bool) -> int:
    """What a command that waited (``waiting``) or only looked returns for a job in ``state``."""
    if state in STATE_EXIT:
        return STATE_EXIT[state]
    return EXIT_TIMEOUT if waiting else EXIT_ACTIVE


def local_dataset_uri(dataset: str) -> str:
    """A relative local path means the caller's directory, not the API's: send it absolute."""
    if "://" in dataset or Path(dataset).is_absolute():
        return dataset
    return str(Path(dataset).resolve())


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True, default=str))


def print_error(exc: ApiError, as_json: bool) -> int:
    if as_json:
        print_json(exc.doc if exc.doc is not None else {"error": "unreachable", "detail": str(exc)})
    else:
        detail = exc.doc.get("detail") if isinstance(exc.doc, dict) else None
        error = exc.doc.get("error") if isinstance(exc.doc, dict) else None
        message = f"{exc}: {error}: {detail}" if error else str(exc)
        Console(stderr=True).print(Text(f"hsx: {message}", style="red"))
    return exc.code
