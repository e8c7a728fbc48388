"""Bare DeepSpeed engine trees written by DeepSpeed itself, judged through the real CLI.

The trees come from tests/_write_deepspeed.py (deepspeed 0.19 on its CPU accelerator, gloo, 2 ranks, torch's AdamW;
ZeRO-2 with bf16, so its optimizer shards are bf16_zero_pp_rank_*, and ZeRO-3 in fp32; saves at steps 2, 4, 6, each
loaded back by DeepSpeed's own load_checkpoint at build time) and tests/_write_hf_deepspeed.py (transformers' Trainer
with a ZeRO-2 config, both saves resumed by Trainer), cached between sessions like the other writers. One defect per
test, on a copy. What DeepSpeed's own load does with each cut is in docs/layouts.md
(scripts/probe_deepspeed_load.py reproduces it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_json import age, codes_of, findings_of, invoke, scan_json, statuses
from conftest import build_cached, writer_key
from ranks import run_ranks

from ckpt_audit.rules import deepspeed as rules
from ckpt_audit.verify import verify

WRITER = Path(__file__).with_name("_write_deepspeed.py")
HF_WRITER = Path(__file__).with_name("_write_hf_deepspeed.py")
Z2_OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def optim(tag_dir: Path, rank: int) -> Path:
    """The optimizer shard of `rank` in a tag, either spelling (the ZeRO-2 tree is bf16: bf16_zero_pp_rank_*)."""
    [p] = tag_dir.glob("*" + Z2_OPTIM.format(rank))
    return p


def _write(writer: Path, dest: Path, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
    res = run_ranks(writer, str(dest), *args, env=env, cwd=dest.parent, timeout=900)  # 2 ranks, as torchrun starts
    assert res.returncode == 0, res.stderr[-3000:]


def _tree(tmp_path_factory, stage: int, *flags: str) -> Path:
    import deepspeed  # noqa: F401  the test extra installs it

    key = writer_key(WRITER, ("torch", "deepspeed"))
    tree = build_cached(
        tmp_path_factory,
        f"deepspeed_z{stage}{''.join(flags)}",
        lambda d: _write(WRITER, d / "ds", str(stage), *flags),
        key=key,
    )
    return tree / "ds"


@pytest.fixture(scope="session")
def ds_z2(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory, 2, "bf16")


@pytest.fixture(scope="session")
def ds_z3(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory, 3)


@pytest.fixture(scope="session")
def ds_z1(tmp_path_factory) -> Path:
    """ZeRO-1 fp32, global_step6 also converted by DeepSpeed's ds_to_universal (global_step6_universal/,
    latest_universal), resumed through latest_universal at build time."""
    return _tree(tmp_path_factory, 1, "universal")


@pytest.fixture(scope="session")
def ds_z0(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory, 0, "bf16")


@pytest.fixture(scope="session")
def hf_ds(tmp_path_factory) -> Path:
    """A transformers Trainer output directory with DeepSpeed ZeRO-2 on (checkpoint-2, -4), resumed by Trainer."""
    import deepspeed  # noqa: F401

    key = writer_key(HF_WRITER, ("torch", "deepspeed", "transformers", "accelerate"))
    return build_cached(tmp_path_factory, "hf_deepspeed", lambda d: _write(HF_WRITER, d / "out"), key=key) / "out"


@pytest.fixture(params=[2, 3], ids=["zero2", "zero3"])
def save_dir(request, tmp_path) -> Path:
    """A private copy of the ZeRO-2 or ZeRO-3 save directory, dated an hour back."""
    dst = tmp_path / "runs" / "ds"
    shutil.copytree(request.getfixturevalue(f"ds_z{request.param}"), dst)
    age(dst)
    return dst


# -- real trees through the CLI --------------------------------------------------------------------------------


@pytest.mark.slow
def test_engine_tree_is_recognised_complete_and_latest_names_its_tag(save_dir, tmp_path):
    doc = scan_json(save_dir.parent, tmp_path / "c.db")
    [run] = doc["runs"]
    assert run["layout"] == "deepspeed" and run["path"] == str(save_dir)
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "complete"}  # not unsafe: LossScaler & co are data
    assert doc["exit_code"] == 0 and run["tracker_step"] == 6
    assert {c["world_size"] for c in run["checkpoints"]} == {2}  # dp_world_size as the files record it
    res = invoke("latest", str(save_dir), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(save_dir / "global_step6")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_zero_0_and_1_trees_complete_and_a_missing_file_of_their_grid_is_incomplete(request, stage, tmp_path):
    # ZeRO-0 (bf16): model states alone, the optimizer inside them; ZeRO-1 (fp32): an optimizer shard per dp rank.
    # Each written tag loads back through load_checkpoint at build time; verify's deep checks pass on both.
    save_dir = tmp_path / "ds"
    shutil.copytree(request.getfixturevalue(f"ds_z{stage}"), save_dir)
    age(save_dir)
    doc = scan_json(save_dir, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "complete"} and doc["exit_code"] == 0
    names = sorted(p.name for p in (save_dir / "global_step4").iterdir())
    deep = [f.code for c in verify([save_dir]).runs[0].checkpoints for f in c.all_findings]
    # no deep check fails; the info codes name the universal copy and the tag latest_universal points at
    assert {c for c in deep if c.startswith("ds-")} <= {"ds-universal", "ds-latest-universal-target"}
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "complete"} and doc["exit_code"] == 0
    assert names == (
        ["mp_rank_00_model_states.pt"]
        if stage == 0
        else ["mp_rank_00_model_states.pt", *(Z2_OPTIM.format(r) for r in (0, 1))]
    )
    if stage == 0:  # the one file of a ZeRO-0 tag, from another step: loads without a word at the wrong step
        shutil.copy2(save_dir / "global_step2" / names[0], save_dir / "global_step4" / names[0])
    else:  # rank 1's optimizer shard: its load_checkpoint raises FileNotFoundError
        (save_dir / "global_step4" / names[-1]).unlink()
    age(save_dir)
    doc = scan_json(save_dir, tmp_path / "c.db")
    assert statuses(doc)[4] == ("corrupt" if stage == 0 else "incomplete")
    assert ("ds-mixed-shards" if stage == 0 else "ds-missing-shard") in codes_of(doc, 4)


@pytest.mark.slow
def test_missing_optimizer_shard_is_incomplete(save_dir, tmp_path):
    # DeepSpeed: rank 1's load_checkpoint(tag="global_step4") raises FileNotFoundError on that file
    shard = optim(save_dir / "global_step4", 1)
    shard.unlink()
    doc = scan_json(save_dir, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "incomplete", 6: "complete"}
    [f] = [f for f in findings_of(doc, 4) if f["code"] == "ds-missing-shard"]
    assert f["path"] == str(shard) and f["rank"] == 1


@pytest.mark.slow
def test_optimizer_shards_in_two_spellings_are_incomplete(ds_z2, tmp_path):
    # the bf16 engine opens bf16_zero_pp_rank_D_* for every rank (engine._get_all_zero_checkpoint_names with its own
    # bf16 mode): rank 1's shard under the plain name is missing to it
    save_dir = tmp_path / "ds"
    shutil.copytree(ds_z2, save_dir)
    shard = optim(save_dir / "global_step6", 1)
    assert shard.name.startswith("bf16_")
    shard.rename(shard.with_name(shard.name.removeprefix("bf16_")))
    age(save_dir)
    doc = scan_json(save_dir, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "incomplete"}
    assert {"ds-mixed-names", "ds-missing-shard"} <= codes_of(doc, 6)


@pytest.mark.slow
def test_stale_model_states_from_another_step_are_caught(save_dir, tmp_path):
    # DeepSpeed loads it without a word: the engine resumes at global_steps=4 with step 6's optimizer (ZeRO-3: rank 1
    # alone at 4, rank 0 at 6)
    name = (
        "mp_rank_00_model_states.pt"
        if (save_dir / "global_step6" / "mp_rank_00_model_states.pt").exists()
        else ("zero_pp_rank_1_mp_rank_00_model_states.pt")
    )
    shutil.copy2(save_dir / "global_step4" / name, save_dir / "global_step6" / name)
    age(save_dir)
    doc = scan_json(save_dir, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "corrupt"}
    [f] = [f for f in findings_of(doc, 6) if f["code"] == "ds-mixed-shards"]
    assert f["path"].endswith(name) and "global_steps=4" in f["message"]
    # latest names the stale tag: the run says so, and the gate answers the newest good one
    assert "ds-latest-dangling" in {f["code"] for f in doc["runs"][0]["findings"]}
    res = invoke("latest", str(save_dir), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(save_dir / "global_step4")


@pytest.mark.slow
def test_truncated_optimizer_shard_is_corrupt(ds_z2, tmp_path):
    # DeepSpeed: rank 1's torch.load of the shard raises (OSError: Invalid argument), the job dies
    save_dir = tmp_path / "ds"
    shutil.copytree(ds_z2, save_dir)
    shard = optim(save_dir / "global_step6", 1)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    age(save_dir)
    doc = scan_json(save_dir, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "corrupt"}
    assert "truncated" in codes_of(doc, 6)


@pytest.mark.slow
def test_tag_newer_than_latest_is_uncommitted_prune_keeps_it_and_missing_latest_is_said(ds_z2, tmp_path):
    # DeepSpeed: load_checkpoint(tag=None) loads the tag `latest` names (global_step4), never the newer one
    save_dir = tmp_path / "ds"
    shutil.copytree(ds_z2, save_dir)
    (save_dir / "latest").write_text("global_step4")
    age(save_dir)
    doc = scan_json(save_dir, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "uncommitted"}
    assert {f["code"] for f in doc["runs"][0]["findings"]} == {"ds-latest-behind"}
    # the gate answers the whole tag beyond the lagging `latest`, as for verl's tracker: a resume passes it as the tag
    res = invoke("latest", str(save_dir), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(save_dir / "global_step6")
    # fix-tracker's dry run would point `latest` at that tag (test_deepspeed_tracker.py writes it), no verl tracker
    res = invoke("fix-tracker", str(save_dir), catalog=tmp_path / "c.db")
    assert res.exit_code == 1 and "would write global_step6" in res.output
    assert (save_dir / "latest").read_text() == "global_step4" and not list(save_dir.glob("latest_*"))
    # prune keeps the tag `latest` names and the whole one beyond it; DeepSpeed's own files beside the tags stay
    res = invoke("prune", "--yes", "--keep-last", "1", str(save_dir), catalog=tmp_path / "c.db")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in save_dir.iterdir()) == [
        "global_step4",
        "global_step6",
        "latest",
        "zero_to_fp32.py",
        "zero_to_torch.py",
    ]
    # DeepSpeed without `latest`: load_checkpoint(tag=None) warns and returns (None, None): training from scratch
    (save_dir / "latest").unlink()
    doc = scan_json(save_dir, tmp_path / "c.db")
    assert statuses(doc) == {4: "complete", 6: "complete"}  # each still loads by its tag
    assert {f["code"] for f in doc["runs"][0]["findings"]} == {"ds-latest-missing"}


@pytest.mark.slow
def test_any_tag_name_is_a_checkpoint_filed_under_its_step(ds_z3, tmp_path):
    # load_checkpoint(tag=...) takes any directory name; OpenRLHF keeps best_global_stepN tags
    save_dir = tmp_path / "ds"
    shutil.copytree(ds_z3, save_dir)
    (save_dir / "global_step6").rename(save_dir / "final")  # a custom tag: step 6 as its files record
    (save_dir / "global_step4").rename(save_dir / "best_global_step4")
    (save_dir / "latest").write_text("final")
    age(save_dir)
    doc = scan_json(save_dir, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "complete"} and doc["exit_code"] == 0
    res = invoke("latest", str(save_dir), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(save_dir / "final")
    # a path at a best_ tag scans that checkpoint with its run
    doc = scan_json(save_dir / "best_global_step4", tmp_path / "c.db")
    assert statuses(doc) == {4: "complete"}
    # a custom tag without model states records no step: said, not judged, never pruned
    for p in (save_dir / "final").glob("*model_states.pt"):
        p.unlink()
    age(save_dir)
    doc = scan_json(save_dir, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete"}
    assert "ds-tag-unplaced" in {f["code"] for f in doc["runs"][0]["findings"]}
    res = invoke("prune", "--yes", "--keep-last", "1", str(save_dir), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and (save_dir / "final").is_dir()


@pytest.mark.slow
def test_a_mixed_root_judges_each_run_by_its_own_layout(verl_run, ds_z3, hf_ds, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(verl_run, root / "verl" / verl_run.name)
    shutil.copytree(ds_z3, root / "ds")
    shutil.copytree(hf_ds, root / "hf" / "out")
    age(root)
    doc = scan_json(root, tmp_path / "c.db")
    assert {Path(r["path"]).relative_to(root).as_posix(): r["layout"] for r in doc["runs"]} == {
        f"verl/{verl_run.name}": "verl-fsdp",
        "ds": "deepspeed",
        "hf/out": "hf-trainer",
    }
    assert {c["status"] for r in doc["runs"] for c in r["checkpoints"]} == {"complete"}


@pytest.mark.slow
def test_unreadable_latest_protects_every_tag_from_prune(ds_z2, tmp_path):
    """`latest` that cannot be read names an unknown tag: tracker-unread, never a dangling or missing `latest`, and
    prune deletes nothing (any tag may be the one a resume loads)."""
    from cli_proc import ckpt_audit, unprivileged

    if unprivileged() is None:
        pytest.skip("root without setpriv: chmod is not enforced")
    save_dir = tmp_path / "ds"
    shutil.copytree(ds_z2, save_dir)
    (save_dir / "latest").chmod(0)
    age(save_dir)
    catalog = tmp_path / "c.db"
    scan = ckpt_audit("scan", "--json", save_dir, catalog=catalog, as_user=True)
    doc = json.loads(scan.stdout)
    assert {f["code"] for f in doc["runs"][0]["findings"]} == {"tracker-unread", "unreadable"}, scan.stdout
    prune = ckpt_audit("prune", "--yes", "--keep-last", "1", save_dir, catalog=catalog, as_user=True)
    assert prune.returncode == 0, prune.stderr
    assert sorted(p.name for p in save_dir.glob("global_step*")) == ["global_step2", "global_step4", "global_step6"]


@pytest.mark.slow
def test_verify_loads_deepspeed_optimizer_states_without_importing_deepspeed(ds_z3):
    """verify's weights-only load admits LossScaler and ZeroStageEnum as inert records, DeepSpeed never imported."""
    shard = optim(ds_z3 / "global_step6", 0)
    code = (
        "import sys\nfrom ckpt_audit.deep import safe_load\n"
        f"r = safe_load.load({str(shard)!r})\n"
        "osd = r.value['optimizer_state_dict']\n"
        "assert r.loaded and not r.findings, r.findings\n"
        "assert osd['zero_stage'].args == (3,) and osd['loss_scaler'].state['cur_scale'] == 1.0\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'deepspeed']\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.slow
def test_trainer_checkpoint_with_deepspeed_is_complete_and_its_tag_judged_by_deepspeed_rules(hf_ds, tmp_path):
    out = tmp_path / "runs" / "out"
    shutil.copytree(hf_ds, out)
    age(out)
    doc = scan_json(out.parent, tmp_path / "c.db")
    [run] = doc["runs"]
    assert run["layout"] == "hf-trainer" and statuses(doc) == {2: "complete", 4: "complete"}
    res = invoke("latest", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(out / "checkpoint-4")
    # an export is the HF model alone: no global_step4/, no `latest`, no zero_to_fp32.py
    res = invoke("export", str(out / "checkpoint-4"), "--to", str(tmp_path / "hf"), catalog=tmp_path / "c.db")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        ".ckpt-audit-export.json",  # the export's lineage
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    # Trainer resumes with load_checkpoint(checkpoint-N, tag=None): without `latest` it raises ValueError, and a
    # missing optimizer shard fails that rank's load (FileNotFoundError)
    (out / "checkpoint-4" / "latest").unlink()
    (out / "checkpoint-2" / "global_step2" / Z2_OPTIM.format(1)).unlink()
    # a save cut before trainer_state.json: still Trainer's checkpoint, never a verl run of its own whose
    # global_step4/ would read as a misnamed, disposable husk
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    age(out)
    doc = scan_json(out, tmp_path / "c.db")  # (one run: statuses() unpacks exactly one)
    assert statuses(doc) == {2: "incomplete", 4: "incomplete"}
    assert {"hf-deepspeed-latest", "hf-missing-trainer-state"} <= codes_of(doc, 4)
    [f] = [f for f in findings_of(doc, 2) if f["code"] == "ds-missing-shard"]
    assert f["path"] == str(out / "checkpoint-2" / "global_step2" / Z2_OPTIM.format(1))


# -- the tag rules on what files record (pure) -----------------------------------------------------------------

Z2_META = {"ds_version": "0.19.8", "zero_stage": 2}


def _z2(dp: int, **model) -> dict:
    metas = {"mp_rank_00_model_states.pt": {**Z2_META, "global_steps": 6, "dp_world_size": dp, "mp_world_size": 1}}
    metas["mp_rank_00_model_states.pt"].update(model)
    for d in range(dp):
        metas[Z2_OPTIM.format(d)] = {**Z2_META, "partition_count": dp}
    return metas


def test_grid_comes_from_recorded_degrees_not_the_highest_index():
    metas = _z2(4)
    del metas[Z2_OPTIM.format(3)]  # the last rank's shard: no higher index says it should be there
    deg, found = rules.check_tag("/r/global_step6", 6, metas)
    assert deg == rules.Degrees(stage=2, dp=4, mp=1)
    assert [(f.code, f.rank) for f in found] == [("ds-missing-shard", 3)]
    # a leftover shard of a larger world is not taken for part of the save
    deg, found = rules.check_tag("/r/global_step6", 6, {**_z2(2), Z2_OPTIM.format(2): None})
    assert [(f.code, f.rank) for f in found] == [("ds-extra-shard", 2)]


def test_mixed_world_sizes_spellings_and_unknown_degrees_are_findings():
    metas = _z2(2)
    metas[Z2_OPTIM.format(1)] = {**Z2_META, "partition_count": 4}  # from a 4-rank save
    assert "ds-mixed-shards" in {f.code for f in rules.check_tag("/r/t", 6, metas)[1]}
    metas = _z2(2)
    metas["bf16_" + Z2_OPTIM.format(1)] = metas.pop(Z2_OPTIM.format(1))
    codes = [f.code for f in rules.check_tag("/r/t", 6, metas)[1]]
    assert "ds-mixed-names" in codes and "ds-missing-shard" in codes
    deg, found = rules.check_tag("/r/t", 6, {Z2_OPTIM.format(0): {"ds_version": "0.19.8"}})
    assert deg is None and [f.code for f in found] == ["ds-degrees-unknown"]
    # model states replaced by some other torch file (read, recording nothing): no mp degree, never complete
    deg, found = rules.check_tag("/r/t", 6, {**_z2(2), "mp_rank_00_model_states.pt": {}})
    assert deg is None and [f.code for f in found] == ["ds-degrees-unknown"]


def test_a_catalog_row_from_before_meta_is_read_again_only_for_deepspeed_files():
    from ckpt_audit.catalog.manifest import pt_from_json

    old = '{"prefix": "x", "n_tensors": 1, "n_dtensors": 0, "mesh_sizes": [], "top_keys": %s}'
    assert pt_from_json(old % '["model", "optimizer"]')[1] is True  # no re-read of every other torch file
    assert pt_from_json(old % '["optimizer_state_dict", "ds_config", "ds_version"]')[1] is False
    pt, whole = pt_from_json(old.replace("}", ', "meta": [["dp_world_size", 2]]}') % "[]")
    assert whole and pt.meta == (("dp_world_size", 2),)


@pytest.mark.slow
def test_trainer_checkpoints_under_deepspeed_as_trainer_resumes_them(hf_ds, tmp_path):
    """Cut from the real Trainer + ZeRO-2 run: checkpoint-4 as ZeRO-3 without gathered weights leaves it (Trainer's
    save_model catches the ValueError, removes the empty model.safetensors it wrote, saves DeepSpeed's state:
    Trainer resumes it, from_pretrained cannot load it); checkpoint-2 as `save_only_model=True` leaves it (weights
    and trainer_state.json only: under DeepSpeed, Trainer's resume raises "Can't find a valid checkpoint"); and a
    2-process save whose rank 1 RNG file is missing (transformers writes rng_state_R.pth per process)."""
    from transformers import GPT2LMHeadModel

    out = tmp_path / "runs" / "out"
    shutil.copytree(hf_ds, out)
    (out / "checkpoint-4" / "model.safetensors").unlink()
    with pytest.raises(OSError):  # what loading the folder as a model does
        GPT2LMHeadModel.from_pretrained(out / "checkpoint-4")
    two = out / "checkpoint-2"
    for p in [two / "latest", two / "scheduler.pt", two / "rng_state.pth", two / "zero_to_fp32.py"]:
        p.unlink()
    shutil.rmtree(two / "global_step2")
    age(out)
    doc = scan_json(out, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete"}
    assert "hf-deepspeed-no-weights" in codes_of(doc, 4) and "hf-model-only" in codes_of(doc, 2)
    res = invoke("latest", str(out), catalog=tmp_path / "c.db")  # the weights-only one is no resume point
    assert res.exit_code == 0 and res.stdout.strip() == str(out / "checkpoint-4"), res.output
    # rank 0's rng_state_0.pth alone, where DeepSpeed's state records 2 processes
    (out / "checkpoint-4" / "rng_state.pth").rename(out / "checkpoint-4" / "rng_state_0.pth")
    age(out)
    doc = scan_json(out, tmp_path / "c.db")
    [f] = [f for f in findings_of(doc, 4) if f["code"] == "hf-missing-rng-state"]
    assert f["path"] == str(out / "checkpoint-4" / "rng_state_1.pth") and f["rank"] == 1


def test_a_shard_of_another_world_size_is_the_one_blamed():
    # the real cut (ZeRO-1, rank 0's shard from a 1-rank save in a 2-rank tag): rank 0's load_checkpoint raises
    # RuntimeError (size of tensor a (106) must match the size of tensor b (212)), rank 1 loads (docs/layouts.md)
    metas = _z2(2)
    metas[Z2_OPTIM.format(0)] = {**Z2_META, "partition_count": 1}
    found = rules.check_tag("/r/global_step6", 6, metas)[1]
    assert [(f.code, f.rank) for f in found] == [("ds-mixed-shards", 0)]


@pytest.mark.slow
def test_a_universal_checkpoint_is_judged_as_the_universal_load_reads_it(ds_z1, tmp_path):
    # global_step6_universal: model states plus zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt and
    # zero/optimizer_state.pt, no optimizer shards; an engine with checkpoint.load_universal reads latest_universal
    save_dir = tmp_path / "ds"
    shutil.copytree(ds_z1, save_dir)
    uni = save_dir / "global_step6_universal"
    age(save_dir)
    doc = scan_json(save_dir, tmp_path / "c.db")
    [run] = doc["runs"]
    got = {Path(c["path"]).name: (c["status"], [f["code"] for f in c["findings"]]) for c in run["checkpoints"]}
    assert got[uni.name] == ("complete", ["ds-universal", "ds-latest-universal-target"])
    assert got["global_step6"] == ("complete", []) and not run["findings"]
    # training went on past the conversion (the run as the scan judged it, `latest` moved on to a later step): the
    # tag latest_universal names stays a tracker target (it was `not-kept`, deleted), the plain global_step6 does not
    from dataclasses import replace

    from ckpt_audit.lifecycle.retention import KeepLast, Policy, Reason, plan_prune
    from ckpt_audit.scan import scan

    [scanned] = scan([save_dir]).runs
    plan = plan_prune([replace(scanned, tracker_step=8)], Policy(rules=(KeepLast(n=1),)), now_ns=time.time_ns())
    kept = {Path(i.path).name: i.reasons for i in plan.keep}
    assert kept[uni.name] == (Reason.TRACKER_TARGET,) and Reason.TRACKER_TARGET not in kept["global_step6"]
    # a plain engine's `latest` never names it: fix-tracker points a missing `latest` at global_step6 (the universal
    # tag sorts after it at the same step)
    (save_dir / "latest").unlink()
    res = invoke("fix-tracker", str(save_dir), catalog=tmp_path / "c.db")
    assert res.exit_code == 1 and "would write global_step6 (" in res.output, res.output
    # the universal load asserts zero/optimizer_state.pt; a parameter folder short of a file resumes without it
    (uni / "zero" / "optimizer_state.pt").unlink()
    (uni / "zero" / "0.bias" / "exp_avg.pt").unlink()
    (save_dir / "latest_universal").write_text("global_step8_universal")
    age(save_dir)
    doc = scan_json(save_dir, tmp_path / "c.db")
    [run] = doc["runs"]
    [c] = [c for c in run["checkpoints"] if c["path"] == str(uni)]
    assert c["status"] == "incomplete"
    assert {f["path"] for f in c["findings"] if f["code"] == "ds-missing-shard"} == {
        str(uni / "zero" / "optimizer_state.pt"),
        str(uni / "zero" / "0.bias" / "exp_avg.pt"),
    }
    [f] = [f for f in run["findings"] if f["code"] == "ds-latest-dangling"]
    assert f["path"] == str(save_dir / "latest_universal") and "global_step8_universal" in f["message"]
