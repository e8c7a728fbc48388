"""Copies of one logical path that differ between nodes are a conflict, never evidence of corruption: node-local
disks simulated as node directories (no Ray: each node's scan and prune task body runs here, as in
tests/test_cluster_nodes.py and the end of tests/test_ray_prune.py), planned and executed through the session the
CLI's `prune --ray` drives.

Two jobs that wrote the same logical path on different node-local disks: node 0 holds the trainer's run, node 1 a
run of the same shape whose every step holds other (whole) bytes. A rank loads the copy on its own node, so which
one a resume gets is chance: prune with no keep rule used to call every checkpoint corrupt and delete them on both
nodes."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from test_cluster_nodes import node_scan
from test_ray_prune import IDS, LocalCluster, steps

from ckpt_audit.lifecycle.retention import KeepLast, Policy
from ckpt_audit.session import open_session

pytestmark = pytest.mark.slow


def two_jobs(verl_run: Path, base: Path, *, rotate: bool = True) -> list[Path]:
    """node0/<project>/<exp>: the trainer's run; node1/...: the same paths, each step holding the bytes of another
    step (a second job's whole files at the same names) when `rotate`, else an identical copy."""
    top = verl_run.parent.parent
    dirs = [base / "node0", base / "node1"]
    for d in dirs:
        shutil.copytree(top, d, ignore=shutil.ignore_patterns(".fixture*"))
    if rotate:
        run = dirs[1] / verl_run.parent.name / verl_run.name
        for a, b in ((2, 4), (4, 6)):  # 2<-4, 4<-6, 6<-2: a step's files from another step, paths unchanged
            (run / f"global_step_{a}").rename(run / "tmp")
            (run / f"global_step_{b}").rename(run / f"global_step_{a}")
            (run / "tmp").rename(run / f"global_step_{b}")
    return dirs


def scanned(monkeypatch, dirs):
    return node_scan(monkeypatch, dirs, now_ns=time.time_ns(), nodes=IDS[:2])


def prune(dirs, result, policy, tmp_path):
    """What prune --ray does once the nodes have answered its scan: plan, re-read the survivors on their nodes,
    execute on each node (each node's task body run here)."""
    cluster = LocalCluster([str(dirs[0])], result)
    with open_session(tmp_path / "c.db", roots=[str(dirs[0])]) as s:
        preview = s.plan_prune(policy, now_ns=time.time_ns(), scanned=result, executor=cluster)
        done = s.prune(preview, confirmed=False)
    return preview.plan, done.result


def by_step(result) -> dict[int, tuple[str, set[str]]]:
    return {c.step: (c.status.name, {f.code for f in c.all_findings}) for r in result.runs for c in r.checkpoints}


def test_two_jobs_on_two_nodes_are_a_conflict_kept_whole_on_both(verl_run, tmp_path, monkeypatch):
    dirs = two_jobs(verl_run, tmp_path)
    before = [steps(d) for d in dirs]
    result = scanned(monkeypatch, dirs)
    got = by_step(result)
    assert {s: status for s, (status, _codes) in got.items()} == {2: "UNKNOWN", 4: "UNKNOWN", 6: "UNKNOWN"}
    assert all("replica-differs" in codes for _status, codes in got.values())
    data = [f for f in result.all_findings if f.code == "replica-differs" and f.path.endswith("/data.pt")]
    assert len(data) == 3 and all(f.rank is None for f in data)  # rank-less files too: a rank loads its node's
    plan, done = prune(dirs, result, Policy(), tmp_path)  # no keep rule: only broken checkpoints go
    assert plan.delete == ()
    assert {i.step: [str(r) for r in i.reasons] for i in plan.keep} == {
        2: ["unread", "replica-conflict"],
        4: ["unread", "replica-conflict"],
        6: ["tracker-target", "unread", "replica-conflict"],
    }
    assert done is None or done.ok
    assert [steps(d) for d in dirs] == before


def test_a_rankless_file_that_differs_is_reported_and_keeps_its_checkpoint(verl_run, tmp_path, monkeypatch):
    dirs = two_jobs(verl_run, tmp_path, rotate=False)
    exp = Path(verl_run.parent.name) / verl_run.name
    shutil.copy2(dirs[1] / exp / "global_step_2" / "data.pt", dirs[1] / exp / "global_step_4" / "data.pt")
    result = scanned(monkeypatch, dirs)
    [bad] = [f for f in result.all_findings if f.code == "replica-differs"]
    assert bad.path == str(dirs[0] / exp / "global_step_4" / "data.pt") and bad.rank is None
    assert f"whole on {', '.join(IDS[:2])}" in bad.message
    assert by_step(result)[4][0] == "UNKNOWN" and by_step(result)[6][0] == "COMPLETE"
    plan, _done = prune(dirs, result, Policy(rules=(KeepLast(n=1),)), tmp_path)
    assert [i.step for i in plan.delete] == [2]
    assert steps(dirs[0])[4] and steps(dirs[1])[4]  # step 4 kept on both nodes


def test_trackers_that_differ_between_nodes_are_reported_and_every_step_they_name_kept(verl_run, tmp_path, monkeypatch):
    dirs = two_jobs(verl_run, tmp_path, rotate=False)
    exp = Path(verl_run.parent.name) / verl_run.name
    (dirs[1] / exp / "latest_checkpointed_iteration.txt").write_text("4")  # node 1's ranks resume from step 4
    result = scanned(monkeypatch, dirs)
    [run] = result.runs
    [told] = [f for f in run.findings if f.code == "replica-differs"]
    assert told.message == f"the tracker differs between nodes: node {IDS[0]}: step 6; node {IDS[1]}: step 4"
    assert {s: status for s, (status, _codes) in by_step(result).items()} == {
        2: "COMPLETE",
        4: "COMPLETE",
        6: "COMPLETE",
    }
    plan, done = prune(dirs, result, Policy(rules=(KeepLast(n=1),)), tmp_path)
    assert [i.step for i in plan.delete] == [2]
    assert "replica-conflict" in next(i for i in plan.keep if i.step == 4).reasons
    assert done is not None and done.ok
    assert [sorted(steps(d)) for d in dirs] == [[4, 6], [4, 6]]
