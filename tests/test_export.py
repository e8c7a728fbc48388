"""export on the harness's real FSDP trees (W=2, W=3 uneven/empty, HSDP 2x2, W=1) and on hand-made edge cases.

The reference for every export is built independently of ckpt_audit.export: each rank file loaded with
torch.load(weights_only=True), local shards concatenated along their DTensor placement (first replica for HSDP),
and a transformers model built from that full state dict. The export must load with transformers offline and
give the same logits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401 - DTensor for weights_only loading
from cli_proc import ckpt_audit
from safetensors import safe_open
from safetensors.torch import save_file
from test_export_trees import write_plain, write_raw
from torch.distributed.tensor import DTensor, Replicate, Shard

from ckpt_audit.export.guard import ExportError
from ckpt_audit.export.orchestrator import export_checkpoint
from ckpt_audit.readers.hashing import digest_file


def latest_step(run: Path) -> Path:
    return run / f"global_step_{int((run / 'latest_checkpointed_iteration.txt').read_text())}"


def rank_files(actor: Path) -> list[Path]:
    files = sorted(actor.glob("model_world_size_*_rank_*.pt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    assert files
    return files


def reference_state_dict(actor: Path) -> tuple[dict, set[str]]:
    """Full tensors by concatenation, plus the shapes seen (e.g. 'shard1', 'empty', 'hsdp', 'plain')."""
    states = [torch.load(p, weights_only=True, map_location="cpu") for p in rank_files(actor)]
    seen: set[str] = set()
    full = {}
    for key, v0 in states[0].items():
        if not isinstance(v0, DTensor):
            seen.add("plain")
            full[key] = v0.clone()
            continue
        mesh = v0.device_mesh.mesh
        if mesh.ndim == 2:
            seen.add("hsdp")
            assert isinstance(v0.placements[0], Replicate)
        ranks = mesh.reshape(-1, mesh.shape[-1])[0].tolist()
        p = v0.placements[-1]
        if isinstance(p, Shard):
            seen.add(f"shard{p.dim}")
            locals_ = [states[r][key].to_local() for r in ranks]
            if any(t.numel() == 0 for t in locals_):
                seen.add("empty")
            if len({t.shape[p.dim] for t in locals_}) > 1:
                seen.add("uneven")
            full[key] = torch.cat(locals_, dim=p.dim)
        else:
            full[key] = v0.to_local().clone()
        assert tuple(full[key].shape) == tuple(v0.shape)
    return full, seen


def exported_state_dict(out: Path) -> dict:
    sd = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                sd[k] = h.get_tensor(k)
    return sd


def logits(model, config) -> torch.Tensor:
    ids = torch.arange(0, min(12, config.vocab_size)).reshape(1, -1) % config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits


def reference_model(actor: Path, full: dict, dtype=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(actor / "huggingface", local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype else {}))
    missing, unexpected = model.load_state_dict(full, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return model.eval(), config


@pytest.mark.parametrize(
    ("fixture", "shapes"),
    [
        ("verl_run", {"shard0"}),
        ("verl_run_w3", {"shard0", "uneven"}),
        ("verl_run_hsdp", {"hsdp", "shard0"}),
        ("verl_run_w1", set()),  # FSDP2 at W=1 still saves 1-rank DTensors; FSDP1's plain tensors: next test
    ],
)
def test_export_equals_concatenated_shards_and_gives_the_same_logits(request, tmp_path, fixture, shapes):
    from transformers import AutoModelForCausalLM

    step = latest_step(Path(request.getfixturevalue(fixture)))
    actor = step / "actor"
    full, seen = reference_state_dict(actor)
    assert shapes <= seen, f"{fixture} no longer covers {shapes - seen}"

    result = export_checkpoint(step, tmp_path / "hf")
    assert result.verified and result.source_kind == "fsdp-shards"
    out = Path(result.out_dir)
    got = exported_state_dict(out)
    config = json.loads((out / "config.json").read_text())
    expected = dict(full)
    if config.get("tie_word_embeddings"):
        expected.pop("lm_head.weight", None)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert result.tensors == len(expected)
    for name in os.listdir(actor / "huggingface"):  # config, tokenizer, generation config copied
        if not name.endswith(".safetensors"):
            assert (out / name).exists(), name

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ref, ref_config = reference_model(actor, full)
    assert torch.equal(logits(model, ref_config), logits(ref, ref_config))


@pytest.mark.slow  # builds, saves and reloads a transformers model: seconds of import and compute
def test_world_size_1_plain_tensors_as_fsdp1_no_shard_saves_them(tmp_path):
    from transformers import AutoModelForCausalLM

    step = latest_step(write_plain(tmp_path / "run"))
    full, seen = reference_state_dict(step / "actor")
    assert seen == {"plain"}
    result = export_checkpoint(step, tmp_path / "hf")
    assert result.verified and result.world_size == 1
    model = AutoModelForCausalLM.from_pretrained(result.out_dir, local_files_only=True).eval()
    ref, config = reference_model(step / "actor", full)
    assert torch.equal(logits(model, config), logits(ref, config))


@pytest.mark.slow  # reads the trainer trees through request.getfixturevalue
def test_shard1_and_uneven_shards_are_covered_by_the_trainer_trees(request):
    """The trainer's trees must exercise Shard(1) and uneven shards, or the export tests above prove less."""
    seen = set()
    for fixture in ("verl_run", "verl_run_w3", "verl_run_hsdp"):
        seen |= reference_state_dict(latest_step(Path(request.getfixturevalue(fixture))) / "actor")[1]
    assert {"shard0", "shard1", "uneven", "hsdp"} <= seen, seen


