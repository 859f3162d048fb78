"""Where an export made through the API lives, and its state, kept in a JSON file (no database table).

Layout, under ``settings.resolved_exports_dir``::

    <job_id>/<export_id>.json   the status record, replaced whole through a rename on every change
    <job_id>/<export_id>/       the export itself (appears only once complete; see hsx.export.common)

The API writes the record (``queued``) before it enqueues the RQ job, and the RQ task moves it through
``running`` to ``succeeded`` or ``failed``. A file on the same shared storage as the job outputs survives
a Redis restart, and an export needs no migration. Standard library only.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hsx.layout import write_atomically
from hsx.settings import Settings

RQ_JOB_PREFIX = "hsx-export-"
STATES = ("queued", "running", "succeeded", "failed")
ACTIVE_STATES = ("queued", "running")
_EXPORT_ID = re.compile(r"^[0-9a-f]{32}$")


def now() -> str:
    return datetime.now(timezone.utc).isoformat()


def new_export_id() -> str:
    return secrets.token_hex(16)


def is_export_id(text: str) -> bool:
    return bool(_EXPORT_ID.match(text))


@dataclass
class ExportStatus:
    id: str
    job_id: str
    format: str
    options: dict[str, Any]
    source: str  # the job's output directory
    dest: str
    state: str = "queued"
    created_at: str = field(default_factory=now)
    updated_at: str = field(default_factory=now)
    attempts: int = 0
    error: dict[str, str] | None = None
    report: dict[str, Any] | None = None

    @property
    def rq_job_id(self) -> str:
        return f"{RQ_JOB_PREFIX}{self.id}"


def job_exports_dir(settings: Settings, job_id: str) -> Path:
    return settings.resolved_exports_dir / job_id


def status_path(settings: Settings, job_id: str, export_id: str) -> Path:
    return job_exports_dir(settings, job_id) / f"{export_id}.json"


def export_dest(settings: Settings, job_id: str, export_id: str) -> Path:
    return job_exports_dir(settings, job_id) / export_id


def write_status(settings: Settings, status: ExportStatus) -> None:
    status.updated_at = now()
    path = status_path(settings, status.job_id, status.id)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(asdict(status), indent=2, sort_keys=True))


def read_status(settings: Settings, job_id: str, export_id: str) -> ExportStatus | None:
    if not is_export_id(export_id):
        return None
    try:
        raw = json.loads(status_path(settings, job_id, export_id).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    known = set(ExportStatus.__dataclass_fields__)
    return ExportStatus(**{k: v for k, v in raw.items() if k in known})


def list_statuses(settings: Settings, job_id: str) -> list[ExportStatus]:
    folder = job_exports_dir(settings, job_id)
    if not folder.is_dir():
        return []
    found = [read_status(settings, job_id, path.stem) for path in folder.glob("*.json")]
    return sorted((s for s in found if s is not None), key=lambda s: s.created_at, reverse=True)
