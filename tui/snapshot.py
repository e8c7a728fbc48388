"""What the TUI shows: the runs of one scan, loaded off the UI thread, and the catalog calls around it.

Every function here blocks (filesystem, SQLite) and runs in a worker thread. The catalog is opened per call,
on the calling thread (SQLite connections belong to the thread that made them). Scanning only *reads* the
catalog (hashes to reuse by stat), which WAL allows while a cron `ckpt-audit scan` writes; recording the
scan, pruning and exporting go through ckpt_audit.session, under the same non-blocking lock the CLI takes, so
they never overlap a cron run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_audit.models import Run, ScanResult
from ckpt_audit.session import Progress, browse, catalog_nodes
from ckpt_audit.session.terms import Links, links_for


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    runs: tuple[Run, ...] = ()
    scanned_ns: dict[str, int] = field(default_factory=dict)  # run path -> when it was last scanned
    loaded_ns: int = 0
    files_hashed: int = 0  # files read by this scan
    files_reused: int = 0  # files whose catalogued hash was reused by stat
    unrecorded: str = ""  # why this scan is not in the catalog (busy with another run, no catalog); "" if it is
    verified_ns: dict[str, int | None] = field(default_factory=dict)  # file -> last read by content (None: never)
    nodes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # file -> Ray nodes holding it (scan --ray)
    links: Links = field(default_factory=Links)  # the links under the scanned roots: prune keeps what they lead into

    def run(self, path: str) -> Run | None:
        return next((r for r in self.runs if r.path == path), None)


def scan_roots(roots: Sequence[str], catalog_path: Path | None, *, progress: Progress | None = None) -> Snapshot:
    """Scan `roots`, reusing the hashes the catalog holds, and record the scan unless the catalog is locked."""
    result, unrecorded = browse(roots, catalog_path, progress=progress)
    done = result.finished_ns or time.time_ns()
    return Snapshot(
        runs=result.runs,
        scanned_ns={r.path: done for r in result.runs},
        loaded_ns=done,
        files_hashed=result.files_hashed,
        files_reused=result.files_reused,
        unrecorded=unrecorded,
        verified_ns={p: f.verified_ns for p, f in result.file_facts.items()},
        nodes=catalog_nodes(catalog_path),
        links=links_for(roots, result.runs),
    )


def verify_paths(paths: Sequence[str], catalog_path: Path | None, *, progress: Progress | None = None) -> ScanResult:
    """Deep-verify checkpoints (loads tensors: imports torch) and record the result. Like the CLI's verify, every
    file is re-read by content whatever its stat says."""
    result, _unrecorded = browse(paths, catalog_path, deep=True, progress=progress)
    return result
