"""The catalog schema, only ever changed by appending a migration (simonw/llm style). Never edit an applied one.

Every body is written out here, even for tables other modules write (lifecycle: prunes, exports): a body that called
into another module would change an applied migration whenever that module changed.
"""

from __future__ import annotations

from typing import Any


class Migrations:
    """sqlite-utils' Migrations, built on first use: registering the bodies (at import) must not import sqlite-utils.

    `pending` and `apply` hand a sqlite_utils.Database (made on the same connection when given a catalog.sqlite.Db)
    to the real Migrations. Infrastructure, not a migration body: it imports nothing of ckpt_audit.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._bodies: list[tuple[str, Any, bool]] = []
        self._real = None

    def __call__(self, *, name: str | None = None, transactional: bool = True):
        def inner(fn):
            self._bodies.append((name or fn.__name__, fn, transactional))
            return fn

        return inner

    def pending_names(self, db) -> list[str]:
        """From plain sqlite3 (`db`: catalog.sqlite.Db): opening an up-to-date catalog never imports sqlite-utils."""
        applied = db.applied_migrations(self.name) or set()
        return [n for n, _fn, _t in self._bodies if n not in applied]

    def pending(self, db) -> list:
        return self._migrations().pending(_as_sqlite_utils(db))

    def apply(self, db) -> None:
        self._migrations().apply(_as_sqlite_utils(db))

    def _migrations(self):
        if self._real is None:
            from sqlite_utils import Migrations as Real

            real = Real(self.name)
            for n, fn, t in self._bodies:
                real(name=n, transactional=t)(fn)
            self._real = real
        return self._real


def _as_sqlite_utils(db):
    return db.sqlite_utils() if hasattr(db, "sqlite_utils") else db  # a catalog.sqlite.Db, or sqlite-utils' own


MIGRATIONS = Migrations("ckpt_audit")


@MIGRATIONS()
def m001_initial(db) -> None:
    db.execute("""
        CREATE TABLE scans (
            id INTEGER PRIMARY KEY,
            started_ns INTEGER NOT NULL,
            finished_ns INTEGER NOT NULL,
            roots TEXT NOT NULL,              -- JSON list of absolute root paths
            tool_version TEXT NOT NULL,
            deep INTEGER NOT NULL DEFAULT 0,
            rehash INTEGER NOT NULL DEFAULT 0,
            files_hashed INTEGER NOT NULL DEFAULT 0,
            files_reused INTEGER NOT NULL DEFAULT 0,
            bytes_hashed INTEGER NOT NULL DEFAULT 0,
            errors INTEGER NOT NULL DEFAULT 0,
            warnings INTEGER NOT NULL DEFAULT 0
        )""")
    db.execute("""
        CREATE TABLE runs (
            path TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            layout TEXT NOT NULL,
            tracker_step INTEGER,
            metrics_path TEXT,
            n_checkpoints INTEGER NOT NULL DEFAULT 0,
            latest_complete_step INTEGER,
            size_bytes INTEGER NOT NULL DEFAULT 0,
            last_scan_id INTEGER NOT NULL REFERENCES scans(id),
            present INTEGER NOT NULL DEFAULT 1
        )""")
    db.execute("""
        CREATE TABLE checkpoints (
            path TEXT PRIMARY KEY,
            run_path TEXT NOT NULL REFERENCES runs(path),
            step INTEGER NOT NULL,
            status TEXT NOT NULL,
            world_size INTEGER,
            size_bytes INTEGER NOT NULL DEFAULT 0,
            n_files INTEGER NOT NULL DEFAULT 0,
            mtime_ns INTEGER NOT NULL DEFAULT 0,
            components TEXT NOT NULL DEFAULT '[]',  -- JSON [{role, path, layout, world_size}]
            last_scan_id INTEGER NOT NULL REFERENCES scans(id),
            present INTEGER NOT NULL DEFAULT 1
        )""")
    db.execute("CREATE INDEX checkpoints_run_status_step ON checkpoints(run_path, status, step)")
    db.execute("""
        CREATE TABLE files (
            path TEXT PRIMARY KEY,
            run_path TEXT NOT NULL REFERENCES runs(path),
            checkpoint_path TEXT REFERENCES checkpoints(path),
            role TEXT,
            kind TEXT NOT NULL,
            rank INTEGER,
            world_size INTEGER,
            size_bytes INTEGER NOT NULL,
            mtime_ns INTEGER NOT NULL,
            inode INTEGER NOT NULL,
            hash TEXT,                        -- xxh3-128 hex; NULL when unreadable
            crc_ok INTEGER,                   -- 1 ok, 0 mismatch, NULL not a zip / CRC disabled
            file_findings TEXT NOT NULL DEFAULT '[]',  -- JSON [[code, message]] of per-file findings, reused by stat
            last_scan_id INTEGER NOT NULL REFERENCES scans(id),
            present INTEGER NOT NULL DEFAULT 1
        )""")
    db.execute("CREATE INDEX files_checkpoint ON files(checkpoint_path)")
    db.execute("CREATE INDEX files_run ON files(run_path)")
    db.execute("""
        CREATE TABLE hash_history (
            id INTEGER PRIMARY KEY,
            path TEXT NOT NULL,
            scan_id INTEGER NOT NULL REFERENCES scans(id),
            hash TEXT,
            size_bytes INTEGER NOT NULL,
            mtime_ns INTEGER NOT NULL
        )""")
    db.execute("CREATE INDEX hash_history_path ON hash_history(path, scan_id)")
    db.execute("""
        CREATE TABLE findings (
            id INTEGER PRIMARY KEY,
            scan_id INTEGER NOT NULL REFERENCES scans(id),
            severity TEXT NOT NULL,           -- info | warning | error
            code TEXT NOT NULL,
            path TEXT NOT NULL,
            message TEXT NOT NULL,
            rank INTEGER,
            tensor TEXT,
            run_path TEXT,
            checkpoint_path TEXT
        )""")
    db.execute("CREATE INDEX findings_checkpoint ON findings(checkpoint_path, scan_id)")
    db.execute("CREATE INDEX findings_scan ON findings(scan_id)")
    db.execute("""
        CREATE VIEW latest_complete_checkpoint AS
        SELECT c.run_path, c.step, c.path, c.size_bytes, c.mtime_ns, c.last_scan_id
        FROM checkpoints c
        WHERE c.present = 1 AND c.status = 'complete' AND c.step = (
            SELECT MAX(c2.step) FROM checkpoints c2
            WHERE c2.run_path = c.run_path AND c2.present = 1 AND c2.status = 'complete')""")
    db.execute("""
        CREATE VIEW checkpoint_status AS
        SELECT c.run_path, c.step, c.path, c.status, c.world_size, c.size_bytes, c.mtime_ns, c.last_scan_id,
            (SELECT COUNT(*) FROM findings f WHERE f.checkpoint_path = c.path AND f.scan_id = c.last_scan_id
                AND f.severity = 'error') AS errors,
            (SELECT COUNT(*) FROM findings f WHERE f.checkpoint_path = c.path AND f.scan_id = c.last_scan_id
                AND f.severity = 'warning') AS warnings
        FROM checkpoints c WHERE c.present = 1""")


@MIGRATIONS()
def m002_lifecycle(db) -> None:
    """lifecycle: executed prune plans (prunes, prune_items) and exports (exports, export_files)."""
    db.execute("""
        CREATE TABLE prunes (
            exec_id TEXT PRIMARY KEY,
            started_ns INTEGER NOT NULL,
            finished_ns INTEGER,               -- NULL: killed or still running
            status TEXT NOT NULL,              -- started | finished
            policy TEXT NOT NULL,
            planned_delete INTEGER NOT NULL,
            planned_bytes INTEGER NOT NULL,
            bytes_freed INTEGER,
            plan TEXT NOT NULL                 -- JSON: PrunePlan.to_dict()
        )""")
    db.execute("""
        CREATE TABLE prune_items (
            id INTEGER PRIMARY KEY,
            exec_id TEXT NOT NULL REFERENCES prunes(exec_id),
            path TEXT NOT NULL,
            run_path TEXT,
            step INTEGER,
            action TEXT NOT NULL,              -- planned | kept | deleted | skipped | failed | reclaimed
            reasons TEXT NOT NULL DEFAULT '[]',  -- JSON list of reason slugs
            detail TEXT NOT NULL DEFAULT '',
            size_bytes INTEGER NOT NULL DEFAULT 0,
            at_ns INTEGER NOT NULL
        )""")
    db.execute("CREATE INDEX prune_items_path ON prune_items(path)")
    db.execute("CREATE INDEX prune_items_exec ON prune_items(exec_id)")
    db.execute("""
        CREATE TABLE exports (
            id INTEGER PRIMARY KEY,
            created_ns INTEGER NOT NULL,
            source TEXT NOT NULL,              -- the checkpoint (step dir) exported
            role_dir TEXT NOT NULL,
            out_dir TEXT NOT NULL,
            source_kind TEXT NOT NULL,         -- fsdp-shards | hf-weights
            world_size INTEGER,
            dtype TEXT NOT NULL,
            tensors INTEGER NOT NULL,
            total_bytes INTEGER NOT NULL,
            verified INTEGER NOT NULL,
            warnings TEXT NOT NULL DEFAULT '[]',
            source_files TEXT NOT NULL DEFAULT '[]'  -- JSON [[path, hash]] of the source as last scanned
        )""")
    db.execute("""
        CREATE TABLE export_files (
            id INTEGER PRIMARY KEY,
            export_id INTEGER NOT NULL REFERENCES exports(id),
            path TEXT NOT NULL,
            size_bytes INTEGER NOT NULL,
            hash TEXT NOT NULL
        )""")
    db.execute("CREATE INDEX export_files_export ON export_files(export_id)")


@MIGRATIONS()
def m003_trust(db) -> None:
    """What a cached verdict needs to stay true: when each file was last read by content, and what its structure
    showed; what a scan re-read on purpose (scrub); how an export's source was checked and what it overrode."""
    db.execute("ALTER TABLE files ADD COLUMN verified_ns INTEGER")  # last content read (hash + CRC); NULL never
    db.execute("ALTER TABLE files ADD COLUMN pt_facts TEXT")  # JSON of tree.PtFacts; NULL: not a torch zip
    db.execute("ALTER TABLE scans ADD COLUMN bytes_scrubbed INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE exports ADD COLUMN source_verified INTEGER NOT NULL DEFAULT 0")  # shards re-read = manifest
    db.execute("ALTER TABLE exports ADD COLUMN override TEXT NOT NULL DEFAULT ''")  # e.g. allow-corrupt; '' none


