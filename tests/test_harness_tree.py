"""The harness writes verl's trees file for file: names, order-independent contents, JSON bytes, tracker, zip prefix."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

HF_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def expected_role_files(world_size: int) -> set[str]:
    shards = {
        f"{kind}_world_size_{world_size}_rank_{r}.pt"
        for kind in ("model", "optim", "extra_state")
        for r in range(world_size)
    }
    return shards | {"fsdp_config.json"} | {f"huggingface/{name}" for name in HF_FILES}


def listing(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}


def load(path: Path):
    from harness.checkpoint import load_file

    return load_file(path)


def test_ppo_tree_matches_verl_file_for_file(verl_run):
    steps = (2, 4, 6)
    expected = {"latest_checkpointed_iteration.txt", "metrics.jsonl"}
    for n in steps:
        expected |= {f"global_step_{n}/data.pt"} | {f"global_step_{n}/actor/{f}" for f in expected_role_files(2)}
    assert listing(verl_run) == expected
    assert (verl_run / "latest_checkpointed_iteration.txt").read_bytes() == b"6"
    for n in steps:
        assert (
            verl_run / f"global_step_{n}/actor/fsdp_config.json"
        ).read_bytes() == b'{\n    "FSDP_version": 2,\n    "world_size": 2\n}'


def test_every_shard_is_a_torch_zip_whose_prefix_is_its_stem(verl_run):
    for pt in verl_run.rglob("*.pt"):
        with zipfile.ZipFile(pt) as z:
            names = z.namelist()
            assert {n.split("/")[0] for n in names} == {pt.stem}
            assert f"{pt.stem}/data.pkl" in names and f"{pt.stem}/version" in names
            assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())


def test_metrics_have_one_line_per_step(verl_run):
    rows = [json.loads(line) for line in (verl_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all({"loss", "lr", "grad_norm"} <= set(r) for r in rows)
    assert rows[0]["lr"] == 0.0 and rows[3]["lr"] > rows[1]["lr"]  # warmup from 0


def test_model_shards_are_fsdp2_dtensors_with_verl_placements(verl_run):
    from torch.distributed.tensor import Shard

    shards = [load(verl_run / f"global_step_6/actor/model_world_size_2_rank_{r}.pt") for r in range(2)]
    emb = shards[0]["model.embed_tokens.weight"]
    assert emb.placements == (Shard(1),)  # 131 rows do not divide by 2, 32 columns do
    assert tuple(emb.shape) == (131, 32) and tuple(emb.to_local().shape) == (131, 16)
    assert shards[0]["model.layers.0.self_attn.q_proj.weight"].placements == (Shard(0),)
    assert emb.device_mesh.mesh_dim_names == ("fsdp",) and emb.device_mesh.mesh.tolist() == [0, 1]
    assert all(v.dtype.is_floating_point and str(v.dtype) == "torch.float32" for v in shards[1].values())


def test_optimizer_and_extra_state_match_step(verl_run):
    import numpy as np

    for n in (2, 4, 6):
        for r in range(2):
            optim = load(verl_run / f"global_step_{n}/actor/optim_world_size_2_rank_{r}.pt")
            assert {int(e["step"]) for e in optim["state"].values()} == {n}
            assert "initial_lr" in optim["param_groups"][0]
            extra = load(verl_run / f"global_step_{n}/actor/extra_state_world_size_2_rank_{r}.pt")
            assert extra["lr_scheduler"]["last_epoch"] == n and extra["lr_scheduler"]["lr_lambdas"] == [None]
            assert set(extra["rng"]) == {"cpu", "numpy", "random"}
            assert extra["rng"]["numpy"][0] == "MT19937" and isinstance(extra["rng"]["numpy"][1], np.ndarray)
    rng0 = load(verl_run / "global_step_6/actor/extra_state_world_size_2_rank_0.pt")["rng"]["cpu"]
    rng1 = load(verl_run / "global_step_6/actor/extra_state_world_size_2_rank_1.pt")["rng"]["cpu"]
    assert not bool((rng0 == rng1).all())  # per-rank streams


def test_data_pt_is_a_multiworker_stateful_dataloader_state(verl_run):
    for n in (2, 4, 6):
        state = load(verl_run / f"global_step_{n}/data.pt")
        assert set(state) == {"_snapshot", "_steps_since_snapshot", "_iterator_finished"}
        consumed = state["_snapshot"]["_snapshot_step"] + state["_steps_since_snapshot"]
        assert consumed == (n - 1) % 4 + 1  # 4 batches per epoch, one batch per step


def test_w3_shards_are_uneven_torch_chunks(verl_run_w3):
    import torch

    shards = [load(verl_run_w3 / f"global_step_4/actor/model_world_size_3_rank_{r}.pt") for r in range(3)]
    rows = [tuple(s["model.embed_tokens.weight"].to_local().shape) for s in shards]
    assert rows == [(44, 32), (44, 32), (43, 32)]
    full = torch.cat([s["model.embed_tokens.weight"].to_local() for s in shards])
    assert full.shape == (131, 32)


def test_hsdp_replicas_hold_identical_shards(verl_run_hsdp):
    import torch
    from torch.distributed.tensor import Replicate

    shards = [load(verl_run_hsdp / f"global_step_4/actor/model_world_size_4_rank_{r}.pt") for r in range(4)]
    sample = shards[0]["model.layers.0.mlp.up_proj.weight"]
    assert sample.device_mesh.mesh_dim_names == ("ddp", "fsdp")
    assert sample.device_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert sample.placements[0] == Replicate()
    for key in shards[0]:
        for r in (0, 1):
            assert torch.equal(shards[r][key].to_local(), shards[r + 2][key].to_local()), key


def test_w1_tree(verl_run_w1):
    assert listing(verl_run_w1 / "global_step_4/actor") == expected_role_files(1)


def test_critic_gives_ppo_layout_with_empty_shards(verl_run_critic):
    step = verl_run_critic / "global_step_4"
    assert listing(step / "critic") == expected_role_files(3)
    assert listing(step / "actor") == expected_role_files(3)
    assert json.loads((step / "critic/huggingface/config.json").read_text())["architectures"] == [
        "Qwen2ForTokenClassification"
    ]
    locals_ = [
        tuple(load(step / f"critic/model_world_size_3_rank_{r}.pt")["score.weight"].to_local().shape) for r in range(3)
    ]
    assert locals_ == [(1, 32), (0, 32), (0, 32)]  # [1, H] with H=32 not divisible by 3: Shard(0), empty tails


def test_sft_layout_puts_shards_in_the_step_dir(verl_run_sft):
    for n in (2, 4):
        assert listing(verl_run_sft / f"global_step_{n}") == expected_role_files(2) | {"data.pt"}
    assert (verl_run_sft / "latest_checkpointed_iteration.txt").read_bytes() == b"4"
    assert not (verl_run_sft / "latest_checkpointed_iteration.txt.tmp").exists()


@pytest.mark.parametrize(
    "bad", [dict(world_size=3, batch_size=8), dict(world_size=3, hsdp=True), dict(drop=("weights",))]
)
def test_bad_configs_fail_before_any_process_starts(tmp_path, bad):
    from harness.tree import write_tree

    with pytest.raises(ValueError):
        write_tree(tmp_path, **bad)
    assert not (tmp_path / "demo" / "exp" / "metrics.jsonl").exists()
