"""The resume gate and tracker repair, through the real CLI (a subprocess) on trainer-written trees.

`latest` answers a job script's resume_from_path; `fix-tracker` points the tracker at the same checkpoint. Each
test builds one failure verl users meet (docs/verl-format.md §1.2, §2.4, §4): a bit-flipped shard, a tracker
missing (FSDP async_save), garbage, dangling, naming a corrupt step or lagging behind, a save still being written
under a tracker published early; then the hostile cases: a read-only run, a tracker linked out of the run, a
directory created a second ago, a second copy holding the catalog lock, a typo'd flag.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import pytest
from cli_proc import ckpt_audit, unprivileged
from scan_trees import flip_payload_byte, shard, steps_of

from ckpt_audit import lock
from ckpt_audit.killpoints import KILL_AFTER_ENV

HOUR_NS = 3600 * 10**9
TRACKER = "latest_checkpointed_iteration.txt"
needs_setpriv = pytest.mark.skipif(unprivileged() is None, reason="root without setpriv: chmod is not enforced")


@pytest.fixture
def run(verl_run, copy_run) -> Path:
    """A private copy of the trainer's run (steps 2, 4, 6; tracker 6), last written three hours ago."""
    run = Path(copy_run(verl_run))
    age(run)
    return run


def age(*paths: Path, hours: float = 3) -> None:
    then = time.time_ns() - int(hours * HOUR_NS)
    for top in paths:
        for p in [*top.rglob("*"), top] if top.is_dir() else [top]:
            os.utime(p, ns=(then, then), follow_symlinks=False)


def set_tracker(run: Path, text: str | None) -> None:
    t = run / TRACKER
    if text is None:
        t.unlink()
    else:
        t.write_text(text)
        age(t)


def codes(doc: dict) -> list[str]:
    return [f["code"] for r in doc["runs"] for f in r["findings"]] + [
        f["code"] for r in doc["runs"] for c in r["checkpoints"] for f in c["findings"]
    ]


# ------------------------------------------------------------------------------------------ the gate


def test_latest_passes_over_a_bit_flipped_newest_checkpoint(run, tmp_path):
    flip_payload_byte(shard(run / "global_step_6", "model", 1))
    plain = ckpt_audit("latest", run, catalog=tmp_path / "c.db")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == f"{run / 'global_step_4'}\n"
    doc = json.loads(ckpt_audit("latest", "--json", run, catalog=tmp_path / "c.db").stdout)
    assert doc["step"] == 4 and doc["files_reused"] > 0  # the first call recorded what it read
    [passed] = doc["passed_over"]
    assert passed["step"] == 6 and passed["status"] == "corrupt" and "crc-mismatch" in passed["reasons"]


def test_verified_reads_by_content_now_unless_max_age_accepts_an_older_read(run, tmp_path):
    db = tmp_path / "c.db"
    assert ckpt_audit("scan", "-q", run, catalog=db).returncode == 0
    flip_payload_byte(shard(run / "global_step_6", "model", 0))  # bit rot: size, mtime and inode unchanged
    assert ckpt_audit("latest", run, catalog=db).stdout.strip() == str(run / "global_step_6")  # the cache cannot see it
    aged = ckpt_audit("latest", "--verified", "--max-age", "2d", "--json", run, catalog=db)
    recent = json.loads(aged.stdout)
    assert recent["step"] == 6 and recent["reread"] == []  # read by content minutes ago: accepted, and said so
    assert "step 6 last read by content at " in aged.stderr and "within --max-age 2d: not re-read" in aged.stderr
    t0 = time.time_ns()
    now = ckpt_audit("latest", "--verified", "--json", run, catalog=db)  # the old code: step 6, read "within 7d"
    doc = json.loads(now.stdout)
    assert now.returncode == 0 and doc["step"] == 4
    assert doc["reread"] == sorted([str(run / "global_step_6"), str(run / "global_step_4")])
    assert "hash-drift" in doc["passed_over"][0]["reasons"]
    said = now.stderr.splitlines()
    assert said[0].startswith("ckpt-audit: read step 6 by content just now") and said[0].endswith("passed over")
    assert said[1].startswith("ckpt-audit: read step 4 by content just now") and said[1].endswith("the answer")
    [(oldest,)] = sqlite3.connect(db).execute(
        "SELECT MIN(verified_ns) FROM files WHERE path LIKE ?", [f"{run / 'global_step_4'}/%"]
    )
    assert oldest >= t0  # what it read is recorded
    # what the re-read found is kept: the next cached answer does not trust step 6 again
    assert ckpt_audit("latest", run, catalog=db).stdout.strip() == str(run / "global_step_4")


def test_no_complete_checkpoint_is_exit_1_and_one_line(run, tmp_path):
    for step in steps_of(run):
        shard(step, "model", 1).unlink()
    out = ckpt_audit("latest", run, catalog=tmp_path / "c.db")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "no complete checkpoint" in out.stderr and "missing-rank" in out.stderr
    doc = json.loads(ckpt_audit("latest", "--json", run, catalog=tmp_path / "c.db").stdout)
    assert doc["checkpoint"] is None and [p["step"] for p in doc["passed_over"]] == [6, 4, 2]
    assert all("missing-rank" in p["reasons"] for p in doc["passed_over"])


