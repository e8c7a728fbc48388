"""Prune's safety through the real CLI (a subprocess) on trainer-written trees: what a plan may delete and what
its execution may touch. Unit-level execution (crash safety at every operation) is tests/test_prune.py; the CLI's
surface (plans, refusals, exit codes, JSON) is tests/test_prune_cli.py.

Deletion needs positive evidence and the survivor is verified first (issue 11's attacks):
1. Deletion needs positive evidence: what prune could not read, what is being written (a fresh, even empty, step
   directory), and whole checkpoints newer than a lagging tracker are kept; a keep rule fed a wrong input is a usage
   error; and execution never half-deletes a tree it cannot remove in full.
2. The survivor is verified before its predecessors go: bit rot that keeps size and mtime in the newest checkpoint
   is found by the re-read, and the older good checkpoints are not deleted on the rotten one's word.

One corruption per test. Permission attacks run the CLI under setpriv without the DAC capabilities (we are root).

A tracker that cannot be read (the red team's holes, TestTrackerThatCannotBeRead):
Each test is one hole found by a hostile review of issue 11's prune: the tracker's target is protected only while
the tracker can be read, so a tracker that cannot be read (permission, a link out of the root, one too large to
read) must protect every checkpoint it could name; and a fresh empty step directory is being written whatever the
tracker says (a run resumed from an older step rewrites steps at or below it).

The blast radius and the filesystem's refusals:
1. A run warm-started from another run's step through a link (`B/global_step_4 -> ../exp/global_step_4`, which verl
   follows) loads that step: it is kept while the link exists, the plan says so, and a link made after the plan is
   found by the execution's own walk.
2. Every refusal the filesystem can give (immutable and append-only flags, mount points, read-only mounts) is found
   before the rename to trash, as root too; one found only after it renames the tree back; a half-done trash is
   finished when it can be, else left marked and reported without failing every later prune.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_proc import ckpt_audit, unprivileged
from scan_trees import flip_payload_byte, shard, steps_of

from ckpt_audit.lifecycle.prune import TRASH_RE

pytestmark = pytest.mark.slow

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
    scan = ckpt_audit("scan", run, "--json", catalog=tmp_path / "c.db", timeout=120)
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
    from ckpt_audit.scan import scan

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
    first = ckpt_audit("scan", run, catalog=catalog, timeout=120)
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
    proc = ckpt_audit("scan", "--no-scrub", "--json", run, catalog=catalog, timeout=120)
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


# -------------------------------------------------------------------------------- a tracker that cannot be read


def _tracker_unread_keeps_all(proc) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = planned(json.loads(proc.stdout))
    assert {step: side for step, (side, _status, _reasons) in plan.items()} == {2: "keep", 4: "keep", 6: "keep"}
    assert all("tracker-unread" in reasons for _side, _status, reasons in plan.values())


class TestTrackerThatCannotBeRead:
    """Red-team attacks on prune's "deletion needs positive evidence", through the real CLI on trainer-written trees.

    Each test is one hole found by a hostile review of issue 11's prune: the tracker's target is protected only while
    the tracker can be read, so a tracker that cannot be read (permission, a link out of the root, one too large to
    read) must protect every checkpoint it could name; and a fresh empty step directory is being written whatever the
    tracker says (a run resumed from an older step rewrites steps at or below it).
    """

    @pytest.fixture
    def run(self, verl_run, copy_run) -> Path:
        """A private copy of the trainer's run (steps 2, 4, 6), its tracker moved back to 4 (resume loads step 4,
        the newest complete is 6), every mtime three hours ago."""
        run = Path(copy_run(verl_run))
        (run / "latest_checkpointed_iteration.txt").write_text("4")
        then = time.time_ns() - 3 * HOUR_NS
        for p in [*run.rglob("*"), run]:
            os.utime(p, ns=(then, then), follow_symlinks=False)
        return run

    @needs_setpriv
    def test_unreadable_tracker_protects_every_checkpoint_it_could_name(self, run, tmp_path):
        tracker = run / "latest_checkpointed_iteration.txt"
        tracker.chmod(0)
        try:
            proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db", unprivileged=True)
        finally:
            tracker.chmod(0o644)
        _tracker_unread_keeps_all(proc)
        assert steps_left(run) == [2, 4, 6]

    def test_tracker_linked_out_of_the_root_protects_every_checkpoint(self, run, tmp_path):
        tracker = run / "latest_checkpointed_iteration.txt"
        outside = tmp_path / "tracker-elsewhere.txt"
        tracker.rename(outside)
        tracker.symlink_to(outside)  # verl follows it and resumes from step 4
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
        _tracker_unread_keeps_all(proc)
        assert steps_left(run) == [2, 4, 6]

    def test_tracker_too_large_to_read_protects_every_checkpoint(self, run, tmp_path):
        tracker = run / "latest_checkpointed_iteration.txt"
        tracker.write_text("4" + " " * 70_000 + "\n")  # verl's int(f.read().decode()) still reads step 4
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
        _tracker_unread_keeps_all(proc)
        assert steps_left(run) == [2, 4, 6]

    def test_fresh_empty_step_dir_at_or_below_the_tracker_is_in_progress(self, run, tmp_path):
        import shutil

        shutil.rmtree(run / "global_step_2")  # a run resumed from an older step saves step 2 again:
        (run / "global_step_2").mkdir()  # verl makes the directory first, the ranks write into it next
        proc = prune(run, "--yes", "--json", catalog=tmp_path / "c.db")
        assert proc.returncode == 0, proc.stderr
        assert planned(json.loads(proc.stdout))[2] == ("keep", "in-progress", ["in-progress"])
        assert (run / "global_step_2").is_dir()

    def test_a_torn_non_utf8_line_in_the_metrics_log_is_skipped_not_an_error(self, run, tmp_path):
        with open(run / "metrics.jsonl", "ab") as fh:
            fh.write(b'{"step": 7, "lo\xff\xfe')  # a trainer killed mid-write, bytes garbled
        proc = prune(run, "--keep-best", "1", "--dry-run", "--json", catalog=tmp_path / "c.db")
        assert proc.returncode == 0, proc.stderr
        plan = planned(json.loads(proc.stdout))
        assert sum("keep-best" in reasons for _side, _status, reasons in plan.values()) == 1

    def test_a_checkpoint_a_kept_one_links_into_is_not_deleted(self, run, tmp_path):
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


# ------------------------------------------------------------------------------------ blast radius and refusals


def warm_start(run: Path, link_to: str) -> Path:
    """Run B beside `run`, warm-started from its step 4 through a link (`B/global_step_4 -> ../exp/<link_to>`)."""
    b = run.parent / "B"
    b.mkdir()
    (b / "latest_checkpointed_iteration.txt").write_text("4")
    link = b / "global_step_4"
    link.symlink_to(f"../{run.name}/{link_to}")
    return link


def test_a_step_another_run_links_to_is_kept_while_the_link_exists(run, tmp_path):
    link = warm_start(run, "global_step_4")
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert planned(doc) == {
        2: ("delete", "complete", ["not-kept"]),
        4: ("keep", "complete", ["linked"]),
        6: ("keep", "complete", ["newest-complete", "tracker-target", "keep-last"]),
    }
    kept = next(i for i in doc["plan"]["keep"] if i["step"] == 4)
    assert kept["linked_from"] == [str(link)] and kept["protected"]
    assert steps_left(run) == [4, 6] and (link / "actor").is_dir()  # B still resumes

    link.unlink()  # once B lets go, step 4 is an ordinary old checkpoint again
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    assert steps_left(run) == [6]


def test_a_sibling_run_outside_the_root_still_keeps_the_step_it_links_to(run, tmp_path):
    link = warm_start(run, "global_step_4")  # demo/B, beside demo/exp; prune is given demo/exp alone
    proc = ckpt_audit("prune", run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _item(json.loads(proc.stdout), run / "global_step_4")["linked_from"] == [str(link)]
    assert steps_left(run) == [4, 6]


def test_a_link_to_one_shard_keeps_the_step_it_lies_in(run, tmp_path):
    b = run.parent / "B" / "global_step_4" / "actor"
    b.mkdir(parents=True)
    name = "model_world_size_2_rank_0.pt"
    (b / name).symlink_to(run / "global_step_4" / "actor" / name)
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    item = _item(json.loads(proc.stdout), run / "global_step_4")
    assert (item["reasons"], item["linked_from"]) == (["linked"], [str(b / name)])  # the plan says why
    assert steps_left(run) == [4, 6] and (b / name).is_file()


def _item(doc: dict, path: Path) -> dict:
    return next(i for side in ("delete", "keep") for i in doc["plan"][side] if i["path"] == str(path))


def test_the_text_plan_names_the_link(run, tmp_path):
    link = warm_start(run, "global_step_4")
    proc = prune(run, "--keep-last", "1", "--dry-run", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "step        4" in ln)
    assert line.lstrip().startswith("keep") and f"linked <- {link}" in line


def test_a_link_made_after_the_plan_is_found_before_the_rename(run, tmp_path):
    from ckpt_audit.lifecycle.links import find_links
    from ckpt_audit.lifecycle.prune import Action, execute
    from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
    from ckpt_audit.scan import scan

    root = str(run.parent.parent)
    plan = plan_prune(
        scan([root]).runs, Policy(rules=(KeepLast(n=1),)), now_ns=time.time_ns(), links=find_links([root])
    )
    assert [i.step for i in plan.delete] == [2, 4]
    link = warm_start(run, "global_step_4")  # B warm-starts while the plan waits for its confirmation
    result = execute(plan)
    got = {o.step: (o.action, o.detail) for o in result.outcomes}
    assert got[4] == (Action.SKIPPED, f"a link leads into it: {link}")
    assert got[2][0] is Action.DELETED and steps_left(run) == [4, 6]


# ------------------------------------------------------------------------------------- 2. filesystem refusals


def _chattr(flag: str, *paths: Path) -> None:
    subprocess.run(["chattr", flag, *map(str, paths)], check=True, capture_output=True)


@contextlib.contextmanager
def _mounted(*args: str, below: Path):
    """`mount args...` for the body (skip where mounting is not allowed); then every mount below `below` is undone,
    wherever a prune moved it."""
    try:
        subprocess.run(["mount", *args], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot bind-mount here: {exc}")
    try:
        yield
    finally:
        from ckpt_audit.lifecycle.removable import mount_points

        for m in reversed(mount_points()):
            if m.startswith(f"{below}/"):
                subprocess.run(["umount", m], check=True)


def _chattr_works(tmp: Path) -> str | None:
    """Why chattr +i cannot be tried here (no chattr, a filesystem without inode flags, no CAP_LINUX_IMMUTABLE)."""
    probe = tmp / "chattr-probe"
    probe.write_text("x")
    try:
        _chattr("+i", probe)
        _chattr("-i", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"chattr +i refused here: {exc}"
    return None


@pytest.fixture
def flags_ok(tmp_path):
    if why := _chattr_works(tmp_path):
        pytest.skip(why)


def _tree(step: Path) -> dict[str, int]:
    return {str(p.relative_to(step)): p.lstat().st_size for p in sorted(step.rglob("*"))}


def _outcomes(doc: dict) -> dict:
    return {
        o["step"] if o["step"] is not None else o["path"]: (o["action"], o["detail"]) for o in doc["result"]["outcomes"]
    }


SHARD = "actor/model_world_size_2_rank_0.pt"


@pytest.mark.parametrize(
    ("flag", "where", "said"),
    [
        ("+i", SHARD, f"immutable (chattr +i): global_step_2/{SHARD}"),
        ("+a", SHARD, f"append-only (chattr +a): global_step_2/{SHARD}"),
        ("+a", "actor", "append-only (chattr +a): global_step_2/actor"),
        ("+i", ".", "immutable (chattr +i): global_step_2"),
    ],
    ids=["immutable-shard", "append-only-shard", "append-only-dir", "immutable-step"],
)
def test_an_inode_flag_is_found_before_the_rename_even_as_root(run, tmp_path, flags_ok, flag, where, said):
    step = run / "global_step_2"
    before = _tree(step)
    _chattr(flag, step / where)
    try:
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
        assert proc.returncode == 3, proc.stdout + proc.stderr  # a deletion failed
        got = _outcomes(json.loads(proc.stdout))
        assert got[2] == ("failed", f"left intact: {said}")
        assert got[4][0] == "deleted"
        assert _tree(step) == before and not [p for p in run.iterdir() if TRASH_RE.match(p.name)]
    finally:
        _chattr(flag.replace("+", "-"), step / where)
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert steps_left(run) == [6]


def test_a_mount_point_inside_is_found_before_the_rename(run, tmp_path):
    hf = run / "global_step_2" / "actor" / "huggingface"
    with _mounted("--bind", str(hf), str(hf), below=tmp_path):  # same device: stat alone cannot tell
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    got = _outcomes(json.loads(proc.stdout))
    assert got[2] == ("failed", "left intact: a mount point (rmdir says EBUSY): global_step_2/actor/huggingface")
    assert steps_left(run) == [2, 6] and (hf / "config.json").is_file()


def test_a_read_only_mount_is_named(run, tmp_path):
    with _mounted("--bind", "-o", "ro", str(run), str(run), below=tmp_path):
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    got = _outcomes(json.loads(proc.stdout))
    assert got[2] == ("failed", f"left intact: read-only filesystem at {run / 'global_step_2'}")
    assert steps_left(run) == [2, 4, 6]


def test_a_half_done_trash_is_left_marked_without_failing_later_prunes_then_finished(run, tmp_path, flags_ok):
    # what the old prune left: step 2 renamed to trash, then removed up to an immutable shard
    trash = run / ".ckpt-audit-trash-global_step_2-0123456789ab"
    (run / "global_step_2").rename(trash)
    (trash / "data.pt").unlink()
    _chattr("+i", trash / SHARD)
    try:
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
        assert proc.returncode == 0, proc.stdout + proc.stderr  # the leftover no longer fails every prune
        got = _outcomes(json.loads(proc.stdout))
        assert got[str(trash)] == (
            "skipped",
            "marked by execution 0123456789ab (global_step_2); cannot finish, left marked: "
            f"immutable (chattr +i): {trash.name}/{SHARD}",
        )
        assert got[4][0] == "deleted" and (trash / SHARD).is_file()  # nothing of the trash was touched
    finally:
        _chattr("-i", trash / SHARD)
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _outcomes(json.loads(proc.stdout))[str(trash)][0] == "reclaimed"
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["global_step_6"]


@needs_setpriv
def test_a_refusal_found_only_after_the_rename_renames_the_tree_back(run, tmp_path, flags_ok):
    from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
    from ckpt_audit.scan import scan

    plan = plan_prune(scan([str(run)]).runs, Policy(rules=(KeepLast(n=1),)), now_ns=time.time_ns())
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
    step = run / "global_step_2"
    before = _tree(step)
    hf = sorted((step / "actor" / "huggingface").iterdir())  # removed first (the deepest directory)
    for f in hf:  # a file we may not open shows no flags: its refusal comes only at unlink, after the rename
        f.chmod(0)
    _chattr("+i", *hf)
    try:
        proc = subprocess.run(
            [*unprivileged(), sys.executable, "-c", EXECUTE, str(tmp_path / "plan.pkl")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        _chattr("-i", *(f for f in hf if f.exists()))
    assert proc.returncode == 0, proc.stderr
    outcomes = {s: (action, detail) for s, action, detail in json.loads(proc.stdout)}
    assert outcomes[2][0] == "failed" and outcomes[2][1].startswith("left intact (renamed back): PermissionError")
    assert _tree(step) == before and not [p for p in run.iterdir() if TRASH_RE.match(p.name)]
    assert outcomes[4][0] == "deleted"


def test_the_tui_plan_keeps_a_linked_step_and_its_prune_deletes_only_the_rest(run, tmp_path):
    from tui_pilot import drive, open_run, settle

    from ckpt_audit.lifecycle.retention import KeepLast, Policy, Reason
    from tui.app import AuditApp

    link = warm_start(run, "global_step_4")
    app = AuditApp(catalog_path=tmp_path / "c.db", roots=[str(run.parent.parent)])
    seen = {}

    async def script(pilot) -> None:
        await pilot.press("down")  # runs: demo/B (its tracker and the link), then demo/exp
        screen = await open_run(pilot)
        assert screen.run_path == str(run)
        screen.set_policy(Policy(rules=(KeepLast(n=1),)))
        seen["plan"] = screen.plan
        assert app.prune(screen.plan)
        await settle(pilot)

    drive(app, script)
    plan = seen["plan"]
    assert [i.step for i in plan.delete] == [2]
    [kept] = [i for i in plan.keep if i.step == 4]
    assert kept.reasons == (Reason.LINKED,) and kept.linked_from == (str(link),)
    assert steps_left(run) == [4, 6] and app.last_prune is not None and app.last_prune.ok


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to drop FOWNER")
def test_a_sticky_directory_holding_someone_elses_file_is_found_before_the_rename(run, tmp_path):
    from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
    from ckpt_audit.scan import scan

    plan = plan_prune(scan([str(run)]).runs, Policy(rules=(KeepLast(n=1),)), now_ns=time.time_ns())
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
    step = run / "global_step_2"
    before = _tree(step)
    actor = step / "actor"
    os.chown(actor, 65534, 65534)
    actor.chmod(0o1777)  # like /tmp: anyone may write, only an entry's owner (or the directory's) may unlink it
    os.chown(actor / "model_world_size_2_rank_0.pt", 65533, 65533)
    no_fowner = [shutil.which("setpriv"), "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    proc = subprocess.run(
        [*no_fowner, sys.executable, "-c", EXECUTE, str(tmp_path / "plan.pkl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    outcomes = {s: (action, detail) for s, action, detail in json.loads(proc.stdout)}
    assert outcomes[2] == (
        "failed",
        "left intact: sticky directory global_step_2/actor: "
        "global_step_2/actor/model_world_size_2_rank_0.pt belongs to uid 65533",
    )
    assert _tree(step) == before and outcomes[4][0] == "deleted"
