"""Crash injection for the fault tests: ``HSX_CRASH_AT=<point>`` ends the process at that point.

The points name the steps of writing a unit, so a test can prove that recovery from a crash at each of them
gives the same output as an uninterrupted run.

``HSX_HOLD_AT=<point>`` with ``HSX_HOLD_DIR=<dir>`` holds the process there instead, until the test lets it
go: it writes ``<dir>/held-<pid>`` and waits for ``<dir>/release``. A test can then act on a state it has
seen (which processes are there, holding what), rather than sample a moment and hope it came.
"""

from __future__ import annotations

import os
import time

HOLD_LOOK_SECONDS = 0.01

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
    if os.environ.get("HSX_HOLD_AT") == name:
        hold(os.environ["HSX_HOLD_DIR"])
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


def hold(directory: str) -> None:
    """Say this process is here (``held-<pid>``, written whole), then wait for the test's ``release``."""
    marker = os.path.join(directory, f"held-{os.getpid()}")
    with open(marker + ".tmp", "w") as fh:
        fh.write(str(os.getppid()))
    os.replace(marker + ".tmp", marker)
    release = os.path.join(directory, "release")
    while not os.path.exists(release):
        time.sleep(HOLD_LOOK_SECONDS)
