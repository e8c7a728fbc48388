"""Finding codes that no test asserted before (see test_codes_asserted.py), each on a small real tree: shards written
by torch.save, DCP directories written by a single-process torch.distributed.checkpoint.save, real metric logs, and
for DTensor properties a copy of the reference trainer's tree.

Each test starts from a tree that verifies clean (or from the same tree unbroken) and breaks one property, so the
finding is the break's and not the tree's.
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from scan_trees import write_torch_tree

from ckpt_audit.continuity import read_metrics
from ckpt_audit.continuity.audit import audit_log
from ckpt_audit.models import Status
from ckpt_audit.verify import verify


def verdict(root: Path) -> tuple[set[str], list[Status]]:
    """Every finding code verify reports under `root`, and each checkpoint's status."""
    result = verify([root])
    codes = {f.code for r in result.runs for c in r.checkpoints for f in c.all_findings}
    return codes | {f.code for f in result.findings}, [c.status for r in result.runs for c in r.checkpoints]


def new_codes(broken: Path, clean: Path) -> set[str]:
    return verdict(broken)[0] - verdict(clean)[0]


@pytest.fixture(autouse=True)
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves without a process group
        yield


# -- FSDP shards from torch.save ------------------------------------------------------------------------------


def test_scheduler_behind_the_step(tmp_path):
    clean, run = write_torch_tree(tmp_path / "a"), write_torch_tree(tmp_path / "b")
    actor = run / "global_step_6" / "actor"
    for r in (0, 1):
        state = {"lr_scheduler": {"last_epoch": 5}, "rng": {"cpu": torch.get_rng_state()}}  # saved at step 6
        torch.save(state, actor / f"extra_state_world_size_2_rank_{r}.pt")
    assert new_codes(run, clean) == {"lr-scheduler-behind"}


def test_optimizer_step_behind_the_scheduler(tmp_path):
    clean, run = write_torch_tree(tmp_path / "a"), write_torch_tree(tmp_path / "b")
    actor = run / "global_step_6" / "actor"
    for r in (0, 1):
        state = {"step": torch.tensor(5.0), "exp_avg": torch.zeros(64, 32)}  # the scheduler says 6
        optim = {"state": {0: state}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
        torch.save(optim, actor / f"optim_world_size_2_rank_{r}.pt")
    assert new_codes(run, clean) == {"optimizer-step-behind"}


def test_plain_tensor_shards_of_different_shapes(tmp_path):
    clean, run = write_torch_tree(tmp_path / "a"), write_torch_tree(tmp_path / "b")
    p = run / "global_step_6" / "actor" / "model_world_size_2_rank_1.pt"
    sd = torch.load(p, weights_only=True)
    sd["model.embed.weight"] = sd["model.embed.weight"][:60].clone()  # rank 0 holds 64 rows
    torch.save(sd, p)
    assert new_codes(run, clean) == {"global-shape-mismatch"}


def test_a_raw_pickle_is_not_loaded(tmp_path):
    clean, run = write_torch_tree(tmp_path / "a"), write_torch_tree(tmp_path / "b")
    (run / "global_step_6" / "data.pt").write_bytes(pickle.dumps({"_num_yielded": 6}))
    assert new_codes(run, clean) == {"raw-pickle", "not-loadable"}


# -- plain DCP and Megatron dist_ckpt -------------------------------------------------------------------------

STATE = {"model.decoder.weight": torch.arange(12.0).reshape(3, 4), "optimizer.state.exp_avg": torch.zeros(3, 4)}


def plain_dcp(root: Path) -> Path:
    step = root / "run" / "step-10"
    dcp.save(dict(STATE), checkpoint_id=str(step))
    assert sorted(p.name for p in step.iterdir()) == [".metadata", "__0_0.distcp"]
    return step


def megatron(root: Path, state: dict | None = None) -> Path:
    """verl's Megatron layout: global_step_N/actor/dist_ckpt/{.metadata, __0_0.distcp, common.pt, metadata.json}."""
    run = root / "demo" / "exp"
    dist = run / "global_step_10" / "actor" / "dist_ckpt"
    dcp.save(dict(state or STATE), checkpoint_id=str(dist))
    torch.save({"lr_scheduler": {"last_epoch": 10}}, dist / "common.pt")
    (dist / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "common_backend": "torch"}))
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    return dist


def test_the_small_trees_verify_clean(tmp_path):
    assert verdict(plain_dcp(tmp_path / "p").parent) == (set(), [Status.COMPLETE])
    assert verdict(megatron(tmp_path / "m").parents[3]) == ({"megatron-old-layout"}, [Status.COMPLETE])


