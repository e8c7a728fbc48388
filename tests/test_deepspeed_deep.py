"""verify's DeepSpeed deep checks (ckpt_audit/deep/deepspeed_check.py) and DeepSpeed trees on node-local disks, on
copies of the trees DeepSpeed 0.19.8 itself writes (tests/test_deepspeed.py's cached fixtures). One defect per test.

What DeepSpeed's own load does with a stale optimizer shard (scripts/probe_deepspeed_load.py, ZeRO-3, rank 0's shard
of global_step6 replaced by global_step2's): both ranks load without a word, the engine at global_steps 6 with one
rank's Adam moments and step from step 2. Only verify's step check sees it: the shard records no global_steps.
"""

from __future__ import annotations

import os
import shutil
import struct
import time
import zipfile
from pathlib import Path

import pytest
from cli_json import age, invoke
from test_cluster_nodes import IDS, node_scan
from test_deepspeed import ds_z2, ds_z3, hf_ds, optim  # noqa: F401  (the session fixtures and a helper)

from ckpt_audit.deep import deepspeed_check
from ckpt_audit.models import Status
from ckpt_audit.verify import verify

pytestmark = pytest.mark.slow


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "runs" / "ds"
    shutil.copytree(src, dst)
    age(dst)
    return dst


def _verified(root: Path) -> dict[int, tuple[Status, list]]:
    [run] = verify([root]).runs
    return {c.step: (c.status, c.all_findings) for c in run.checkpoints}


@pytest.mark.parametrize("fixture", ["ds_z2", "ds_z3", "hf_ds"])
def test_clean_trees_pass_the_deep_checks(request, fixture, tmp_path):
    root = _copy(request.getfixturevalue(fixture), tmp_path)
    got = _verified(root)
    assert {s for s, _ in got.values()} == {Status.COMPLETE}
    assert not [f for _, fs in got.values() for f in fs if f.code.startswith("ds-")]


