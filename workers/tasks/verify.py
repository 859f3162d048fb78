"""The RQ entry point of ``POST /verify``: ``run_verify(engine_url)`` runs ``hsx verify`` on a worker, which
sees the engine's dumps (the API does not), and returns the report as a dict, answered through the queue."""

from __future__ import annotations

from typing import Any

from hsx.server.settings import get_settings


def run_verify(engine_url: str, reference: bool = False) -> dict[str, Any]:
    """``reference``: once every check passes, also compare each dump's values with a transformers forward
    of the same tokens (``hsx verify --reference``; the engine's model must be a local directory here)."""
    from hsx.engine.verify import run_verification

    settings = get_settings()
    # This worker's dump directory is where it sees its own engine's dumps; for another engine the engine's
    # own record (GET /hsx/info) says where they are.
    dump_dir = settings.dump_dir if settings.engine_url.rstrip("/") == engine_url.rstrip("/") else ""
    report = run_verification(engine_url, dump_dir or None)
    doc = report.to_dict()
    if reference and report.ok:
        from workers.reference_check import reference_checks

        extra = reference_checks(engine_url, dump_dir or None)
        doc["checks"].extend(check.to_dict() for check in extra)
        doc["ok"] = doc["ok"] and all(check.ok for check in extra)
    return doc