@MIGRATIONS()
def m004_tracker_fixes(db) -> None:
    """fix-tracker: every rewrite of a run's tracker, with what it said before and where that was kept."""
    db.execute("""
        CREATE TABLE tracker_fixes (
            id INTEGER PRIMARY KEY,
            at_ns INTEGER NOT NULL,
            run_path TEXT NOT NULL,
            tracker_path TEXT NOT NULL,
            problem TEXT NOT NULL,             -- missing | garbage | dangling | names-<status> | behind
            old_content TEXT,                  -- NULL: there was no tracker
            old_step INTEGER,
            new_step INTEGER NOT NULL,
            backup_path TEXT                   -- the old content, kept beside the tracker; NULL when none
        )""")
    db.execute("CREATE INDEX tracker_fixes_run ON tracker_fixes(run_path, at_ns)")


@MIGRATIONS()
def m005_nodes(db) -> None:
    """scan --ray: the cluster's nodes (when each last answered) and which node holds a copy of which file (a file
    may be on several: replicas). A node's stat of its copy is its own, so its cache is keyed by (path, node)."""
    db.execute("""
        CREATE TABLE nodes (
            node_id TEXT PRIMARY KEY,          -- the Ray node id
            first_seen_ns INTEGER NOT NULL,
            last_answered_ns INTEGER,          -- start of the last scan it answered; NULL: never
            last_silent_ns INTEGER,            -- start of the last scan it did not answer; NULL: never
            last_scan_id INTEGER NOT NULL REFERENCES scans(id)
        )""")
    db.execute("""
        CREATE TABLE file_nodes (
            path TEXT NOT NULL,                -- the logical path (files.path)
            node_id TEXT NOT NULL REFERENCES nodes(node_id),
            size_bytes INTEGER NOT NULL,       -- the stat of this node's copy
            mtime_ns INTEGER NOT NULL,
            inode INTEGER NOT NULL,
            hash TEXT,
            verified_ns INTEGER,               -- last content read of this copy; NULL: never
            last_scan_id INTEGER NOT NULL REFERENCES scans(id),
            present INTEGER NOT NULL DEFAULT 1,  -- 0: the node answered a later scan without it
            PRIMARY KEY (path, node_id)
        )""")
    db.execute("CREATE INDEX file_nodes_node ON file_nodes(node_id, present)")