def test_latest_refuses_paths_that_are_not_one_run(run, tmp_path):
    db = tmp_path / "c.db"
    inside = ckpt_audit("latest", run / "global_step_6", catalog=db)
    assert inside.returncode == 3 and "not a run directory" in inside.stderr
    assert ckpt_audit("latest", tmp_path / "nope", catalog=db).returncode == 3
    assert ckpt_audit("latest", "--verfied", run, catalog=db).returncode == 2  # a typo is a usage error, not an answer


def test_async_save_without_tracker(run, tmp_path):
    """FSDP async_save writes no tracker (verl #7952): the scan says what auto-resume would do; the gate and the
    repair still find step 6."""
    set_tracker(run, None)
    doc = json.loads(ckpt_audit("scan", "--json", run, catalog=tmp_path / "c.db").stdout)
    [untracked] = [f for r in doc["runs"] for f in r["findings"] if f["code"] == "untracked-complete"]
    assert untracked["severity"] == "warning" and "trains from step 0" in untracked["message"]
    # the job-script form, RUN/ with a slash: the answer has none (verl's int(path.split("global_step_")[-1]))
    assert ckpt_audit("latest", f"{run}/", catalog=tmp_path / "c.db").stdout == f"{run / 'global_step_6'}\n"


def test_tracker_published_early_while_its_files_change(run, tmp_path):
    """Megatron's async queue can publish the tracker before the files it names are written (verl #8000)."""
    age(run / TRACKER, hours=1)
    os.utime(shard(run / "global_step_6", "optim", 1))  # still being written, after the tracker
    doc = json.loads(ckpt_audit("scan", "--json", run, catalog=tmp_path / "c.db").stdout)
    assert "tracker-published-early" in codes(doc)
    gate = json.loads(ckpt_audit("latest", "--json", run, catalog=tmp_path / "c.db").stdout)
    assert gate["step"] == 4 and gate["passed_over"][0]["reasons"] == ["tracker-published-early"]
    fix = ckpt_audit("fix-tracker", "--yes", run, catalog=tmp_path / "c.db")
    assert fix.returncode == 1 and "looks alive" in fix.stderr and (run / TRACKER).read_text() == "6"


def test_remote_copy_configured_without_a_complete_local_checkpoint(run, tmp_path):
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("trainer:\n  default_hdfs_dir: hdfs://nn/ckpts/exp  # copy\n")
    shard(run / "global_step_6", "model", 1).unlink()
    age(run)
    doc = json.loads(ckpt_audit("scan", "--json", run, catalog=tmp_path / "c.db").stdout)
    [remote] = [f for r in doc["runs"] for f in r["findings"] if f["code"] == "remote-copy-unfinished"]
    assert "hdfs://nn/ckpts/exp" in remote["message"] and "step 6 is incomplete" in remote["message"]
    (run / ".hydra" / "config.yaml").write_text("trainer:\n  default_hdfs_dir: null\n")
    age(run)
    doc = json.loads(ckpt_audit("scan", "--json", run, catalog=tmp_path / "c.db").stdout)
    assert "remote-copy-unfinished" not in codes(doc)


# ------------------------------------------------------------------------------------------ tracker repair


@pytest.mark.parametrize(
    "tracker,problem,target",
    [
        (None, "missing", 6),
        ("twelve", "garbage", 6),
        ("", "garbage", 6),
        ("999", "dangling", 6),
        ("9" * 30, "dangling", 6),  # past SQLite's INTEGER: the fix was written, then its log raised (exit 3)
        ("4", "behind", 6),
        ("6", "names-corrupt", 4),
    ],
)
def test_fix_tracker(run, tmp_path, tracker, problem, target):
    db = tmp_path / "c.db"
    if problem == "names-corrupt":
        flip_payload_byte(shard(run / "global_step_6", "extra_state", 0))
    set_tracker(run, tracker)
    dry = ckpt_audit("fix-tracker", "--json", run, catalog=db)
    plan = json.loads(dry.stdout)
    assert dry.returncode == 1 and plan["problem"] == problem and plan["new_step"] == target
    assert plan["written"] is False
    assert (run / TRACKER).exists() == (tracker is not None)  # a dry run writes nothing
    done = ckpt_audit("fix-tracker", "--yes", run, catalog=db)
    assert done.returncode == 0, done.stderr
    assert (run / TRACKER).read_bytes() == str(target).encode()  # as verl writes it: no newline
    backups = sorted(run.glob(f"{TRACKER}.ckpt-audit-old-*"))
    assert [b.read_text() for b in backups] == ([] if tracker is None else [tracker])
    assert not list(run.glob(f".{TRACKER}.ckpt-audit-tmp-*"))
    rows = sqlite3.connect(db).execute("SELECT problem, old_content, new_step FROM tracker_fixes").fetchall()
    assert rows == [(problem, tracker, target)]
    again = ckpt_audit("fix-tracker", run, catalog=db)
    assert again.returncode == 0 and ": ok" in again.stdout
    assert ckpt_audit("latest", run, catalog=db).stdout.strip() == str(run / f"global_step_{target}")