@pytest.mark.slow  # write_raw: a 3-process gloo group
def test_empty_trailing_shards_shard0_and_shard1(tmp_path):
    """torch.chunk semantics: 4 rows over 3 ranks are 2/2/0; 7 columns are 3/3/1."""
    step = write_raw(tmp_path / "raw", 3)
    full, seen = reference_state_dict(step / "actor")
    assert {"empty", "uneven", "shard0", "shard1"} <= seen
    for dtype, tdtype in ((None, torch.float32), ("bf16", torch.bfloat16)):
        result = export_checkpoint(step, tmp_path / f"hf-{dtype}", dtype=dtype, allow_unverified=True)  # not a model
        got = exported_state_dict(Path(result.out_dir))
        assert set(got) == set(full)
        assert all(got[k].dtype == tdtype and torch.equal(got[k], full[k].to(tdtype)) for k in full)


def test_bf16_sharded_export_with_index_loads_with_transformers(verl_run, tmp_path):
    from transformers import AutoModelForCausalLM

    step = latest_step(verl_run)
    full, _ = reference_state_dict(step / "actor")
    largest = max(v.numel() for v in full.values()) * 2
    result = export_checkpoint(step, tmp_path / "hf", dtype="bf16", max_shard_size=largest + 1)
    out = Path(result.out_dir)
    files = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    got = exported_state_dict(out)
    assert set(index["weight_map"]) == set(got)
    for k, v in got.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, full[k].to(torch.bfloat16)), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.bfloat16).eval()
    ref, config = reference_model(
        step / "actor", {k: v.to(torch.bfloat16) for k, v in full.items()}, dtype=torch.bfloat16
    )
    assert torch.equal(logits(model, config), logits(ref, config))


def test_refuses_to_overwrite_without_force_and_replaces_only_an_earlier_export_with_it(verl_run, tmp_path):
    step = latest_step(verl_run)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ExportError, match="exists"):
        export_checkpoint(step, out)
    with pytest.raises(ExportError, match="only an earlier export or an empty directory"):
        export_checkpoint(step, out, force=True)  # a directory of the user's is never replaced
    assert (out / "mine.txt").read_text() == "keep me"
    (out / "mine.txt").unlink()
    first = export_checkpoint(step, out, force=True)  # an empty directory may be
    assert first.replaced == "empty-dir" and (out / "model.safetensors").exists()
    second = export_checkpoint(step, out, force=True, dtype="bf16")  # and so may an earlier export
    assert second.replaced == "export" and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temp or old dirs left


