"""scan --ray's shared placement without Ray: the pure planning (files over nodes), the auto placement's detection,
and a node's share read in this process with the local scan's read_file (docs/ray.md)."""

from __future__ import annotations

import os
import shutil

import pytest

from ckpt_audit import scan
from ckpt_audit.cluster.shared import (
    FILE_COST_BYTES,
    NETWORK_FS,
    ReadJob,
    RootView,
    choose_placement,
    mount_fstype,
    plan_files,
    read_share,
    root_view,
)
from ckpt_audit.layouts import file_kind, load_layouts


def test_one_run_of_8000_rank_files_spreads_over_every_node_within_one_file_of_the_mean():
    sizes = {f"/s/run/global_step_9/actor/model_world_size_8000_rank_{r}.pt": 10**6 + r for r in range(8000)}
    sizes["/s/run/latest_checkpointed_iteration.txt"] = 1
    plan = plan_files(sizes, ["a", "b", "c"])
    assert sorted(p for share in plan.values() for p in share) == sorted(sizes)  # each file on exactly one node
    loads = [sum(sizes[p] + FILE_COST_BYTES for p in share) for share in plan.values()]
    assert max(loads) - min(loads) <= max(sizes.values()) + FILE_COST_BYTES
    assert all(2600 <= len(share) <= 2700 for share in plan.values())


def test_a_huge_file_takes_one_node_and_the_rest_go_to_the_others():
    sizes = {"/s/big.pt": 100 * 2**30, **{f"/s/r{i}.pt": 2**30 for i in range(10)}}
    plan = plan_files(sizes, ["a", "b"])
    assert plan["a"] == ("/s/big.pt",)
    assert len(plan["b"]) == 10
    assert plan_files(sizes, []) == {}
    assert plan_files({}, ["a"]) == {"a": ()}


MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
server:/export /mnt/ckpts nfs4 rw,relatime 0 0
lfs@o2ib:/scratch /lustre lustre rw 0 0
tmpfs /lustre/tmp tmpfs rw 0 0
server:/b /mnt/with\\040space nfs rw 0 0
/dev/vdb /mnt/ckpts ext4 rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/home/u/ckpts", "ext4"),
        ("/lustre/proj/run", "lustre"),
        ("/lustre/tmp/x", "tmpfs"),  # the longest mount point above the path
        ("/lustre", "lustre"),
        ("/lustreX/a", "ext4"),  # a prefix of the name is not a mount above it
        ("/mnt/with space/r", "nfs"),  # /proc/mounts escapes a space as \040
        ("/mnt/ckpts/r", "ext4"),  # mounted over the NFS one (a later line): the top mount wins
    ],
)
def test_the_fs_type_is_the_longest_mount_above_the_path(path, fstype):
    assert mount_fstype(path, MOUNTS) == fstype


def test_auto_is_shared_only_when_the_driver_sees_a_network_fs_and_every_node_sees_the_same_root():
    nfs = RootView(fstype="nfs4", inode=12, mtime_ns=5)
    assert "nfs4" in NETWORK_FS and "lustre" in NETWORK_FS and "ext4" not in NETWORK_FS
    assert choose_placement({"/r": nfs}, {"a": {"/r": nfs}, "b": {"/r": nfs}}) == "shared"
    # a node that sees another directory at that path (its own disk, another export, a mapped copy)
    assert choose_placement({"/r": nfs}, {"a": {"/r": nfs}, "b": {"/r": RootView("nfs4", 13, 5)}}) == "node-local"
    assert choose_placement({"/r": nfs}, {"a": {"/r": nfs}, "b": {"/r": None}}) == "node-local"
    local = RootView(fstype="ext4", inode=12, mtime_ns=5)  # rsync'd copies can agree on inode and mtime
    assert choose_placement({"/r": local}, {"a": {"/r": local}}) == "node-local"
    assert choose_placement({"/r": None}, {"a": {"/r": nfs}}) == "node-local"
    assert choose_placement({"/r": nfs}, {}) == "node-local"  # no node answered the probe
    two = {"/r": nfs, "/s": local}  # one root not shared: node-local for all (one placement per scan)
    assert choose_placement(two, {"a": two}) == "node-local"


def test_this_machines_tmp_is_not_a_network_fs(tmp_path):
    view = root_view(str(tmp_path))
    with open("/proc/mounts", encoding="utf-8") as fh:
        assert view.fstype == mount_fstype(os.path.realpath(tmp_path), fh.read())
    assert view.fstype not in NETWORK_FS
    assert root_view(str(tmp_path / "missing")) is None


def _jobs(root):
    tree, stats, _ = scan.walk(str(root))
    layouts = load_layouts()
    paths = sorted(p for d in tree.files for p in (f"{d}/{n}" for n in tree.files[d]))
    jobs = [ReadJob(path=p, st=stats[p], prev=None, kind=file_kind(p, layouts)) for p in paths]
    return jobs, stats


@pytest.mark.slow
def test_a_nodes_share_is_what_the_local_read_gives_and_other_files_are_handed_back(verl_run, tmp_path, monkeypatch):
    root = tmp_path / "shared"
    shutil.copytree(verl_run, root, ignore=shutil.ignore_patterns(".fixture*"))
    jobs, stats = _jobs(root)
    now = 10**18
    answer = read_share(jobs, "n1", workers=2, now_ns=now)
    assert answer.unseen == ()
    want = {j.path: scan.read_file(j.path, stats[j.path], None, kind=j.kind, now_ns=now) for j in jobs}
    assert answer.facts == want
    # this node's copy of the root is another directory: same names, other inodes: nothing is the driver's file
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    monkeypatch.setenv("CKPT_AUDIT_NODE_ROOTS", f"{root}={copy}")
    answer = read_share(jobs, "n1", workers=2, now_ns=now)
    assert answer.facts == {} and sorted(answer.unseen) == sorted(j.path for j in jobs)
    # a mapped copy that IS the driver's file (a hard link: same inode) is read there, reported by logical path
    shutil.rmtree(copy)
    shutil.copytree(root, copy, copy_function=os.link)
    answer = read_share(jobs, "n1", workers=2, now_ns=now)
    assert answer.unseen == () and answer.facts == want


def test_placement_without_ray_is_a_usage_error(tmp_path):
    from click.testing import CliRunner

    from ckpt_audit.cli import cli

    out = CliRunner().invoke(cli, ["scan", "--placement", "shared", "--catalog", str(tmp_path / "c.db"), str(tmp_path)])
    assert out.exit_code == 2
    assert "--placement needs --ray" in out.output
    assert not (tmp_path / "c.db").exists()


def test_with_no_alive_node_the_driver_reads_every_file(tmp_path):
    import ray  # noqa: F401  the test extra installs it

    from ckpt_audit.cluster.shared import RayReader

    (tmp_path / "a.pt").write_bytes(b"x" * 10)
    (tmp_path / "b.json").write_bytes(b"{}")
    _, stats, _ = scan.walk(str(tmp_path))
    paths = sorted(stats)
    kinds = {p: file_kind(p, load_layouts()) for p in paths}
    reader = RayReader(nodes=[])
    got = dict(reader(paths, stats, {}, kinds, workers=1, now_ns=7))
    assert got == dict(scan.read_all(paths, stats, {}, kinds, workers=1, now_ns=7))
    assert sorted(got) == paths and reader.read_here == 2
