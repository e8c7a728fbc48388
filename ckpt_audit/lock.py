"""A non-blocking flock beside the catalog, so an overlapping cron run exits at once (exit code 4)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


class Locked(Exception):
    """Another ckpt-audit process holds the lock."""


@contextlib.contextmanager
def hold(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if needed) or raise Locked without waiting.

    flock is released by the kernel when the process dies, so a killed run never leaves a stale lock.
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            raise Locked(f"another ckpt-audit run holds {path}" + (f" (pid {holder})" if holder else "")) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def lock_path_for(catalog: str | os.PathLike[str]) -> str:
    return os.fspath(catalog) + ".lock"
