"""Trainer-format exports of a job's output (``hsx export``, ``POST /jobs/{id}/exports``); see common."""

from hsx.export.common import (
    CHECKSUMS_FILE,
    FORMATS,
    REPORT_FILE,
    ExportDestinationTaken,
    ExportError,
    ExportOptions,
    ExportSourceMissing,
    export_output,
    load_report,
    refusal,
    resolve_source,
)

__all__ = [
    "CHECKSUMS_FILE",
    "FORMATS",
    "REPORT_FILE",
    "ExportDestinationTaken",
    "ExportError",
    "ExportOptions",
    "ExportSourceMissing",
    "export_output",
    "load_report",
    "refusal",
    "resolve_source",
]
