"""Crash injection for the fault tests: ``HSX_CRASH_AT=<point>`` ends the process at that point.

The points name the steps of writing a unit, so a test can prove that recovery from a crash at each of them
gives the same output as an uninterrupted run.
"""

from __future__ import annotations

import os

POINTS = (
    "after_claim",
    "mid_unit",
    "before_shard_fsync",
    "after_shard_staged",
    "after_rename",
    "before_row_commit",
    "after_row_commit",
)


# A regenerate job's unit: its generated conversations are durable, its capture has not started.
REGENERATE_POINTS = ("after_regenerate_durable",)

# Beyond a unit: finalization, between an output's first object and its manifest in the object store.
PUBLISH_POINTS = ("mid_publish",)


def crash_point(name: str) -> None:
    assert name in POINTS or name in PUBLISH_POINTS or name in REGENERATE_POINTS, name
    wanted = os.environ.get("HSX_CRASH_AT", "")
    if not wanted or wanted != name:
        return
    marker = os.environ.get("HSX_CRASH_ONCE_FILE")
    if marker:
        # Crash only once across retries: the marker's existence means the crash already happened.
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
    os._exit(137)
