"""scan --ray --placement shared on a real local Ray cluster (the session's 3 nodes, tests/ray_cluster.py), through
the CLI: a shared root's files are read on every node and the catalog is the local scan's, row for row."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_audit.cli import cli

pytestmark = pytest.mark.slow
# columns that name the scan, not the tree: they differ between any two scans
SCAN_COLUMNS = {"id", "scan_id", "last_scan_id", "verified_ns", "started_ns", "finished_ns"}


def catalog_rows(db: Path) -> dict[str, list[tuple]]:
    """Every row of the tables a scan writes, without the columns that name the scan."""
    out = {}
    with sqlite3.connect(db) as con:
        for table in ("runs", "checkpoints", "files", "findings", "hash_history"):
            cols = [r[1] for r in con.execute(f"PRAGMA table_info({table})") if r[1] not in SCAN_COLUMNS]
            out[table] = sorted(con.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall(), key=repr)
    return out


def scan(root: Path, db: Path, *args: str) -> dict:
    out = CliRunner().invoke(cli, ["scan", *args, "--json", "--catalog", str(db), str(root)])
    assert out.exit_code in (0, 1), out.output
    return json.loads(out.output)


@pytest.fixture
def shared_root(verl_run, verl_run_sft, tmp_path) -> Path:
    root = tmp_path / "shared"
    shutil.copytree(verl_run.parent.parent, root, ignore=shutil.ignore_patterns(".fixture*"))
    shutil.copytree(verl_run_sft, root / "sft" / "exp", ignore=shutil.ignore_patterns(".fixture*"))
    (root / "sft" / "exp" / "global_step_4" / "model_world_size_2_rank_1.pt").write_bytes(b"torn")  # a finding
    return root


def test_shared_scan_records_the_local_scans_catalog_reading_on_every_node(ray_cluster, shared_root, tmp_path):
    ids, table = ray_cluster.ids, ray_cluster.table
    table.write_text("{}")
    got = scan(shared_root, tmp_path / "ray.db", "--ray", "--placement", "shared")
    want = scan(shared_root, tmp_path / "local.db")
    assert catalog_rows(tmp_path / "ray.db") == catalog_rows(tmp_path / "local.db")
    rows = catalog_rows(tmp_path / "local.db")
    assert len(rows["files"]) > 40 and ("error", "not-a-zip") in {r[:2] for r in rows["findings"]}
    assert got["exit_code"] == want["exit_code"] == 1
    assert (got["files_hashed"], got["bytes_hashed"]) == (want["files_hashed"], want["bytes_hashed"])
    placed = got["placement"]
    assert placed["mode"] == "shared" and placed["read_by_driver"] == 0
    assert sorted(placed["nodes"]) == sorted(ids)  # every node read a share, none handed any back
    assert sum(n["files"] for n in placed["nodes"].values()) == want["files_hashed"]
    assert all(n["files"] > 5 and n["handed_back"] == 0 for n in placed["nodes"].values())
    # the next scan reuses the catalogued hashes exactly as a local scan does: nothing is sent to the nodes
    again = scan(shared_root, tmp_path / "ray.db", "--ray", "--placement", "shared")
    local_again = scan(shared_root, tmp_path / "local.db")
    assert again["files_reused"] == local_again["files_reused"] > 40
    sent = sum(n["files"] for n in again["placement"]["nodes"].values())
    assert sent == again["files_hashed"] == local_again["files_hashed"]
    assert catalog_rows(tmp_path / "ray.db") == catalog_rows(tmp_path / "local.db")


def test_a_node_that_sees_other_files_hands_them_back_and_the_catalog_is_still_the_local_one(
    ray_cluster, shared_root, tmp_path
):
    """A wrong placement guess: node 1's view of the root is a copy (same names and bytes, other inodes)."""
    ids, table = ray_cluster.ids, ray_cluster.table
    copy = tmp_path / "copy"
    shutil.copytree(shared_root, copy)
    (copy / "sft" / "exp" / "global_step_2" / "model_world_size_2_rank_0.pt").write_bytes(b"other bytes")
    table.write_text(json.dumps({ids[1]: {str(shared_root): str(copy)}}))
    try:
        got = scan(shared_root, tmp_path / "ray.db", "--ray", "--placement", "shared")
    finally:
        table.write_text("{}")
    scan(shared_root, tmp_path / "local.db")
    assert catalog_rows(tmp_path / "ray.db") == catalog_rows(tmp_path / "local.db")
    node1 = got["placement"]["nodes"][ids[1]]
    assert node1["files"] == 0 and node1["handed_back"] > 5
    assert got["placement"]["read_by_driver"] == node1["handed_back"]


def test_auto_on_a_local_filesystem_is_node_local(ray_cluster, shared_root, tmp_path):
    ray_cluster.table.write_text("{}")
    got = scan(shared_root, tmp_path / "ray.db", "--ray")
    assert "placement" not in got and got["ray"] is True  # the node-local path answered


def test_nodes_whose_task_fails_leave_their_share_to_the_driver(ray_cluster, shared_root, tmp_path):
    """Every node's task raises (its CKPT_AUDIT_NODE_ROOTS table is unreadable): the driver reads every file."""
    ids, table = ray_cluster.ids, ray_cluster.table
    table.write_text("not json")
    try:
        got = scan(shared_root, tmp_path / "ray.db", "--ray", "--placement", "shared")
    finally:
        table.write_text("{}")
    scan(shared_root, tmp_path / "local.db")
    assert catalog_rows(tmp_path / "ray.db") == catalog_rows(tmp_path / "local.db")
    placed = got["placement"]
    assert sorted(placed["nodes"]) == sorted(ids) and all(n["failed"] for n in placed["nodes"].values())
    assert placed["read_by_driver"] == got["files_hashed"] > 40


def test_the_auto_probe_reports_each_nodes_own_view_of_the_root(ray_cluster, shared_root, tmp_path):
    """On one machine every node sees the driver's root directory, unless its CKPT_AUDIT_NODE_ROOTS maps it to a
    copy: that node's view differs, so auto could not call the root shared even on a network filesystem."""
    import ray

    from ckpt_audit.cluster.shared import RootView, choose_placement, probe_views, root_view

    ids, table = ray_cluster.ids, ray_cluster.table
    root = str(shared_root)
    table.write_text("{}")
    here = root_view(root)
    assert probe_views(ray, ids, [root]) == {n: {root: here} for n in ids}
    copy = tmp_path / "copy"
    copy.mkdir()
    table.write_text(json.dumps({ids[1]: {root: str(copy)}}))
    try:
        views = probe_views(ray, ids, [root])
    finally:
        table.write_text("{}")
    assert views[ids[0]] == {root: here} and views[ids[1]] == {root: root_view(str(copy))}
    as_if_nfs = {root: RootView("nfs4", here.inode, here.mtime_ns)}
    nfs_views = {n: {root: RootView("nfs4", v[root].inode, v[root].mtime_ns)} for n, v in views.items()}
    assert choose_placement(as_if_nfs, nfs_views) == "node-local"
    nfs_views[ids[1]] = {root: as_if_nfs[root]}
    assert choose_placement(as_if_nfs, nfs_views) == "shared"
