"""Durability of directory entries: what prune's rename and export's marker and rename need on disk before they
count. Its own module so that neither loads the other (export must not import prune's retention and continuity)."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """Make a directory's entries durable; where the filesystem cannot fsync a directory, nothing more is possible."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
