"""Red-team attacks on what `scan` says about a run's tracker, through the real CLI on a trainer-written tree.

A tracker that exists but cannot be read is not a missing tracker: resume still loads the step it names, so scan
reports `tracker-unread` (and prune keeps every checkpoint of the run: tests/test_prune_safety.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from cli_proc import ckpt_audit


def scan_json(root: Path, catalog: Path) -> dict:
    proc = ckpt_audit("scan", "--json", root, catalog=catalog, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def test_tracker_linked_out_of_the_root_is_unread_not_missing(verl_run, copy_run, tmp_path):
    run = Path(copy_run(verl_run))
    tracker = run / "latest_checkpointed_iteration.txt"
    outside = tmp_path / "tracker-elsewhere.txt"
    tracker.rename(outside)
    tracker.symlink_to(outside)
    doc = scan_json(run, tmp_path / "c.db")
    [scanned] = doc["runs"]
    codes = [f["code"] for f in scanned["findings"]]
    assert "tracker-unread" in codes and "tracker-missing" not in codes
    assert codes.count("symlink-outside-root") == 1
    assert not [f for f in doc["findings"] if f["code"] == "symlink-outside-root"]  # reported once, on the run


def test_tracker_too_large_to_read_is_unread(verl_run, copy_run, tmp_path):
    run = Path(copy_run(verl_run))
    (run / "latest_checkpointed_iteration.txt").write_text("6" + " " * 70_000)
    doc = scan_json(run, tmp_path / "c.db")
    [scanned] = doc["runs"]
    assert [f["code"] for f in scanned["findings"]] == ["tracker-unread"]
