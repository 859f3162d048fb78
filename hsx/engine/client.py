"""The worker's side of the engine protocol: prefill requests over HTTP (dumps are read by hsx.engine.dumps),
and the generations of regeneration (hsx.engine.regenerate_contract).

No torch here: the API process (through :mod:`hsx.engine.verify`) uses this too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from hsx import contract
from hsx.engine import regenerate_contract as engine_contract
from hsx.engine.regenerate_contract import Generation, GenerationParams
from hsx.errors import HsxError, ReasonError
from hsx.server.retry import engine_policy

DEFAULT_TIMEOUT_SECONDS = 600.0
DEFAULT_RETRIES = 4
DEFAULT_BACKOFF_SECONDS = 0.5
# Statuses that say the server is not an hsx engine (or not this route's), whatever the request: the
# engine is unfit, not the sample.
ENGINE_LEVEL_STATUSES = frozenset({401, 403, 404, 405})
# /hsx/info is answered at once by a live engine, however long its prefills take (their timeout is
# HSX_ENGINE_TIMEOUT_SECONDS): a frozen engine is found out in seconds, not in a prefill's time.
INFO_TIMEOUT_SECONDS = 15.0


class EngineError(HsxError):
    """Base of the engine failures a worker turns into a retry or a rejected sample."""

    status_code = 503
    error = "engine_error"


class EngineUnavailable(EngineError):
    """The engine did not answer properly (connection errors, 5xx), after the retries."""

    error = "engine_unavailable"


class EngineTimeout(EngineUnavailable):
    """A prefill got no answer within the timeout. Not resent by the client: the engine may still be
    working on it, and the same rid again would run twice (or be refused as a duplicate)."""

    error = "engine_timeout"


class EngineUnfit(EngineError):
    """This engine cannot serve the job at all (not an hsx engine, another model, a reply or dump that
    breaks the protocol): its worker gives the work back for others and takes no more of the job."""

    error = "engine_unfit"


class EngineRejected(EngineError, ReasonError):
    """The engine refused the request (4xx); retrying it unchanged cannot help."""

    status_code = 502

    def __init__(self, reason: str, status: int = 400, detail: str = "") -> None:
        ReasonError.__init__(self, reason, detail)
        self.status = status


class DumpMissing(EngineError):
    """No complete dump appeared for a request in time."""

    error = "dump_missing"


class DumpCorrupt(DumpMissing):
    """A dump is present but unreadable; for a sample it is as good as missing."""


class EngineClient:
    def __init__(
        self,
        base_url: str,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF_SECONDS,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = max(0, retries)
        self.policy = engine_policy(retries, backoff)
        self.timeout = timeout
        # Connecting is quick or hopeless; only the prefill itself may take long.
        self._http = httpx.Client(
            base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0))
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def info(self) -> contract.EngineInfo:
        """``GET /hsx/info``; raises :class:`EngineUnfit` when the server is not an hsx engine."""
        try:
            raw = self._request("GET", contract.INFO_PATH, timeout=INFO_TIMEOUT_SECONDS)
        except EngineRejected as exc:
            raise EngineUnfit(
                f"{self.base_url}{contract.INFO_PATH} answered HTTP {exc.status} ({exc}): not an hsx engine "
                "(a stock server without the hsx plugin?)"
            ) from exc
        if not isinstance(raw, dict):
            raise EngineUnfit(f"{self.base_url}{contract.INFO_PATH} did not answer a JSON object")
        try:
            return contract.EngineInfo.from_dict(raw)
        except TypeError as exc:  # a required field is absent: not an hsx-capable engine
            raise EngineUnfit(f"{self.base_url}{contract.INFO_PATH} is not an hsx engine's: {exc}") from exc

    def prefill(self, input_ids: Sequence[int], rid: str, extra_key: str | None = None) -> dict[str, Any]:
        """``POST /generate`` for one prompt; the engine's JSON reply. A 4xx that no request could avoid
        (401, 403, 404, 405) is :class:`EngineUnfit`; other 4xx are :class:`EngineRejected`."""
        body = contract.generate_body([int(token) for token in input_ids], rid, extra_key)
        try:
            reply = self._request("POST", "/generate", json=body)
        except EngineRejected as exc:
            if exc.status in ENGINE_LEVEL_STATUSES:
                raise EngineUnfit(f"{self.base_url}/generate answered HTTP {exc.status}: {exc}") from exc
            raise
        if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
            raise EngineUnfit(f"/generate answered without meta_info: {str(reply)[:200]}")
        return reply

    def generate(
        self, input_ids: Sequence[int], params: GenerationParams, rid: str, extra_key: str | None = None
    ) -> Generation:
        """``POST /generate`` continuing one prompt (``rid``: a generation rid, never a captured one).

        Errors are the prefill's: :class:`EngineRejected` when the engine refuses this request (a 4xx) or
        aborts it (reason ``generation_aborted``): the sample's, not the engine's; :class:`EngineUnfit`
        for a route no request could use or a reply that breaks the contract; :class:`EngineUnavailable`
        (and :class:`EngineTimeout`, never resent) when it does not answer. Thread-safe, like
        :meth:`prefill`: callers keep several in flight from a pool.
        """
        ids = [int(token) for token in input_ids]
        body = engine_contract.generate_body(ids, params, rid, extra_key)
        try:
            reply = self._request("POST", "/generate", json=body)
        except EngineRejected as exc:
            if exc.status in ENGINE_LEVEL_STATUSES:
                raise EngineUnfit(f"{self.base_url}/generate answered HTTP {exc.status}: {exc}") from exc
            raise
        try:
            return engine_contract.parse_reply(reply, len(ids), params)
        except engine_contract.GenerationAborted as exc:
            raise EngineRejected("generation_aborted", 200, exc.message) from exc
        except engine_contract.GenerationReplyError as exc:
            raise EngineUnfit(f"{self.base_url}/generate broke the generation contract: {exc}") from exc

    def alive(self) -> bool:
        """Whether the engine answers ``/hsx/info`` now (after the usual retries)."""
        try:
            self.info()
        except EngineError:
            return False
        return True

    def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None) -> Any:
        limit: Any = httpx.USE_CLIENT_DEFAULT
        if timeout is not None:
            limit = httpx.Timeout(min(timeout, self.timeout), connect=min(timeout, self.timeout, 10.0))

        def once() -> Any:
            try:
                response = self._http.request(method, path, json=json, timeout=limit)
            except httpx.ReadTimeout as exc:
                if method != "GET":
                    raise EngineTimeout(f"{method} {path}: no answer within the timeout ({exc})") from exc
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            except httpx.TransportError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            if response.status_code >= 500:
                raise _Transient(f"HTTP {response.status_code}: {response.text[:200]}")
            if response.status_code >= 400:
                reason, detail = _rejection(response)
                raise EngineRejected(reason, response.status_code, detail)
            try:
                return response.json()
            except ValueError as exc:
                raise EngineUnavailable(f"{method} {path}: reply is not JSON: {response.text[:200]}") from exc

        try:
            return self.policy.call(once, (_Transient,), f"{method} {self.base_url}{path}")
        except _Transient as exc:
            raise EngineUnavailable(
                f"{method} {self.base_url}{path} failed {self.policy.attempts} times; last: {exc}"
            ) from exc


class _Transient(Exception):
    """A failure a later try may not meet: no connection, a 5xx, a GET that timed out."""


def _rejection(response: httpx.Response) -> tuple[str, str]:
    """The reason and detail of a 4xx: hsx engines send ``{"error", "detail"}``, SGLang a message object."""
    try:
        body = response.json()
    except ValueError:
        return f"http_{response.status_code}", response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, str):
            return error, str(body.get("detail", ""))
        if isinstance(error, dict):
            return f"http_{response.status_code}", str(error.get("message", error))
        if "message" in body:
            return f"http_{response.status_code}", str(body["message"])
        if "detail" in body:
            return f"http_{response.status_code}", str(body["detail"])
    return f"http_{response.status_code}", str(body)[:500]
