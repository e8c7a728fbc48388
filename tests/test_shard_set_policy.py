"""One policy for "which shard set of a role directory is the checkpoint" (`rules.shards.current_world_size`): the
scan judges that set and export reads it. Before the merge, export refused a role directory holding two sets and
no fsdp_config.json while the scan judged the newest set; now both take the newest (or the one the config names).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from cli_proc import ckpt_audit

from ckpt_audit.rules.shards import current_world_size


def test_policy_config_first_then_the_only_set_then_the_newest():
    assert current_world_size({2: 10, 1: 20}, 2) == 2  # the config names a set that exists
    assert current_world_size({2: 10, 1: 20}, 4) == 1  # it names none of them: the newest
    assert current_world_size({2: 10, 1: 20}, None) == 1
    assert current_world_size({2: 30, 1: 20}, None) == 2
    assert current_world_size({2: 10}, 1) == 2  # one set is the set, whatever the config says
    assert current_world_size({None: 10, 2: 5}, None) is None  # v0.2-era names, newest
    assert current_world_size({}, 2) is None


@pytest.mark.parametrize("keep_config, expected", [(False, 1), (True, 2)])
def test_scan_and_export_take_the_same_shard_set(verl_run, verl_run_w1, copy_run, tmp_path, keep_config, expected):
    """A run resumed at world size 1 wrote a W=1 set beside the trainer's W=2 set (newer by mtime)."""
    run = copy_run(verl_run)
    actor = run / "global_step_4" / "actor"
    for src in sorted((verl_run_w1 / "global_step_4" / "actor").glob("*_world_size_1_rank_0.pt")):
        shutil.copy2(src, actor / src.name)
        os.utime(actor / src.name)  # written after the W=2 set
    if not keep_config:
        (actor / "fsdp_config.json").unlink()  # world_size 2: when present, it names the set
    catalog = tmp_path / "c.db"

    scan = ckpt_audit("scan", run.parent.parent, "--json", catalog=catalog)
    assert scan.returncode == 0, scan.stderr
    (ckpt,) = [c for r in json.loads(scan.stdout)["runs"] for c in r["checkpoints"] if c["step"] == 4]
    (comp,) = ckpt["components"]
    assert (ckpt["status"], comp["world_size"]) == ("complete", expected)
    stale = [f["message"] for f in comp["findings"] if f["code"] == "stale-world-size"]
    other, n_other = {1: (2, 6), 2: (1, 3)}[expected]  # model, optim, extra_state per rank
    assert stale == [f"{n_other} shard file(s) for world size {other} sit beside the world size {expected} set"]

    export = ckpt_audit("export", run / "global_step_4", "--to", tmp_path / "out", "--json", catalog=catalog)
    assert export.returncode == 0, export.stderr
    assert json.loads(export.stdout)["world_size"] == expected == comp["world_size"]
