"""The catalog: one SQLite file (WAL) recording every scan's manifest, statuses and findings.

Opening it (`open_catalog` to write, `read_catalog` to read) and writing to it: `record_scan` writes a whole scan
in one transaction (a crash or kill mid-scan leaves the catalog as it was), `record_rereads` what prune's survivor
check read. The reads that answer `ls`, `show`, the TUI and lifecycle are in `queries.py`.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable, Iterator
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_audit import __version__
from ckpt_audit.catalog.deep_verdicts import record_deep_verdicts
from ckpt_audit.catalog.manifest import (
    CatalogError,
    checksums_to_text,
    dcp_to_json,
    findings_from_json,
    findings_to_json,
    pt_to_json,
)
from ckpt_audit.catalog.migrations import MIGRATIONS
from ckpt_audit.catalog.queries import CatalogQueries
from ckpt_audit.catalog.sqlite import Db
from ckpt_audit.catalog.verdicts import record_verdicts
from ckpt_audit.killpoints import CATALOG_KILL_AFTER_ENV, OpCounter
from ckpt_audit.models import (
    Checkpoint,
    Component,
    Finding,
    RunSummary,
    ScanResult,
    Severity,
    ShardFile,
    judged_runs,
    run_name,
    run_summaries,
)
from ckpt_audit.readers import RULES
from ckpt_audit.tree import FileFacts

if TYPE_CHECKING:  # pragma: no cover
    from ckpt_audit.lifecycle.survivors import Reread

BATCH = 1000


def open_catalog(path: str | os.PathLike[str]) -> Catalog:
    """Open (creating if needed) the catalog at `path` with migrations applied. Raises CatalogError."""
    path = os.fspath(path)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        db = Db(sqlite3.connect(path))  # plain sqlite3: importing sqlite-utils costs a cron job 0.2-0.35 s
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA busy_timeout=5000")
        db.enable_wal()
        db.execute("PRAGMA synchronous=NORMAL")
        if MIGRATIONS.pending_names(db):  # only then is sqlite-utils imported
            MIGRATIONS.apply(db)
    except (sqlite3.Error, OSError) as exc:
        raise CatalogError(f"catalog {path} is unusable: {exc}") from None
    return Catalog(db, path, writable=True)


def read_catalog(path: str | os.PathLike[str]) -> Catalog:
    """Open an existing catalog read-only, for `ls`, `show`, `continuity` and browsing in the TUI.

    Works for a user who can write neither the catalog nor its directory (a root-owned cron catalog): nothing is
    created, no migration runs, no lock is taken. Raises CatalogError (missing, not SQLite, or written by an
    older ckpt-audit whose schema a writer has not upgraded yet).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CatalogError(f"no catalog at {path}; run `ckpt-audit scan ROOT` first")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=5000")
        db = Db(conn)
        pending = MIGRATIONS.pending_names(db)
    except sqlite3.Error as exc:
        raise CatalogError(f"catalog {path} cannot be read: {exc}") from None
    if pending:
        conn.close()
        raise CatalogError(
            f"catalog {path} was written by an older ckpt-audit: the next `ckpt-audit scan` "
            "(by a user who can write it) upgrades it"
        )
    return Catalog(db, path, writable=False)


