"""Moved to :mod:`hsx.engine_client` (the API's ``hsx verify`` uses it too, and ``hsx`` never imports
``workers``); this name stays for the benchmarks and scripts that import it from here."""

from hsx.engine_client import (
    Dump,
    DumpCorrupt,
    DumpMissing,
    EngineClient,
    EngineError,
    EngineRejected,
    EngineUnavailable,
    as_float32,
    delete_dump,
    read_dump,
    wait_for_meta,
)

__all__ = [
    "Dump",
    "DumpCorrupt",
    "DumpMissing",
    "EngineClient",
    "EngineError",
    "EngineRejected",
    "EngineUnavailable",
    "as_float32",
    "delete_dump",
    "read_dump",
    "wait_for_meta",
]
