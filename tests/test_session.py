"""The session: one locked catalog under both front ends. Every command that writes the catalog, export
included, refuses at once (exit 4) while another process holds the lock, and writes nothing."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_audit.cli import cli
from ckpt_audit.exitcodes import ExitCode
from ckpt_audit.session import Locked, SessionError, open_session

HOLDER = (
    "import sys\n"
    "from ckpt_audit import lock\n"
    "with lock.hold(lock.lock_path_for(sys.argv[1])):\n"
    "    print('held', flush=True)\n"
    "    sys.stdin.read()  # until the test closes our stdin\n"
)


@contextmanager
def lock_held_by_another_process(catalog: Path):
    """A real second process holding the catalog's lock (what a cron `ckpt-audit scan` holds while it runs)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(catalog)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def latest_step(run: Path) -> Path:
    return max(run.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))


def test_cli_export_refuses_while_another_process_holds_the_lock(verl_run, tmp_path):
    catalog, out = tmp_path / "c.db", tmp_path / "hf"
    args = ["export", str(latest_step(verl_run)), "--to", str(out), "--catalog", str(catalog)]
    with lock_held_by_another_process(catalog) as pid:
        held = CliRunner().invoke(cli, args)
    assert held.exit_code == ExitCode.LOCKED, held.output
    assert f"pid {pid}" in held.output and not out.exists()  # nothing written, not even the export
    free = CliRunner().invoke(cli, args)  # the same export once the lock is free
    assert free.exit_code == ExitCode.OK, free.output
    assert sqlite3.connect(catalog).execute("SELECT COUNT(*) FROM exports").fetchone() == (1,)


@pytest.mark.parametrize("command", ["scan", "verify", "prune"])
def test_every_writing_command_refuses_while_another_process_holds_the_lock(command, tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    catalog = tmp_path / "c.db"
    with lock_held_by_another_process(catalog):
        res = CliRunner().invoke(cli, [command, str(root), "--catalog", str(catalog)])
    assert res.exit_code == ExitCode.LOCKED and "another ckpt-audit run holds" in res.output
    assert not catalog.exists()


def test_open_session_never_waits_and_checks_roots_first(tmp_path):
    catalog = tmp_path / "c.db"
    with pytest.raises(SessionError, match="missing"):
        with open_session(catalog, roots=[tmp_path / "missing"]):
            pass
    with lock_held_by_another_process(catalog), pytest.raises(Locked):
        with open_session(catalog):
            pass
    with open_session(catalog, roots=[tmp_path]) as session:  # free again: it records
        assert session.roots == (str(tmp_path.resolve()),)
        recorded = session.scan()
        assert recorded.scan_id == 1 and recorded.result.runs == ()
    with open_session(catalog) as session:  # the lock was released on the way out (flock: a second hold would fail)
        assert session.previous == {}  # the catalog exists now and lists no file


@pytest.mark.slow
def test_prune_hands_back_the_preview_whole_and_reports_through_one_progress(verl_run, copy_run, tmp_path):
    """Session.prune takes plan_prune's preview as it is (scan, reclaim dirs, executor ride in it), records the
    scan it came from, and reports each deletion through the one Progress shape: (done, total, line)."""
    import time

    from ckpt_audit.session.terms import KeepLast, Policy

    run = copy_run(verl_run)
    calls: list[tuple[int, int, str]] = []
    with open_session(tmp_path / "c.db", roots=[run]) as s:
        preview = s.plan_prune(Policy(rules=(KeepLast(n=1),)), now_ns=time.time_ns())
        assert preview.scanned is not None and preview.executor is None and str(run) in preview.reclaim_dirs
        done = s.prune(preview, confirmed=True, progress=lambda *call: calls.append(call))
    gone = sorted(i.path for i in preview.plan.delete)
    assert len(gone) == 2 and done.result is not None and not any(Path(p).exists() for p in gone)
    deleted = [c for c in calls if c[2].startswith("deleted: ")]
    assert [c[2] for c in deleted] == [f"deleted: {p}" for p in gone] and all(c[1] >= 2 for c in calls)
    assert [c[0] for c in calls] == list(range(1, len(calls) + 1))
    assert sqlite3.connect(tmp_path / "c.db").execute("SELECT COUNT(*) FROM scans").fetchone() == (1,)