def test_fix_tracker_refuses_a_run_that_is_being_written(run, tmp_path):
    set_tracker(run, "4")
    (run / "global_step_8").mkdir()  # made a second ago: verl's next save has begun
    out = ckpt_audit("fix-tracker", "--yes", run, catalog=tmp_path / "c.db")
    assert out.returncode == 1 and "being written" in out.stderr
    assert (run / TRACKER).read_text() == "4" and not list(run.glob(f"{TRACKER}.ckpt-audit-*"))


def test_fix_tracker_refuses_a_freshly_written_tracker(run, tmp_path):
    (run / TRACKER).write_text("4")  # the trainer just wrote it
    out = ckpt_audit("fix-tracker", "--yes", run, catalog=tmp_path / "c.db")
    assert out.returncode == 1 and "looks alive" in out.stderr and (run / TRACKER).read_text() == "4"


def test_fix_tracker_never_replaces_a_link_out_of_the_run(run, tmp_path):
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("2")
    (run / TRACKER).unlink()
    (run / TRACKER).symlink_to(outside)
    age(run)
    out = ckpt_audit("fix-tracker", "--yes", run, catalog=tmp_path / "c.db")
    assert out.returncode == 1 and "symbolic link" in out.stderr
    assert (run / TRACKER).is_symlink() and outside.read_text() == "2"


def test_second_copy_exits_4_and_typos_exit_2(run, tmp_path):
    db = tmp_path / "c.db"
    set_tracker(run, None)
    with lock.hold(lock.lock_path_for(db)):
        busy = ckpt_audit("fix-tracker", "--yes", run, catalog=db)
    assert busy.returncode == 4 and not (run / TRACKER).exists()
    assert ckpt_audit("fix-tracker", "--yse", run, catalog=db).returncode == 2
    assert ckpt_audit("fix-tracker", "-y", run, catalog=db).returncode == 2
    assert not (run / TRACKER).exists()


@needs_setpriv
def test_read_only_run_is_one_line_and_leaves_nothing(run, tmp_path):
    set_tracker(run, "999")
    db = tmp_path / "c.db"
    run.chmod(0o555)
    try:
        out = ckpt_audit("fix-tracker", "--yes", run, catalog=db, as_user=True)
    finally:
        run.chmod(0o755)
    assert out.returncode == 3 and out.stderr.count("\n") == 1 and "cannot write the tracker" in out.stderr
    assert (run / TRACKER).read_text() == "999" and not list(run.glob(f"*{TRACKER}.ckpt-audit-*"))
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM tracker_fixes").fetchone() == (0,)


def test_nothing_to_point_at(run, tmp_path):
    for step in steps_of(run):
        shard(step, "model", 0).unlink()
    set_tracker(run, None)
    age(run)  # removing files made the directories young: not a save in progress
    out = ckpt_audit("fix-tracker", "--yes", run, catalog=tmp_path / "c.db")
    assert out.returncode == 1 and "no complete checkpoint" in out.stderr and not (run / TRACKER).exists()


# ------------------------------------------------------------------------------------------ kill -9


@pytest.mark.parametrize("kill_after", [1, 2, 3, 4])
def test_fix_tracker_killed_at_any_point_leaves_a_whole_tracker_and_the_next_run_finishes(run, tmp_path, kill_after):
    """SIGKILL after each counted step of the write (backup, temporary file, rename, directory fsync): the tracker
    holds the old or the new content, whole, and a second fix-tracker --yes ends with the tracker on the target."""
    db = tmp_path / "c.db"
    set_tracker(run, "4")
    killed = ckpt_audit("fix-tracker", "--yes", run, catalog=db, env={KILL_AFTER_ENV: str(kill_after)}, timeout=120)
    assert killed.returncode == -9, (killed.returncode, killed.stderr)
    assert (run / TRACKER).read_bytes() in (b"4", b"6")  # never empty, never half written
    age(run / TRACKER)  # the killed write is not a trainer that is alive
    again = ckpt_audit("fix-tracker", "--yes", run, catalog=db)
    assert again.returncode == 0, again.stderr
    assert (run / TRACKER).read_bytes() == b"6"
    assert not list(run.glob(f".{TRACKER}.ckpt-audit-tmp-*"))  # a killed write's temporary is gone
    assert ckpt_audit("latest", run, catalog=db).stdout.strip() == str(run / "global_step_6")
    scan = ckpt_audit("scan", "--json", run, catalog=db)
    assert scan.returncode == 0, (scan.stdout[-2000:], scan.stderr)  # what the kill left is no finding
