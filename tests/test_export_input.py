"""Export takes its input from the walked tree through the layouts (export.sources.export_input): the files it
reads as a checkpoint's model are the ones the scan's component holds, by the same walk, link rules and name rules.

Each test is a tree on which scan and export used to disagree about which files the model is; each says what the
format's own load does with it, and checks that export now refuses (or reads) exactly what the scan judged.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cli_proc import ckpt_audit, unprivileged
from test_export_zero import ds_export  # noqa: F401  DeepSpeed's own ZeRO saves, cached

from ckpt_audit.export.guard import ExportError
from ckpt_audit.export.orchestrator import export_checkpoint
from ckpt_audit.models import FileKind
from ckpt_audit.scan.pipeline import scan


def _component(result, role_dir: Path):
    return next(c for r in result.runs for ck in r.checkpoints for c in ck.components if c.path == str(role_dir))


def _codes(result) -> set[str]:
    """Every finding's code, wherever the scan filed it."""
    every = [*result.findings, *(f for r in result.runs for f in r.findings)]
    for ck in (ck for r in result.runs for ck in r.checkpoints):
        every += [*ck.findings, *(f for c in ck.components for f in c.findings)]
    return {f.code for f in every}


@pytest.mark.slow
def test_fsdp_newer_world_size_without_config_is_the_set_scan_and_export_both_take(verl_run, copy_run, tmp_path):
    """No fsdp_config.json, and a world-4 optimizer set written after the world-2 shards: the scan judges the newest
    set (world 4, no model shards: missing-model). verl's resume at 4 ranks opens model_world_size_4_rank_R.pt and
    fails; its current merger refuses without fsdp_config.json. Export used to merge the world-2 model anyway."""
    run = copy_run(verl_run)
    actor = run / "global_step_6" / "actor"
    (actor / "fsdp_config.json").unlink()
    newer = os.stat(actor / "model_world_size_2_rank_0.pt").st_mtime_ns + 10**9
    for r in range(4):
        p = actor / f"optim_world_size_4_rank_{r}.pt"
        shutil.copy(actor / "optim_world_size_2_rank_0.pt", p)
        os.utime(p, ns=(newer, newer))
    comp = _component(scan([run]), actor)
    assert comp.world_size == 4 and "missing-model" in {f.code for f in comp.findings}
    with pytest.raises(ExportError, match="world size 4") as err:
        export_checkpoint(run / "global_step_6", tmp_path / "hf")
    assert "fsdp_config.json" in str(err.value)  # the way out: name the world size
    assert not (tmp_path / "hf").exists()
    # naming the world size settles it for both: the scan judges world 2 and export reads it
    (actor / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 2}')
    assert _component(scan([run]), actor).world_size == 2
    res = export_checkpoint(run / "global_step_6", tmp_path / "hf2")
    assert res.world_size == 2


@pytest.mark.slow
def test_a_model_shard_linked_outside_the_run_is_not_read_by_export_as_the_scan_does_not(verl_run, copy_run, tmp_path):
    """The scan's walk follows no link out of its root (symlink-outside-root): the rank is missing to it, and export
    used to read the linked file anyway. Now export walks the same way and names the link."""
    run = copy_run(verl_run)
    actor = run / "global_step_6" / "actor"
    shard = actor / "model_world_size_2_rank_1.pt"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(shard, outside / shard.name)
    shard.symlink_to(outside / shard.name)
    result = scan([run])
    comp = _component(result, actor)
    assert str(shard) not in {f.path for f in comp.files if f.kind is FileKind.MODEL}
    assert {"symlink-outside-root", "missing-rank"} <= _codes(result)
    with pytest.raises(ExportError, match="symlink-outside-root|outside") as err:
        export_checkpoint(run / "global_step_6", tmp_path / "hf")
    assert str(shard) in str(err.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_deepspeed_optimizer_states_in_a_spelling_deepspeed_never_writes_are_not_read(ds_export, tmp_path):
    """DeepSpeed 0.19 writes and loads `[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt` only (engine
    _get_zero_ckpt_prefix); the scan's rules (rules/deepspeed.py) know those. Export's own pattern also took an
    `fp16_` spelling no engine reads, so it exported fp32 weights from files the load would never open."""
    save = tmp_path / "z2"
    shutil.copytree(ds_export / "z2", save)
    tag = save / "global_step2"
    for p in sorted(tag.glob("zero_pp_rank_*_optim_states.pt")):
        p.rename(tag / f"fp16_{p.name}")
    with pytest.raises(ExportError, match=r"no optimizer states \(\[bf16_\]zero_pp_rank_D_mp_rank_MM_optim_states"):
        export_checkpoint(save, tmp_path / "hf", allow_unverified=True)
    assert not (tmp_path / "hf").exists()
    # the module's own weights are in the model states, which are named as the load opens them
    assert export_checkpoint(save, tmp_path / "hf", allow_unverified=True, weights="module").tensors


@pytest.mark.slow
def test_a_shard_replaced_between_the_walk_and_the_check_is_caught(verl_run, copy_run, tmp_path):
    """export.guard re-reads what export_input listed at the moment it acts: a shard swapped for a link to a copy
    of itself (same bytes, CRCs fine) after the walk chose it is not the file the walk listed."""
    from ckpt_audit.export.guard import changed_since, check_source
    from ckpt_audit.export.sources import export_input, files_to_read

    run = copy_run(verl_run)
    inp = export_input((run / "global_step_6").resolve(), "actor", None, "auto")
    shard = inp.role_dir / "model_world_size_2_rank_1.pt"
    assert (1, shard) in inp.shards
    copy = tmp_path / "copy.pt"
    shutil.copy2(shard, copy)
    shard.unlink()
    shard.symlink_to(copy)
    check = check_source(files_to_read(inp, inp.hf_dir), manifest={}, status=None)
    assert not check.findings  # the bytes alone pass
    assert changed_since(check) is None  # and nothing moved since the check
    assert changed_since(check, inp.listed) == str(shard)


@pytest.mark.slow
@pytest.mark.skipif(unprivileged() is None, reason="needs setpriv to drop root's read bypass")
def test_an_unreadable_role_directory_is_named_in_the_refusal(verl_run, copy_run, tmp_path):
    """The walk records a directory it cannot list (unreadable), as the scan reports it; export's one line says so
    instead of only that no weights were found."""
    run = copy_run(verl_run)
    actor = run / "global_step_6" / "actor"
    actor.chmod(0)
    try:
        res = ckpt_audit("export", run / "global_step_6", "--to", tmp_path / "hf", as_user=True)
    finally:
        actor.chmod(0o755)
    assert res.returncode == 3, res.stderr
    assert f"{actor}: unreadable: cannot read: Permission denied" in res.stderr
    assert not (tmp_path / "hf").exists()
