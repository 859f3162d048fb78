"""An export made through the API: its id, its RQ job's id and where a worker writes it. Its state is a
row of the job table (:mod:`hsx.server.db.export_models`), not a file here.

The folder, under ``settings.resolved_exports_dir`` on the workers' hosts::

    <job_id>/<export_id>/       the export itself (appears only once complete; see hsx.integrations.exports)

Standard library only: the API computes the path to show it, and never opens it.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from hsx.server.settings import Settings

RQ_JOB_PREFIX = "hsx-export-"
STATES = ("queued", "running", "succeeded", "failed")
_EXPORT_ID = re.compile(r"^[0-9a-f]{32}$")


def new_export_id() -> str:
    return secrets.token_hex(16)


def is_export_id(text: str) -> bool:
    return bool(_EXPORT_ID.match(text))


def rq_job_id(export_id: str) -> str:
    return f"{RQ_JOB_PREFIX}{export_id}"


def export_dest(settings: Settings, job_id: str, export_id: str) -> Path:
    return settings.resolved_exports_dir / job_id / export_id
