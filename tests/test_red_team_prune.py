"""Red-team attacks on prune's "deletion needs positive evidence", through the real CLI on trainer-written trees.

Each test is one hole found by a hostile review of issue 11's prune: the tracker's target is protected only while
the tracker can be read, so a tracker that cannot be read (permission, a link out of the root, one too large to
read) must protect every checkpoint it could name; and a fresh empty step directory is being written whatever the
tracker says (a run resumed from an older step rewrites steps at or below it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from test_prune_attacks import HOUR_NS, needs_setpriv, planned, prune, steps_left


@pytest.fixture
def run(verl_run, copy_run) -> Path:
    """A private copy of the trainer's run (steps 2, 4, 6), its tracker moved back to 4 (resume loads step 4,
    the newest complete is 6), every mtime three hours ago."""
    run = Path(copy_run(verl_run))
    (run / "latest_checkpointed_iteration.txt").write_text("4")
    then = time.time_ns() - 3 * HOUR_NS
    for p in [*run.rglob("*"), run]:
        os.utime(p, ns=(then, then), follow_symlinks=False)
    return run


def _tracker_unread_keeps_all(proc) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = planned(json.loads(proc.stdout))
    assert {step: side for step, (side, _status, _reasons) in plan.items()} == {2: "keep", 4: "keep", 6: "keep"}
    assert all("tracker-unread" in reasons for _side, _status, reasons in plan.values())


@needs_setpriv
def test_unreadable_tracker_protects_every_checkpoint_it_could_name(run, tmp_path):
    tracker = run / "latest_checkpointed_iteration.txt"
    tracker.chmod(0)
    try:
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db", unprivileged=True)
    finally:
        tracker.chmod(0o644)
    _tracker_unread_keeps_all(proc)
    assert steps_left(run) == [2, 4, 6]


def test_tracker_linked_out_of_the_root_protects_every_checkpoint(run, tmp_path):
    tracker = run / "latest_checkpointed_iteration.txt"
    outside = tmp_path / "tracker-elsewhere.txt"
    tracker.rename(outside)
    tracker.symlink_to(outside)  # verl follows it and resumes from step 4
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    _tracker_unread_keeps_all(proc)
    assert steps_left(run) == [2, 4, 6]


def test_tracker_too_large_to_read_protects_every_checkpoint(run, tmp_path):
    tracker = run / "latest_checkpointed_iteration.txt"
    tracker.write_text("4" + " " * 70_000 + "\n")  # verl's int(f.read().decode()) still reads step 4
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    _tracker_unread_keeps_all(proc)
    assert steps_left(run) == [2, 4, 6]


def test_fresh_empty_step_dir_at_or_below_the_tracker_is_in_progress(run, tmp_path):
    import shutil

    shutil.rmtree(run / "global_step_2")  # a run resumed from an older step saves step 2 again:
    (run / "global_step_2").mkdir()  # verl makes the directory first, the ranks write into it next
    proc = prune(run, "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    assert planned(json.loads(proc.stdout))[2] == ("keep", "in-progress", ["in-progress"])
    assert (run / "global_step_2").is_dir()


def test_a_torn_non_utf8_line_in_the_metrics_log_is_skipped_not_an_error(run, tmp_path):
    with open(run / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": 7, "lo\xff\xfe')  # a trainer killed mid-write, bytes garbled
    proc = prune(run, "--keep-best", "1", "--dry-run", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    plan = planned(json.loads(proc.stdout))
    assert sum("keep-best" in reasons for _side, _status, reasons in plan.values()) == 1


def test_a_checkpoint_a_kept_one_links_into_is_not_deleted(run, tmp_path):
    name = "actor/model_world_size_2_rank_0.pt"
    kept = run / "global_step_6" / name
    shared = run / "global_step_4" / "actor" / "shared_model_rank_0.pt"
    kept.rename(shared)  # step 6's shard now lives in step 4's directory (deduplicated), reached by a link
    kept.symlink_to(os.path.relpath(shared, kept.parent))
    (run / "latest_checkpointed_iteration.txt").write_text("6")
    then = time.time_ns() - 3 * HOUR_NS
    for p in [*run.rglob("*"), run]:
        os.utime(p, ns=(then, then), follow_symlinks=False)
    proc = prune(run, "--keep-last", "1", "--yes", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    assert steps_left(run) == [4, 6] and kept.is_file()  # step 2 went; step 4 holds step 6's bytes
    assert f"linked <- {kept}" in proc.stdout  # the plan keeps it and names the link (it was skipped at execution)
