"""The engines a job met: one entry per worker host and engine URL, in ``jobs.engines`` (a JSON list).

A worker writes its engine's entry each time it joins a job: ``ok`` (it took units; ``verified`` once its
preflight passed for this job), ``unfit`` (another model, tokenizer or template than the job's, its prefix
cache on, a failed preflight, a protocol break) or ``unavailable`` (it did not
answer). ``GET /jobs/{id}`` shows the list, so a job waiting for a fit engine says why.

Entry: ``{"worker", "url", "state", "reason", "backend", "model_fingerprint", "identity", "verified",
"since", "seen"}``; ``since`` is when the entry entered its state, ``seen`` the last time a worker wrote it
(epoch seconds).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from hsx.server.db.models import Job, utcnow

OK = "ok"
UNFIT = "unfit"
UNAVAILABLE = "unavailable"
# A job keeps the latest entries only; a fleet that churns through hosts must not grow the row forever.
MAX_ENTRIES = 256


def note_engine(session: Session, job_id: str, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Insert or update the entry of ``(entry["worker"], entry["url"])``; returns the job's entries. The
    job row is locked for the read-modify-write, so concurrent workers do not lose each other's entries."""
    job = session.execute(select(Job).where(Job.id == job_id).with_for_update()).scalar_one_or_none()
    if job is None:
        return []
    entries = [dict(e) for e in (job.engines or [])]
    key = (entry["worker"], entry["url"])
    previous = next((e for e in entries if (e.get("worker"), e.get("url")) == key), None)
    merged = dict(entry)
    if previous is not None:
        if previous.get("state") == entry["state"] and "since" in previous:
            merged["since"] = previous["since"]
        entries.remove(previous)
    entries.append(merged)
    job.engines = entries[-MAX_ENTRIES:]
    job.updated_at = utcnow()
    return job.engines


def entry_of(entries: list[dict[str, Any]] | None, worker: str, url: str) -> dict[str, Any] | None:
    return next((e for e in entries or [] if (e.get("worker"), e.get("url")) == (worker, url)), None)


def no_fit_engine(entries: list[dict[str, Any]], live_leases: int, now: float, window: float) -> str | None:
    """Why the job must stop waiting, or None: no lease is live, no fit engine was seen for ``window``
    seconds, and the engines met have been unfit or unavailable for that long."""
    if live_leases:
        return None
    if any(e.get("state") == OK and now - float(e.get("seen", 0)) < window for e in entries):
        return None
    unfit = [e for e in entries if e.get("state") != OK]
    if not unfit or now - min(float(e.get("since", now)) for e in unfit) < window:
        return None
    reasons = "; ".join(f"{e.get('worker')} {e.get('url')}: {e.get('reason')}" for e in unfit[-4:])
    return f"no fit engine for {window:g}s: {reasons}"
