"""Whether ``POST /jobs`` may accept a job, where the answer is already known: the configured engine
(``HSX_ENGINE_URL``) answers and fails the preflight (``hsx verify``), so no worker of this deployment could
ever serve the job. Refused then with a 422 naming the failed checks, rather than queued to fail after
``HSX_NO_FIT_ENGINE_SECONDS``.

Not refused: an engine that does not answer now (every worker checks its own engine), a preflight whose
failures may be the API's own view (it could not load a tokenizer, or a prefill did not come back in time),
and any job in a fleet (``HSX_ENGINE_FLEET=true``), where other engines may join. Those jobs keep the wait,
and the job document says so (``engine_wait``).

A preflight is two prefills of a short prompt, judged on the engine's replies alone (its info, the cached
and prompt token counts): nothing is dumped, since the API has no view of the dumps (the workers validate
every dump of a job; ``POST /verify`` runs the full check on a worker). Its result is kept per engine
identity (everything
``/hsx/info`` reports, the prefix cache included) for ``HSX_SUBMIT_PREFLIGHT_TTL_SECONDS``, so a burst of
submissions runs it once and a restarted engine with other settings is checked afresh.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from hsx.contract import EngineInfo
from hsx.engine import fitness as engine_fitness
from hsx.server.settings import Settings

# Shorter than hsx verify's own limits: a preflight that cannot finish in this time decides nothing here.
PREFLIGHT_TIMEOUT_SECONDS = 30.0
# Failed checks that may say more about the API's host or the moment than about the engine (no tokenizer
# files, a request lost in transit): never a reason to refuse. Every other check judges what the engine
# itself reported.
INCONCLUSIVE_CHECKS = ("engine_info", "tokenizer", ".generate")


@dataclass(frozen=True)
class Preflight:
    refused: bool
    failed: tuple[str, ...]  # "name: expected X, got Y" for every failed check

    @property
    def detail(self) -> str:
        return "; ".join(self.failed)


Key = tuple[str, str]
_results: dict[Key, tuple[float, Preflight]] = {}
# One preflight at a time per API process: submissions that arrive meanwhile wait for it and share it.
_lock = threading.Lock()
# Preflights started for /readyz, which waits for one only a little while (see preflight_within).
_pending: dict[Key, Future[Preflight]] = {}
_pending_lock = threading.Lock()


def _key(settings: Settings, info: EngineInfo) -> Key:
    return (settings.engine_url, engine_fitness.identity_digest(info))


def _kept(key: Key, settings: Settings) -> Preflight | None:
    kept = _results.get(key)
    if kept is not None and time.monotonic() - kept[0] < settings.submit_preflight_ttl_seconds:
        return kept[1]
    return None


def preflight(settings: Settings, info: EngineInfo) -> Preflight:
    """The configured engine's preflight, run at most once per identity and TTL in this process."""
    key = _key(settings, info)
    with _lock:
        kept = _kept(key, settings)
        if kept is not None:
            return kept
        result = _run(settings)
        _results[key] = (time.monotonic(), result)
        return result


def preflight_within(settings: Settings, info: EngineInfo, wait_seconds: float) -> Preflight | None:
    """The same preflight (and the same kept result) as :func:`preflight`, or None when it is not known
    within ``wait_seconds``: a readiness probe must answer in a probe's time, while a preflight may take
    many seconds on a loaded host. The preflight goes on in the background, one per identity, so a later
    probe (or a submission) finds its result."""
    key = _key(settings, info)
    with _pending_lock:
        future = _pending.get(key)
        if future is None:
            kept = _kept(key, settings)
            if kept is not None:
                return kept
            future = _pending[key] = Future()
            threading.Thread(
                target=_settle, args=(future, key, settings, info), name="hsx-preflight", daemon=True
            ).start()
    try:
        return future.result(timeout=wait_seconds)
    except FutureTimeout:
        return None


def _settle(future: Future[Preflight], key: Key, settings: Settings, info: EngineInfo) -> None:
    try:
        future.set_result(preflight(settings, info))
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
        future.set_exception(exc)
    finally:
        with _pending_lock:
            _pending.pop(key, None)


def _run(settings: Settings) -> Preflight:
    from hsx.engine.verify import run_verification

    report = run_verification(
        settings.engine_url, rid_prefix_tag="submit", timeout=PREFLIGHT_TIMEOUT_SECONDS, dumps=False
    )
    failed = [c for c in report.checks if not c.ok]
    conclusive = [c for c in failed if not any(c.name.endswith(n) for n in INCONCLUSIVE_CHECKS)]
    described = tuple(f"{c.name}: expected {c.expected}, got {c.actual}" for c in failed)
    return Preflight(refused=bool(conclusive), failed=described)


def wait_statement(settings: Settings) -> str:
    """What the job document says about waiting for a fit engine."""
    window = f"{settings.no_fit_engine_seconds:g}s"
    if settings.engine_fleet:
        return (
            f"fleet (HSX_ENGINE_FLEET): other engines may join, so a job is not refused for the configured "
            f"engine's preflight; it waits up to {window} for a fit engine, then fails naming those it met"
        )
    return (
        f"single engine: POST /jobs refuses a job the configured engine (when it answers) is unfit for; an "
        f"accepted job that meets no fit engine for {window} fails, naming those it met"
    )
