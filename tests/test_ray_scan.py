"""Node-local placement on a real local Ray cluster (the session's 3 nodes, tests/ray_cluster.py): a reference-trainer
tree split by rank over node directories is judged exactly as the same tree on one disk."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time

import pytest
from click.testing import CliRunner
from node_dirs import split_by_rank

from ckpt_audit import scan
from ckpt_audit.cli import cli
from ckpt_audit.cli import ray as ray_cli
from ckpt_audit.cluster import ray_scan
from ckpt_audit.cluster.findings import judge_nodes
from ckpt_audit.session import open_session

pytestmark = pytest.mark.slow
LOGICAL = "/ckpt-audit-logical/ckpts"  # exists on no node: every node maps it to its own directory


def summary(result, root: str) -> tuple:
    ckpts = sorted((c.path.replace(root, "<root>"), c.status.name) for r in result.runs for c in r.checkpoints)
    found = sorted((f.code, f.path.replace(root, "<root>"), f.rank) for f in result.all_findings)
    hashes = sorted((p.replace(root, "<root>"), f.hash) for p, f in result.file_facts.items())
    return ckpts, found, hashes


def test_ranks_split_over_three_nodes_judged_as_one_disk(ray_cluster, verl_run, tmp_path):
    ids, table = ray_cluster.ids, ray_cluster.table
    dirs = split_by_rank(verl_run, tmp_path, 3)
    table.write_text(json.dumps({nid: {LOGICAL: str(d)} for nid, d in zip(ids, dirs)}))
    now = time.time_ns() + 86_400 * 10**9
    answers, silent = ray_scan.node_local_map([LOGICAL], address=None)
    assert silent == []
    assert sorted(a.node_id for a in answers) == sorted(ids)
    got = ray_scan.reduce_nodes(answers, now_ns=now, in_progress_window_ns=60 * 10**9)
    whole = tmp_path / "whole"
    shutil.copytree(verl_run.parent.parent, whole, ignore=shutil.ignore_patterns(".fixture*"))
    want = scan.scan([str(whole)], now_ns=now, in_progress_window_s=60)
    assert summary(got, LOGICAL) == summary(want, str(whole))
    assert len([c for r in got.runs for c in r.checkpoints]) == 3


def _scan(table, mapping, ids, now):
    table.write_text(json.dumps({nid: {LOGICAL: str(d)} for nid, d in zip(ids, mapping)}))
    answers, silent = ray_scan.node_local_map([LOGICAL])
    reduced = ray_scan.reduce_nodes(answers, now_ns=now, in_progress_window_ns=60 * 10**9)
    return judge_nodes(reduced, answers, silent), silent


def _codes(result):
    return [(f.code, f.path.replace(LOGICAL, "<root>"), f.message) for f in result.all_findings]


def test_spread_ranks_named_by_node_and_a_differing_replica_is_a_conflict(ray_cluster, verl_run, tmp_path):
    ids, table = ray_cluster.ids, ray_cluster.table
    dirs = split_by_rank(verl_run, tmp_path, 2) + [tmp_path / "node2"]
    now = time.time_ns() + 86_400 * 10**9
    got, silent = _scan(table, dirs, ids, now)
    assert silent == []
    spread = [f for f in got.all_findings if f.code.startswith("ranks-spread")]
    assert [f.code for f in spread] == ["ranks-spread-over-nodes"] * 3  # one per checkpoint's actor component
    assert all(f"ranks 0 on node {ids[0]}" in f.message and f"ranks 1 on node {ids[1]}" in f.message for f in spread)
    assert {c.status.name for r in got.runs for c in r.checkpoints} == {"COMPLETE"}
    # node 2 holds a copy of one rank-1 shard with one byte changed
    shard = next(p for p in dirs[1].rglob("model_world_size_2_rank_1.pt") if "global_step_4" in str(p))
    twin = dirs[2] / shard.relative_to(dirs[1])
    twin.parent.mkdir(parents=True)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    twin.write_bytes(bytes(data))
    got, _ = _scan(table, dirs, ids, now)
    [bad] = [f for f in got.all_findings if f.code == "replica-differs"]
    assert bad.path == LOGICAL + str(shard)[len(str(dirs[1])) :]
    assert bad.message.endswith(f"(whole on {ids[1]})")  # node 2's twin is damaged, node 1's whole
    step4 = next(c for r in got.runs for c in r.checkpoints if c.step == 4)
    assert step4.status.name == "UNKNOWN"  # a conflict, not corruption: which copy rank 1 loads is chance


def test_scan_ray_cli_records_the_union_in_the_catalog(ray_cluster, verl_run, tmp_path):
    """The head node's directory is the logical root itself (no entry: identity); the others are mapped to it."""
    ids, table = ray_cluster.ids, ray_cluster.table
    dirs = split_by_rank(verl_run, tmp_path, 2)
    table.write_text(json.dumps({ids[1]: {str(dirs[0]): str(dirs[1])}, ids[2]: {str(dirs[0]): str(tmp_path / "none")}}))
    out = CliRunner().invoke(cli, ["scan", "--ray", "--json", "--catalog", str(tmp_path / "c.db"), str(dirs[0])])
    doc = json.loads(out.output)
    want = CliRunner().invoke(cli, ["scan", "--json", "--catalog", str(tmp_path / "w.db"), str(verl_run)])
    statuses = sorted(c["status"] for r in doc["runs"] for c in r["checkpoints"])
    assert statuses == sorted(c["status"] for r in json.loads(want.output)["runs"] for c in r["checkpoints"])
    assert statuses == ["complete"] * 3
    assert doc["ray"] is True and out.exit_code == 0
    assert sorted(doc["cluster"]["answered"]) == sorted(ids) and doc["cluster"]["silent"] == []
    assert {tuple(n) for n in doc["cluster"]["holders"].values()} == {(ids[0],), (ids[1],)}

    # again: each node reuses its own catalogued copies (only the run-level tracker and log are read, as locally)
    prom = tmp_path / "m.prom"
    args = ["scan", "--ray", "--json", "--no-scrub", "--metrics-file", str(prom), "--catalog", str(tmp_path / "c.db")]
    again = json.loads(CliRunner().invoke(cli, [*args, str(dirs[0])]).output)
    assert (again["files_hashed"], again["files_reused"]) == (2, len(doc["cluster"]["holders"]) - 2)
    assert "ckpt_audit_checkpoints" in prom.read_text()
    ls = CliRunner().invoke(cli, ["ls", str(dirs[0] / "demo" / "exp"), "--catalog", str(tmp_path / "c.db")])
    assert ls.output.splitlines()[1].endswith("nodes") and ids[1][:8] in ls.output
    deep = CliRunner().invoke(cli, ["scan", "--ray", "--deep", "--catalog", str(tmp_path / "d.db"), str(dirs[0])])
    assert deep.exit_code == 2 and deep.output.strip() == f"ckpt-audit: {ray_cli.DEEP_REFUSED}"


