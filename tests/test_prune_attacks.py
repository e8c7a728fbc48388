"""Attacks on prune's two safety invariants, through the real CLI (a subprocess) on trainer-written trees.

1. Deletion needs positive evidence: what prune could not read, what is being written (a fresh, even empty, step
   directory), and whole checkpoints newer than a lagging tracker are kept; a keep rule fed a wrong input is a usage
   error; and execution never half-deletes a tree it cannot remove in full.
2. The survivor is verified before its predecessors go: bit rot that keeps size and mtime in the newest checkpoint
   is found by the re-read, and the older good checkpoints are not deleted on the rotten one's word.

One corruption per test. Permission attacks run the CLI under setpriv without the DAC capabilities (we are root).
"""

from __future__ import annotations

import json
import os
import pickle
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_proc import ckpt_audit, unprivileged
from scan_trees import flip_payload_byte, shard, steps_of

from ckpt_audit.lifecycle.prune import TRASH_RE

HOUR_NS = 3600 * 10**9
needs_setpriv = pytest.mark.skipif(unprivileged() is None, reason="root without setpriv: chmod is not enforced")


@pytest.fixture
def run(verl_run, copy_run) -> Path:
    """A private copy of the trainer's run (steps 2, 4, 6; tracker 6), last written three hours ago."""
    run = Path(copy_run(verl_run))
    then = time.time_ns() - 3 * HOUR_NS
    for p in [*run.rglob("*"), run]:
        os.utime(p, ns=(then, then), follow_symlinks=False)
    return run


def prune(run: Path, *args: str, catalog: Path, unprivileged: bool = False) -> subprocess.CompletedProcess:
    return ckpt_audit("prune", run.parent.parent, *args, catalog=catalog, as_user=unprivileged)


def steps_left(run: Path) -> list[int]:
    return [int(p.name[12:]) for p in steps_of(run)]


def planned(doc: dict) -> dict[int, tuple[str, str, list[str]]]:
    """step -> (delete|keep, status, reasons) of a prune --json document's plan."""
    return {i["step"]: (side, i["status"], i["reasons"]) for side in ("delete", "keep") for i in doc["plan"][side]}


# ------------------------------------------------------------------------------------- 1. positive evidence


