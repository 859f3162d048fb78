"""The RQ entry point of an export made through the API: ``run_export(job_id, export_id)``.

It runs in any ``hsx worker`` (same queue as the extraction units), which sees the job's output, and moves
the export's row (hsx.server.db.export_models) through its states: the API only recorded it. Running it again
is safe: a finished export is not redone, and an export whose folder is complete but whose row still says
``running`` (a crash between the two) is recorded as succeeded from the folder's own report.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hsx.errors import HsxError
from hsx.integrations.exports import REPORT_FILE, ExportOptions, export_output, load_report
from hsx.server.db.session import retry_db, session_scope
from hsx.server.jobs import exports
from hsx.server.jobs import repository as repo
from hsx.server.settings import get_settings

log = logging.getLogger(__name__)


def run_export(job_id: str, export_id: str) -> str:
    from hsx.loader import LoaderError

    settings = get_settings()
    db_url = settings.resolved_database_url
    started = retry_db(lambda: _start(db_url, job_id, export_id))
    if started is None:
        return f"export {export_id} of job {job_id} has no row; nothing to do"
    state, source, fmt, dest, raw_options = started
    if state == "succeeded":
        return f"export {export_id} already succeeded"
    report: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    try:
        if (Path(dest) / REPORT_FILE).is_file():
            report = load_report(Path(dest))
        else:
            report = export_output(source, fmt, dest, _options(raw_options))
    except HsxError as exc:
        error = _failure(export_id, job_id, exc.error, exc.detail)
    except LoaderError as exc:
        error = _failure(export_id, job_id, "output_damaged", str(exc))
    except OSError as exc:
        error = _failure(
            export_id, job_id, "export_io_error", f"{exc.strerror or exc} ({exc.filename or dest})"
        )
    except Exception as exc:
        error = _failure(export_id, job_id, "internal_error", f"{type(exc).__name__}: {exc}")
        retry_db(lambda: _finish(db_url, export_id, None, error))
        raise  # RQ keeps the traceback in its failed registry
    retry_db(lambda: _finish(db_url, export_id, report, error))
    outcome = "failed" if error else "succeeded"
    log.info("export %s of job %s: %s", export_id, job_id, outcome)
    return f"export {export_id}: {outcome}"


def _start(db_url: str, job_id: str, export_id: str) -> tuple[str, str, str, str, dict[str, Any]] | None:
    """The export's state before this run, and what to make: (state, source, format, dest, options)."""
    with session_scope(db_url) as session:
        job = repo.get_job(session, job_id)
        row = exports.start(session, export_id)
        if row is None or job is None or row.job_id != job_id:
            return None
        return row.state, job.output_dir, row.format, row.dest, dict(row.options)


def _finish(db_url: str, export_id: str, report: dict[str, Any] | None, error: dict[str, str] | None) -> None:
    with session_scope(db_url) as session:
        exports.finish(session, export_id, report=report, error=error)


def _options(raw: dict[str, Any]) -> ExportOptions:
    known = set(ExportOptions.__dataclass_fields__)
    return ExportOptions(**{k: v for k, v in raw.items() if k in known})


def _failure(export_id: str, job_id: str, error: str, detail: str) -> dict[str, str]:
    log.warning("export %s of job %s failed: %s: %s", export_id, job_id, error, detail)
    return {"error": error, "detail": detail}
