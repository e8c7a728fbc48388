"""scan --ray's node-local completeness without a cluster: the worker's body (`scan_on_this_node`) runs here once per
named node over a reference-trainer tree split by rank into node directories, and the driver's half
(`judge_cluster`) reduces, judges and is recorded in a real catalog: which node holds each file, each node's
cache keyed by (path, node), the scan options a node honours, ls/show/TUI node columns, and the gone-node rule.
(tests/test_ray_scan.py runs the same code on a real Ray cluster, a node killed mid-scan included.)"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from node_dirs import split_by_rank
from textual.widgets import DataTable
from tui_pilot import drive, open_run

from ckpt_audit.catalog.node_memory import NodeMemory, read_nodes
from ckpt_audit.cli import cli
from ckpt_audit.cluster import ray_scan
from ckpt_audit.cluster.noderoots import ENV
from ckpt_audit.lifecycle.retention import KeepLast, Policy, Reason, plan_prune
from ckpt_audit.scan import focus_of
from ckpt_audit.scan.scrub import ScrubPolicy
from ckpt_audit.session import open_session
from tui.app import AuditApp
from tui.screens.details import DetailsScreen

IDS = ["a1" * 28, "b2" * 28, "c3" * 28]  # Ray node ids are 56 hex digits
HOUR = 3600 * 10**9
EMPTY = NodeMemory(facts={}, last_answered_ns={})


def node_scan(monkeypatch, dirs, memory=EMPTY, options=None, *, now_ns, nodes=None, dead=(), roots=None):
    """What scan_cluster does, each node's map task run here: node 0's directory is the logical root itself, the
    others map onto it. `dead`: nodes Ray lists dead; `roots`: logical paths to scan (default node 0's dir)."""
    table = dirs[0].parent / "node_roots.json"
    table.write_text(json.dumps({nid: {str(dirs[0]): str(d)} for nid, d in zip(IDS[1:], dirs[1:])}))
    monkeypatch.setenv(ENV, f"@{table}")
    roots = roots or [str(dirs[0])]
    walk, focus = focus_of(roots)
    opts = replace(options or ray_scan.NodeScanOptions(), focus=focus)
    answers = [
        ray_scan.scan_on_this_node(walk, nid, memory.facts.get(nid), opts)
        for nid in (nodes if nodes is not None else IDS[: len(dirs)])
    ]
    return ray_scan.judge_cluster(roots, answers, list(dead), memory=memory, now_ns=now_ns, in_progress_window_s=60)


def test_a_root_with_no_runs_on_any_node_is_still_no_runs(tmp_path, monkeypatch):
    dirs = [tmp_path / f"node{i}" for i in range(2)]
    for d in dirs:
        d.mkdir()
    result = node_scan(monkeypatch, dirs, now_ns=time.time_ns())
    assert "no-runs" in {f.code for f in result.findings}


def record(catalog: Path, result) -> int:
    with open_session(catalog) as s:
        return s.record(result)


def statuses(result) -> dict[int, str]:
    return {c.step: c.status.name for r in result.runs for c in r.checkpoints}


def test_catalog_records_each_nodes_copies_and_each_node_reuses_only_its_own(verl_run, tmp_path, monkeypatch):
    dirs = split_by_rank(verl_run, tmp_path, 3)
    cat = tmp_path / "c.db"
    now = time.time_ns() + 24 * HOUR
    first = node_scan(monkeypatch, dirs, now_ns=now)
    n_files = len(first.file_facts)
    assert statuses(first) == {2: "COMPLETE", 4: "COMPLETE", 6: "COMPLETE"}
    assert "no-runs" not in {f.code for f in first.findings}  # node 2's copy holds none; the root holds runs
    assert first.files_hashed == n_files and first.files_reused == 0
    record(cat, first)
    with sqlite3.connect(cat) as db:
        assert db.execute("SELECT COUNT(*) FROM file_nodes WHERE present = 1").fetchone()[0] == n_files
        assert sorted(n for (n,) in db.execute("SELECT node_id FROM nodes")) == IDS  # every node answered
    assert sorted(read_nodes(cat).facts) == IDS[:2]  # node 2 holds nothing

    memory = read_nodes(cat)
    again = node_scan(monkeypatch, dirs, memory, now_ns=now)
    run_level = {p for p in first.file_facts if "/global_step_" not in p}  # tracker, metrics log: no files row
    assert len(run_level) == 2 and (again.files_hashed, again.files_reused) == (2, n_files - 2)  # as a local re-scan
    assert again.reused_paths == frozenset(again.file_facts) - run_level
    step4 = next(dirs[0].rglob("global_step_4"))  # asked for alone: its run walked, it alone read and judged
    focused = node_scan(monkeypatch, dirs, memory, now_ns=now, roots=[str(step4)])
    assert statuses(focused) == {4: "COMPLETE"} and focused.roots == (str(step4),)
    assert focused.files_hashed == 2 and {p.split("/global_step_")[1][0] for p in focused.reused_paths} == {"4"}

    # node 1's copy of one shard gets a new mtime; node 2 gets a replica of another: only those two are read
    moved = next(dirs[1].rglob("global_step_4/actor/model_world_size_2_rank_1.pt"))
    os.utime(moved, ns=(moved.stat().st_atime_ns, moved.stat().st_mtime_ns + 10**9))
    shard = next(dirs[1].rglob("global_step_6/actor/optim_world_size_2_rank_1.pt"))
    twin = dirs[2] / shard.relative_to(dirs[1])
    twin.parent.mkdir(parents=True)
    shutil.copy2(shard, twin)
    third = node_scan(monkeypatch, dirs, memory, now_ns=now)
    assert third.files_hashed == 2 + 2 and third.files_reused == n_files - 3
    logical = str(dirs[0]) + str(shard)[len(str(dirs[1])) :]
    assert {c.node_id for c in third.cluster.copies[logical]} == set(IDS[1:])
    assert not [f for f in third.all_findings if f.code == "replica-differs"]  # same bytes: a replica, no error
    record(cat, third)
    assert sorted(read_nodes(cat).facts) == IDS  # node 2 answered holding a file now

    # --rehash and the scrub reach every node; the scrub's budget is each node's own
    rehashed = node_scan(monkeypatch, dirs, read_nodes(cat), ray_scan.NodeScanOptions(rehash=True), now_ns=now)
    assert rehashed.files_hashed == n_files + 1  # every copy, the replica too
    budget = ray_scan.NodeScanOptions(scrub=ScrubPolicy(period_ns=0, budget_bytes=1))
    scrubbed = node_scan(monkeypatch, dirs, read_nodes(cat), budget, now_ns=now)
    assert scrubbed.files_scrubbed == 3  # one file per node: the budget is per node's disk
    assert [f.code for f in scrubbed.all_findings].count("scrub-overdue") == 2  # nodes 0, 1 left files unread

    # ls and show: a node column, since the catalog knows nodes
    run = next(p for p in dirs[0].rglob("global_step_6")).parent
    ls = CliRunner().invoke(cli, ["ls", str(run), "--catalog", str(cat)])
    assert ls.exit_code == 0, ls.output
    assert ls.output.splitlines()[1].endswith("  nodes")
    short = [i[:8] for i in IDS]
    assert [line.rsplit(" ", 1)[1] for line in ls.output.splitlines()[2:]] == [",".join(short[:2])] * 2 + [
        ",".join(short)
    ]
    ls_json = json.loads(CliRunner().invoke(cli, ["ls", str(run), "--json", "--catalog", str(cat)]).output)
    assert [c["nodes"] for c in ls_json["checkpoints"]] == [IDS[:2], IDS[:2], IDS]
    show = CliRunner().invoke(cli, ["show", str(run / "global_step_6"), "--catalog", str(cat)])
    [line] = [x for x in show.output.splitlines() if x.endswith(shard.name)]
    assert f"{IDS[1][:8]},{IDS[2][:8]}" in line
    detail = json.loads(
        CliRunner().invoke(cli, ["show", str(run / "global_step_6"), "--json", "--catalog", str(cat)]).output
    )
    assert {f["path"]: f["nodes"] for f in detail["checkpoint"]["files"]}[logical] == IDS[1:]


def test_local_scan_catalog_shows_no_node_column(verl_run, tmp_path):
    cat = str(tmp_path / "c.db")
    assert CliRunner().invoke(cli, ["scan", "-q", "--catalog", cat, str(verl_run)]).exit_code == 0
    again = json.loads(
        CliRunner().invoke(cli, ["scan", "--json", "--no-scrub", "--catalog", cat, str(verl_run)]).output
    )
    assert again["files_hashed"] == 2 and "cluster" not in again  # the run-level files, as scan --ray's nodes do
    ls = CliRunner().invoke(cli, ["ls", str(verl_run), "--catalog", cat])
    assert "nodes" not in ls.output and ls.exit_code == 0
    show = CliRunner().invoke(cli, ["show", str(verl_run / "global_step_2"), "--json", "--catalog", cat])
    assert json.loads(show.output)["checkpoint"]["nodes"] == []


def test_a_node_gone_past_the_window_keeps_only_its_own_checkpoints_unknown(verl_run, tmp_path, monkeypatch):
    """Node 1 holds rank 1 of step 4 and all of step 6 (step 2's rank 1 is lost before it is ever catalogued), then
    stops answering. Within the window every incomplete checkpoint is unknown; past it, step 2 is incomplete (node 1
    never held its missing files), steps 4 and 6 stay unknown with node-gone (step 6 known from the catalog alone,
    not dropped as absent), and prune keeps them."""
    dirs = split_by_rank(verl_run, tmp_path, 2)
    for f in dirs[1].rglob("global_step_2/actor/*_rank_1.pt"):
        f.unlink()
    step6 = next(dirs[0].rglob("global_step_6"))  # node 1 holds all of step 6
    shutil.copytree(step6, dirs[1] / step6.relative_to(dirs[0]), dirs_exist_ok=True)
    shutil.rmtree(step6)
    cat = tmp_path / "c.db"
    t0 = time.time_ns() + 24 * HOUR
    first = node_scan(monkeypatch, dirs, now_ns=t0)
    assert statuses(first) == {2: "INCOMPLETE", 4: "COMPLETE", 6: "COMPLETE"}
    record(cat, first)

    # node 1 stops answering and Ray forgets it; node 2, which never answered, is listed dead from now on
    soon = node_scan(monkeypatch, dirs, read_nodes(cat), now_ns=t0 + HOUR, nodes=IDS[:1], dead=IDS[2:])
    assert soon.cluster.silent == (IDS[2], IDS[1])  # node 1 too: the catalog knows it held files here
    assert statuses(soon) == {2: "UNKNOWN", 4: "UNKNOWN", 6: "UNKNOWN"}
    assert [f.code for f in soon.all_findings].count("node-silent") == 5  # 3 checkpoints and one per node
    record(cat, soon)

    later = node_scan(monkeypatch, dirs, read_nodes(cat), now_ns=t0 + 48 * HOUR, nodes=IDS[:1], dead=IDS[2:])
    assert statuses(later) == {2: "INCOMPLETE", 4: "UNKNOWN", 6: "UNKNOWN"}
    gone = sorted((f.code, os.path.basename(f.path)) for f in later.all_findings if f.severity.label == "warning")
    assert gone == [("node-gone", "global_step_4"), ("node-gone", "global_step_6")] + [("node-silent", "")] * 2
    assert all("counted as gone" in f.message for f in later.all_findings if f.code == "node-silent")
    assert all(IDS[1] in f.message and "silent for 2d" in f.message for f in later.all_findings if f.code == gone[0][0])
    assert not [f for f in later.all_findings if f.code == "node-silent" and f.path]  # only the scan-level line
    plan = plan_prune(later.runs, Policy(rules=(KeepLast(n=0),)), now_ns=t0 + 48 * HOUR)
    kept = {os.path.basename(i.path): i.reasons for i in plan.keep}
    assert Reason.UNREAD in kept["global_step_4"] and Reason.UNREAD in kept["global_step_6"] and not plan.delete

    record(cat, later)
    with sqlite3.connect(cat) as db:
        [(answered, silent_at)] = db.execute(
            "SELECT last_answered_ns, last_silent_ns FROM nodes WHERE node_id = ?", [IDS[1]]
        ).fetchall()
        ckpts = dict(db.execute("SELECT path, status FROM checkpoints WHERE present = 1"))
    assert (answered, silent_at) == (t0, t0 + 48 * HOUR)
    assert sorted((os.path.basename(p), st) for p, st in ckpts.items()) == [
        ("global_step_2", "incomplete"),
        ("global_step_4", "unknown"),
        ("global_step_6", "unknown"),
    ]


def test_tui_details_show_the_node_of_each_file(verl_run, tmp_path, monkeypatch):
    dirs = split_by_rank(verl_run, tmp_path, 2)
    cat = tmp_path / "c.db"
    record(cat, node_scan(monkeypatch, dirs, now_ns=time.time_ns() + 24 * HOUR))
    app = AuditApp(catalog_path=cat, roots=[str(dirs[0])])

    async def script(pilot):
        await open_run(pilot)
        await pilot.press("enter")
        await pilot.pause()
        details = app.screen
        assert isinstance(details, DetailsScreen)
        files = details.query_one("#files", DataTable)
        assert "nodes" in files.columns
        rows = [files.get_row_at(i) for i in range(files.row_count)]
        assert rows and {str(r[-1]) for r in rows} == {IDS[0][:8]}  # node 0's share: the head's own directory

    drive(app, script)


def test_a_node_local_rescan_reuses_the_catalogued_dcp_metadata(dcp_trees, tmp_path, monkeypatch):
    """files.dcp_facts reach the nodes' memory as the local scan's: an unchanged .metadata is not read again, and
    the byte ranges it gave still judge a .distcp truncated on another node since."""
    dirs = split_by_rank(dcp_trees["dcp"], tmp_path, 2)
    step = next(dirs[0].rglob("step-1"))
    far = dirs[1] / step.relative_to(dirs[0]) / "__1_0.distcp"  # rank 1's file on node 1, .metadata on node 0
    far.parent.mkdir(parents=True)
    shutil.move(step / far.name, far)
    cat = tmp_path / "c.db"
    now = time.time_ns() + 24 * HOUR
    first = node_scan(monkeypatch, dirs, now_ns=now)
    assert statuses(first) == {1: "COMPLETE"}
    record(cat, first)
    meta = str(step / ".metadata")
    memory = read_nodes(cat)
    assert memory.facts[IDS[0]][meta].dcp == first.file_facts[meta].dcp is not None

    with open(far, "r+b") as f:
        f.truncate(10)
    os.utime(far, ns=(far.stat().st_atime_ns, far.stat().st_mtime_ns - HOUR))  # older than the in-progress window
    again = node_scan(monkeypatch, dirs, memory, now_ns=now)
    assert meta in again.reused_paths and again.file_facts[meta].dcp == first.file_facts[meta].dcp
    logical = str(step / far.name)
    assert statuses(again) == {1: "CORRUPT"}
    assert ("dcp-range-outside-file", logical) in {(f.code, f.path) for f in again.all_findings}
    fresh = node_scan(monkeypatch, dirs, now_ns=now)  # the same findings as a scan that reads every file
    assert meta not in fresh.reused_paths
    assert sorted((f.code, f.path, f.message) for f in again.all_findings) == sorted(
        (f.code, f.path, f.message) for f in fresh.all_findings
    )


def test_a_node_roots_file_whose_entry_is_no_object_is_a_one_line_error(tmp_path):
    from ckpt_audit.cluster.noderoots import NodeRootsError, parse_node_roots

    table = tmp_path / "roots.json"
    table.write_text('{"*": 5}')
    with pytest.raises(NodeRootsError, match="must be a JSON object"):
        parse_node_roots(f"@{table}", node_id="n1")
