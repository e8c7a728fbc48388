"""The gate and the repair on saves written in verl's own order, and on a Megatron run.

verl's FSDP save (docs/verl-format.md §1.2): every rank writes model, optim, extra_state to their final names,
rank 0 writes fsdp_config.json, the driver writes data.pt, then the tracker, last. With FSDP `async_save` the
tracker is never written (verl #7952). A Megatron run keeps the tracker in the run directory too, with
dist_ckpt/metadata.json written last inside each checkpoint (§2.1), and its async queue may publish the tracker and
the HDFS copy first (verl #8000). Each stage is checked through the real CLI.
"""

from __future__ import annotations

import json
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest
from _verl_megatron_v2 import migrate
from cli_proc import ckpt_audit
from scan_trees import steps_of
from test_resume_gate import TRACKER, age, set_tracker


@pytest.fixture
def run(verl_run, copy_run) -> Path:
    run = Path(copy_run(verl_run))
    age(run)
    return run


def save_step_8_in_verl_order(run: Path):
    """Yield after each write of a new global_step_8 made from step 6's files, in the order verl writes them."""
    src, dst = run / "global_step_6", run / "global_step_8"
    (dst / "actor").mkdir(parents=True)
    yield "mkdir"
    for kind in ("model", "optim", "extra_state"):
        for p in sorted((src / "actor").glob(f"{kind}_world_size_*_rank_*.pt")):
            shutil.copyfile(p, dst / "actor" / p.name)
        yield kind
    shutil.copyfile(src / "actor" / "fsdp_config.json", dst / "actor" / "fsdp_config.json")
    shutil.copytree(src / "actor" / "huggingface", dst / "actor" / "huggingface")
    yield "fsdp_config"
    shutil.copyfile(src / "data.pt", dst / "data.pt")
    yield "data.pt"


def latest(run: Path, db: Path) -> dict:
    return json.loads(ckpt_audit("latest", "--json", run, catalog=db).stdout)


def test_sync_save_is_the_answer_only_once_the_tracker_names_it(run, tmp_path):
    db = tmp_path / "c.db"
    for stage in save_step_8_in_verl_order(run):
        doc = latest(run, db)
        assert doc["step"] == 6, stage  # a save under way is never the answer
        assert doc["passed_over"][0]["step"] == 8 and doc["passed_over"][0]["status"] == "in-progress"
    (run / TRACKER).write_text("8")  # verl's last write
    doc = latest(run, db)
    assert doc["step"] == 8 and doc["passed_over"] == []
    fix = ckpt_audit("fix-tracker", "--json", run, catalog=db)
    assert fix.returncode == 0 and json.loads(fix.stdout)["problem"] == "ok"  # nothing to repair


def test_async_save_never_writes_the_tracker(run, tmp_path):
    """FSDP async_save: the save finishes, the tracker still says 6; once the files settle step 8 is whole."""
    db = tmp_path / "c.db"
    for _ in save_step_8_in_verl_order(run):
        pass
    assert latest(run, db)["step"] == 6  # settling: still in-progress
    age(run)
    doc = json.loads(ckpt_audit("scan", "--json", run, catalog=db).stdout)
    behind = [f for r in doc["runs"] for f in r["findings"] if f["code"] == "tracker-behind"]
    assert behind and "step 8" in behind[0]["message"]
    assert latest(run, db)["step"] == 8  # whole beyond a lagging tracker
    fix = json.loads(ckpt_audit("fix-tracker", "--json", "--yes", run, catalog=db).stdout)
    assert (fix["problem"], fix["new_step"], fix["written"]) == ("behind", 8, True)
    assert (run / TRACKER).read_text() == "8"


def test_async_save_of_a_fresh_run_has_no_tracker_at_all(run, tmp_path):
    set_tracker(run, None)
    for older in steps_of(run)[:-1]:
        shutil.rmtree(older)
    age(run)
    db = tmp_path / "c.db"
    doc = json.loads(ckpt_audit("scan", "--json", run, catalog=db).stdout)
    [f] = [f for r in doc["runs"] for f in r["findings"] if f["code"] == "untracked-complete"]
    assert "step 6" in f["message"]
    assert ckpt_audit("fix-tracker", "--yes", run, catalog=db).returncode == 0
    assert (run / TRACKER).read_text() == "6"