def test_dcp_metadata_without_data_files(tmp_path):
    step = plain_dcp(tmp_path)
    (step / "__0_0.distcp").unlink()
    codes, statuses = verdict(step.parent)
    assert "dcp-no-data" in codes and statuses != [Status.COMPLETE]


def test_dcp_data_file_the_metadata_does_not_name(tmp_path):
    step = plain_dcp(tmp_path)
    (step / "__1_0.distcp").write_bytes((step / "__0_0.distcp").read_bytes())
    assert verdict(step.parent)[0] == {"dcp-unreferenced-file"}


def test_dcp_chunk_without_a_storage_entry(tmp_path):
    step = plain_dcp(tmp_path)
    with open(step / ".metadata", "rb") as f:
        meta = pickle.load(f)  # the test's own fresh save, not a scanned file
    del meta.storage_data[next(k for k in meta.storage_data if k.fqn == "model.decoder.weight")]
    with open(step / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    assert verdict(step.parent) == ({"dcp-chunk-unstored"}, [Status.CORRUPT])


def test_megatron_dist_ckpt_without_dcp_metadata(tmp_path):
    dist = megatron(tmp_path)
    (dist / ".metadata").unlink()
    assert verdict(dist.parents[3]) == ({"dcp-metadata-missing", "megatron-old-layout"}, [Status.INCOMPLETE])


def test_megatron_without_common_pt(tmp_path):
    dist = megatron(tmp_path)
    (dist / "common.pt").unlink()
    assert verdict(dist.parents[3]) == ({"megatron-common-missing", "megatron-old-layout"}, [Status.INCOMPLETE])


def test_megatron_without_model_state_or_hf_weights(tmp_path):
    dist = megatron(tmp_path, {"optimizer.state.exp_avg": torch.zeros(3, 4)})
    assert verdict(dist.parents[3]) == ({"megatron-model-missing", "megatron-old-layout"}, [Status.INCOMPLETE])


# -- DTensor shards from the reference trainer -----------------------------------------------------------------


def _rewrite(path: Path, change) -> None:
    """Load with weights_only, change, save under the same name (the zip's record prefix is the file's stem) from a
    side directory, then rename over: never write into a file that is mmapped."""
    sd = torch.load(path, weights_only=True)
    change(sd)
    side = path.parent / ".rewrite"
    side.mkdir(exist_ok=True)
    torch.save(sd, side / path.name)
    (side / path.name).replace(path)
    side.rmdir()


def _newest_actor(run: Path) -> Path:
    return max(run.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1])) / "actor"


def test_a_dtensor_on_one_rank_is_a_plain_tensor_on_another(verl_run, copy_run):
    run = copy_run(verl_run)
    assert verdict(run)[0] == set()
    shard = _newest_actor(run) / "model_world_size_2_rank_1.pt"
    key = next(k for k, v in torch.load(shard, weights_only=True).items() if hasattr(v, "placements"))
    _rewrite(shard, lambda sd: sd.update({key: sd[key].to_local().clone()}))
    assert "dtensor-mismatch" in verdict(run)[0]


def test_a_mesh_with_dimension_names_verl_does_not_use(verl_run, copy_run):
    run = copy_run(verl_run)

    def rename(sd):
        for v in sd.values():
            if hasattr(v, "placements"):
                v.device_mesh._mesh_dim_names = ("shard",)  # verl: ("fsdp",) or ("ddp", "fsdp")

    for shard in sorted(_newest_actor(run).glob("model_world_size_*")):
        _rewrite(shard, rename)
    assert verdict(run)[0] == {"mesh-names-unknown"}


# -- continuity on real metric logs ---------------------------------------------------------------------------


def _log(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_too_few_points_before_a_resume_is_no_verdict(tmp_path):
    log = _log(tmp_path / "m.jsonl", [{"step": s, "loss": 2.0 / s} for s in range(1, 30)])
    res = audit_log(read_metrics([log]), resume_at=[3])
    assert [f.code for f in res.findings] == ["metric-window-short"]
    assert not res.points[0].judgement.sufficient


def test_an_attempt_that_logged_no_training_step(tmp_path):
    first = _log(tmp_path / "1.jsonl", [{"step": s, "loss": 2.0 / s} for s in range(1, 21)])
    second = _log(tmp_path / "2.jsonl", [{"step": 20, "val/score": 0.5}])  # validation at the resume, then exit
    assert [f.code for f in audit_log(read_metrics([first])).findings] == []
    [f] = audit_log(read_metrics([first, second])).findings
    assert f.code == "resume-trained-nothing" and f.path == second
