"""Where the work is: a job's units and leases, the workers holding them and the engines they feed.

Read-only views for the dashboard and ``hsx watch``. A lease owner is ``host:pid@engine_url`` (see
``workers.job_runner.lease_owner``), which is how a lease names both its worker and its engine.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

from sqlalchemy.orm import Session

from app.fleet import schemas
from app.jobs.service import JobService
from hsx import contract
from hsx.layout import split_lease_owner
from hsx.server.jobs import queries
from hsx.server.settings import Settings

# Engines that committed a unit this recently are listed even when no lease is live now.
RECENT_ENGINE_WINDOW = timedelta(hours=1)


class FleetService:
    def __init__(self, session: Session, settings: Settings) -> None:
        self.session = session
        self.settings = settings

    def units(self, job_id: str) -> schemas.UnitPage:
        JobService(self.session, self.settings).get(job_id)
        items = [
            schemas.UnitOut.model_validate(u) for u in queries.units_of(self.session, job_id, time.time())
        ]
        leased = [i for i in items if i.lease_seconds_left is not None]
        return schemas.UnitPage(
            items=items, total=len(items), leased=len(leased), workers_busy=len({i.worker for i in leased})
        )

    def workers(self) -> list[schemas.WorkerOut]:
        busy: dict[str, schemas.WorkerOut] = {}
        for lease in queries.live_leases(self.session, time.time()):
            worker, engine = split_lease_owner(lease.owner)
            out = busy.setdefault(
                lease.owner, schemas.WorkerOut(worker=worker or "?", engine=engine or "?", leases=0, units=[])
            )
            out.leases += 1
            out.units.append(f"{lease.job_id}/{lease.unit_index}")
        return sorted(busy.values(), key=lambda w: w.worker)

    def engines(self) -> list[schemas.EngineOut]:
        """The configured engine first (not probed here), then every engine with a live lease or a unit
        committed in the last hour."""
        since = datetime.now(timezone.utc) - RECENT_ENGINE_WINDOW
        leases = queries.live_leases(self.session, time.time())
        done = queries.done_units_by_owner(self.session, since=since)
        per_engine: dict[str, schemas.EngineOut] = {}

        def entry(url: str) -> schemas.EngineOut:
            return per_engine.setdefault(
                url,
                schemas.EngineOut(
                    url=url, configured=False, healthy=None, info=None, live_leases=0, units_done_last_hour=0
                ),
            )

        entry(self.settings.engine_url).configured = True
        for lease in leases:
            entry(split_lease_owner(lease.owner)[1] or "?").live_leases += 1
        for owner, n in done.items():
            entry(split_lease_owner(owner)[1] or "?").units_done_last_hour += n
        return sorted(per_engine.values(), key=lambda e: (not e.configured, e.url))


async def probe(url: str) -> tuple[bool, dict[str, object] | None]:
    """Whether an engine answers ``/health``, and its info."""
    import httpx

    base = url.rstrip("/")
    try:
        async with httpx.AsyncClient(timeout=3) as client:
            health = await client.get(base + "/health")
            if health.status_code != 200:
                return False, None
            info = await client.get(base + contract.INFO_PATH)
            return True, info.json() if info.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return False, None
