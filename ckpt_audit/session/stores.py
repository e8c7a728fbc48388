"""Object-store roots as the front ends reach them (docs/remote.md): `compare` a copy with its source, the scan's
per-command switches (`--store-checksums`, `--read-data`), and the key the catalog holds a path under."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ckpt_audit.readers.hashing import store_checksums_on
from ckpt_audit.remote import RemoteError, is_remote, normal
from ckpt_audit.session.core import Session, SessionError

if TYPE_CHECKING:
    from ckpt_audit.lifecycle.retention import Policy

__all__ = ["catalog_key", "compare", "is_remote", "plan_prune_remote", "read_data_on", "store_checksums_on"]


def compare(source: str, copy: str):
    """remote.compare.compare (file by file: names, sizes, checksums); a side that cannot be listed is a
    SessionError (exit 3)."""
    from ckpt_audit.remote.compare import compare as compare_trees

    try:
        return compare_trees(source, copy)
    except (RemoteError, OSError) as exc:
        raise SessionError(str(exc)) from None


@contextmanager
def read_data_on(on: bool = True) -> Iterator[None]:
    """While inside (`on`), a remote scan downloads and reads every object (`scan --read-data`)."""
    from ckpt_audit.remote.scan import read_data_on as reading

    with reading(on):
        yield


def catalog_key(path: str) -> str:
    """What the catalog keys `path` by: a URL as given (s3://…), a local path made absolute."""
    return normal(path) if is_remote(path) else os.path.abspath(path).rstrip("/")


def plan_prune_remote(session: Session, policy: Policy, *, pins, now_ns: int, check: bool, read_data: bool):
    """Session.plan_prune for s3:// roots: the session's remote scan (`read_data`: every object read by content),
    planned and checked by the session with the store as re-reader and executor (remote.prune.RemotePrune)."""
    from ckpt_audit.remote.prune import RemotePrune

    with read_data_on(read_data):
        scanned = session.scan(now_ns=now_ns, record=False).result
    return session.plan_prune(
        policy,
        pins=pins,
        now_ns=now_ns,
        scanned=scanned,
        executor=RemotePrune(scanned, read_data=read_data),
        check=check,
    )