class Catalog(CatalogQueries):
    """An open catalog: the writes that record a scan and what prune re-read are here, the reads in
    `queries.CatalogQueries`."""

    def __init__(self, db: Db, path: str, *, writable: bool) -> None:
        self.db = db
        self.path = path
        self.writable = writable

    def close(self) -> None:
        if self.writable:
            # leave no WAL behind: a reader who cannot write the directory cannot create the -shm file a WAL
            # database needs, but opens a rollback-journal one read-only. Another open connection keeps WAL on.
            try:
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self.db.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.Error:
                pass
        self.db.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def record_scan(self, result: ScanResult, *, rehash: bool = False) -> int:
        """Record one scan in one transaction; returns the scan id.

        Files reused by stat keep their stored row (a nightly re-scan of an unchanged tree writes almost nothing);
        the rest go in with executemany: the row-dict path of sqlite-utils costs ~0.1 ms a row.
        """
        every = result.all_findings
        conn = self.db.conn
        ops = OpCounter.from_env(
            CATALOG_KILL_AFTER_ENV
        )  # the kill -9 matrix stops the process between any two statements
        with self.db.atomic():
            scan_id = (
                self.db["scans"]
                .insert(
                    {
                        "started_ns": result.started_ns,
                        "finished_ns": result.finished_ns,
                        "roots": json.dumps(list(result.roots)),
                        "tool_version": __version__,
                        "deep": int(result.deep),
                        "rehash": int(rehash),
                        "files_hashed": result.files_hashed,
                        "files_reused": result.files_reused,
                        "bytes_hashed": result.bytes_hashed,
                        "bytes_scrubbed": result.bytes_scrubbed,
                        "errors": sum(1 for f in every if f.severity is Severity.ERROR),
                        "warnings": sum(1 for f in every if f.severity is Severity.WARNING),
                    }
                )
                .last_pk
            )
            ops.tick()
            kept = result.runs_reused
            old_hash = _present_hashes(conn, kept)
            reused = result.reused_paths
            run_rows, ckpt_rows, file_rows, history = [], [], [], []
            kept_ckpts: list[tuple[int, str]] = []
            finding_rows: list[tuple] = []
            seen: set[str] = set()
            for summary in run_summaries(result.runs):  # a kept run's model is not decoded (models.LazyRuns)
                run_rows.append(_run_row(summary, scan_id))
                finding_rows.extend(_finding_row(f, scan_id, summary.path, ckpt) for ckpt, f in summary.findings)
                if summary.path in kept:  # its rows hold what the kept verdict says (a change deletes the verdict)
                    kept_ckpts.extend((scan_id, path) for path, _step, _status in summary.checkpoints)
            # a kept run's files the scrub read again now: the same content (or the verdict would not stand), so
            # only when it was read changes
            facts = result.file_facts
            kept_read = [(facts[p].verified_ns, scan_id, p) for p in sorted(result.kept_reread)]
            for run in judged_runs(result.runs, kept):
                for ckpt in run.checkpoints:
                    ckpt_rows.append(_checkpoint_row(ckpt, scan_id))
                    for role, sf in _files_with_role(ckpt):
                        seen.add(sf.path)
                        if sf.path in reused and sf.path in old_hash:
                            continue  # same stat, same hash, same facts, same verified_ns: the stored row stands
                        fact = facts.get(sf.path)
                        file_rows.append((*_file_row(sf, run.path, ckpt.path, role, fact), scan_id))
                        if sf.path not in old_hash or old_hash[sf.path] != sf.hash:
                            history.append((sf.path, scan_id, sf.hash, sf.size_bytes, sf.mtime_ns))
            finding_rows.extend(_finding_row(f, scan_id, None, None) for f in result.findings)
            self.db["runs"].upsert_all(run_rows, pk="path", batch_size=BATCH)
            self.db["checkpoints"].upsert_all(ckpt_rows, pk="path", batch_size=BATCH)
            conn.executemany("UPDATE checkpoints SET last_scan_id = ? WHERE path = ?", kept_ckpts)
            ops.tick()
            cols = _FILE_COLS + ", last_scan_id, present"
            conn.executemany(
                f"INSERT OR REPLACE INTO files ({cols}) VALUES ({', '.join('?' * (_N_FILE_COLS + 1))}, 1)", file_rows
            )
            conn.executemany("UPDATE files SET verified_ns = ?, last_scan_id = ? WHERE path = ?", kept_read)
            conn.executemany(
                "INSERT INTO hash_history (path, scan_id, hash, size_bytes, mtime_ns) VALUES (?, ?, ?, ?, ?)", history
            )
            conn.executemany(
                "INSERT INTO findings (scan_id, severity, code, path, message, rank, tensor, run_path, checkpoint_path)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                finding_rows,
            )
            ops.tick()
            for root in result.roots:  # what the roots no longer hold is kept, marked absent
                below = root.rstrip("/") + "/"
                gone = [(p,) for p in old_hash if p not in seen and (p == root or p.startswith(below))]
                conn.executemany("UPDATE files SET present = 0 WHERE path = ?", gone)
                under = "(path = ? OR substr(path, 1, ?) = ?)"
                for table in ("checkpoints", "runs"):
                    conn.execute(
                        f"UPDATE {table} SET present = 0 WHERE last_scan_id != ? AND present = 1 AND {under}",
                        [scan_id, root, len(below), below],
                    )
            refresh_run_summaries(conn, [row["path"] for row in run_rows])
            record_verdicts(
                conn,
                judged_runs(result.runs, kept),
                result.run_keys,
                result.run_unrowed,
                judged_ns=result.started_ns,
            )
            record_deep_verdicts(conn, result, scan_id)
            if result.cluster is not None:
                _record_cluster(conn, result, scan_id)
            ops.tick()
        ops.tick()  # committed
        return int(scan_id)

    def record_rereads(self, rereads: Iterable[Reread]) -> None:
        """What prune's survivor check read by content: each file's hash, CRC verdict and verification time as
        read now, its findings added to the file's row, and a failed checkpoint's new status with its findings.

        The check reads files whose stat never moved, so a scan would reuse their stored rows: unless written
        here, a failure the check found would be forgotten by the very next scan.
        """
        conn = self.db.conn
        with self.db.atomic():
            for r in rereads:
                ckpt = r.checkpoint
                scan_id = conn.execute("SELECT last_scan_id FROM checkpoints WHERE path = ?", [ckpt.path]).fetchone()
                if scan_id is None:
                    continue  # never recorded (a plan made without a catalog): nothing to keep current
                for path, got in r.read_back:
                    row = conn.execute("SELECT hash, file_findings FROM files WHERE path = ?", [path]).fetchone()
                    if row is None:
                        continue
                    new = [f for f in r.findings if f.path == path]
                    old = [f for f in findings_from_json(row[1], path) if f.code not in {n.code for n in new}]
                    conn.execute(
                        "UPDATE files SET hash = ?, crc_ok = ?, file_findings = ?, verified_ns = ? WHERE path = ?",
                        [
                            got.hash,
                            None if got.crc_ok is None else int(got.crc_ok),
                            findings_to_json(tuple(old + new)),
                            r.read_ns,
                            path,
                        ],
                    )
                    if got.hash != row[0]:
                        conn.execute(
                            "INSERT INTO hash_history (path, scan_id, hash, size_bytes, mtime_ns)"
                            " VALUES (?, ?, ?, ?, ?)",
                            [path, scan_id[0], got.hash, got.size_bytes, got.mtime_ns],
                        )
                if not r.ok:
                    conn.execute("UPDATE checkpoints SET status = ? WHERE path = ?", [r.status.value, ckpt.path])
                    conn.executemany(
                        "INSERT INTO findings (scan_id, severity, code, path, message, rank, tensor, run_path,"
                        " checkpoint_path) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [_finding_row(f, scan_id[0], ckpt.run_path, ckpt.path) for f in r.findings],
                    )
                    refresh_run_summaries(conn, [ckpt.run_path])


