"""Re-read at the moment of the act, through the real CLI on trainer-written trees (issue 26).

Whatever deletes, rewrites the tracker or names a checkpoint for a resume reads what it relies on when it acts,
not when it planned: `prune` after the [y/N] prompt (a terminal the test answers, step 6 truncated or removed while
it waits), `fix-tracker --yes` before writing (bit rot after the nightly scan, size and mtime kept), and a tracker
whose step exists only under a name verl never opens (`global_step_06`). `latest --verified` reading now is in
test_resume_gate.py (test_verified_reads_by_content_now_unless_max_age_accepts_an_older_read).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from scan_trees import flip_payload_byte, shard, steps_of
from test_resume_gate import TRACKER, age, set_tracker


@pytest.fixture
def run(verl_run, copy_run) -> Path:
    """A private copy of the trainer's run (steps 2, 4, 6; tracker 6), last written three hours ago."""
    run = Path(copy_run(verl_run))
    age(run)
    return run


def steps_left(run: Path) -> list[int]:
    return [int(p.name[12:]) for p in steps_of(run)]


def prune_on_a_terminal(run: Path, catalog: Path, while_asked) -> tuple[int, str, str]:
    """`prune --keep-last 1` with stdin and stderr on a pseudo-terminal: call `while_asked()` once the [y/N] prompt
    waits, then answer y. Returns (exit code, stdout, terminal output)."""
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_audit", "prune", str(run.parent.parent), "--keep-last", "1"],
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "CKPT_AUDIT_CATALOG": str(catalog)},
    )
    os.close(slave)
    seen = b""
    try:
        while b"[y/N]" not in seen:
            ready, _, _ = select.select([master], [], [], 120)
            assert ready, f"no prompt within 120 s: {seen!r}"
            seen += os.read(master, 4096)
        while_asked()
        os.write(master, b"y\n")
        out, _ = proc.communicate(timeout=120)
        while select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return proc.returncode, out.decode(), seen.decode(errors="replace")


def truncate_step_6(run: Path) -> None:
    f = shard(run / "global_step_6", "model", 0)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(truncate_step_6, id="truncated"),
        pytest.param(lambda run: shutil.rmtree(run / "global_step_6"), id="removed"),
    ],
)
def test_prune_rereads_the_survivor_after_confirmation_and_deletes_nothing_when_it_failed(run, tmp_path, change):
    code, out, term = prune_on_a_terminal(run, tmp_path / "c.db", lambda: change(run))
    assert code == 1, out + term
    assert 2 in steps_left(run) and 4 in steps_left(run)  # the old code deleted both, on the pre-prompt read
    assert "FAILED re-read: step 6" in out and "just now, after confirmation" in out
    assert "nothing deleted" in term and "failed its re-read after confirmation (step 6 is now " in term
    assert "Traceback" not in term


def test_prune_confirmed_on_a_terminal_rereads_then_deletes(run, tmp_path):
    code, out, term = prune_on_a_terminal(run, tmp_path / "c.db", lambda: None)
    assert code == 0, out + term
    assert steps_left(run) == [6]
    [line] = [x for x in out.splitlines() if "after confirmation" in x]
    assert line.startswith("survivor check: re-read 1 checkpoint(s)") and "all match the scan" in line
    assert f"re-read: {run / 'global_step_6'} (matches the scan, read " in term  # each re-read, with its time


def test_fix_tracker_rereads_its_target_by_content_before_writing(run, tmp_path):
    db = tmp_path / "c.db"
    set_tracker(run, "4")  # lagging: the plan moves it to step 6
    assert ckpt_audit("scan", "-q", run, catalog=db).returncode in (0, 1)  # the nightly scan: every hash catalogued
    flip_payload_byte(shard(run / "global_step_6", "model", 1))  # bit rot: size, mtime and inode kept
    dry = json.loads(ckpt_audit("fix-tracker", "--json", run, catalog=db).stdout)
    assert dry["problem"] == "behind" and dry["new_step"] == 6  # the stat cache cannot see it

    out = ckpt_audit("fix-tracker", "--yes", run, catalog=db)
    assert out.returncode == 1, out.stderr
    assert "not fixed: step 6 failed its re-read by content just now" in out.stderr and "crc-mismatch" in out.stderr
    assert (run / TRACKER).read_text() == "4" and not list(run.glob(f"*{TRACKER}.ckpt-audit-*"))
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM tracker_fixes").fetchone() == (0,)
    # what the read found is recorded: the next plan knows step 6 is corrupt and leaves the tracker on 4
    again = ckpt_audit("fix-tracker", run, catalog=db)
    assert again.returncode == 0 and ": ok" in again.stdout


def test_fix_tracker_writes_after_a_good_reread_and_says_so(run, tmp_path):
    db = tmp_path / "c.db"
    set_tracker(run, "4")
    t0 = time.time_ns()
    out = ckpt_audit("fix-tracker", "--yes", "--json", run, catalog=db)
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["written"] is True and (run / TRACKER).read_text() == "6"
    assert doc["reread"]["ok"] is True and doc["reread"]["step"] == 6 and doc["reread"]["bytes_read"] > 0
    [(oldest,)] = sqlite3.connect(db).execute(
        "SELECT MIN(verified_ns) FROM files WHERE path LIKE ?", [f"{run / 'global_step_6'}/%"]
    )
    assert oldest >= t0  # the read is in the catalog


def test_fix_tracker_never_trusts_a_step_directory_verl_does_not_open(run, tmp_path):
    """The tracker says 6; verl opens global_step_6, and only global_step_06 exists: resume trains from step 0."""
    db = tmp_path / "c.db"
    (run / "global_step_6").rename(run / "global_step_06")
    age(run)
    scan = json.loads(ckpt_audit("scan", "--json", run, catalog=db).stdout)
    assert "tracker-dangling" in [f["code"] for r in scan["runs"] for f in r["findings"]]
    dry = ckpt_audit("fix-tracker", "--json", run, catalog=db)
    plan = json.loads(dry.stdout)
    assert dry.returncode == 1 and plan["problem"] == "dangling" and plan["new_step"] == 4  # the old code: ok
    assert "global_step_06" in plan["detail"]
    assert ckpt_audit("fix-tracker", "--yes", run, catalog=db).returncode == 0
    assert (run / TRACKER).read_text() == "4"


def test_fix_tracker_counts_a_global_step_0_as_the_scan_does(run, tmp_path):
    """The act re-lists the run's step directories to see that no save began since the scan; it skipped
    global_step_0, which the scan counts, so every fix of such a run failed with "gained or lost a step directory"."""
    db = tmp_path / "c.db"
    shutil.copytree(run / "global_step_2", run / "global_step_0")
    set_tracker(run, "9")  # dangling
    age(run)
    out = ckpt_audit("fix-tracker", "--yes", run, catalog=db)
    assert out.returncode == 0, out.stderr
    assert (run / TRACKER).read_text() == "6"


def test_latest_verified_reads_now_whatever_time_the_catalog_claims(run, tmp_path):
    """A catalog time after now (a clock stepped back, another node's clock) is no read made now."""
    db = tmp_path / "c.db"
    assert ckpt_audit("scan", "-q", run, catalog=db).returncode == 0
    flip_payload_byte(shard(run / "global_step_6", "model", 0))
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE files SET verified_ns = ?", [time.time_ns() + 3600 * 10**9])
    out = ckpt_audit("latest", "--verified", run, catalog=db)
    assert out.returncode == 0 and out.stdout.strip() == str(run / "global_step_4"), out.stderr
    assert "read step 6 by content just now" in out.stderr