@MIGRATIONS()
def m006_dcp_facts(db) -> None:
    """What a DCP .metadata says of its directory (models.DcpFacts: the bytes each data file must hold, the state's
    top keys), so a re-scan checks the data files without parsing an unchanged .metadata again."""
    db.execute("ALTER TABLE files ADD COLUMN dcp_facts TEXT")  # JSON of models.DcpFacts; NULL: not a DCP .metadata


@MIGRATIONS()
def m007_run_verdicts(db) -> None:
    """The run verdict cache (ckpt_audit.scan.verdicts): a run's judged model under a key of everything the verdict
    read. A row must never outlive the catalog rows it was judged from, so any change to a files row of the run, or
    to a checkpoint's status or presence, or the run's removal, deletes it, whoever makes the change."""
    db.execute("""
        CREATE TABLE run_verdicts (
            run_path TEXT PRIMARY KEY,
            key TEXT NOT NULL,                 -- xxh3-128 hex of what the verdict read (scan.verdicts.run_key)
            judged_ns INTEGER NOT NULL,
            run_doc TEXT NOT NULL              -- JSON of the models.Run (catalog.verdicts), never a pickle
        )""")
    forget = "DELETE FROM run_verdicts WHERE run_path"
    # what a verdict read of a files row (verified_ns aside: a scrub that reads the same content back keeps it)
    cols = (
        "size_bytes, mtime_ns, inode, hash, crc_ok, file_findings, pt_facts, dcp_facts, present, run_path, "
        "checkpoint_path, role, kind, rank, world_size"
    )
    new = ", ".join(f"NEW.{c.strip()}" for c in cols.split(","))
    old = ", ".join(f"OLD.{c.strip()}" for c in cols.split(","))
    db.execute(  # BEFORE: an INSERT OR REPLACE still sees the row it replaces
        f"CREATE TRIGGER run_verdicts_file_written BEFORE INSERT ON files "
        f"WHEN NOT EXISTS (SELECT 1 FROM files WHERE path = NEW.path AND ({cols}) IS ({new})) "
        f"BEGIN {forget} IN (NEW.run_path, (SELECT run_path FROM files WHERE path = NEW.path)); END"
    )
    db.execute(
        f"CREATE TRIGGER run_verdicts_file_changed AFTER UPDATE ON files WHEN ({old}) IS NOT ({new}) "
        f"BEGIN {forget} IN (OLD.run_path, NEW.run_path); END"
    )
    db.execute(f"CREATE TRIGGER run_verdicts_file_removed AFTER DELETE ON files BEGIN {forget} = OLD.run_path; END")
    db.execute(
        f"CREATE TRIGGER run_verdicts_checkpoint_changed AFTER UPDATE ON checkpoints "
        f"WHEN OLD.status IS NOT NEW.status OR OLD.present IS NOT NEW.present OR OLD.run_path IS NOT NEW.run_path "
        f"BEGIN {forget} IN (OLD.run_path, NEW.run_path); END"
    )
    db.execute(
        f"CREATE TRIGGER run_verdicts_checkpoint_removed AFTER DELETE ON checkpoints BEGIN {forget} = OLD.run_path; END"
    )
    db.execute(
        f"CREATE TRIGGER run_verdicts_run_changed AFTER UPDATE ON runs WHEN OLD.present IS NOT NEW.present "
        f"BEGIN {forget} = OLD.path; END"
    )
    db.execute(f"CREATE TRIGGER run_verdicts_run_removed AFTER DELETE ON runs BEGIN {forget} = OLD.path; END")