def test_missing_rank_is_a_one_line_error(verl_run, copy_run, tmp_path):
    run = copy_run(verl_run)
    step = latest_step(run)
    rank_files(step / "actor")[-1].unlink()
    with pytest.raises(ExportError, match="missing model shard"):
        export_checkpoint(step, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_cli_export_records_hashes_in_the_catalog(verl_run, tmp_path):
    step = latest_step(verl_run)
    catalog = tmp_path / "c.db"
    export = ("export", step, "--to", tmp_path / "hf", "--json")
    proc = ckpt_audit(*export, catalog=catalog)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == 1 and doc["verified"] is True
    for f in doc["files"]:
        assert digest_file(f["path"]).hash == f["hash"]

    import sqlite3

    db = sqlite3.connect(catalog)
    [(source, out_dir)] = db.execute("SELECT source, out_dir FROM exports").fetchall()
    assert (source, out_dir) == (str(step.resolve()), str((tmp_path / "hf").resolve()))
    rows = dict(db.execute("SELECT path, hash FROM export_files").fetchall())
    assert rows == {f["path"]: f["hash"] for f in doc["files"]}

    again = ckpt_audit(*export, catalog=catalog)
    assert again.returncode == 2 and "exists" in again.stderr and len(again.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------- hand-made layouts (no trainer)


def _hf_config(d: Path, **extra) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", **extra}))


def test_lora_adapter_is_exported_beside_the_base_and_flagged_as_not_fused(tmp_path):
    actor = tmp_path / "run" / "global_step_3" / "actor"
    _hf_config(actor / "huggingface")
    g = torch.Generator().manual_seed(0)
    sd = {
        "base_model.model.model.layers.0.q_proj.base_layer.weight": torch.randn(8, 8, generator=g),
        "base_model.model.model.layers.0.q_proj.lora_A.default.weight": torch.randn(2, 8, generator=g),
        "base_model.model.model.layers.0.q_proj.lora_B.default.weight": torch.randn(8, 2, generator=g),
        "base_model.model.model.norm.weight": torch.ones(8),
    }
    torch.save(sd, actor / "model_world_size_1_rank_0.pt")
    (actor / "lora_adapter").mkdir()
    (actor / "lora_adapter" / "adapter_config.json").write_text('{"r": 2}')

    result = export_checkpoint(actor.parent, tmp_path / "hf", allow_unverified=True)  # tensors, not a model
    out = Path(result.out_dir)
    assert any("NOT fused" in w for w in result.warnings)
    base = exported_state_dict(out)
    assert set(base) == {"model.layers.0.q_proj.weight", "model.norm.weight"}
    assert torch.equal(
        base["model.layers.0.q_proj.weight"], sd["base_model.model.model.layers.0.q_proj.base_layer.weight"]
    )
    adapter = exported_state_dict(out / "lora_adapter")
    assert set(adapter) == {k for k in sd if "lora_" in k}
    assert json.loads((out / "lora_adapter" / "adapter_config.json").read_text()) == {"r": 2}


def test_megatron_checkpoint_exports_from_its_hf_weights(tmp_path):
    actor = tmp_path / "run" / "global_step_5" / "actor"
    (actor / "dist_ckpt").mkdir(parents=True)
    (actor / "dist_ckpt" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    _hf_config(actor / "huggingface", tie_word_embeddings=False)
    weights = {"model.embed_tokens.weight": torch.randn(10, 4), "lm_head.weight": torch.randn(10, 4)}
    save_file(weights, str(actor / "huggingface" / "model.safetensors"))

    result = export_checkpoint(actor.parent, tmp_path / "hf", dtype="fp16", allow_unverified=True)
    assert result.source_kind == "hf-weights" and result.read_back
    # safetensors carry no CRCs and nothing was scanned: equal to itself only, so not called verified
    assert result.source_check == "none" and not result.verified
    got = exported_state_dict(Path(result.out_dir))
    assert {k: v.dtype for k, v in got.items()} == {k: torch.float16 for k in weights}
    assert all(torch.equal(got[k], weights[k].to(torch.float16)) for k in weights)


def test_megatron_without_weights_names_every_layout_it_looked_for(tmp_path):
    actor = tmp_path / "run" / "global_step_5" / "actor"
    (actor / "dist_ckpt").mkdir(parents=True)  # no .metadata: no dist_ckpt to read
    _hf_config(actor / "huggingface")
    with pytest.raises(ExportError, match=r"no FSDP shards .* no Megatron dist_ckpt .* no HF weights"):
        export_checkpoint(actor.parent, tmp_path / "hf")


def test_tied_lm_head_is_dropped_only_when_equal(tmp_path):
    actor = tmp_path / "run" / "global_step_1" / "actor"
    _hf_config(actor / "huggingface", tie_word_embeddings=True)
    emb = torch.randn(6, 4)
    torch.save(
        {"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone()}, actor / "model_world_size_1_rank_0.pt"
    )
    tied = export_checkpoint(actor.parent, tmp_path / "a", allow_unverified=True)  # tensors, not a model: no sizes
    assert set(exported_state_dict(Path(tied.out_dir))) == {"model.embed_tokens.weight"}
    torch.save({"model.embed_tokens.weight": emb, "lm_head.weight": emb + 1}, actor / "model_world_size_1_rank_0.pt")
    result = export_checkpoint(actor.parent, tmp_path / "b", allow_unverified=True)
    assert set(exported_state_dict(Path(result.out_dir))) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert any("differs from embed_tokens" in w for w in result.warnings)


def test_unsafe_shard_is_refused_without_executing_it(tmp_path):
    actor = tmp_path / "run" / "global_step_1" / "actor"
    _hf_config(actor / "huggingface")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"w": torch.ones(2), "x": Evil()}, actor / "model_world_size_1_rank_0.pt")
    with pytest.raises(ExportError, match="cannot load safely"):
        export_checkpoint(actor.parent, tmp_path / "hf")
    assert not marker.exists()


def test_critic_role_and_sft_layout_export(verl_run_critic, verl_run_sft, tmp_path):
    critic = latest_step(verl_run_critic)
    full, _ = reference_state_dict(critic / "critic")
    got = exported_state_dict(Path(export_checkpoint(critic, tmp_path / "critic", role="critic").out_dir))
    assert set(got) <= set(full) and all(torch.equal(got[k], full[k]) for k in got)

    sft = latest_step(verl_run_sft)  # shards directly in global_step_N
    full, _ = reference_state_dict(sft)
    result = export_checkpoint(sft, tmp_path / "sft")
    assert result.role_dir == str(sft.resolve())
    got = exported_state_dict(Path(result.out_dir))
    assert set(got) <= set(full) and all(torch.equal(got[k], full[k]) for k in got)


def test_check_compares_an_hf_dir_with_fsdp_shards_bit_for_bit_or_as_cast(verl_run, tmp_path):
    """`export --check` on an FSDP source: the export passes (fp32 as is, bf16 as exactly the documented cast); one
    ulp off, a tensor dropped or one added is named."""
    from ckpt_audit.export.orchestrator import check_export

    step = latest_step(verl_run)
    for dtype in (None, "bf16"):
        out = tmp_path / f"hf-{dtype}"
        export_checkpoint(step, out, dtype=dtype)
        report = check_export(step, out)
        assert report.same and report.tensors > 0, report.differences
    out = tmp_path / "hf-None"
    sd = exported_state_dict(out)
    name = sorted(k for k in sd if sd[k].dtype == torch.float32 and sd[k].numel() > 1)[0]
    sd[name].view(torch.int32).view(-1)[0] += 1
    dropped = sorted(sd)[-1]
    sd.pop(dropped)
    sd["model.extra.weight"] = torch.zeros(2)
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    diffs = check_export(step, out).differences
    assert f"{name}: values differ from the checkpoint's" in diffs
    assert any(d.startswith(f"{dropped}: missing") for d in diffs) or dropped == "lm_head.weight"
    assert "model.extra.weight: extra (in" in " ".join(diffs)
