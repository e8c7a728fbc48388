"""A root: the directory (or s3:// prefix) a scan starts from.

`check_root` names it as the scan does, or says why it cannot be scanned (ScanError). The session checks its
roots with it before it takes the catalog's lock; commands that scan nothing (ls, show, the TUI's catalog reads)
need no more of the scan than this, so it sits below the scan package (its pipeline is ~10 ms of their start-up).
"""

from __future__ import annotations

import os

from ckpt_audit.remote import is_remote, normal  # the package's light __init__ only


class ScanError(Exception):
    """A root that cannot be scanned at all (missing, not a directory): a one-line error, exit 3."""


def check_root(root: str | os.PathLike[str]) -> str:
    """A remote root normalised; a local one absolute with its links resolved. ScanError if it is no directory."""
    if is_remote(root):
        return normal(str(root))
    path = os.path.abspath(os.fspath(root))
    if not os.path.exists(path):
        raise ScanError(f"root {path} does not exist")
    if not os.path.isdir(path):
        raise ScanError(f"root {path} is not a directory")
    return os.path.realpath(path)
