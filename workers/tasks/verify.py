"""The RQ entry point of ``POST /verify``: ``run_verify(engine_url)`` runs ``hsx verify`` on a worker, which
sees the engine's dumps (the API does not), and returns the report as a dict, answered through the queue."""

from __future__ import annotations

from typing import Any

from hsx.settings import get_settings


def run_verify(engine_url: str) -> dict[str, Any]:
    from hsx.verify import run_verification

    settings = get_settings()
    # This worker's dump directory is where it sees its own engine's dumps; for another engine the engine's
    # own record (GET /hsx/info) says where they are.
    dump_dir = settings.dump_dir if settings.engine_url.rstrip("/") == engine_url.rstrip("/") else ""
    return run_verification(engine_url, dump_dir or None).to_dict()
