"""What the TUI shows: the runs of one scan, loaded off the UI thread, and the catalog calls around it.

Every function here blocks (filesystem, SQLite) and runs in a worker thread. The catalog is opened per call,
on the calling thread (SQLite connections belong to the thread that made them). Scanning only *reads* the
catalog (hashes to reuse by stat), which WAL allows while a cron `ckpt-audit scan` writes; recording the
scan, pruning and exporting take the same non-blocking lock the CLI takes, so they never overlap a cron run.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_audit import lock
from ckpt_audit.catalog.manifest import CatalogError
from ckpt_audit.models import Run, ScanResult

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    runs: tuple[Run, ...] = ()
    scanned_ns: dict[str, int] = field(default_factory=dict)  # run path -> when it was last scanned
    loaded_ns: int = 0
    files_hashed: int = 0  # files read by this scan
    files_reused: int = 0  # files whose catalogued hash was reused by stat
    unrecorded: str = ""  # why this scan is not in the catalog (busy with another run, no catalog); "" if it is
    verified_ns: dict[str, int | None] = field(default_factory=dict)  # file -> last read by content (None: never)

    def run(self, path: str) -> Run | None:
        return next((r for r in self.runs if r.path == path), None)


def catalog_runs(catalog_path: Path) -> tuple[str, ...]:
    """The run directories the catalog knows (still present at its last scan)."""
    if not catalog_path.exists():
        return ()
    from ckpt_audit.catalog import read_catalog

    with read_catalog(catalog_path) as cat:  # browsing needs no write access to the catalog or its directory
        return tuple(r["path"] for r in cat.runs() if os.path.isdir(r["path"]))


def scan_roots(roots: Sequence[str], catalog_path: Path | None, *, progress: Progress | None = None) -> Snapshot:
    """Scan `roots`, reusing the hashes the catalog holds, and record the scan unless the catalog is locked."""
    from ckpt_audit.scanner import scan

    result = scan(list(roots), previous=_previous(catalog_path), progress=progress)
    unrecorded = record(result, catalog_path)
    done = result.finished_ns or time.time_ns()
    return Snapshot(
        runs=result.runs,
        scanned_ns={r.path: done for r in result.runs},
        loaded_ns=done,
        files_hashed=result.files_hashed,
        files_reused=result.files_reused,
        unrecorded=unrecorded,
        verified_ns={p: f.verified_ns for p, f in result.file_facts.items()},
    )


def verify_paths(paths: Sequence[str], catalog_path: Path | None, *, progress: Progress | None = None) -> ScanResult:
    """Deep-verify checkpoints (loads tensors: imports torch) and record the result. Like the CLI's verify, every
    file is re-read by content whatever its stat says."""
    from ckpt_audit.verify import verify

    result = verify(list(paths), progress=progress, previous=_previous(catalog_path), rehash=True)
    record(result, catalog_path)
    return result


def _previous(catalog_path: Path | None):
    """The catalogued hashes to reuse by stat (a WAL read: fine while a cron scan writes)."""
    if catalog_path is None or not catalog_path.exists():
        return None
    from ckpt_audit.catalog.manifest import read_previous

    return read_previous(catalog_path)


def record(result: ScanResult, catalog_path: Path | None) -> str:
    """Record a scan; returns "" or why it was not recorded. A busy catalog is no error: the view is still
    right, and the cron run that holds it records its own scan."""
    if catalog_path is None:
        return "no catalog"
    try:
        with locked_catalog(catalog_path) as cat:
            cat.record_scan(result)
    except lock.Locked:
        return "catalog locked by another run"
    except sqlite3.OperationalError as exc:  # a writer outside the lock kept the database busy
        return f"catalog busy ({exc})"
    except (OSError, CatalogError) as exc:  # a catalog this user may read but not write: browsing goes on
        return f"catalog not writable ({getattr(exc, 'strerror', None) or exc})"
    return ""


@contextlib.contextmanager
def locked_catalog(catalog_path: Path | None) -> Iterator:
    """The catalog open under the CLI's lock (raises lock.Locked at once if a cron run holds it); None without one."""
    if catalog_path is None:
        yield None
        return
    from ckpt_audit.catalog import open_catalog

    with lock.hold(lock.lock_path_for(catalog_path)), open_catalog(catalog_path) as cat:
        yield cat
