"""The RQ entry point of an export made through the API: ``run_export(job_id, export_id)``.

It runs in any ``hsx worker`` (same queue as the extraction units) and keeps the export's status record
(hsx.export.status) up to date. Running it again is safe: a finished export is not redone, and an export
whose folder is complete but whose record still says ``running`` (a crash between the two) is recorded
as succeeded from the folder's own report.
"""

from __future__ import annotations

import logging

from hsx.errors import HsxError
from hsx.export.common import REPORT_FILE, ExportOptions, export_output, load_report
from hsx.export.status import ExportStatus, export_dest, read_status, write_status
from hsx.settings import get_settings

log = logging.getLogger(__name__)


def run_export(job_id: str, export_id: str) -> str:
    from hsx.loader import LoaderError

    settings = get_settings()
    status = read_status(settings, job_id, export_id)
    if status is None:
        return f"export {export_id} of job {job_id} has no status record; nothing to do"
    if status.state == "succeeded":
        return f"export {export_id} already succeeded"
    dest = export_dest(settings, job_id, export_id)
    status.state, status.error = "running", None
    status.attempts += 1
    write_status(settings, status)
    try:
        if (dest / REPORT_FILE).is_file():
            status.report = load_report(dest)
        else:
            status.report = export_output(status.source, status.format, dest, _options(status))
        status.state = "succeeded"
    except HsxError as exc:
        _fail(status, exc.error, exc.detail)
    except LoaderError as exc:
        _fail(status, "output_damaged", str(exc))
    except OSError as exc:
        _fail(status, "export_io_error", f"{exc.strerror or exc} ({exc.filename or dest})")
    except Exception as exc:
        _fail(status, "internal_error", f"{type(exc).__name__}: {exc}")
        write_status(settings, status)
        raise  # RQ keeps the traceback in its failed registry
    write_status(settings, status)
    log.info("export %s of job %s: %s", export_id, job_id, status.state)
    return f"export {export_id}: {status.state}"


def _options(status: ExportStatus) -> ExportOptions:
    known = set(ExportOptions.__dataclass_fields__)
    return ExportOptions(**{k: v for k, v in status.options.items() if k in known})


def _fail(status: ExportStatus, error: str, detail: str) -> None:
    status.state = "failed"
    status.error = {"error": error, "detail": detail}
    log.warning("export %s of job %s failed: %s: %s", status.id, status.job_id, error, detail)
