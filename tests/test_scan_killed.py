"""kill -9 at every catalog statement of a scan: the tree is untouched and the catalog holds the old scan or the new
one, whole, and the next scan succeeds (issue 11: the kill -9 matrix covers scan as well as prune and export)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from cli_proc import ckpt_audit

from ckpt_audit.killpoints import CATALOG_KILL_AFTER_ENV

COMMIT_OP = 5  # record_scan's counted steps: scans row, runs+checkpoints, files+history+findings, summaries, commit


def tree_digest(root: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def catalog_state(cat: Path) -> tuple:
    conn = sqlite3.connect(cat)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        scans = conn.execute("SELECT COUNT(*) FROM scans").fetchone()[0]
        ckpts = tuple(
            conn.execute("SELECT step, status, last_scan_id FROM checkpoints WHERE present = 1 ORDER BY step")
        )
        runs = tuple(conn.execute("SELECT n_checkpoints, latest_complete_step, last_scan_id FROM runs"))
        findings = conn.execute("SELECT COUNT(*) FROM findings f JOIN scans s ON s.id = f.scan_id").fetchone()[0]
    finally:
        conn.close()
    return scans, ckpts, runs, findings


@pytest.fixture(scope="module")
def scanned_then_broken(verl_run, tmp_path_factory) -> tuple[Path, Path, tuple]:
    """(run, catalog of its first scan, that catalog's state), the run then broken: one rank's optimizer gone."""
    base = tmp_path_factory.mktemp("killed-scan")
    run = base / "tree" / verl_run.parent.name / verl_run.name
    shutil.copytree(verl_run, run, symlinks=True)
    cat = base / "first.db"
    assert ckpt_audit("scan", str(run), "--catalog", str(cat)).returncode == 0
    (run / "global_step_2" / "actor" / "optim_world_size_2_rank_1.pt").unlink()
    return run, cat, catalog_state(cat)


@pytest.mark.parametrize("kill_after", range(1, COMMIT_OP + 1))
def test_a_scan_killed_at_any_statement_leaves_tree_and_catalog_whole(scanned_then_broken, tmp_path, kill_after):
    run, first, old_state = scanned_then_broken
    cat = tmp_path / "catalog.db"
    shutil.copy2(first, cat)
    before = tree_digest(run)

    killed = ckpt_audit("scan", str(run), "--catalog", str(cat), env={CATALOG_KILL_AFTER_ENV: str(kill_after)})
    assert killed.returncode == -9, killed.stderr
    assert tree_digest(run) == before  # a scan never writes the tree, killed or not

    state = catalog_state(cat)
    if kill_after < COMMIT_OP:
        assert state == old_state  # rolled back whole
    else:
        assert state[0] == old_state[0] + 1
        assert [(step, status) for step, status, _ in state[1]] == [(2, "incomplete"), (4, "complete"), (6, "complete")]
    listed = ckpt_audit("ls", "--json", "--catalog", str(cat))
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["runs"][0]["n_checkpoints"] == 3

    again = ckpt_audit("scan", str(run), "--catalog", str(cat))
    assert again.returncode == 1, again.stderr  # the missing optimizer shard is an error finding
    assert [(s, st) for s, st, _ in catalog_state(cat)[1]] == [(2, "incomplete"), (4, "complete"), (6, "complete")]
