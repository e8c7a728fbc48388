"""prune.execute on real directories: crash safety (SIGKILL at every filesystem operation), re-checks, logging."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlite_utils

from ckpt_audit.catalog.lifecycle import LifecycleLog
from ckpt_audit.catalog.migrations import MIGRATIONS
from ckpt_audit.killpoints import KILL_AFTER_ENV
from ckpt_audit.lifecycle.prune import TRASH_RE, Action, execute, find_trash
from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
from ckpt_audit.models import Checkpoint, FileKind, Run, ShardFile, Status

W = 2


def make_run(root: Path, steps=(1, 2, 3, 4, 5, 6), tracker: int | None = 6) -> Path:
    run = root / "proj" / "exp"
    for s in steps:
        actor = run / f"global_step_{s}" / "actor"
        (actor / "huggingface").mkdir(parents=True)
        for r in range(W):
            (actor / f"model_world_size_{W}_rank_{r}.pt").write_bytes(os.urandom(4096) + bytes([s, r]))
        (actor / "huggingface" / "config.json").write_text('{"model_type": "qwen2"}')
        (run / f"global_step_{s}" / "data.pt").write_bytes(os.urandom(512))
    if tracker is not None:
        (run / "latest_checkpointed_iteration.txt").write_text(str(tracker))
    return run


def scan_dir(run: Path, status: dict[int, Status] | None = None) -> Run:
    """The model a scan would build, from stat alone (the scanner's own tests cover recognition)."""
    status = status or {}
    ckpts = []
    for d in sorted(run.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1])):
        step = int(d.name.rsplit("_", 1)[1])
        files = []
        for p in sorted(x for x in d.rglob("*") if x.is_file()):
            st = p.lstat()
            files.append(
                ShardFile(
                    path=str(p), kind=FileKind.OTHER, size_bytes=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino
                )
            )
        dirs = [
            d,
            *(x for x in d.rglob("*") if x.is_dir() and not x.is_symlink()),
        ]  # a scan ages a step by its dirs too
        newest = max([*(f.mtime_ns for f in files), *(x.lstat().st_mtime_ns for x in dirs)])
        ckpts.append(
            Checkpoint(
                run_path=str(run),
                step=step,
                path=str(d),
                status=status.get(step, Status.COMPLETE),
                files=tuple(files),
                mtime_ns=newest,
            )
        )
    tracker = run / "latest_checkpointed_iteration.txt"
    return Run(
        path=str(run),
        layout="verl-fsdp",
        checkpoints=tuple(ckpts),
        tracker_step=int(tracker.read_text()) if tracker.exists() else None,
    )


