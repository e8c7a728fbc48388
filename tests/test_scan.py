"""scan() on real trees, one corruption per test: every finding code and every status."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_proc import ckpt_audit, unprivileged
from scan_trees import base_run, flip_payload_byte, rewrite_zip, run_copy, shard, steps_of  # noqa: F401

from ckpt_audit.catalog import open_catalog, read_previous
from ckpt_audit.codes import CODES
from ckpt_audit.models import Severity, Status
from ckpt_audit.scan import ScanError, scan


def do_scan(root, **kw):
    kw.setdefault("in_progress_window_s", 0)
    return scan([root], **kw)


def codes(result) -> set[str]:
    return {f.code for f in result.all_findings}


def the_run(result):
    (run,) = result.runs
    return run


def status_of(result, step_dir: Path) -> Status:
    return next(c.status for r in result.runs for c in r.checkpoints if c.path == str(step_dir))


def test_clean_tree_is_complete_with_no_warnings(run_copy):
    r = do_scan(run_copy.parent.parent)
    run = the_run(r)
    assert run.layout == "verl-fsdp" and run.tracker_step == int(steps_of(run_copy)[-1].name.split("_")[-1])
    assert [c.status for c in run.checkpoints] == [Status.COMPLETE] * len(steps_of(run_copy))
    assert not [f for f in r.all_findings if f.severity >= Severity.WARNING]
    assert run.latest_complete.step == run.tracker_step
    assert all(f.hash and len(f.hash) == 32 for c in run.checkpoints for f in c.all_files)
    assert all(f.crc_ok for c in run.checkpoints for comp in c.components for f in comp.files if f.path.endswith(".pt"))
    assert run.checkpoints[0].world_size == 2


def test_tracker_behind_whole_checkpoints_is_a_run_warning(run_copy):
    (run_copy / "latest_checkpointed_iteration.txt").write_text("2")  # the tracker writes of 4 and 6 were lost
    r = do_scan(run_copy)
    [behind] = [f for f in r.all_findings if f.code == "tracker-behind"]
    assert behind.severity is Severity.WARNING and "step 4, 6" in behind.message
    assert [c.status for c in the_run(r).checkpoints] == [Status.COMPLETE, Status.UNCOMMITTED, Status.UNCOMMITTED]


def test_a_step_dir_is_as_young_as_its_newest_directory(run_copy):
    fresh = run_copy / "global_step_8"
    fresh.mkdir()  # verl makes it first, then the ranks write: empty, and one second old
    r = scan([run_copy], in_progress_window_s=300)
    assert status_of(r, fresh) is Status.IN_PROGRESS


def test_missing_rank_makes_incomplete_and_tracker_dangling(run_copy):
    last = steps_of(run_copy)[-1]
    shard(last, "model", 1).unlink()
    r = do_scan(run_copy)
    miss = [f for f in r.all_findings if f.code == "missing-rank"]
    assert [f.rank for f in miss] == [1]
    assert status_of(r, last) is Status.INCOMPLETE
    assert "tracker-dangling" in codes(r)


def test_fsdp_config_world_size_mismatch(run_copy):
    cfg = steps_of(run_copy)[0] / "actor" / "fsdp_config.json"
    cfg.write_text(json.dumps({"FSDP_version": 2, "world_size": 4}, indent=4))
    r = do_scan(run_copy)
    assert "world-size-mismatch" in codes(r)
    assert status_of(r, steps_of(run_copy)[0]) is Status.INCOMPLETE


def test_stale_world_size_set_beside_current(run_copy):
    actor = steps_of(run_copy)[0] / "actor"
    shutil.copy2(shard(actor.parent, "model", 0), actor / "model_world_size_3_rank_0.pt")
    r = do_scan(run_copy)
    assert "stale-world-size" in codes(r)
    assert status_of(r, actor.parent) is Status.COMPLETE  # a warning, not a broken checkpoint


@pytest.mark.parametrize("kind,code", [("optim", "missing-optimizer"), ("extra_state", "missing-extra-state")])
def test_missing_kind(run_copy, kind, code):
    step = steps_of(run_copy)[0]
    for p in (step / "actor").glob(f"{kind}_world_size_*"):
        p.unlink()
    r = do_scan(run_copy)
    assert code in codes(r) and status_of(r, step) is Status.INCOMPLETE


def test_missing_dataloader_state_is_a_warning(run_copy):
    step = steps_of(run_copy)[0]
    (step / "data.pt").unlink()
    r = do_scan(run_copy)
    assert "missing-dataloader-state" in codes(r)
    assert status_of(r, step) is Status.COMPLETE


def test_truncated_shard_is_corrupt(run_copy):
    p = shard(steps_of(run_copy)[0], "optim", 1)
    os.truncate(p, p.stat().st_size // 2)
    r = do_scan(run_copy)
    assert "truncated" in codes(r) and status_of(r, steps_of(run_copy)[0]) is Status.CORRUPT


def test_zero_byte_shard(run_copy):
    p = shard(steps_of(run_copy)[0], "extra_state", 0)
    os.truncate(p, 0)
    r = do_scan(run_copy)
    assert "zero-byte" in codes(r) and status_of(r, steps_of(run_copy)[0]) is Status.CORRUPT


def test_bit_flip_is_a_crc_mismatch(run_copy):
    flip_payload_byte(shard(steps_of(run_copy)[0], "model", 0))
    r = do_scan(run_copy)
    bad = [f for f in r.all_findings if f.code == "crc-mismatch"]
    assert len(bad) == 1 and bad[0].severity is Severity.ERROR
    assert status_of(r, steps_of(run_copy)[0]) is Status.CORRUPT


def test_rehash_reports_hash_drift_under_unchanged_stat(run_copy, tmp_path):
    cat = open_catalog(tmp_path / "c.db")
    cat.record_scan(do_scan(run_copy))
    p = shard(steps_of(run_copy)[0], "model", 0)
    st = p.stat()
    with open(p, "r+b") as f:  # the local header's mod-time field: outside every CRC, so only the hash sees it
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    plain = do_scan(run_copy, previous=read_previous(cat.db.conn))
    assert "hash-drift" not in codes(plain) and plain.files_reused > 0
    deep = do_scan(run_copy, previous=read_previous(cat.db.conn), rehash=True)
    assert [f.path for f in deep.all_findings if f.code == "hash-drift"] == [str(p)]
    assert deep.files_reused == 0


@pytest.mark.parametrize(
    "content,code",
    [(None, "tracker-missing"), ("", "tracker-empty"), ("twelve", "tracker-invalid"), ("999", "tracker-dangling")],
)
def test_tracker_problems(run_copy, content, code):
    tracker = run_copy / "latest_checkpointed_iteration.txt"
    if content is None:
        tracker.unlink()
    else:
        tracker.write_text(content)
    r = do_scan(run_copy)
    assert code in codes(r)
    assert all(c.status is Status.COMPLETE for c in the_run(r).checkpoints)


def test_misnamed_step_directory(run_copy):
    first = steps_of(run_copy)[0]
    first.rename(run_copy / first.name.replace("global_step_", "global_steps_"))
    r = do_scan(run_copy)
    assert "misnamed-step" in codes(r)


def test_step_newer_than_tracker_is_uncommitted(run_copy):
    steps = steps_of(run_copy)
    (run_copy / "latest_checkpointed_iteration.txt").write_text(steps[-2].name.split("_")[-1])
    (steps[-1] / "data.pt").unlink()
    r = do_scan(run_copy)
    assert status_of(r, steps[-1]) is Status.UNCOMMITTED
    assert the_run(r).latest_complete.path == str(steps[-2])


def test_only_data_pt_left_is_a_husk(run_copy):
    first = steps_of(run_copy)[0]
    shutil.rmtree(first / "actor")
    r = do_scan(run_copy)
    assert status_of(r, first) is Status.HUSK and "husk" in codes(r)
    assert not [f for f in r.all_findings if f.severity is Severity.ERROR]


def test_recent_uncommitted_checkpoint_is_in_progress_never_corrupt(run_copy):
    steps = steps_of(run_copy)
    (run_copy / "latest_checkpointed_iteration.txt").write_text(steps[-2].name.split("_")[-1])
    p = shard(steps[-1], "optim", 1)
    os.truncate(p, p.stat().st_size // 3)  # a shard half-written right now
    r = scan([run_copy], in_progress_window_s=3600)
    ck = next(c for c in the_run(r).checkpoints if c.path == str(steps[-1]))
    assert ck.status is Status.IN_PROGRESS and "in-progress" in {f.code for f in ck.findings}
    assert "truncated" in {f.code for f in ck.all_findings}
    assert all(f.severity is Severity.INFO for f in ck.all_findings)


def test_file_growing_during_scan_is_reported_and_in_progress(run_copy):
    last = steps_of(run_copy)[-1]
    victims = sorted(p for p in (last / "actor").iterdir() if p.suffix == ".pt")
    grown = []

    def grow(done, total):
        if not grown:  # first file finished: the files still to come grow under the scanner
            for p in victims:
                with open(p, "ab") as f:
                    f.write(b"\0" * 4096)
            grown.append(True)

    r = do_scan(run_copy, workers=1, progress=grow)
    assert "file-changed-during-scan" in codes(r)
    assert status_of(r, last) is Status.IN_PROGRESS


def test_file_vanishing_during_scan(run_copy):
    last = steps_of(run_copy)[-1]
    victims = sorted((last / "actor").glob("*.pt"))

    def vanish(done, total):
        for p in victims:
            p.unlink(missing_ok=True)

    r = do_scan(run_copy, workers=1, progress=vanish)
    assert "file-vanished" in codes(r)


def test_links_loops_garbage_and_odd_names_become_findings(run_copy, tmp_path):
    actor = steps_of(run_copy)[0] / "actor"
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"x" * 10)
    (actor / "link_out.pt").symlink_to(outside)
    (actor / "loop").symlink_to(run_copy)
    (actor / "broken.pt").symlink_to(actor / "nothing-here")
    (actor / "garbage.pt").write_bytes(os.urandom(300))
    os.mkdir(os.fsencode(actor) + b"/bad\xffname")
    r = do_scan(run_copy.parent.parent)
    found = codes(r)
    assert {"symlink-outside-root", "symlink-loop", "broken-symlink", "not-a-zip", "non-utf8-name"} <= found
    assert str(outside) not in {f.path for c in the_run(r).checkpoints for f in c.all_files}


def test_storage_shorter_than_its_tensor(run_copy):
    p = shard(steps_of(run_copy)[0], "model", 0)
    rewrite_zip(p, shorten="data/0")
    r = do_scan(run_copy)
    assert "storage-size-mismatch" in codes(r)
    assert status_of(r, steps_of(run_copy)[0]) is Status.CORRUPT


def test_copied_shard_has_a_zip_prefix_mismatch(run_copy):
    step = steps_of(run_copy)[0]
    shutil.copy2(shard(step, "extra_state", 0), shard(step, "extra_state", 1))
    r = do_scan(run_copy)
    assert [f.path for f in r.all_findings if f.code == "zip-prefix-mismatch"] == [str(shard(step, "extra_state", 1))]


def test_pickle_problems(run_copy):
    step = steps_of(run_copy)[0]
    rewrite_zip(shard(step, "extra_state", 0), replace={"data.pkl": b"\x80\x02cos\nsystem\nq\x00."})
    rewrite_zip(shard(step, "extra_state", 1), replace={"data.pkl": b"not a pickle at all"})
    rewrite_zip(shard(step, "optim", 0), drop="data.pkl")
    found = codes(do_scan(run_copy))
    assert {"unsafe-pickle", "bad-pickle", "not-a-torch-archive"} <= found


def test_raw_pickle_where_a_shard_belongs_is_named_not_called_garbage(run_copy):
    import pickle

    step = steps_of(run_copy)[0]
    shard(step, "extra_state", 0).write_bytes(pickle.dumps({"lr_scheduler": {"last_epoch": 2}}))
    r = do_scan(run_copy)
    assert "raw-pickle" in codes(r) and "not-a-zip" not in codes(r) and "unsafe-pickle" not in codes(r)
    assert status_of(r, step) is Status.INCOMPLETE  # torch.load refuses it, but nothing in it would run


def test_legacy_names_without_world_size(run_copy):
    step = steps_of(run_copy)[0]
    for p in (step / "actor").glob("*_world_size_*"):
        p.rename(p.with_name(p.name.replace("world_size_2_", "")))
    (step / "actor" / "fsdp_config.json").unlink()
    r = do_scan(run_copy)
    ck = next(c for c in the_run(r).checkpoints if c.path == str(step))
    assert ck.status is Status.COMPLETE and ck.world_size == 2
    assert {"missing-fsdp-config", "missing-rank"}.isdisjoint({f.code for f in ck.all_findings})


def test_sft_shards_directly_in_the_step_directory(run_copy):
    step = steps_of(run_copy)[0]
    for p in (step / "actor").iterdir():
        p.rename(step / p.name)
    (step / "actor").rmdir()
    r = do_scan(run_copy)
    ck = next(c for c in the_run(r).checkpoints if c.path == str(step))
    assert ck.status is Status.COMPLETE and [c.role for c in ck.components] == [""]
    shard(step, "model", 1).unlink()
    assert "missing-rank" in codes(do_scan(run_copy))


@pytest.mark.skipif(unprivileged() is None, reason="running as root without setpriv: chmod 000 cannot be enforced")
def test_unreadable_file_becomes_a_finding(run_copy):
    victim = shard(steps_of(run_copy)[0], "model", 0)
    victim.chmod(0)
    code = (
        "import json, sys; from ckpt_audit.scan import scan; r = scan([sys.argv[1]], in_progress_window_s=0);"
        "print(json.dumps(sorted({(f.code, f.path) for f in r.all_findings})))"
    )
    out = subprocess.run(
        [*unprivileged(), sys.executable, "-c", code, str(run_copy)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert ["unreadable", str(victim)] in json.loads(out.stdout)


def test_missing_root_is_an_error():
    with pytest.raises(ScanError):
        scan(["/nonexistent/ckpt-root"])


def test_every_registered_code_has_an_explanation():
    # each code's docs entry is held by tests/test_docs.py: docs/codes.md is generated from this registry
    assert all(c.explanation and c.code == k for k, c in CODES.items())


def test_optimizer_without_model_shards(run_copy):
    step = steps_of(run_copy)[0]
    for p in (step / "actor").glob("model_world_size_*"):
        p.unlink()
    r = do_scan(run_copy)
    assert "missing-model" in codes(r) and status_of(r, step) is Status.INCOMPLETE


def test_fsdp_config_that_is_not_json(run_copy):
    (steps_of(run_copy)[0] / "actor" / "fsdp_config.json").write_text("{world_size: 2")
    r = do_scan(run_copy)
    assert "fsdp-config-invalid" in codes(r)


@pytest.mark.parametrize(
    ("text", "expected"),
    [('{"world_size": 2}', 2), ('{"world_size": 0}', None), ('{"world_size": true}', None), ("{world", None)],
)
def test_verify_reads_the_config_world_size_as_the_scan_does(tmp_path, text, expected):
    """One parser for fsdp_config.json's world_size: verify's mesh check takes the scan's (a 0 or a bool the scan
    calls fsdp-config-invalid is no world size to compare a DeviceMesh with either)."""
    from ckpt_audit.layouts.verl_fsdp import config_world_size
    from ckpt_audit.rules.shards import parse_fsdp_config

    (tmp_path / "fsdp_config.json").write_text(text)
    assert config_world_size(str(tmp_path)) == expected == parse_fsdp_config("c", text)[0]
    assert config_world_size(str(tmp_path / "absent")) is None


def test_no_fsdp_config_is_noted(run_copy):
    (steps_of(run_copy)[0] / "actor" / "fsdp_config.json").unlink()
    r = do_scan(run_copy)
    assert "missing-fsdp-config" in codes(r) and status_of(r, steps_of(run_copy)[0]) is Status.COMPLETE


def test_empty_critic_directory(run_copy):
    (steps_of(run_copy)[0] / "critic").mkdir()
    assert "empty-role" in codes(do_scan(run_copy))


def test_damaged_central_directory_is_a_bad_zip(run_copy):
    import struct

    p = shard(steps_of(run_copy)[0], "optim", 0)
    data = p.read_bytes()
    eocd = data.rfind(b"PK\x05\x06")
    (cd_offset,) = struct.unpack_from("<I", data, eocd + 16)
    with open(p, "r+b") as f:
        f.seek(cd_offset)
        f.write(b"JUNK")
    r = do_scan(run_copy)
    assert "bad-zip" in codes(r) and status_of(r, steps_of(run_copy)[0]) is Status.CORRUPT


def test_legacy_torch_pickle_format_is_noted(run_copy):
    import torch

    p = steps_of(run_copy)[0] / "data.pt"
    torch.save({"_num_yielded": 1}, p, _use_new_zipfile_serialization=False)
    r = do_scan(run_copy)
    assert "legacy-pickle-format" in codes(r) and status_of(r, steps_of(run_copy)[0]) is Status.COMPLETE


def test_run_without_any_complete_checkpoint(run_copy):
    for step in steps_of(run_copy):
        shard(step, "model", 0).unlink()
    r = do_scan(run_copy)
    assert {"no-complete-checkpoint", "tracker-dangling"} <= codes(r) and the_run(r).latest_complete is None


def test_dtensor_mesh_must_match_the_file_world_size(run_copy):
    from ckpt_audit.readers.pt import read_pt_structure

    step = steps_of(run_copy)[0]
    assert read_pt_structure(shard(step, "model", 0)).has_dtensors  # the trainer's FSDP2 shards hold DTensors
    actor = step / "actor"
    w = len(list(actor.glob("model_world_size_*")))
    for p in sorted(actor.glob("*_world_size_*")):  # relabel the W-rank set as a (2W)-rank one, ranks copied
        kind, rank = p.name.split("_world_size_")[0], int(p.stem.rsplit("_", 1)[1])
        for r in (rank, rank + w):
            shutil.copy2(p, actor / f"{kind}_world_size_{2 * w}_rank_{r}.pt")
        p.unlink()
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2 * w}, indent=4))
    r = do_scan(run_copy)
    assert "mesh-size-mismatch" in codes(r) and "missing-rank" not in codes(r)


def test_root_without_runs_is_not_silently_clean(tmp_path):
    (tmp_path / "empty-mount").mkdir()
    r = do_scan(tmp_path / "empty-mount")
    assert [f.code for f in r.findings] == ["no-runs"] and r.runs == ()


@pytest.mark.parametrize(
    "fixture,roles,world",
    [
        ("verl_run_w3", [["actor"]], 3),
        ("verl_run_hsdp", [["actor"]], 4),
        ("verl_run_w1", [["actor"]], 1),
        ("verl_run_critic", [["actor", "critic"]], 3),
        ("verl_run_sft", [[""]], 2),
    ],
)
def test_every_harness_layout_scans_complete_and_clean(request, fixture, roles, world):
    """Uneven chunks, HSDP meshes, W=1, critics and SFT trees from the reference trainer are all healthy."""
    run_dir = Path(request.getfixturevalue(fixture))
    r = do_scan(run_dir)
    run = the_run(r)
    assert [c.status for c in run.checkpoints] == [Status.COMPLETE] * len(run.checkpoints) and run.checkpoints
    assert [[c.role for c in ck.components] for ck in run.checkpoints[:1]] == roles
    assert {ck.world_size for ck in run.checkpoints} == {world}
    assert [f for f in r.all_findings if f.severity >= Severity.WARNING] == []


def test_an_interrupted_prune_leaves_trash_that_is_reported_not_hashed(run_copy, tmp_path):
    """A prune killed right after its first rename: the step is now prune's trash. The scan reports the disk it
    holds, reads none of it, and no longer counts it as a checkpoint; the next prune reclaims it."""
    from ckpt_audit.killpoints import KILL_AFTER_ENV

    root = run_copy.parent.parent
    catalog = tmp_path / "c.db"
    prune = ("prune", root, "--keep-last", "1", "--yes")
    assert ckpt_audit(*prune, catalog=catalog, env={KILL_AFTER_ENV: "1"}, timeout=120).returncode == -9
    [trash] = [p for p in run_copy.iterdir() if p.name.startswith(".ckpt-audit-trash-global_step_")]
    trash_bytes = sum(f.stat().st_size for f in trash.rglob("*") if f.is_file())
    clean = do_scan(root)
    [left] = [f for f in clean.all_findings if f.code == "prune-leftover"]
    assert left.path == str(trash) and left.severity is Severity.INFO and "next `ckpt-audit prune`" in left.message
    assert f"{sum(1 for f in trash.rglob('*') if f.is_file())} file(s)" in left.message
    assert all(not f.path.startswith(str(trash)) for c in the_run(clean).checkpoints for f in c.files)
    everything = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert trash_bytes > 0 and clean.bytes_hashed == everything - trash_bytes  # every file read but the trash
    assert ckpt_audit(*prune, catalog=catalog, timeout=120).returncode == 0
    assert not trash.exists() and "prune-leftover" not in codes(do_scan(root))
