"""Durable file placement, standard library only (the manifest writer and the shard writer share it)."""

from __future__ import annotations

import os
from pathlib import Path


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