def digest_tree(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


def plan_for(run: Path, n: int = 1, **kw):
    return plan_prune([scan_dir(run, **kw)], Policy(rules=(KeepLast(n=n),)), now_ns=time.time_ns())


def test_execute_deletes_exactly_the_plan_and_logs_it(tmp_path):
    run = make_run(tmp_path)
    bystander = run / "notes.txt"
    bystander.write_text("mine")
    plan = plan_for(run, n=2)
    assert [i.step for i in plan.delete] == [1, 2, 3, 4]
    kept_before = {s: digest_tree(run / f"global_step_{s}") for s in (5, 6)}

    db = sqlite_utils.Database(tmp_path / "catalog.db")
    MIGRATIONS.apply(db)  # the catalog's schema, as open_catalog makes it
    log = LifecycleLog(db)
    result = execute(plan, catalog=log)

    assert result.count(Action.DELETED) == 4 and result.ok
    assert result.bytes_freed == plan.bytes_freed > 0
    assert sorted(p.name for p in run.iterdir()) == [
        "global_step_5",
        "global_step_6",
        "latest_checkpointed_iteration.txt",
        "notes.txt",
    ]
    assert {s: digest_tree(run / f"global_step_{s}") for s in (5, 6)} == kept_before
    assert bystander.read_text() == "mine"

    [row] = log.prunes()
    assert row["status"] == "finished" and row["planned_delete"] == 4 and row["bytes_freed"] == plan.bytes_freed
    items = log.prune_items(result.exec_id)
    assert [(i["step"], i["action"]) for i in items if i["action"] == "deleted"] == [
        (1, "deleted"),
        (2, "deleted"),
        (3, "deleted"),
        (4, "deleted"),
    ]
    assert {i["step"]: i["reasons"] for i in items if i["action"] == "kept"} == {
        5: ["keep-last"],
        6: ["newest-complete", "tracker-target", "keep-last"],
    }
    assert all(i["reasons"] == ["not-kept"] for i in items if i["action"] == "deleted")


def test_checkpoint_changed_since_plan_is_skipped(tmp_path):
    run = make_run(tmp_path)
    plan = plan_for(run)
    shard = run / "global_step_2" / "actor" / f"model_world_size_{W}_rank_0.pt"
    shard.write_bytes(b"rewritten by a trainer")  # same dir, different bytes and mtime
    fresh = run / "global_step_3" / "actor" / "late.txt"
    fresh.write_text("appeared after the scan")
    os.utime(fresh, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    result = execute(plan)
    by_step = {o.step: o for o in result.outcomes}
    assert by_step[2].action is Action.SKIPPED and "planned file changed" in by_step[2].detail
    assert by_step[3].action is Action.SKIPPED and "written since the scan" in by_step[3].detail
    assert (run / "global_step_2").is_dir() and (run / "global_step_3").is_dir()
    assert not (run / "global_step_1").exists() and not (run / "global_step_4").exists()


def test_tracker_moved_onto_a_planned_checkpoint_is_skipped(tmp_path):
    run = make_run(tmp_path)
    plan = plan_for(run)
    (run / "latest_checkpointed_iteration.txt").write_text("3")  # someone resumed from step 3 meanwhile
    result = execute(plan)
    assert {o.step: o.action for o in result.outcomes}[3] is Action.SKIPPED
    assert (run / "global_step_3").is_dir()


def test_symlink_inside_a_checkpoint_is_removed_not_followed(tmp_path):
    run = make_run(tmp_path, steps=(1, 2), tracker=2)
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"x" * 10)
    os.symlink(outside, run / "global_step_1" / "actor" / "link_to_outside")
    result = execute(plan_for(run))
    assert result.count(Action.DELETED) == 1
    assert (outside / "keep.bin").read_bytes() == b"x" * 10


def test_execute_is_idempotent(tmp_path):
    run = make_run(tmp_path)
    plan = plan_for(run)
    execute(plan)
    again = execute(plan)
    assert {o.action for o in again.outcomes} == {Action.SKIPPED}
    assert {o.detail for o in again.outcomes} == {"gone already"}


def test_leftover_trash_is_reclaimed_and_reported(tmp_path):
    run = make_run(tmp_path, steps=(1, 2), tracker=2)
    trash = run / ".ckpt-audit-trash-global_step_0-0123456789ab"
    (trash / "actor").mkdir(parents=True)
    (trash / "actor" / "x.pt").write_bytes(b"y" * 100)
    assert [t.original_name for t in find_trash([str(run)])] == ["global_step_0"]
    result = execute(plan_for(run))
    reclaimed = [o for o in result.outcomes if o.action is Action.RECLAIMED]
    assert [o.path for o in reclaimed] == [str(trash)] and reclaimed[0].size_bytes == 100
    assert "0123456789ab" in reclaimed[0].detail
    assert not trash.exists()


def test_reclaimed_bytes_count_a_hardlinked_file_once(tmp_path):
    """verl's Megatron migration hardlinks each dist_ckpt file into three more directories: removing the four
    names frees one file's bytes."""
    run = make_run(tmp_path, steps=(1, 2), tracker=2)
    trash = run / ".ckpt-audit-trash-global_step_0-0123456789ab" / "actor"
    (trash / "dist_ckpt").mkdir(parents=True)
    (trash / "dist_ckpt" / "__0_0.distcp").write_bytes(b"y" * 100)
    for sub in ("model", "optimizer", "extra"):
        (trash / sub / "dist_ckpt").mkdir(parents=True)
        os.link(trash / "dist_ckpt" / "__0_0.distcp", trash / sub / "dist_ckpt" / "__0_0.distcp")
    [reclaimed] = [o for o in execute(plan_for(run)).outcomes if o.action is Action.RECLAIMED]
    assert reclaimed.size_bytes == 100


# ------------------------------------------------------------------------------------------------- kill test

RUNNER = (
    "import pickle, sys; from ckpt_audit.lifecycle.prune import execute; execute(pickle.load(open(sys.argv[1], 'rb')))"
)


def _ops_needed(tmp_path: Path) -> int:
    """Filesystem operations a full prune of the tree takes: rename + unlinks + rmdirs per checkpoint."""
    run = make_run(tmp_path / "count")
    return sum(1 + sum(1 for _ in (run / f"global_step_{s}").rglob("*")) + 1 for s in range(1, 6))


@pytest.mark.slow  # a Python subprocess per filesystem operation
def test_sigkill_at_every_filesystem_operation_never_loses_the_newest_and_a_rerun_completes(tmp_path):
    total = _ops_needed(tmp_path)
    assert total > 20
    for k in range(1, total + 1):
        run = make_run(tmp_path / f"k{k}")
        before = {s: digest_tree(run / f"global_step_{s}") for s in range(1, 7)}
        plan_file = tmp_path / f"plan{k}.pkl"
        plan_file.write_bytes(pickle.dumps(plan_for(run)))
        proc = subprocess.run(
            [sys.executable, "-c", RUNNER, str(plan_file)],
            env={**os.environ, KILL_AFTER_ENV: str(k)},
            capture_output=True,
            timeout=60,
        )
        assert proc.returncode == -9, (k, proc.stderr.decode()[-500:])

        # After the kill: every global_step_N is intact or gone; the rest is clearly marked trash.
        for entry in run.iterdir():
            if entry.name.startswith("global_step_"):
                assert digest_tree(entry) == before[int(entry.name.rsplit("_", 1)[1])], (k, entry.name)
            elif entry.is_dir():
                assert TRASH_RE.match(entry.name), (k, entry.name)
        assert digest_tree(run / "global_step_6") == before[6], k
        assert len(find_trash([str(run)])) <= 1, k

        # A later run (fresh scan, fresh plan) finishes the job.
        rerun = execute(plan_for(run))
        assert rerun.ok
        assert sorted(p.name for p in run.iterdir()) == ["global_step_6", "latest_checkpointed_iteration.txt"], k
        assert digest_tree(run / "global_step_6") == before[6]