@pytest.mark.parametrize("fixture, rank", [("ds_z2", 1), ("ds_z3", 0)])
def test_an_optimizer_shard_from_another_step_is_corrupt(request, fixture, rank, tmp_path):
    # same world size, same names: nothing the scan reads differs (it is complete to scan), the AdamW step does
    root = _copy(request.getfixturevalue(fixture), tmp_path)
    stale = optim(root / "global_step6", rank)
    shutil.copy2(optim(root / "global_step2", rank), stale)
    age(root)
    assert invoke("scan", str(root), catalog=tmp_path / "c.db").exit_code == 0
    got = _verified(root)
    assert got[6][0] is Status.CORRUPT and got[4][0] is Status.COMPLETE
    [f] = [f for f in got[6][1] if f.code == "ds-optim-step-mismatch"]
    assert f.path == str(stale) and f.rank == rank and "optimizer step 2, the tag's other shards 6" in f.message
    res = invoke("verify", str(root), catalog=tmp_path / "c.db")
    assert res.exit_code == 1 and "ds-optim-step-mismatch" in res.output
    res = invoke("latest", "--verified", "--print", "tag", str(root), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout == "global_step4\n", res.output


def _rewrite(path: Path, change) -> None:
    """Load a shard with DeepSpeed importable (the test's own process, never ckpt-audit), change it, save it whole."""
    import deepspeed  # noqa: F401  its classes unpickle as themselves
    import torch

    sd = torch.load(path, weights_only=False)
    change(sd)
    torch.save(sd, path)


def test_flat_partitions_that_do_not_cover_param_shapes_are_corrupt(ds_z2, tmp_path):  # noqa: F811
    root = _copy(ds_z2, tmp_path)
    for r in (0, 1):  # both ranks 4 elements short: equal sizes, but 208 elements for 212 parameters

        def cut(sd):
            groups = sd["optimizer_state_dict"]["single_partition_of_fp32_groups"]
            groups[0] = groups[0][:-2].clone()

        _rewrite(optim(root / "global_step4", r), cut)
    age(root)
    got = _verified(root)
    assert got[4][0] is Status.CORRUPT and got[6][0] is Status.COMPLETE
    [f] = [f for f in got[4][1] if f.code == "ds-partition-mismatch"]
    assert "hold 208 elements, param_shapes need 212" in f.message
    # one rank's partition of another size
    _rewrite(optim(root / "global_step6", 1), cut)
    age(root)
    [f] = [f for f in _verified(root)[6][1] if f.code == "ds-partition-mismatch"]
    assert f.path == str(optim(root / "global_step6", 1)) and f.rank == 1


def test_zero3_copies_of_one_tensor_that_differ_are_corrupt(ds_z3, tmp_path):  # noqa: F811
    # ZeRO-3: each dp rank writes the module's non-partitioned tensors (a buffer here) into its own model states
    root = _copy(ds_z3, tmp_path)
    import torch

    for r, value in ((0, 1.0), (1, 2.0)):

        def add(sd, value=value):
            sd["module"]["norm.running_mean"] = torch.full((4,), value)
            sd["buffer_names"] = ["norm.running_mean"]

        _rewrite(root / "global_step4" / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", add)
    age(root)
    got = _verified(root)
    assert got[4][0] is Status.CORRUPT
    [f] = [f for f in got[4][1] if f.code == "ds-replica-mismatch"]
    assert f.tensor == "norm.running_mean" and f.rank == 1


def test_tp_replicated_parameters_are_compared_only_when_the_checkpoint_names_them():
    a = deepspeed_check.ModelStates("/t/mp_rank_00_model_states.pt", None, 0, 6, ((4,),), {"ln.weight": "x"})
    b = deepspeed_check.ModelStates("/t/mp_rank_01_model_states.pt", None, 1, 6, ((4,),), {"ln.weight": "y"})
    [f] = deepspeed_check.check_copies([a, b])
    assert (f.code, f.path, f.rank) == ("ds-replica-mismatch", b.path, 1)
    assert deepspeed_check.check_copies([a, deepspeed_check.ModelStates(b.path, None, 1, 6, ((4,),), {})]) == []


# -- node-local storage ------------------------------------------------------------------------------------------


def _node_local(save_dir: Path, base: Path) -> list[Path]:
    """What use_node_local_storage writes with 2 nodes of 1 rank: each node's local rank 0 writes the model states,
    `latest` and the converters; each rank its own optimizer shard, on its own node."""
    dirs = [base / "node0", base / "node1"]
    for i, d in enumerate(dirs):
        for f in sorted(p for p in save_dir.rglob("*") if p.is_file()):
            rel = f.relative_to(save_dir)
            if "_optim_states" in f.name and f"zero_pp_rank_{i}_" not in f.name:
                continue
            (d / "ds" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, d / "ds" / rel)
    return [d / "ds" for d in dirs]


def test_node_local_saves_are_judged_as_their_union_and_differing_latest_is_reported(ds_z2, tmp_path, monkeypatch):  # noqa: F811
    dirs = _node_local(ds_z2, tmp_path)
    result = node_scan(monkeypatch, dirs, now_ns=time.time_ns() + 3600 * 10**9, nodes=IDS[:2])
    [run] = result.runs
    assert run.layout == "deepspeed" and {c.step: c.status for c in run.checkpoints} == {
        2: Status.COMPLETE,
        4: Status.COMPLETE,
        6: Status.COMPLETE,
    }
    assert run.tracker_step == 6 and not [f for f in result.all_findings if f.code == "replica-differs"]
    # node 1's `latest` still names global_step4 (its rank 0 died before rewriting it): its rank resumes there
    (dirs[1] / "latest").write_text("global_step4")
    result = node_scan(monkeypatch, dirs, now_ns=time.time_ns() + 3600 * 10**9, nodes=IDS[:2])
    [run] = result.runs
    [told] = [f for f in run.findings if f.code == "replica-differs"]
    assert told.path == f"{dirs[0]}/latest"
    assert told.message == f"the tracker differs between nodes: node {IDS[0]}: step 6; node {IDS[1]}: step 4"
    assert {c.step for c in run.checkpoints if any(f.code == "replica-differs" for f in c.findings)} == {4, 6}


def test_a_bit_flipped_shard_is_corrupt_though_deepspeed_loads_it(ds_z3, tmp_path):  # noqa: F811
    # DeepSpeed (scripts/probe_deepspeed_load.py): both ranks load rank 1's optimizer shard with one bit flipped in
    # a tensor's bytes, without a word; the zip entry's CRC-32 says the bytes are not what was written
    root = _copy(ds_z3, tmp_path)
    shard = optim(root / "global_step6", 1)
    with zipfile.ZipFile(shard) as z:  # the largest tensor's bytes: the fp32 partition or a moment
        entry = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(shard.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[entry.header_offset + 26 : entry.header_offset + 30])
    data[entry.header_offset + 30 + name_len + extra_len + entry.file_size // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    age(root)
    got = _verified(root)
    assert got[6][0] is Status.CORRUPT and got[4][0] is Status.COMPLETE
    assert any(f.code == "crc-mismatch" and f.path == str(shard) for f in got[6][1])


def test_prune_rereads_the_surviving_tag_and_deletes_nothing_when_it_changed(ds_z2, tmp_path):  # noqa: F811
    """Bit rot in the newest tag after the nightly scan (size and mtime kept): prune's survivor re-read by content
    finds it before anything older goes, as for verl's runs, and the recomputed plan keeps global_step4, now the
    newest whole tag (read again too), deleting only global_step2."""
    root = _copy(ds_z2, tmp_path)
    db = tmp_path / "c.db"
    assert invoke("scan", str(root), catalog=db).exit_code == 0
    shard = optim(root / "global_step6", 0)
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = invoke("prune", "--yes", "--keep-last", "1", str(root), catalog=db)
    assert res.exit_code == 1 and "FAILED re-read: step 6" in res.output and "plan recomputed" in res.output
    assert sorted(p.name for p in root.glob("global_step*")) == ["global_step4", "global_step6"]
