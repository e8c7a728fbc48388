"""The SQLite catalog: migrations, one transaction per scan, reuse by stat, absent checkpoints, views."""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest
from scan_trees import base_run, run_copy, shard, steps_of  # noqa: F401

from ckpt_audit.catalog import CatalogError, open_catalog, probe, read_previous
from ckpt_audit.catalog.migrations import MIGRATIONS
from ckpt_audit.models import Checkpoint, Status
from ckpt_audit.scan import scan

TABLES = {"scans", "runs", "checkpoints", "files", "hash_history", "findings"}
VIEWS = {"latest_complete_checkpoint", "checkpoint_status"}


def do_scan(root, **kw):
    return scan([root], in_progress_window_s=0, **kw)


def test_fresh_catalog_has_schema_wal_and_foreign_keys(tmp_path):
    cat = open_catalog(tmp_path / "sub" / "c.db")
    assert TABLES <= set(cat.db.table_names()) and VIEWS <= set(cat.db.view_names())
    assert cat.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert cat.db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert MIGRATIONS.pending(cat.db) == []
    cat.close()
    open_catalog(tmp_path / "sub" / "c.db").close()  # re-opening applies nothing twice


def test_migrations_are_written_out_in_full():
    """An applied migration is frozen: its body may call no other ckpt_audit module, whose edits would edit it."""
    import ast
    from pathlib import Path

    import ckpt_audit.catalog.migrations as migrations

    tree = ast.parse(Path(migrations.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert sorted(m for m in imported if m and m.startswith("ckpt_audit")) == []


def test_rescan_reuses_hashes_and_records_history_only_on_change(run_copy, tmp_path):
    cat = open_catalog(tmp_path / "c.db")
    first = do_scan(run_copy)
    cat.record_scan(first)
    second = do_scan(run_copy, previous=cat.previous_facts())
    assert second.files_reused == len({f.path for r in first.runs for c in r.checkpoints for f in c.all_files})
    cat.record_scan(second)
    victim = shard(steps_of(run_copy)[0], "model", 0)
    victim.write_bytes(victim.read_bytes() + b"\0")  # a rewrite: new stat, new hash
    cat.record_scan(do_scan(run_copy, previous=cat.previous_facts()))
    assert [h["scan_id"] for h in cat.file_history(str(victim))] == [1, 3]
    assert len(cat.file_history(str(shard(steps_of(run_copy)[0], "model", 1)))) == 1
    assert set(cat.previous_manifest()) == set(cat.previous_facts())


def test_per_file_findings_survive_reuse(run_copy, tmp_path):
    p = shard(steps_of(run_copy)[0], "optim", 0)
    import os

    os.truncate(p, p.stat().st_size - 100)
    cat = open_catalog(tmp_path / "c.db")
    cat.record_scan(do_scan(run_copy))
    again = do_scan(run_copy, previous=read_previous(tmp_path / "c.db"))
    assert again.files_reused > 0 and "truncated" in {f.code for f in again.all_findings}
    assert any(c.status is Status.CORRUPT for r in again.runs for c in r.checkpoints)


def test_views_and_absent_checkpoints(run_copy, tmp_path):
    import shutil

    cat = open_catalog(tmp_path / "c.db")
    steps = steps_of(run_copy)
    shard(steps[-1], "model", 1).unlink()
    cat.record_scan(do_scan(run_copy))
    (latest,) = cat.latest_complete()
    assert latest["path"] == str(steps[-2])
    statuses = {c["path"]: c["status"] for c in cat.checkpoints()}
    assert statuses[str(steps[-1])] == "incomplete"
    shutil.rmtree(steps[0])
    cat.record_scan(do_scan(run_copy))
    assert str(steps[0]) not in {c["path"] for c in cat.checkpoints()}
    assert cat.db.execute("SELECT present FROM checkpoints WHERE path = ?", [str(steps[0])]).fetchone() == (0,)


def test_failed_record_leaves_the_catalog_as_it_was(run_copy, tmp_path):
    cat = open_catalog(tmp_path / "c.db")
    good = do_scan(run_copy)
    cat.record_scan(good)
    before = (
        cat.db.execute("SELECT COUNT(*) FROM scans").fetchone(),
        cat.db.execute("SELECT COUNT(*) FROM findings").fetchone(),
    )
    run = good.runs[0]
    orphan = dataclasses.replace(run.checkpoints[0], run_path="/not/a/catalogued/run", path="/not/a/catalogued/run/x")
    broken = dataclasses.replace(good, runs=(dataclasses.replace(run, checkpoints=run.checkpoints + (orphan,)),))
    with pytest.raises(sqlite3.IntegrityError):  # the foreign key fails mid-transaction, after the scan row
        cat.record_scan(broken)
    after = (
        cat.db.execute("SELECT COUNT(*) FROM scans").fetchone(),
        cat.db.execute("SELECT COUNT(*) FROM findings").fetchone(),
    )
    assert after == before
    assert cat.db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert isinstance(orphan, Checkpoint)


def test_unusable_catalog_is_a_catalog_error(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"garbage" * 1000)
    with pytest.raises(CatalogError):
        probe(bad)
    with pytest.raises(CatalogError):
        open_catalog(bad)
    with pytest.raises(CatalogError):
        probe(tmp_path)  # a directory


def test_sigkill_mid_scan_leaves_a_consistent_catalog(run_copy, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    db = tmp_path / "c.db"
    cmd = [sys.executable, "-m", "ckpt_audit", "scan", "-q", "--rehash", "--catalog", str(db), str(run_copy)]
    subprocess.run(cmd, check=True, timeout=120)
    n_files = sqlite3.connect(db).execute("SELECT COUNT(*) FROM files").fetchone()[0]
    for delay in (0.15, 0.25, 0.35, 0.45, 0.6):
        before = sqlite3.connect(db).execute("SELECT COUNT(*) FROM scans").fetchone()[0]
        proc = subprocess.Popen(cmd)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        conn = sqlite3.connect(db)
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        after = conn.execute("SELECT COUNT(*) FROM scans").fetchone()[0]
        assert after in (before, before + 1)  # the whole scan or nothing
        assert conn.execute("SELECT COUNT(*) FROM files").fetchone()[0] == n_files
        if after == before + 1:  # a committed scan carries its findings row count exactly
            last = conn.execute("SELECT id, errors + warnings FROM scans ORDER BY id DESC LIMIT 1").fetchone()
            got = conn.execute("SELECT COUNT(*) FROM findings WHERE scan_id = ? AND severity != 'info'", [last[0]])
            assert got.fetchone()[0] == last[1]
    # the flock died with each killed process: a new run is not refused as locked
    assert subprocess.run(cmd, timeout=120).returncode == 0
