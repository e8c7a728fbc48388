"""prune --ray on a real local Ray cluster (the session's, tests/ray_cluster.py: two of its nodes hold the tree, the
third holds nothing of it): a reference-trainer tree split by rank over node directories, pruned over the union; a
node whose execution is killed mid-way, a silent node (an extra node, removed), links out of a node's root. At the
end, without Ray: the node-side checks, and the driver's execution with each node's task body run in-process."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from node_dirs import split_by_rank

from ckpt_audit.cli import cli
from ckpt_audit.cluster import ray_prune
from ckpt_audit.cluster.noderoots import ENV
from ckpt_audit.lifecycle.prune import TRASH_RE
from ckpt_audit.lifecycle.retention import PlanItem, Policy, PrunePlan, Reason
from ckpt_audit.models import Checkpoint, FileKind, ShardFile, Status


def place(table: Path, ids: list[str], dirs: list[Path]) -> str:
    """Node i's copy of the root (node 0's directory, the logical root the driver sees) is dirs[i]; the nodes past
    the last directory (the shared cluster's others) map it to a directory that does not exist: they hold nothing."""
    absent = [dirs[0].parent / "absent"] * (len(ids) - len(dirs))
    table.write_text(json.dumps({nid: {str(dirs[0]): str(d)} for nid, d in zip(ids, [*dirs, *absent], strict=True)}))
    return str(dirs[0])


def prune(root: str, db: Path, *args: str):
    return CliRunner().invoke(cli, ["prune", "--ray", "--catalog", str(db), *args, root])


def steps(d: Path) -> dict[int, list[str]]:
    """step -> its files on this node (relative), and any trash left there under -1."""
    out: dict[int, list[str]] = {}
    for s in d.rglob("global_step_*"):
        if s.is_dir() and not s.is_symlink():
            out[int(s.name.rsplit("_", 1)[1])] = sorted(str(p.relative_to(s)) for p in s.rglob("*") if p.is_file())
    trash = [p.name for p in d.rglob("*") if TRASH_RE.match(p.name)]
    return {**out, **({-1: trash} if trash else {})}


@pytest.mark.slow
def test_keeps_the_newest_complete_over_the_union_and_deletes_the_rest_on_every_node(ray_cluster, verl_run, tmp_path):
    ids, table = ray_cluster.ids, ray_cluster.table
    dirs = split_by_rank(verl_run, tmp_path, 2)
    root = place(table, ids, dirs)
    before = [steps(d) for d in dirs]
    assert sorted(before[1]) == [2, 4, 6] and all(f.endswith("_rank_1.pt") for f in before[1][6] if "rank" in f)
    db = tmp_path / "c.db"
    typo = CliRunner().invoke(cli, ["prune", "--ray", "--yes", "--keep-lats", "1", "--catalog", str(db), root])
    assert typo.exit_code == 2 and "No such option" in typo.output
    asked = prune(root, db, "--keep-last", "1")  # no --yes, no terminal: refused, nothing deleted
    assert asked.exit_code == 2 and "refusing to prompt" in asked.output
    dry = prune(root, db, "--keep-last", "1", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert [(i["step"], i["reasons"]) for i in json.loads(dry.output)["plan"]["delete"]] == [
        (2, ["not-kept"]),
        (4, ["not-kept"]),
    ]
    assert [steps(d) for d in dirs] == before

    done = prune(root, db, "--keep-last", "1", "--yes", "--json")
    assert done.exit_code == 0, done.output
    doc = json.loads(done.output)
    deleted = {o["step"]: o["detail"] for o in doc["result"]["outcomes"] if o["action"] == "deleted"}
    assert sorted(deleted) == [2, 4]
    assert all(ids[0] in why and ids[1] in why for why in deleted.values())  # each on both nodes holding it
    assert [o["step"] for o in doc["result"]["outcomes"] if o["action"] == "re-read"] == [6]
    assert sorted(doc["ray"]["answered"]) == sorted(ids) and doc["ray"]["silent"] == doc["ray"]["partly_pruned"] == []
    assert [steps(d) for d in dirs] == [{6: before[0][6]}, {6: before[1][6]}]


@pytest.mark.slow
def test_a_node_killed_mid_prune_leaves_marks_and_the_rerun_finishes(ray_cluster, verl_run, tmp_path):
    ids, table, kill = ray_cluster.ids, ray_cluster.table, ray_cluster.kill
    dirs = split_by_rank(verl_run, tmp_path, 2)
    root = place(table, ids, dirs)
    before = [steps(d) for d in dirs]
    db = tmp_path / "c.db"
    (kill / ids[1]).write_text("2")  # node 1's execution dies after the rename of step 2 and one unlink
    try:
        killed = prune(root, db, "--keep-last", "1", "--yes")
    finally:
        (kill / ids[1]).unlink()
    assert killed.exit_code == 3, killed.output
    assert f"node {ids[1]} did not answer the prune" in killed.output
    assert killed.output.count(f"(partly pruned: removed on node(s) {ids[0]}; node {ids[1]} did not answer") == 2
    partly = sorted(line.rsplit(" ", 1)[1] for line in killed.output.splitlines() if "partly pruned (" in line)
    assert partly == [f"{root}/{verl_run.parent.name}/{verl_run.name}/global_step_{s}" for s in (2, 4)]
    left = steps(dirs[1])
    assert sorted(left) == [-1, 4, 6]  # its part of step 2 marked (half removed), step 4 intact, step 6 untouched
    assert left[-1][0].startswith(".ckpt-audit-trash-global_step_2-") and left[4] == before[1][4]
    assert steps(dirs[0]) == {6: before[0][6]}

    rerun = prune(root, db, "--keep-last", "1", "--yes", "--json")
    assert rerun.exit_code == 0, rerun.output
    actions = sorted((o["action"], o["step"]) for o in json.loads(rerun.output)["result"]["outcomes"])
    assert actions == [("deleted", 4), ("re-read", 6), ("reclaimed", None)]
    assert [steps(d) for d in dirs] == [{6: before[0][6]}, {6: before[1][6]}]


@pytest.mark.slow
def test_a_link_out_of_a_nodes_root_protects_the_checkpoint_and_its_target(ray_cluster, verl_run, tmp_path):
    ids, table = ray_cluster.ids, ray_cluster.table
    dirs = split_by_rank(verl_run, tmp_path, 2)
    root = place(table, ids, dirs)
    victim = tmp_path / "outside" / "victim.pt"
    victim.parent.mkdir()
    victim.write_bytes(b"not yours")
    actor = next(dirs[1].rglob("global_step_2")) / "actor"
    (actor / "extra.pt").symlink_to(victim)
    got = prune(root, tmp_path / "c.db", "--keep-last", "1", "--yes", "--json")
    assert got.exit_code == 0, got.output
    plan = json.loads(got.output)["plan"]
    assert [i["step"] for i in plan["delete"]] == [4]
    assert ("unread" in next(i for i in plan["keep"] if i["step"] == 2)["reasons"]) is True
    assert victim.read_bytes() == b"not yours" and (actor / "extra.pt").is_symlink()
    assert sorted(steps(dirs[1])) == [2, 6]


@pytest.mark.slow
@pytest.mark.ray_dead_node_ok  # a node removed earlier is only in the first scan (silent, holding nothing): removing
# node 1 makes Ray forget it (tests/ray_cluster.py), so the prune's own scan sees node 1 alone silent
def test_a_silent_node_protects_what_it_held(ray_cluster, ray_extra_node, verl_run, tmp_path):
    """Node 1, an extra node added for this test, holds a copy of step 2's rank-1 shards (node 0 holds all) and is
    removed before the prune; the shared cluster's other nodes hold nothing."""
    table, x = ray_cluster.table, ray_extra_node.node_id
    ids = [ray_cluster.ids[0], x, *ray_cluster.ids[1:]]
    dirs = split_by_rank(verl_run, tmp_path, 1) + [tmp_path / "node1"]
    root = place(table, ids, dirs)
    for f in next(dirs[0].rglob("global_step_2")).rglob("*_rank_1.pt"):
        twin = dirs[1] / f.relative_to(dirs[0])
        twin.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, twin)
    db = tmp_path / "c.db"
    seen = CliRunner().invoke(cli, ["scan", "--ray", "--catalog", str(db), root])
    assert seen.exit_code == 0, seen.output
    ray_cluster.remove(x)
    got = prune(root, db, "--keep-last", "1", "--yes", "--json")
    assert got.exit_code == 0, got.output
    plan = json.loads(got.output)["plan"]
    assert [i["step"] for i in plan["delete"]] == [4]
    step2 = next(i for i in plan["keep"] if i["step"] == 2)
    assert json.loads(got.output)["ray"]["silent"] == [x]
    assert step2["status"] == "unknown" and "unread" in step2["reasons"]
    assert sorted(steps(dirs[0])) == [2, 6] and sorted(steps(dirs[1])) == [2]


def test_prune_ray_without_the_extra_is_one_line_exit_2(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if the extra were not installed\n"
        "from ckpt_audit.cli import cli\n"
        f"cli.main(['prune', '--ray', '--yes', '--catalog', {str(tmp_path / 'c.db')!r}, {str(tmp_path)!r}])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "ckpt-audit: prune --ray needs the optional extra: pip install 'ckpt-audit[ray]'"
    ]
    assert not (tmp_path / "c.db").exists()


# ---------------------------------------------------------------------------------------------------- node side


def _part(root: Path) -> tuple[PrunePlan, Path]:
    """A one-checkpoint plan for the node-side checks (no Ray: the task body runs here)."""
    step = root / "p" / "e" / "global_step_1"
    step.mkdir(parents=True)
    (step / "a.pt").write_bytes(b"x" * 10)
    st = (step / "a.pt").stat()
    f = ShardFile(path=str(step / "a.pt"), kind=FileKind.OTHER, size_bytes=10, mtime_ns=st.st_mtime_ns, inode=st.st_ino)
    ckpt = Checkpoint(
        run_path=str(step.parent),
        step=1,
        path=str(step),
        status=Status.INCOMPLETE,
        files=(f,),
        mtime_ns=max(st.st_mtime_ns, step.stat().st_mtime_ns),
    )
    item = PlanItem(checkpoint=ckpt, reasons=(Reason.INCOMPLETE,))
    return PrunePlan(policy=Policy(), now_ns=0, delete=(item,)), step


def test_node_side_blast_radius_refuses_a_link_out_of_its_root(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    root = tmp_path / "root"
    plan, step = _part(root)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    (step / "out").symlink_to(victim)  # made after the plan, so only the node's own check can see it
    os.utime(step, ns=(plan.delete[0].checkpoint.mtime_ns,) * 2)
    got = ray_prune.prune_on_this_node([str(root)], "n", plan, [str(step.parent)], [str(root)], "0123456789ab")
    assert got.objections[str(step)][1].startswith("a link out of the root")
    assert step.is_dir() and (victim / "keep.txt").read_text() == "mine"


def test_node_side_blast_radius_refuses_a_run_reached_through_a_link(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    plan, step = _part(elsewhere)
    root.mkdir()
    (root / "p").symlink_to(elsewhere / "p")
    item = plan.delete[0]
    moved = str(root / "p" / "e" / "global_step_1")
    files = tuple(replace(f, path=moved + "/a.pt") for f in item.checkpoint.files)
    plan = replace(plan, delete=(replace(item, checkpoint=replace(item.checkpoint, path=moved, files=files)),))
    got = ray_prune.prune_on_this_node([str(root)], "n", plan, [], [str(root)], "0123456789ab")
    assert got.objections[moved][1].startswith("reached through a symbolic link")
    assert (step / "a.pt").exists()


# ---------------------------------------------------------------------------------------------------- driver, no Ray

IDS = ["a1" * 28, "b2" * 28]  # Ray node ids are 56 hex digits


class LocalCluster(ray_prune.Cluster):
    """The driver's Cluster with each node's task body run here (its directory from CKPT_AUDIT_NODE_ROOTS) instead
    of on Ray; the nodes in `quiet` do not answer."""

    def __init__(self, *args, quiet=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.quiet = set(quiet)

    def _call(self, fn, per_node):
        got = {n: fn(self.roots, n, *args) for n, args in per_node.items() if n not in self.quiet}
        return got, [n for n in per_node if n in self.quiet]


def _planned(verl_run, tmp_path, monkeypatch):
    """verl_run split by rank over two node directories, scanned node by node, judged over the union, planned to
    keep the last 1: steps 2 and 4 go, each half on node 0 and half on node 1."""
    from ckpt_audit.catalog.node_memory import NodeMemory
    from ckpt_audit.cluster import ray_scan
    from ckpt_audit.lifecycle.retention import KeepLast, plan_prune

    dirs = split_by_rank(verl_run, tmp_path, 2)
    table = tmp_path / "node_roots.json"
    table.write_text(json.dumps({nid: {str(dirs[0]): str(d)} for nid, d in zip(IDS, dirs, strict=True)}))
    monkeypatch.setenv(ENV, f"@{table}")
    root = str(dirs[0])
    now = time.time_ns()
    answers = [ray_scan.scan_on_this_node([root], nid) for nid in IDS]
    memory = NodeMemory(facts={}, last_answered_ns={})
    scanned = ray_scan.judge_cluster([root], answers, [], memory=memory, now_ns=now, in_progress_window_s=60)
    plan = plan_prune(scanned.runs, Policy(rules=(KeepLast(n=1),)), now_ns=now)
    assert [i.step for i in plan.delete] == [2, 4]
    return dirs, root, scanned, plan


def test_a_checkpoint_one_node_objects_to_is_left_whole_on_every_node(verl_run, tmp_path, monkeypatch):
    dirs, root, scanned, plan = _planned(verl_run, tmp_path, monkeypatch)
    before = [steps(d) for d in dirs]
    victim = tmp_path / "victim"
    victim.mkdir()
    actor = next(dirs[1].rglob("global_step_2")) / "actor"
    (actor / "out").symlink_to(victim)  # after the plan: only node 1's own check sees it
    got = LocalCluster([root], scanned).execute(plan)
    by_step = {o.step: o for o in got.outcomes}
    assert str(by_step[2].action) == "skipped" and by_step[2].detail.startswith(f"on node {IDS[1]}: ")
    assert by_step[2].detail.endswith("nothing removed on any node")
    assert str(by_step[4].action) == "deleted" and got.ok
    assert [steps(d) for d in dirs] == [{2: before[0][2], 6: before[0][6]}, {2: before[1][2], 6: before[1][6]}]
    assert victim.is_dir()


def test_a_node_silent_in_the_check_leaves_its_checkpoints_whole_everywhere_and_fails(verl_run, tmp_path, monkeypatch):
    dirs, root, scanned, plan = _planned(verl_run, tmp_path, monkeypatch)
    before = [steps(d) for d in dirs]
    cluster = LocalCluster([root], scanned, quiet=[IDS[1]])
    got = cluster.execute(plan)
    assert [(o.step, str(o.action)) for o in got.outcomes] == [(2, "failed"), (4, "failed")]
    assert all(f"node(s) {IDS[1]} did not answer" in o.detail for o in got.outcomes)
    assert not got.ok and cluster.document()["silent"] == [IDS[1]] and cluster.document()["partly_pruned"] == []
    assert [steps(d) for d in dirs] == before


def test_bit_rot_in_one_nodes_part_of_the_newest_is_found_by_that_node_before_anything_goes(
    verl_run, tmp_path, monkeypatch
):
    from ckpt_audit.lifecycle.survivors import verify_plan

    dirs, root, scanned, plan = _planned(verl_run, tmp_path, monkeypatch)
    shard = next(next(dirs[1].rglob("global_step_6")).rglob("model_world_size_2_rank_1.pt"))
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, same mtime: only a read by content sees it
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    check = verify_plan(plan, scanned.runs, read=LocalCluster([root], scanned).reread)
    assert [(r.checkpoint.step, r.status.name) for r in check.failed] == [(6, "CORRUPT")]
    assert check.failed[0].findings[0].path == root + str(shard)[len(str(dirs[1])) :]  # logical path, not node 1's
    # step 4 is the newest complete now, step 6 the tracker's target: only step 2 still goes
    assert [i.step for i in check.plan.delete] == [2] and sorted(i.step for i in check.plan.keep) == [4, 6]