@MIGRATIONS()
def m008_deep_verdicts(db) -> None:
    """What verify (or scan --deep) found of each checkpoint beyond the scan, with the files it read as it read them:
    every later judgement takes the worse of the scan's verdict and this one while those files are unchanged
    (ckpt_audit.rules.deep_verdict). One row per checkpoint, replaced by its next verify; none when verify found
    nothing."""
    db.execute("""
        CREATE TABLE deep_verdicts (
            checkpoint_path TEXT PRIMARY KEY,
            run_path TEXT NOT NULL,
            scan_id INTEGER NOT NULL,          -- the verify's scan (scans.id)
            judged_ns INTEGER NOT NULL,        -- when verify read the files (its scan's start)
            findings TEXT NOT NULL,            -- JSON list of the findings verify added to the scan's
            files TEXT NOT NULL                -- JSON [[path, size_bytes, mtime_ns, inode, hash], ...]: what it read
        )""")


@MIGRATIONS()
def m009_read_rules(db) -> None:
    """Which readers' rules (ckpt_audit.readers.RULES) each file's facts were read under: a row read under other
    rules does not vouch for its file, which the next scan reads again. NULL (every row before this): not today's."""
    db.execute("ALTER TABLE files ADD COLUMN read_rules INTEGER")


@MIGRATIONS()
def m010_store_checksums(db) -> None:
    """The whole file's checksums as object stores record them (`crc32=… crc32c=… crc64nvme=…`, base64 of the
    big-endian value as S3's headers give them; scan --store-checksums): a remote scan checks a bucket's copy of the
    file against them without downloading it (docs/remote.md). NULL: not computed."""
    db.execute("ALTER TABLE files ADD COLUMN store_checksums TEXT")


