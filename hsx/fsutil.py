"""Durable file placement, standard library only (the manifest writer and the shard writer share it)."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Any


def fsync_dir(path: Path | str) -> None:
    """Make a rename or a new file in ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (PermissionError, IsADirectoryError):  # platforms that cannot open a directory
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# sync_file_range(2) flags (Linux): wait for writeback already under way, start it, wait for it to end.
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4
WRITE_BEHIND_WINDOW = 32 << 20


def _load_sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


class WriteBehind:
    """Keeps a file that is written front to back flowing to the disk while it is written.

    Without it, a shard's bytes sit in the page cache until its closing fsync: the disk idles while the
    engine computes, then every worker flushes gigabytes at once at the end of its unit (and of the job).
    Here each ``window`` of new bytes is handed to writeback at once, and the writer waits only for the
    window two back, so at most about three windows per file are dirty and the closing fsync has little
    left to do. Durability still comes from that fsync; this only moves the work earlier.

    Where ``sync_file_range`` is missing, the file system refuses it or ``window`` is 0, this does nothing.
    """

    def __init__(self, fd: int, window: int = WRITE_BEHIND_WINDOW) -> None:
        self.fd = fd
        self.window = max(1, window)
        self.enabled = _sync_file_range is not None and window > 0
        self.started = 0  # writeback started for [0, started)
        self.waited = 0  # writeback finished for [0, waited)

    def advance(self, end: int) -> None:
        """The file is written up to ``end`` (an offset)."""
        if not self.enabled or end - self.started < self.window:
            return
        if not self._call(self.started, end - self.started, _WRITE):
            return
        behind = self.started - self.window
        if behind > self.waited:
            self._call(self.waited, behind - self.waited, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            self.waited = behind
        self.started = end

    def rewind(self, end: int) -> None:
        """The file was cut back to ``end``."""
        self.started = min(self.started, end)
        self.waited = min(self.waited, end)

    def _call(self, offset: int, length: int, flags: int) -> bool:
        if _sync_file_range(self.fd, offset, length, flags) == 0:
            return True
        # EINVAL/ESPIPE/ENOSYS: a file system without it. Writing goes on; the fsync does all the work.
        self.enabled = False
        return False