# ------------------------------------------------------------------------------------------ Megatron


def test_fix_tracker_writes_no_verl_tracker_into_a_plain_dcp_run(dcp_trees, tmp_path):
    """torch.distributed.checkpoint writes no tracker: fix-tracker wrote verl's into a plain DCP run (--yes then
    failed re-listing it, exit 3). Refused like torchtitan's, dry run or not: exit 1, one line, nothing written."""
    run = tmp_path / "dcp" / "checkpoint"
    shutil.copytree(dcp_trees["dcp"], run / "ckpt_1")
    age(run)
    for yes in ((), ("--yes",)):
        out = ckpt_audit("fix-tracker", *yes, run, catalog=tmp_path / "c.db")
        assert out.returncode == 1, out.stderr
        [line] = out.stderr.strip().splitlines()
        assert line.endswith(
            "not fixed: a plain DCP run has no tracker (torch.distributed.checkpoint writes none; the "
            "training script names the directory it loads): pass `ckpt-audit latest` to it instead"
        )
    assert sorted(p.name for p in run.iterdir()) == ["ckpt_1"]


@pytest.fixture(scope="module")
def megatron_tree(dcp_trees) -> Path:
    return dcp_trees["megatron"]  # tests/conftest.py: one cached gloo run per session


@pytest.fixture
def megatron(megatron_tree, tmp_path) -> Path:
    dst = tmp_path / "m" / "megatron" / "exp"
    shutil.copytree(megatron_tree, dst)
    age(dst)
    return dst


def test_megatron_tracker_repair_and_gate(megatron, tmp_path):
    db = tmp_path / "c.db"
    step = megatron / "global_step_1"
    # the tree is in the pre-v2 layout, which verl >= 0.9.1 refuses: no answer until verl's own script migrates it
    gate = ckpt_audit("latest", megatron, catalog=db)
    assert gate.returncode == 1 and "megatron-old-layout" in gate.stderr
    if find_spec("verl") is None:
        return
    migrate(step / "actor")
    age(megatron)
    assert ckpt_audit("latest", megatron, catalog=db).stdout.strip() == str(step)
    set_tracker(megatron, None)
    doc = json.loads(ckpt_audit("scan", "--json", megatron, catalog=db).stdout)
    assert doc["runs"][0]["checkpoints"][0]["status"] == "complete"
    assert "untracked-complete" in [f["code"] for f in doc["runs"][0]["findings"]]
    fix = ckpt_audit("fix-tracker", "--yes", megatron, catalog=db)
    assert fix.returncode == 0, fix.stderr
    assert (megatron / TRACKER).read_text() == "1"


def test_megatron_published_before_finalize_with_a_remote_copy(megatron, tmp_path):
    """The async queue published the tracker and the HDFS copy; metadata.json (written last) is not there yet."""
    db = tmp_path / "c.db"
    (megatron / "config.yaml").write_text("trainer:\n  default_hdfs_dir: hdfs://nn/user/me/exp\n")
    next(megatron.glob("global_step_1/actor/dist_ckpt/metadata.json")).unlink()
    age(megatron)
    doc = json.loads(ckpt_audit("scan", "--json", megatron, catalog=db).stdout)
    [remote] = [f for f in doc["runs"][0]["findings"] if f["code"] == "remote-copy-unfinished"]
    assert "hdfs://nn/user/me/exp" in remote["message"]
    gate = ckpt_audit("latest", megatron, catalog=db)
    assert gate.returncode == 1 and "megatron-metadata-missing" in gate.stderr
    fix = ckpt_audit("fix-tracker", "--yes", megatron, catalog=db)
    assert fix.returncode == 1 and "no complete checkpoint" in fix.stderr
    assert (megatron / TRACKER).read_text() == "1"  # left as it was: there is nothing better to name