def test_fresh_empty_step_dir_is_in_progress_and_kept(run, tmp_path):
    (run / "global_step_8").mkdir()  # verl makes the directory first; the ranks write into it next
    proc = prune(run, "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    assert planned(json.loads(proc.stdout))[8] == ("keep", "in-progress", ["in-progress"])
    assert (run / "global_step_8").is_dir()


@needs_setpriv
def test_unreadable_actor_is_protected_not_a_husk(run, tmp_path):
    actor = run / "global_step_2" / "actor"
    actor.chmod(0)
    try:
        proc = prune(run, "--yes", "--json", catalog=tmp_path / "c.db", unprivileged=True)
    finally:
        actor.chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    assert planned(json.loads(proc.stdout))[2] == ("keep", "unknown", ["unread"])
    assert steps_left(run) == [2, 4, 6] and shard(run / "global_step_2").is_file()


def test_actor_linked_out_of_the_root_is_protected_not_a_husk(run, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    actor = run / "global_step_2" / "actor"
    actor.rename(elsewhere / "actor")
    actor.symlink_to(elsewhere / "actor")
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    assert planned(json.loads(proc.stdout))[2] == ("keep", "unknown", ["unread"])
    assert steps_left(run) == [2, 6] and actor.is_symlink()
    assert len(list((elsewhere / "actor").glob("model_*.pt"))) == 2


def test_keep_best_by_a_metric_no_record_has_is_a_usage_error(run, tmp_path):
    proc = prune(run, "--keep-best", "1", "--metric", "losss", "--yes", catalog=tmp_path / "c.db")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "'losss'" in proc.stderr and "loss" in proc.stderr.split("logs:")[-1] and "Traceback" not in proc.stderr
    assert steps_left(run) == [2, 4, 6]


def test_keep_best_on_a_run_without_metrics_log_is_a_usage_error(run, tmp_path):
    (run / "metrics.jsonl").unlink()
    proc = prune(run, "--keep-best", "1", "--yes", catalog=tmp_path / "c.db")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no metrics log" in proc.stderr and "Traceback" not in proc.stderr
    assert steps_left(run) == [2, 4, 6]


def test_whole_checkpoints_ahead_of_a_lagging_tracker_are_kept_and_reported(run, tmp_path):
    tracker = run / "latest_checkpointed_iteration.txt"
    st = tracker.stat()
    tracker.write_text("2")  # the tracker write of steps 4 and 6 was lost
    os.utime(tracker, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc = prune(run, "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    plan = planned(json.loads(proc.stdout))
    assert plan[4] == plan[6] == ("keep", "uncommitted", ["ahead-of-tracker"])
    assert steps_left(run) == [2, 4, 6]
    scan = subprocess.run(
        [sys.executable, "-m", "ckpt_audit", "scan", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CKPT_AUDIT_CATALOG": str(tmp_path / "c.db")},
    )
    behind = [f for f in _findings(json.loads(scan.stdout)) if f["code"] == "tracker-behind"]
    assert len(behind) == 1 and behind[0]["severity"] == "warning" and "step 4, 6" in behind[0]["message"]


def _findings(doc) -> list[dict]:
    """Every finding dict anywhere in a scan --json document."""
    out = []
    if isinstance(doc, dict):
        if "code" in doc and "severity" in doc:
            out.append(doc)
        for v in doc.values():
            out.extend(_findings(v))
    elif isinstance(doc, list):
        for v in doc:
            out.extend(_findings(v))
    return out


# A plan is made, then a directory inside a planned checkpoint stops being removable; execute runs unprivileged.
EXECUTE = (
    "import pickle, sys, json; from ckpt_audit.lifecycle.prune import execute; "
    "r = execute(pickle.load(open(sys.argv[1], 'rb'))); "
    "print(json.dumps([[o.step, str(o.action), o.detail] for o in r.outcomes]))"
)


@needs_setpriv
@pytest.mark.parametrize("mode", [0o555, 0o000], ids=["read-only-dir", "unreadable-dir"])
def test_execution_never_half_deletes_a_tree_it_cannot_remove(run, tmp_path, mode):
    from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
    from ckpt_audit.scanner import scan

    plan = plan_prune(scan([str(run)]).runs, Policy(rules=(KeepLast(n=1),)), now_ns=time.time_ns())
    assert [i.step for i in plan.delete] == [2, 4]
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
    before = sorted(p.name for p in (run / "global_step_2").rglob("*"))
    hf = run / "global_step_2" / "actor" / "huggingface"
    hf.chmod(mode)  # chmod moves ctime, not mtime: the plan still matches by stat
    try:
        proc = subprocess.run(
            [*unprivileged(), sys.executable, "-c", EXECUTE, str(tmp_path / "plan.pkl")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        if hf.exists():  # the old code renamed the tree to trash and removed what it could
            hf.chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    outcomes = {step: (action, detail) for step, action, detail in json.loads(proc.stdout)}
    assert outcomes[2][0] == "failed" and outcomes[2][1].startswith("left intact")
    assert outcomes[4][0] == "deleted"
    assert sorted(p.name for p in (run / "global_step_2").rglob("*")) == before
    assert not [p for p in run.iterdir() if TRASH_RE.match(p.name)]


# ------------------------------------------------------------------------------------- 2. survivor re-read


def test_bit_rot_in_the_newest_is_found_before_older_good_checkpoints_go(run, tmp_path):
    catalog = tmp_path / "c.db"
    first = subprocess.run(
        [sys.executable, "-m", "ckpt_audit", "scan", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CKPT_AUDIT_CATALOG": str(catalog)},
    )
    assert first.returncode == 0, first.stderr  # the catalog now holds every hash, reused by stat from here on
    rotten = shard(run / "global_step_6")
    flip_payload_byte(rotten)  # size, mtime and inode kept
    good = {p: p.read_bytes() for p in (run / "global_step_4").rglob("*") if p.is_file()}

    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=catalog)
    assert proc.returncode == 1, proc.stderr  # a checkpoint the plan counted on failed its re-read
    doc = json.loads(proc.stdout)
    plan = planned(doc)
    assert plan[6] == ("keep", "corrupt", ["tracker-target", "corrupt"])
    assert plan[4][0] == "keep" and "newest-complete" in plan[4][2]
    checked = {c["step"]: c for c in doc["survivors"]["checked"]}
    assert checked[6]["ok"] is False and {f["code"] for f in checked[6]["findings"]} >= {"crc-mismatch"}
    assert checked[4]["ok"] is True  # the new survivor was read back too before step 2 went
    sizes = {s: sum(p.stat().st_size for p in (run / f"global_step_{s}").rglob("*") if p.is_file()) for s in (4, 6)}
    assert doc["survivors"]["bytes_reread"] == doc["result"]["bytes_reread"] == sizes[4] + sizes[6]
    assert steps_left(run) == [4, 6]
    assert {p: p.read_bytes() for p in (run / "global_step_4").rglob("*") if p.is_file()} == good

    db = sqlite3.connect(catalog)
    rereads = db.execute("SELECT step, size_bytes FROM prune_items WHERE action = 're-read' ORDER BY step").fetchall()
    assert rereads == [(4, sizes[4]), (6, sizes[6])]
    [(status,)] = db.execute("SELECT status FROM checkpoints WHERE step = 6").fetchall()
    assert status == "corrupt"  # recorded as it is now
    assert cached_status(run, catalog)[6] == "corrupt"  # and a later scan that trusts its cache keeps saying so


def cached_status(run: Path, catalog: Path) -> dict[int, str]:
    """step -> status from a re-scan that reuses every stat-unchanged file (no scrub): what the catalog kept."""
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_audit", "scan", "--no-scrub", "--json", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CKPT_AUDIT_CATALOG": str(catalog)},
    )
    assert proc.returncode in (0, 1), proc.stderr
    doc = json.loads(proc.stdout)
    run_files = sum(1 for p in run.iterdir() if p.is_file())  # tracker, metrics log: in no checkpoint, never cached
    assert doc["files_hashed"] == run_files  # no checkpoint file re-read: the verdicts below are the catalog's
    return {c["step"]: c["status"] for r in doc["runs"] for c in r["checkpoints"]}


def test_text_output_reports_the_bytes_re_read(run, tmp_path):
    proc = prune(run, "--keep-last", "1", "--dry-run", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("survivor check:"))
    assert "re-read 1 checkpoint(s)" in line and "all match the scan" in line
    assert steps_left(run) == [2, 4, 6]


def test_tui_prune_re_reads_the_survivor_and_deletes_nothing_on_a_stale_verdict(run, tmp_path):
    import asyncio

    from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
    from ckpt_audit.models import Status
    from tui.app import AuditApp

    app = AuditApp(catalog_path=tmp_path / "c.db", roots=[str(run.parent.parent)])

    async def main() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.app.workers.wait_for_complete()
            await pilot.pause()
            [scanned] = app.snapshot.runs
            plan = plan_prune([scanned], Policy(rules=(KeepLast(n=1),)), now_ns=time.time_ns())
            assert [i.step for i in plan.delete] == [2, 4]
            flip_payload_byte(shard(run / "global_step_6"))  # after the scan the snapshot shows, before the prune
            assert app.prune(plan)
            await pilot.app.workers.wait_for_complete()
            await pilot.pause()

    asyncio.run(main())
    assert steps_left(run) == [2, 4, 6]
    assert {c.step: c.status for c in app.snapshot.runs[0].checkpoints}[6] is Status.CORRUPT
    assert app.last_survivors is not None and [r.checkpoint.step for r in app.last_survivors.failed] == [6]
    assert cached_status(run, tmp_path / "c.db")[6] == "corrupt"  # the TUI's finding outlives the next cached scan
