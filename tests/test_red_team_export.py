"""Red-team attacks on export's destination check and on the unsafe-pickle reading (issue 11, invariants 5 and 6),
each found by a hostile review after the issue landed. Real CLI in a subprocess, on trees the reference trainer wrote
(tests/conftest.py), copied before they are touched. Payloads would `touch` a marker file if anything ran them.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from cli_proc import ckpt_audit, unprivileged

from harness.checkpoint import load_file  # the trainer's own weights_only loader


def refused_with(proc: subprocess.CompletedProcess, code: int, needle: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt-audit: error: ") and needle in lines[0], lines


class _Payload:
    """Pickles as os.system('touch MARKER'); nothing in this test process unpickles it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _checkpoint(doc: dict, step: Path) -> dict:
    return next(c for r in doc["runs"] for c in r["checkpoints"] if c["path"] == str(step))


def _error_codes(ck: dict) -> set[str]:
    found = list(ck["findings"]) + [f for comp in ck["components"] for f in comp["findings"]]
    return {f["code"] for f in found if f["severity"] == "error"}


def _statuses(catalog: Path, run: Path, step: Path) -> list[tuple[str, str, int, set[str]]]:
    """(command, status, exit code, error codes) of step under scan, a cached re-scan and verify."""
    out = []
    for command, path in (("scan", run), ("scan", run), ("verify", step)):
        proc = ckpt_audit(command, path, "--json", catalog=catalog)
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        ck = _checkpoint(json.loads(proc.stdout), step)
        out.append((command, ck["status"], proc.returncode, _error_codes(ck)))
    return out


# ---------------------------------------------------------------------------------------------------- --to


def test_to_inside_a_run_no_catalog_knows_is_refused_and_nothing_is_written(verl_run, verl_run_w3, copy_run, tmp_path):
    run = copy_run(verl_run)
    other = tmp_path / "elsewhere" / "exp"  # a run no catalog and no root knows
    shutil.copytree(verl_run_w3, other, symlinks=True)
    before = sorted(p.name for p in other.iterdir())
    refused_with(
        ckpt_audit("export", run / "global_step_6", "--to", other / "hf", catalog=tmp_path / "c.db"),
        2,
        f"is inside the run {other}",
    )
    inside_step = other / "global_step_4" / "actor" / "huggingface" / "merged"
    refused_with(
        ckpt_audit("export", run / "global_step_6", "--to", inside_step, catalog=tmp_path / "c.db"),
        2,
        f"is inside the checkpoint {other / 'global_step_4'}",
    )
    assert sorted(p.name for p in other.iterdir()) == before and not inside_step.exists()


def test_force_onto_a_fresh_empty_step_dir_of_another_run_is_refused(verl_run, verl_run_w3, copy_run, tmp_path):
    run = copy_run(verl_run)
    other = tmp_path / "elsewhere" / "exp"
    shutil.copytree(verl_run_w3, other, symlinks=True)
    saving = other / "global_step_8"  # verl made the directory; the ranks are about to write into it
    saving.mkdir()
    refused_with(
        ckpt_audit("export", run / "global_step_6", "--to", saving, "--force", catalog=tmp_path / "c.db"),
        2,
        f"is the checkpoint {saving}",
    )
    assert saving.is_dir() and list(saving.iterdir()) == []


# ---------------------------------------------------------------------------------------------------- unsafe pickles


def test_unsafe_pickle_in_huggingface_bin_makes_the_checkpoint_unsafe(copy_run, verl_run, tmp_path):
    run = copy_run(verl_run)
    step = run / "global_step_6"
    marker = tmp_path / "MARKER"
    planted = step / "actor" / "huggingface" / "pytorch_model.bin"  # transformers torch.loads it
    torch.save({"lm_head.weight": torch.zeros(2), "hook": _Payload(marker)}, planted)
    results = _statuses(tmp_path / "c.db", run, step)
    assert not marker.exists()
    for command, status, rc, codes in results:
        assert (status, rc) == ("unsafe", 1) and "unsafe-pickle" in codes, (command, status, rc, codes)


def test_legitimate_huggingface_bin_stays_complete(copy_run, verl_run, tmp_path):
    run = copy_run(verl_run)
    step = run / "global_step_6"
    torch.save({"lm_head.weight": torch.zeros(2)}, step / "actor" / "huggingface" / "pytorch_model.bin")
    for command, status, rc, codes in _statuses(tmp_path / "c.db", run, step):
        assert (status, rc, codes) == ("complete", 0, set()), (command, status, rc, codes)


def test_a_zip_with_a_second_data_pkl_is_not_complete(copy_run, verl_run, tmp_path):
    """torch.save never repeats an entry; with two data.pkl the scan read one copy, torch.load may run the other."""
    run = copy_run(verl_run)
    step = run / "global_step_6"
    marker = tmp_path / "MARKER"
    target = next((step / "actor").glob("extra_state_world_size_*_rank_0.pt"))
    with zipfile.ZipFile(target) as zf:
        entries = [(name, zf.read(name)) for name in zf.namelist()]
    pkl_name = next(name for name, _ in entries if name.endswith("/data.pkl"))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as out, pytest.warns(UserWarning, match="Duplicate name"):
        out.writestr(pkl_name, pickle.dumps({"hook": _Payload(marker)}, protocol=2))
        for name, data in entries:
            out.writestr(name, data)  # the real data.pkl last: the copy a last-wins reader sees
    target.write_bytes(buf.getvalue())
    assert load_file(target) is not None  # the trainer's weights_only load takes the real copy here
    results = _statuses(tmp_path / "c.db", run, step)
    assert not marker.exists()
    for command, status, rc, codes in results:
        assert status != "complete" and rc == 1 and "bad-zip" in codes, (command, status, rc, codes)


def test_a_file_added_to_the_earlier_export_during_a_force_export_is_not_deleted(copy_run, verl_run, tmp_path):
    """--force was judged at the start; what --to holds when the new export is swapped in is judged again."""
    from ckpt_audit.export.guard import ExportError
    from ckpt_audit.export.orchestrator import export_checkpoint

    run = Path(copy_run(verl_run))
    out = tmp_path / "hf"
    export_checkpoint(run / "global_step_4", out)
    mine = out / "notes.txt"

    def meanwhile(done: int, total: int, name: str) -> None:  # the user writes into it while step 6 exports
        if done == 1:
            mine.write_text("my notes")

    with pytest.raises(ExportError, match="holds notes.txt, which the export did not write"):
        export_checkpoint(run / "global_step_6", out, force=True, progress=meanwhile)
    assert mine.read_text() == "my notes"
    assert not [p for p in tmp_path.iterdir() if "ckpt-audit-tmp" in p.name]  # the new export's work dir is gone


@pytest.mark.skipif(unprivileged() is None, reason="root without setpriv: chmod is not enforced")
def test_an_unreadable_huggingface_dir_is_one_line_naming_it(copy_run, verl_run, tmp_path):
    """huggingface/ without read permission: the export and --check were a bare 'PermissionError: [Errno 13] ...'
    line from the last-resort handler; now the project's one line naming what could not be read, exit 3."""
    hf = copy_run(verl_run) / "global_step_6" / "actor" / "huggingface"
    hf.chmod(0)
    try:
        for args in (("--to", tmp_path / "hf"), ("--check", tmp_path)):
            proc = ckpt_audit("export", hf.parent.parent, *args, catalog=tmp_path / "c.db", as_user=True)
            refused_with(proc, 3, f"cannot read {hf / 'config.json'} (Permission denied); nothing was written")
    finally:
        hf.chmod(0o755)
    assert not (tmp_path / "hf").exists()