def _record_cluster(conn: sqlite3.Connection, result: ScanResult, scan_id: int) -> None:
    """scan --ray: when each node answered (or not), and the copy of each file each answering node holds. A silent
    node's rows are left as they were: they are what the catalog knows it held."""
    view, at = result.cluster, result.started_ns
    assert view is not None
    conn.executemany(
        "INSERT INTO nodes (node_id, first_seen_ns, last_answered_ns, last_scan_id) VALUES (?, ?, ?, ?)"
        " ON CONFLICT(node_id) DO UPDATE SET last_answered_ns = excluded.last_answered_ns,"
        " last_scan_id = excluded.last_scan_id",
        [(n, at, at, scan_id) for n in view.answered],
    )
    conn.executemany(
        "INSERT INTO nodes (node_id, first_seen_ns, last_silent_ns, last_scan_id) VALUES (?, ?, ?, ?)"
        " ON CONFLICT(node_id) DO UPDATE SET last_silent_ns = excluded.last_silent_ns,"
        " last_scan_id = excluded.last_scan_id",
        [(n, at, at, scan_id) for n in view.silent],
    )
    answered = set(view.answered)
    old = {
        (p, n): rest
        for p, n, *rest in conn.execute(
            "SELECT path, node_id, size_bytes, mtime_ns, inode, hash, verified_ns FROM file_nodes WHERE present = 1"
        )
    }
    rows, seen = [], set()
    for path, copies in view.copies.items():
        for c in copies:
            seen.add((path, c.node_id))
            if old.get((path, c.node_id)) != [c.size_bytes, c.mtime_ns, c.inode, c.hash, c.verified_ns]:
                rows.append((path, c.node_id, c.size_bytes, c.mtime_ns, c.inode, c.hash, c.verified_ns, scan_id))
    conn.executemany(
        "INSERT OR REPLACE INTO file_nodes (path, node_id, size_bytes, mtime_ns, inode, hash, verified_ns,"
        " last_scan_id, present) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1)",
        rows,
    )
    roots = [r.rstrip("/") + "/" for r in result.roots]
    gone = [
        key for key in old if key not in seen and key[1] in answered and any(key[0].startswith(r) for r in roots)
    ]  # an answering node that no longer has a file under a scanned root
    conn.executemany("UPDATE file_nodes SET present = 0 WHERE path = ? AND node_id = ?", gone)


RUN_SUMMARY_SQL = """
    UPDATE runs SET
        n_checkpoints = (SELECT COUNT(*) FROM checkpoints c WHERE c.run_path = runs.path AND c.present = 1),
        latest_complete_step = (SELECT MAX(c.step) FROM checkpoints c
                                WHERE c.run_path = runs.path AND c.present = 1 AND c.status = 'complete'),
        size_bytes = (SELECT COALESCE(SUM(c.size_bytes), 0) FROM checkpoints c
                      WHERE c.run_path = runs.path AND c.present = 1)
    WHERE path = ?"""