def test_a_node_killed_during_the_scan_makes_its_checkpoints_unknown_never_incomplete(
    ray_cluster, ray_extra_node, verl_run, tmp_path
):
    """Node X, added for this test, holds rank 1 of every checkpoint and is killed while its task runs; the shared
    nodes hold the rest (the head) or nothing (the others), and answer."""
    shared, table = ray_cluster.ids, ray_cluster.table
    x = ray_extra_node.node_id
    ids = [*shared, x]
    dirs = [tmp_path / f"node{i}" for i in range(len(shared))] + split_by_rank(verl_run, tmp_path / "x", 2)[1:]
    split_by_rank(verl_run, tmp_path / "y", 2)[0].rename(dirs[0])
    for d in dirs[1 : len(shared)]:
        d.mkdir()
    now = time.time_ns() + 86_400 * 10**9
    got, silent = _scan(table, dirs, ids, now)
    assert {c.status.name for r in got.runs for c in r.checkpoints} == {"COMPLETE"}

    hold = ray_cluster.hold
    (hold / f"{x}.started").unlink()
    (hold / f"{x}.hold").touch()  # node X's next task waits until it is killed
    done: dict = {}
    scan = threading.Thread(
        target=lambda: done.update(result=ray_scan.scan_cluster([LOGICAL], address=None, in_progress_window_s=60))
    )
    scan.start()
    deadline = time.monotonic() + 60
    while not (hold / f"{x}.started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (hold / f"{x}.started").exists() and scan.is_alive()  # its task is running now
    ray_cluster.remove(x)  # raylet and workers killed
    scan.join(timeout=120)
    (hold / f"{x}.hold").unlink()
    assert not scan.is_alive()
    got = done["result"]
    assert got.cluster.silent == (x,) and sorted(got.cluster.answered) == sorted(shared)
    assert {c.step: c.status.name for r in got.runs for c in r.checkpoints} == {
        2: "UNKNOWN",
        4: "UNKNOWN",
        6: "UNKNOWN",
    }
    assert any(f.code == "node-silent" and x in f.message for f in got.all_findings)
    with open_session(tmp_path / "c.db") as s:
        s.record(got)
    with sqlite3.connect(tmp_path / "c.db") as db:
        assert {st for (st,) in db.execute("SELECT status FROM checkpoints")} == {"unknown"}

    # Ray now lists it dead: the next scan judges alike
    got, silent = _scan(table, dirs, ids, now)
    assert silent == [x]
    assert {c.status.name for r in got.runs for c in r.checkpoints} == {"UNKNOWN"}
