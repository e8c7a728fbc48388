"""fix-tracker on a DeepSpeed save directory: `latest` rewritten to name the newest whole tag, with the bytes
DeepSpeed's own save_checkpoint writes (`fd.write(tag)`: the tag's name, no newline), by the same safe write as
verl's tracker (target re-read by content, old content kept, temporary + fsync + rename, kill-safe); and the resume
gate's `latest --print tag`, the tag for load_checkpoint(tag=...). Copies of the cached trees of
tests/test_deepspeed.py; the repaired tree is resumed once by DeepSpeed itself."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_json import age, invoke, scan_json
from cli_proc import ckpt_audit
from ranks import run_ranks
from test_deepspeed import ds_z2, hf_ds, optim  # noqa: F401  (the session fixtures and a helper)

from ckpt_audit.killpoints import KILL_AFTER_ENV

LOADER = Path(__file__).with_name("_load_deepspeed.py")


@pytest.fixture
def save_dir(ds_z2, tmp_path) -> Path:  # noqa: F811
    dst = tmp_path / "ds"
    shutil.copytree(ds_z2, dst)
    return dst


def _truncate(shard: Path) -> None:
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)


@pytest.mark.slow
@pytest.mark.parametrize(
    "old, cut, new",
    [
        (None, False, b"global_step6"),  # missing: load_checkpoint(tag=None) warns and trains from scratch
        (b"global_step4", False, b"global_step6"),  # behind: it resumes the older tag
        (b"global_step8", False, b"global_step6"),  # dangling: it fails to find the tag
        (b"", False, b"global_step6"),  # empty: it looks for shards in the save directory itself
        (b"global_step6", True, b"global_step4"),  # names a corrupt tag: rank 1's torch.load raises
    ],
    ids=["missing", "behind", "dangling", "empty", "names-corrupt"],
)
def test_fix_tracker_rewrites_latest_to_the_newest_whole_tag(save_dir, tmp_path, old, cut, new):
    db = tmp_path / "c.db"
    latest = save_dir / "latest"
    if old is None:
        latest.unlink()
    else:
        latest.write_bytes(old)
    if cut:
        _truncate(optim(save_dir / "global_step6", 1))
    age(save_dir)
    dry = invoke("fix-tracker", str(save_dir), catalog=db)
    assert dry.exit_code == 1 and f"would write {new.decode()}" in dry.output, dry.output
    assert (latest.read_bytes() if latest.exists() else None) == old  # a dry run writes nothing
    res = invoke("fix-tracker", "--yes", str(save_dir), catalog=db)
    assert res.exit_code == 0, res.output
    assert latest.read_bytes() == new  # exactly what save_checkpoint writes
    backups = list(save_dir.glob("latest.ckpt-audit-old-*"))
    assert [b.read_bytes() for b in backups] == ([] if old is None else [old])
    assert not list(save_dir.glob(".latest.ckpt-audit-tmp-*"))
    doc = scan_json(save_dir, db)
    assert not [f for f in doc["runs"][0]["findings"] if f["code"].startswith("ds-latest")]
    assert doc["runs"][0]["tracker_step"] == int(new.removeprefix(b"global_step"))
    again = invoke("fix-tracker", str(save_dir), catalog=db)
    assert again.exit_code == 0 and ": ok (" in again.output


@pytest.mark.slow
def test_fix_tracker_reads_the_target_by_content_before_writing(save_dir, tmp_path):
    """A bit flipped in the target after the scan cached it (same size and mtime): the re-read catches it and
    `latest` is left as it was."""
    db = tmp_path / "c.db"
    (save_dir / "latest").write_bytes(b"global_step4")
    age(save_dir)
    assert invoke("scan", str(save_dir), catalog=db).exit_code == 0  # the catalog now holds the good hashes
    shard = optim(save_dir / "global_step6", 0)
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = invoke("fix-tracker", "--yes", str(save_dir), catalog=db)
    assert res.exit_code == 1 and "failed its re-read" in res.output, res.output
    assert (save_dir / "latest").read_bytes() == b"global_step4"


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", [1, 2, 3, 4])
def test_fix_tracker_killed_at_any_point_leaves_a_whole_latest(save_dir, tmp_path, kill_after):
    """SIGKILL after the backup, the temporary file, the rename, the directory fsync: `latest` names the old or the
    new tag, whole, and a second run finishes the fix."""
    db = tmp_path / "c.db"
    (save_dir / "latest").write_bytes(b"global_step4")
    age(save_dir)
    cmd = ("fix-tracker", "--yes", save_dir)
    killed = ckpt_audit(*cmd, catalog=db, env={KILL_AFTER_ENV: str(kill_after)}, timeout=120)
    assert killed.returncode == -9, (killed.returncode, killed.stderr)
    assert (save_dir / "latest").read_bytes() in (b"global_step4", b"global_step6")
    age(save_dir / "latest")  # the killed write is not a trainer that is alive
    again = ckpt_audit(*cmd, catalog=db, timeout=120)
    assert again.returncode == 0, again.stderr
    assert (save_dir / "latest").read_bytes() == b"global_step6"
    assert not list(save_dir.glob(".latest.ckpt-audit-tmp-*"))


@pytest.mark.slow
def test_deepspeed_resumes_the_tag_fix_tracker_wrote(save_dir, tmp_path):
    """The proof by DeepSpeed itself: `latest` names global_step6, whose rank-1 optimizer shard is truncated (its
    load_checkpoint(tag=None) would die in torch.load); after fix-tracker, DeepSpeed's load_checkpoint(save_dir)
    with no tag resumes global_step4."""
    _truncate(optim(save_dir / "global_step6", 1))
    age(save_dir)
    assert invoke("fix-tracker", "--yes", str(save_dir), catalog=tmp_path / "c.db").exit_code == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    res = run_ranks(LOADER, str(save_dir), env=env, cwd=tmp_path, timeout=600)  # 2 ranks, as torchrun starts them
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"loaded {save_dir}/global_step4/mp_rank_00_model_states.pt global_steps=4" in res.stdout, res.stdout


@pytest.mark.slow
def test_latest_verified_prints_the_tag_for_load_checkpoint(save_dir, tmp_path):
    """--print tag: the tag DeepSpeed's load_checkpoint(save_dir, tag=...) takes; the default stays the directory.
    A bit flipped in global_step6 after the scan cached it is passed over by --verified for global_step4."""
    db = tmp_path / "c.db"
    age(save_dir)
    res = invoke("latest", "--verified", "--print", "tag", str(save_dir), catalog=db)
    assert res.exit_code == 0 and res.stdout == "global_step6\n", res.output
    assert invoke("latest", str(save_dir), catalog=db).stdout == f"{save_dir / 'global_step6'}\n"
    shard = optim(save_dir / "global_step6", 0)
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = invoke("latest", "--verified", "--print", "tag", "--json", str(save_dir), catalog=db)
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and (doc["tag"], doc["step"]) == ("global_step4", 4), res.output
    res = invoke("latest", "--verified", "--print", "tag", str(save_dir), catalog=db)
    assert res.exit_code == 0 and res.stdout == "global_step4\n", res.output


@pytest.mark.slow
def test_latest_print_tag_is_a_usage_error_outside_a_deepspeed_save_dir(hf_ds, tmp_path):  # noqa: F811
    """An HF Trainer run (DeepSpeed inside or not) resumes from the checkpoint-N directory: no tag to print."""
    out = tmp_path / "out"
    shutil.copytree(hf_ds, out)
    age(out)
    res = invoke("latest", "--print", "tag", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 2 and "not a DeepSpeed one" in res.output and not res.stdout.startswith("/"), res.output
    res = invoke("latest", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip().startswith(str(out / "checkpoint-")), res.output