@MIGRATIONS()
def m011_kept_run_summaries(db) -> None:
    """A kept run answered without decoding its model (ckpt_audit.scan.reuse): each verdict row gets a small summary
    (statuses, findings, tracker step, size; the files the catalog keeps no row for), and a scan picks the scrub's
    files by an index in verified order instead of loading a row per file. A verdict now also goes when a files row
    of its run stops vouching by content (verified_ns emptied, or read under other readers' rules): the summary's
    list of files to read every scan stays the whole truth. Rows from before this migration have no summary: their
    runs are judged afresh once."""
    db.execute("ALTER TABLE run_verdicts ADD COLUMN summary TEXT")  # JSON (catalog.verdicts); NULL: judge afresh
    db.execute("CREATE INDEX files_verified ON files(verified_ns, path) WHERE present = 1 AND hash IS NOT NULL")
    forget = "DELETE FROM run_verdicts WHERE run_path"
    cols = (
        "size_bytes, mtime_ns, inode, hash, crc_ok, file_findings, pt_facts, dcp_facts, present, run_path, "
        "checkpoint_path, role, kind, rank, world_size, verified_ns IS NULL, read_rules"
    )
    new = ", ".join(f"NEW.{c.strip()}" for c in cols.split(","))
    old = ", ".join(f"OLD.{c.strip()}" for c in cols.split(","))
    # m007's two file triggers again over the new columns, spelled out: a migration stays as it ran
    db.execute("DROP TRIGGER run_verdicts_file_written")
    db.execute("DROP TRIGGER run_verdicts_file_changed")
    db.execute(  # BEFORE: an INSERT OR REPLACE still sees the row it replaces
        f"CREATE TRIGGER run_verdicts_file_written BEFORE INSERT ON files "
        f"WHEN NOT EXISTS (SELECT 1 FROM files WHERE path = NEW.path AND ({cols}) IS ({new})) "
        f"BEGIN {forget} IN (NEW.run_path, (SELECT run_path FROM files WHERE path = NEW.path)); END"
    )
    db.execute(
        f"CREATE TRIGGER run_verdicts_file_changed AFTER UPDATE ON files WHEN ({old}) IS NOT ({new}) "
        f"BEGIN {forget} IN (OLD.run_path, NEW.run_path); END"
    )
