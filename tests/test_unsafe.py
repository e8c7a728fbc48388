"""Invariant 6 of issue 11, unsafe is not complete: a pickle that names a global outside the allowlist, in any
container (torch.save zip, the legacy non-zip format, a raw pickle stream) and in any file a resume loads (model,
optim, extra_state, data.pt), is an `unsafe-pickle` error; the checkpoint is `unsafe` under `scan` and `verify`
(the real CLI, in a subprocess), which exit 1, and the payload never runs. A legitimate legacy-format checkpoint
is complete under both.

Payloads are built without running them: `torch.save` of an object whose __reduce__ names os.system pickles the
name, and a hand-written protocol 0 pickle spells `cos\\nsystem`. Each planted file replaces a real file of a
trainer-written tree (tests/conftest.py `verl_run`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from cli_proc import ckpt_audit

from harness.checkpoint import load_file  # the trainer's own weights_only loader


class _Payload:
    """Pickles as os.system('touch MARKER'); the test process never unpickles it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _raw_pickle(marker: Path) -> bytes:
    return f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()  # protocol 0: GLOBAL os.system, REDUCE


def _save(value, path: Path, *, legacy: bool) -> None:
    """torch.save under the same name (the zip's folder is the stem at save time), then replace the original."""
    tmp = path.parent / ".plant"
    tmp.mkdir(exist_ok=True)
    torch.save(value, tmp / path.name, _use_new_zipfile_serialization=not legacy)
    os.replace(tmp / path.name, path)
    tmp.rmdir()


def _target(step: Path, kind: str, rank: int = 0) -> Path:
    if kind == "data":
        return step / "data.pt"
    return next((step / "actor").glob(f"{kind}_world_size_*_rank_{rank}.pt"))


def _plant(step: Path, kind: str, container: str, marker: Path) -> Path:
    target = _target(step, kind)
    if container == "raw":
        target.write_bytes(_raw_pickle(marker))
        return target
    value = load_file(target)
    value["resume_hook"] = _Payload(marker)
    _save(value, target, legacy=container == "legacy")
    return target


def _cli(*args: str, catalog: Path) -> tuple[int, dict, str]:
    proc = ckpt_audit(*args, "--json", "--catalog", catalog, timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _checkpoint(doc: dict, step: Path) -> dict:
    return next(c for r in doc["runs"] for c in r["checkpoints"] if c["path"] == str(step))


def _findings(ck: dict) -> list[dict]:
    return list(ck["findings"]) + [f for comp in ck["components"] for f in comp["findings"]]


def _latest(run: Path) -> Path:
    return max(run.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))


@pytest.mark.parametrize(
    ("kind", "container"),
    [
        ("extra_state", "zip"),
        ("extra_state", "legacy"),
        ("data", "zip"),
        ("data", "legacy"),
        ("data", "raw"),
        ("model", "zip"),
        ("model", "legacy"),
        ("optim", "raw"),
    ],
)
def test_code_on_resume_makes_the_checkpoint_unsafe(copy_run, verl_run, tmp_path, kind, container):
    run = copy_run(verl_run)
    step = _latest(run)
    marker = tmp_path / "MARKER"
    planted = _plant(step, kind, container, marker)
    catalog = tmp_path / "c.db"
    for command, path in (("scan", run), ("verify", step)):
        rc, doc, err = _cli(command, str(path), catalog=catalog)
        assert not marker.exists(), f"{command} ran the payload"
        ck = _checkpoint(doc, step)
        unsafe = [f for f in _findings(ck) if f["code"] == "unsafe-pickle"]
        assert [f["path"] for f in unsafe] == [str(planted)], (command, _findings(ck))
        assert unsafe[0]["severity"] == "error" and "system" in unsafe[0]["message"]
        assert ck["status"] == "unsafe", (command, ck["status"], _findings(ck))
        assert rc == 1, (command, rc, err[-500:])
    assert not marker.exists()


def test_rescan_that_reuses_the_file_keeps_it_unsafe(copy_run, verl_run, tmp_path):
    run = copy_run(verl_run)
    step = _latest(run)
    _plant(step, "extra_state", "legacy", tmp_path / "MARKER")
    catalog = tmp_path / "c.db"
    _cli("scan", str(run), catalog=catalog)
    rc, doc, _ = _cli("scan", str(run), catalog=catalog)
    assert doc["files_reused"] > 0 and _checkpoint(doc, step)["status"] == "unsafe" and rc == 1
    assert not (tmp_path / "MARKER").exists()


def test_rescan_that_reuses_a_raw_pickle_keeps_it_incomplete(copy_run, verl_run, tmp_path):
    import pickle

    run = copy_run(verl_run)
    step = _latest(run)
    _target(step, "optim").write_bytes(pickle.dumps({"state": {}, "param_groups": []}))
    catalog = tmp_path / "c.db"
    _cli("scan", str(run), catalog=catalog)
    rc, doc, _ = _cli("scan", str(run), catalog=catalog)
    ck = _checkpoint(doc, step)
    assert doc["files_reused"] > 0 and "raw-pickle" in {f["code"] for f in _findings(ck)}
    assert ck["status"] == "incomplete" and rc == 1


def test_legitimate_legacy_format_checkpoint_is_complete(copy_run, verl_run, tmp_path):
    run = copy_run(verl_run)
    step = _latest(run)
    legacy = [_target(step, k) for k in ("model", "optim", "extra_state", "data")]
    for path in legacy:
        _save(load_file(path), path, legacy=True)
    catalog = tmp_path / "c.db"
    for command, path in (("scan", run), ("verify", step)):
        rc, doc, err = _cli(command, str(path), catalog=catalog)
        ck = _checkpoint(doc, step)
        found = _findings(ck)
        assert ck["status"] == "complete", (command, found)
        assert sorted(f["path"] for f in found if f["code"] == "legacy-pickle-format") == sorted(map(str, legacy))
        assert not [f for f in found if f["severity"] != "info"], (command, found)
        assert rc == 0, (command, rc, err[-500:])


def test_legacy_shard_structure_is_read_like_a_zip(verl_run, tmp_path):
    from ckpt_audit.readers.pt import read_pt_structure

    src = _target(_latest(Path(verl_run)), "model")
    legacy = tmp_path / src.name
    torch.save(load_file(src), legacy, _use_new_zipfile_serialization=False)
    zipped, old = read_pt_structure(src), read_pt_structure(legacy)
    assert old.container == "legacy" and old.problems == () and old.unsafe_globals == frozenset()
    shape = lambda s: sorted((t.key, t.dtype, t.shape, t.global_shape, t.placements, t.mesh_ranks) for t in s.tensors)  # noqa: E731
    assert shape(old) == shape(zipped) and old.has_dtensors


def test_truncated_legacy_shard_is_corrupt(copy_run, verl_run, tmp_path):
    run = copy_run(verl_run)
    path = _target(_latest(run), "model")
    _save(load_file(path), path, legacy=True)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    rc, doc, _ = _cli("scan", str(run), catalog=tmp_path / "c.db")
    ck = _checkpoint(doc, _latest(run))
    assert "truncated" in {f["code"] for f in _findings(ck)} and ck["status"] == "corrupt" and rc == 1


def test_no_text_suggests_loading_without_weights_only():
    repo = Path(__file__).resolve().parent.parent
    texts = [
        repo / "README.md",
        *(repo / "docs").glob("*.md"),
        *(repo / "ckpt_audit").rglob("*.py"),
        *(repo / "tui").rglob("*.py"),
    ]
    hits = [str(p) for p in texts if "weights_only=False" in p.read_text(encoding="utf-8")]
    assert hits == []
