"""The session's reads, which never wait for the lock: a viewer's scan (`browse`), the resume gate (`latest`),
the catalog opened read-only (`reading`) and the catalog facts the TUI and `continuity` show.

`browse` scans with the catalogued hashes (a WAL read, fine while a cron run writes) and records through a session
only if the lock is free; `latest` does the same for one run; `reading` opens the catalog read-only for `ls`, `show`
and viewers.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ckpt_audit import lock
from ckpt_audit.models import IN_PROGRESS_WINDOW_S
from ckpt_audit.roots import ScanError, check_root
from ckpt_audit.session.core import (
    Progress,
    SessionError,
    StrPath,
    open_session,
    read_kept_deep,
    run_named,
    scan_any,
    verify_paths,
)

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from ckpt_audit.answers import LatestAnswer
    from ckpt_audit.catalog.store import Catalog
    from ckpt_audit.models import ScanResult
    from ckpt_audit.rules.deep_verdict import DeepVerdict


def browse(
    roots: Sequence[str], catalog_path: StrPath | None, *, deep: bool = False, progress: Progress | None = None
) -> tuple[ScanResult, str]:
    """Scan (`deep`: verify, re-reading every file) `roots` without waiting for the lock, reusing the catalogued
    hashes, then record it if the lock is free. Returns the result and "" or why it was not recorded: a busy
    catalog is no error for a viewer (the cron run that holds it records its own scan)."""
    previous = _previous(catalog_path)
    if deep:
        result = verify_paths(roots, previous=previous, progress=progress, rehash=True)
    else:
        from ckpt_audit.scan import scan  # when it scans: the session's catalog reads load none of it

        result = scan(list(roots), previous=previous, progress=progress, deep=read_kept_deep(catalog_path))
    return result, record_if_free(result, catalog_path)


def record_if_free(result: ScanResult, catalog_path: StrPath | None) -> str:
    """Record `result` through a session if the lock is free; "" or why it was not recorded."""
    if catalog_path is None:
        return "no catalog"
    try:
        with open_session(catalog_path) as session:
            session.record(result)
    except lock.Locked:
        return "catalog locked by another run"
    except sqlite3.OperationalError as exc:  # a writer outside the lock kept the database busy
        return f"catalog busy ({exc})"
    except (OSError, SessionError) as exc:  # a catalog this user may read but not write: browsing goes on
        return f"catalog not writable ({getattr(exc, 'strerror', None) or exc})"
    return ""


def latest(
    run: str | Path,
    catalog_path: StrPath | None,
    *,
    verified: bool = False,
    max_age_ns: int = 0,
    in_progress_window_s: float = IN_PROGRESS_WINDOW_S,
) -> LatestAnswer:
    """The resume gate for `run` (lifecycle.latest.gate): scan it with the catalogued hashes (a stale or absent
    catalog still gives a true answer); with `verified`, read the candidate by content now (hash + CRC of every
    file against the catalog; `max_age_ns` > 0: unless it was read within that age), falling back to the next
    one when that read fails; then record the scans if the lock is free: a job script's gate never waits for, nor
    fails on, a cron scan holding the lock or a catalog it may not write. Raises SessionError when `run` is not one
    run."""
    from ckpt_audit.answers import LatestAnswer
    from ckpt_audit.layouts import run_tracker
    from ckpt_audit.lifecycle.latest import gate, oldest_verified

    previous = _previous_or_empty(catalog_path)
    deep = _kept_deep_or_empty(catalog_path)
    started = time.time_ns()  # a file read by content from here on was read "now"
    try:
        real = check_root(run)
        result = scan_any([real], previous=previous, in_progress_window_s=in_progress_window_s, deep=deep)
    except ScanError as exc:
        raise SessionError(str(exc)) from None
    the_run = run_named(result, run)
    scans = [result]

    def read_at(scan: ScanResult) -> dict[str, int | None]:
        # when each file was last read by content; with no max age only this call's reads count (never a catalog
        # time, which a clock stepped back could place after `started`)
        return {p: f.verified_ns for p, f in scan.file_facts.items() if max_age_ns or not f.reused}

    verified_at = read_at(result)
    reread: set[str] = set()
    while True:
        g = gate(
            the_run,
            verified=verified_at if verified else None,
            now_ns=started,
            max_age_ns=max_age_ns,
            reread=frozenset(reread),
        )
        if g.reread is None:
            break
        # read the candidate by content now; what that read finds (hash drift, a bad CRC) is its verdict
        focused = scan_any(
            [g.reread.path], previous=previous, in_progress_window_s=in_progress_window_s, rehash=True, deep=deep
        )
        scans.append(focused)
        fresh = {c.path: c for r in focused.runs for c in r.checkpoints}
        the_run = replace(the_run, checkpoints=tuple(fresh.get(c.path, c) for c in the_run.checkpoints))
        verified_at.update(read_at(focused))
        reread.add(g.reread.path)
    not_recorded = ""
    for s in scans:
        if not_recorded := record_if_free(s, catalog_path):
            break
    return LatestAnswer(
        run=the_run,
        gate=g,
        verified_ns=None if g.chosen is None else oldest_verified(g.chosen, verified_at),
        reread=tuple(sorted(reread)),
        files_reused=scans[0].files_reused,
        files_read=sum(s.files_hashed for s in scans),
        not_recorded=not_recorded,
        takes_tag=run_tracker(the_run.layout).takes_tag,
    )


@contextlib.contextmanager
def reading(catalog_path: StrPath) -> Iterator[Catalog]:
    """The catalog opened read-only, without the lock: `ls`, `show` and viewers answer while a cron run writes (a
    WAL read), for a user who can write neither the catalog nor its directory. Raises SessionError."""
    from ckpt_audit.catalog import CatalogError, read_catalog

    try:
        cat = read_catalog(catalog_path)
    except CatalogError as exc:
        raise SessionError(str(exc)) from None
    with cat:
        yield cat


def _previous(catalog_path: StrPath | None) -> dict | None:
    """The catalogued facts to reuse by stat (a WAL read: fine while a cron scan writes); None without a catalog."""
    if catalog_path is None or not os.path.exists(catalog_path):
        return None
    from ckpt_audit.catalog.manifest import read_previous

    return read_previous(catalog_path)


def _kept_deep_or_empty(catalog_path: StrPath | None) -> dict[str, DeepVerdict]:
    """The kept deep verdicts; {} when the catalog is absent or unreadable (as _previous_or_empty)."""
    from ckpt_audit.catalog.manifest import CatalogError

    try:
        return read_kept_deep(catalog_path)
    except CatalogError:
        return {}


def _previous_or_empty(catalog_path: StrPath | None) -> dict:
    """The catalogued facts; {} when the catalog is absent or unreadable (the run is then read in full)."""
    from ckpt_audit.catalog.manifest import CatalogError

    try:
        return _previous(catalog_path) or {}
    except CatalogError:
        return {}


def catalog_runs(catalog_path: StrPath) -> tuple[str, ...]:
    """The run directories the catalog knows (still present at its last scan); () without a catalog file."""
    if not os.path.exists(catalog_path):
        return ()
    with reading(catalog_path) as cat:  # browsing needs no write access to the catalog or its directory
        return tuple(r["path"] for r in cat.runs() if os.path.isdir(r["path"]))


def catalog_nodes(catalog_path: StrPath | None) -> dict[str, tuple[str, ...]]:
    """Which Ray node holds each file, as the last `scan --ray` recorded it; {} without one (or a catalog)."""
    if catalog_path is None or not os.path.exists(catalog_path):
        return {}
    try:
        with reading(catalog_path) as cat:
            return cat.file_nodes()
    except SessionError:
        return {}
