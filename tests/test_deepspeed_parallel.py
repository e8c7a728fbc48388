"""DeepSpeed MoE and pipeline checkpoints: expert and layer files counted against what the model states record.

The trees come from tests/_write_deepspeed_parallel.py (deepspeed 0.19 on its CPU accelerator, gloo, 2 ranks, torch's
AdamW; each resumed by DeepSpeed's own load_checkpoint at build time): `moe`, ZeRO-0, two `deepspeed.moe.layer.MoE`
layers of 2 and 4 experts at expert-parallel size 2; `pipe`, a `deepspeed.pipe.PipelineModule` of Linear, ReLU |
Linear, Linear in 2 stages at ZeRO-1. What DeepSpeed's load does with each cut (the writer's --probe mode, run on the
cut tree) is in docs/layouts.md.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from cli_json import age, findings_of, scan_json, statuses
from conftest import build_cached, writer_key
from test_deepspeed import _write

from ckpt_audit.catalog.manifest import pt_from_json, pt_to_json
from ckpt_audit.models import PtFacts
from ckpt_audit.rules import deepspeed as rules

WRITER = Path(__file__).with_name("_write_deepspeed_parallel.py")
EXPERTS = [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer, n in ((0, 2), (1, 4)) for e in range(n)]
EXPP = [f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]


def _tree(tmp_path_factory, kind: str) -> Path:
    import deepspeed  # noqa: F401  the test extra installs it

    key = writer_key(WRITER, ("torch", "deepspeed"))
    return build_cached(tmp_path_factory, f"deepspeed_{kind}", lambda d: _write(WRITER, d / "ds", kind), key=key) / "ds"


@pytest.fixture(scope="session")
def ds_moe(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory, "moe")


@pytest.fixture(scope="session")
def ds_pipe(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory, "pipe")


@pytest.fixture
def moe_dir(ds_moe, tmp_path) -> Path:
    dst = tmp_path / "runs" / "ds"
    shutil.copytree(ds_moe, dst)
    return dst


@pytest.mark.slow
def test_moe_tree_is_complete_with_every_expert_file_deepspeed_wrote(moe_dir, tmp_path):
    names = sorted(p.name for p in (moe_dir / "global_step2").iterdir())
    assert names == sorted([*EXPERTS, *EXPP, "mp_rank_00_model_states.pt"])
    age(moe_dir)
    doc = scan_json(moe_dir.parent, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete"} and doc["exit_code"] == 0
    assert doc["runs"][0]["layout"] == "deepspeed" and not findings_of(doc, 2)


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["layer_1_expert_3_mp_rank_00_model_states.pt", EXPP[1]])
def test_missing_expert_or_expert_parallel_optimizer_file_is_incomplete(moe_dir, tmp_path, cut):
    # DeepSpeed (--probe on this cut): rank 0 loads; rank 1, which holds expert 3 of layer 1 and is expert-parallel
    # rank 1, raises FileNotFoundError on the file. Each is the highest index of its kind, which a count by the
    # highest index found would miss: the count comes from num_experts=[2, 4] and the experts' group ep_size_2
    (moe_dir / "global_step2" / cut).unlink()
    age(moe_dir)
    doc = scan_json(moe_dir.parent, tmp_path / "c.db")
    assert statuses(doc) == {2: "incomplete"} and doc["exit_code"] == 1
    [f] = findings_of(doc, 2)
    assert f["code"] == "ds-missing-shard" and f["path"] == str(moe_dir / "global_step2" / cut)
    assert f["rank"] == (1 if cut in EXPP else None)


@pytest.mark.slow
def test_expert_file_beyond_the_recorded_count_is_a_leftover(moe_dir, tmp_path):
    # layer 0 records 2 experts: an expert_2 (a larger model's leftover) is never opened by the load
    tag = moe_dir / "global_step2"
    shutil.copy2(tag / EXPERTS[1], tag / "layer_0_expert_2_mp_rank_00_model_states.pt")
    age(moe_dir)
    doc = scan_json(moe_dir.parent, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete"}
    # (the copy also keeps its source's zip prefix: zip-prefix-mismatch, a warning of its own)
    assert [(f["code"], f["path"].rsplit("/", 1)[-1]) for f in findings_of(doc, 2) if f["code"].startswith("ds-")] == [
        ("ds-extra-shard", "layer_0_expert_2_mp_rank_00_model_states.pt")
    ]


MOE_META = {"ds_version": "0.19.8", "zero_stage": 0, "global_steps": 2, "dp_world_size": 4, "mp_world_size": 1}


def test_expert_files_follow_the_recorded_counts_and_the_old_format():
    # num_experts=[1, 3] and ep_size 4 capped by dp_world_size 4: the names are counted, never guessed from indices
    meta = {**MOE_META, "num_experts": "[1,3]", "ep_size": 4}
    deg, found = rules.check_tag("/r/global_step2", 2, {"mp_rank_00_model_states.pt": meta})
    assert deg is not None and deg.experts == (1, 3) and deg.ep == 4
    missing = sorted(f.path.rsplit("/", 1)[-1] for f in found if f.code == "ds-missing-shard")
    assert missing == sorted(
        [
            "layer_0_expert_0_mp_rank_00_model_states.pt",
            *(f"layer_1_expert_{e}_mp_rank_00_model_states.pt" for e in range(3)),
            *(f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)),
        ]
    )
    # a count no save writes (a crafted file) is not expanded into a billion names, nor called complete
    huge = {**MOE_META, "num_experts": "[1000000000]", "ep_size": 4}
    deg, found = rules.check_tag("/r/global_step2", 2, {"mp_rank_00_model_states.pt": huge})
    assert [f.code for f in found if f.code != "ds-missing-shard"] == ["ds-degrees-unknown"]
    # nor are degrees no save writes: a billion data-parallel ranks would be a billion optimizer-shard names
    for degrees in (
        {"dp_world_size": 10**9},
        {"mp_world_size": 10**9},
        {"dp_world_size": 2**11, "mp_world_size": 2**10},
    ):
        deg, found = rules.check_tag("/r/global_step2", 2, {"mp_rank_00_model_states.pt": {**MOE_META, **degrees}})
        assert deg is None and [f.code for f in found] == ["ds-degrees-unknown"], degrees
    # the old one-layer format records an int and names expert_E files; ZeRO >= 1 writes no expp files
    meta = {**MOE_META, "zero_stage": 1, "num_experts": 2, "partition_count": 4}
    optims = {
        f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt": {"ds_version": "0.19.8", "partition_count": 4} for d in range(4)
    }
    deg, found = rules.check_tag("/r/global_step2", 2, {"mp_rank_00_model_states.pt": meta, **optims})
    assert sorted(f.path.rsplit("/", 1)[-1] for f in found) == [
        f"expert_{e}_mp_rank_00_model_states.pt" for e in (0, 1)
    ]


def test_moe_without_a_recorded_expert_parallel_size_says_so():
    meta = {**MOE_META, "num_experts": "[2]"}
    names = {
        "mp_rank_00_model_states.pt": meta,
        **{f"layer_0_expert_{e}_mp_rank_00_model_states.pt": {} for e in (0, 1)},
    }
    deg, found = rules.check_tag("/r/global_step2", 2, names)
    assert [(f.code, f.path.rsplit("/", 1)[-1]) for f in found] == [
        ("ds-moe-ep-unknown", "global_step2"),
        ("ds-missing-shard", "expp_rank_0_mp_rank_00_optim_states.pt"),
    ]


def test_a_cached_model_states_row_from_before_expert_counts_or_pipelines_is_read_again():
    old = PtFacts(prefix="archive", top_keys=("ds_version", "num_experts"), meta=(("ds_version", "0.19.8"),))
    assert pt_from_json(pt_to_json(old))[1] is False
    new = replace(old, meta=(*old.meta, ("num_experts", "[2,4]")))
    assert pt_from_json(pt_to_json(new)) == (new, True)
    # 0.19's model states record checkpoint_parallel_dimensions: a row without its tp_degree is from before pipelines
    old = replace(new, top_keys=(*new.top_keys, "checkpoint_parallel_dimensions"))
    assert pt_from_json(pt_to_json(old))[1] is False
    assert pt_from_json(pt_to_json(replace(old, meta=(*old.meta, ("tp_degree", 1)))))[1] is True


# -- pipeline ------------------------------------------------------------------------------------------------------

LAYER = "layer_{:02d}-model_states.pt"


@pytest.mark.slow
@pytest.mark.parametrize("cut", [None, 2, 1])
def test_pipeline_layer_files_against_the_stages_param_shapes(ds_pipe, tmp_path, cut):
    # DeepSpeed (--probe): without layer_02 (stage 1's Linear) rank 0 loads and rank 1's load_checkpoint raises
    # AssertionError (state_dict_factory: no file for the layer); without layer_01 (stage 0's ReLU, no parameters,
    # so no param_shapes records it) rank 0 raises the same and rank 1 loads
    save_dir = tmp_path / "runs" / "ds"
    shutil.copytree(ds_pipe, save_dir)
    tag = save_dir / "global_step2"
    assert {LAYER.format(i) for i in range(4)} <= {p.name for p in tag.iterdir()}
    if cut is not None:
        (tag / LAYER.format(cut)).unlink()
    age(save_dir)
    doc = scan_json(save_dir.parent, tmp_path / "c.db")
    found = [(f["code"], f["path"].rsplit("/", 1)[-1]) for f in findings_of(doc, 2)]
    if cut is None:
        assert statuses(doc) == {2: "complete"} and doc["exit_code"] == 0 and not found
        assert doc["runs"][0]["checkpoints"][0]["world_size"] == 2  # dp 1 x mp 2 (the stages)
    elif cut == 2:  # stage 1's param_shapes name 2.weight, 2.bias: required
        assert statuses(doc) == {2: "incomplete"} and found == [("ds-missing-shard", LAYER.format(2))]
    else:  # recorded nowhere: the gap is said, the verdict cannot follow the load here
        assert statuses(doc) == {2: "complete"} and found == [("ds-pipe-layer-gap", "layer_01-*model_states.pt")]


PIPE_META = {"ds_version": "0.19.8", "zero_stage": 0, "global_steps": 2, "dp_world_size": 1, "mp_world_size": 4}


def test_pipeline_layer_files_per_tensor_slice_and_without_any_layer_file():
    # 2 stages x tp_degree 2 at ZeRO-0 (nothing records the layers): each layer found needs both slices' files
    meta = {**PIPE_META, "pipeline": 1, "tp_degree": 2}
    states = {f"mp_rank_{m:02d}_model_states.pt": meta for m in range(4)}
    layers = {"layer_00-model_00-model_states.pt": {}, "layer_00-model_01-model_states.pt": {}}
    layers |= {"layer_02-model_00-model_states.pt": {}, "layer_02-model_02-model_states.pt": {}}
    layers |= {"layer_999999999-model_00-model_states.pt": {}, "layer_999999999-model_01-model_states.pt": {}}
    deg, found = rules.check_tag("/r/global_step2", 2, {**states, **layers})
    assert deg is not None and deg.pipeline and deg.tp == 2
    assert [(f.code, f.path.rsplit("/", 1)[-1]) for f in found] == [
        ("ds-pipe-layer-gap", "layer_01-*model_states.pt"),  # one finding for 1 and 3-999999998
        ("ds-missing-shard", "layer_02-model_01-model_states.pt"),
        ("ds-extra-shard", "layer_02-model_02-model_states.pt"),
    ]
    deg, found = rules.check_tag("/r/global_step2", 2, states)
    assert [(f.code, f.path) for f in found] == [("ds-missing-shard", "/r/global_step2")]
    # a dense (not pipeline) tag never opens layer files
    dense = {**PIPE_META, "mp_world_size": 1}
    found = rules.check_tag("/r/global_step2", 2, {"mp_rank_00_model_states.pt": dense, LAYER.format(0): {}})[1]
    assert [f.code for f in found] == ["ds-extra-shard"]