def _present_hashes(conn: sqlite3.Connection, kept_runs: frozenset[str]) -> dict[str, str | None]:
    """path -> hash of the present files rows, but those of runs whose cached verdict stood this scan: their rows
    are left as they are (the verdict's key matched every file's stat, and any change to a row since would have
    deleted the verdict), so a re-scan of an unchanged store does not load a row per file to rewrite none."""
    if not kept_runs:
        return dict(conn.execute("SELECT path, hash FROM files WHERE present = 1"))
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS kept_runs (path TEXT PRIMARY KEY)")
    conn.execute("DELETE FROM temp.kept_runs")
    conn.executemany("INSERT INTO temp.kept_runs (path) VALUES (?)", [(r,) for r in kept_runs])
    # by the run index, run by run (files.run_path references runs): a scan of every row for the few not kept
    # cost ~0.45 s at 1M files
    return dict(
        conn.execute(
            "SELECT path, hash FROM files WHERE present = 1"
            " AND run_path IN (SELECT path FROM runs WHERE path NOT IN (SELECT path FROM temp.kept_runs))"
        )
    )


def refresh_run_summaries(conn: sqlite3.Connection, run_paths: list[str]) -> None:
    """A run's summary is what the catalog holds of it, not what one scan looked at: a scan of one step
    directory (or a prune that removed some) must not make the run one checkpoint long."""
    conn.executemany(RUN_SUMMARY_SQL, [(p,) for p in run_paths])


_PATH = attrgetter("path")


def _files_with_role(ckpt: Checkpoint) -> Iterator[tuple[str | None, ShardFile]]:
    for f in ckpt.files:
        yield None, f
    for c in ckpt.components:
        for f in c.files:
            yield c.role, f


def _run_row(run: RunSummary, scan_id: int) -> dict:
    return {
        "path": run.path,
        "name": run_name(run.path),
        "layout": run.layout,
        "tracker_step": run.tracker_step,
        "metrics_path": run.metrics_path,
        "n_checkpoints": len(run.checkpoints),
        "latest_complete_step": run.latest_complete_step,
        "size_bytes": run.size_bytes,
        "last_scan_id": scan_id,
        "present": 1,
    }


def _component_doc(c: Component) -> dict:
    return {"role": c.role, "path": c.path, "layout": c.layout, "world_size": c.world_size}


def _checkpoint_row(ckpt: Checkpoint, scan_id: int) -> dict:
    return {
        "path": ckpt.path,
        "run_path": ckpt.run_path,
        "step": ckpt.step,
        "status": ckpt.status.value,
        "world_size": ckpt.world_size,
        "size_bytes": ckpt.size_bytes,
        "n_files": len(ckpt.all_files),
        "mtime_ns": ckpt.mtime_ns,
        "components": json.dumps([_component_doc(c) for c in ckpt.components]),
        "last_scan_id": scan_id,
        "present": 1,
    }


_FILE_COLS = (
    "path, run_path, checkpoint_path, role, kind, rank, world_size, size_bytes, mtime_ns, inode, hash,"
    " crc_ok, file_findings, pt_facts, verified_ns, dcp_facts, read_rules, store_checksums"
)
_N_FILE_COLS = _FILE_COLS.count(",") + 1


def _file_row(f: ShardFile, run_path: str, ckpt_path: str, role: str | None, fact: FileFacts | None) -> tuple:
    """A files row in _FILE_COLS order. Everything the readers said of the file goes in whole (findings, structure),
    not a hand-kept list of codes, so a later scan that reuses the row forgets nothing; a file whose facts are
    unknown here is recorded as never verified, so the next scan reads it again."""
    return (
        f.path,
        run_path,
        ckpt_path,
        role,
        f.kind.value,
        f.rank,
        f.world_size,
        f.size_bytes,
        f.mtime_ns,
        f.inode,
        f.hash,
        None if f.crc_ok is None else int(f.crc_ok),
        findings_to_json(fact.findings) if fact else "[]",
        pt_to_json(fact.pt) if fact else None,
        fact.verified_ns if fact else None,
        dcp_to_json(fact.dcp) if fact else None,
        RULES,  # the facts above are what today's readers say (a reused row's were vouched for under them)
        checksums_to_text(fact.checksums) if fact else None,
    )


def _finding_row(f: Finding, scan_id: int, run_path: str | None, ckpt_path: str | None) -> tuple:
    return (scan_id, f.severity.label, f.code, f.path, f.message, f.rank, f.tensor, run_path, ckpt_path)
