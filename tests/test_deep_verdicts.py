"""Verdicts are never forgotten (issue 26): what verify finds binds every later judgement while its files stand.

Each tree is a private copy of the trainer's verl_run (steps 2, 4, 6; tracker 6) with step 6 broken in a way only
verify's deep checks see: a plain scan calls it complete. After `verify`, every later judgement through the real CLI
(plain scan, the cached re-scan, prune, latest, latest --verified, fix-tracker) and the TUI's refresh
(session.browse) must call step 6 what verify called it, until a file verify read changes.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from cli_json import age, codes_of, invoke, scan_json, statuses
from scan_trees import shard, steps_of

from ckpt_audit.catalog.deep_verdicts import read_deep_verdicts, record_deep_verdicts
from ckpt_audit.catalog.node_memory import NodeMemory
from ckpt_audit.cluster import ray_scan
from ckpt_audit.cluster.noderoots import ENV
from ckpt_audit.deep import safe_load
from ckpt_audit.session import browse, record_if_free
from ckpt_audit.verify import verify

pytestmark = pytest.mark.slow


def rewrite(path: Path, change) -> None:
    """Load with weights_only, change, torch.save back under the same stem (the archive folder stays right)."""
    value = safe_load._torch_load(str(path))
    value = change(value) or value
    tmp = path.parent / ".rewrite"
    tmp.mkdir()
    torch.save(value, tmp / path.name)
    os.replace(tmp / path.name, path)
    tmp.rmdir()


def _no_scheduler(step: Path) -> None:
    rewrite(shard(step, "extra_state", 0), lambda e: {k: v for k, v in e.items() if k != "lr_scheduler"})


def _optim_other_step(step: Path) -> None:
    def change(o):
        for st in o["state"].values():
            st["step"] = st["step"] + 3

    rewrite(shard(step, "optim", 1), change)


def _param_groups_differ(step: Path) -> None:
    rewrite(shard(step, "optim", 1), lambda o: o["param_groups"][0].update(lr=0.5))


def _bad_data_pt(step: Path) -> None:
    tmp = step / ".rewrite"
    tmp.mkdir()
    torch.save({"not": "a dataloader"}, tmp / "data.pt")
    os.replace(tmp / "data.pt", step / "data.pt")
    tmp.rmdir()


# corruption -> the code verify reports for it (a plain scan sees none of them)
CORRUPTIONS = {
    "lr-scheduler-missing": _no_scheduler,
    "optimizer-step-differs": _optim_other_step,
    "param-groups-differ": _param_groups_differ,
    "dataloader-state-invalid": _bad_data_pt,
}


def broken_copy(copy_run, verl_run, tmp_path: Path, corrupt) -> tuple[Path, Path, Path]:
    """(root, run, catalog): a copy of verl_run with step 6 broken, dated an hour back (nothing being written)."""
    run = copy_run(verl_run)
    corrupt(steps_of(run)[-1])
    age(run.parent.parent)
    return run.parent.parent, run, tmp_path / "c.db"


def step_dir(run: Path, step: int) -> Path:
    return run / f"global_step_{step}"


def verified(root: Path, catalog: Path, code: str) -> dict:
    """verify's document, after checking that the plain scan misses the defect and verify finds it."""
    shallow = scan_json(root, catalog)
    assert statuses(shallow)[6] == "complete" and code not in codes_of(shallow, 6)
    doc = scan_json(root, catalog, command="verify")
    assert statuses(doc)[6] == "incomplete" and code in codes_of(doc, 6)
    return doc


def test_verify_then_prune_keeps_the_checkpoint_verify_accepts(copy_run, verl_run, tmp_path):
    """The issue's sequence: verify rejects step 6; scan, latest, latest --verified, fix-tracker and prune then treat
    step 6 as verify did, and prune --keep-last 1 keeps step 4; a good file in its place frees step 6 again."""
    root, run, db = broken_copy(copy_run, verl_run, tmp_path, _no_scheduler)
    verified(root, db, "lr-scheduler-missing")

    again = scan_json(root, db)
    assert statuses(again)[6] == "incomplete"
    assert {"lr-scheduler-missing", "deep-verdict-kept"} <= codes_of(again, 6)

    for gate in (["latest"], ["latest", "--verified"]):
        res = invoke(*gate, "--json", str(run), catalog=db)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["checkpoint"] == str(step_dir(run, 4))

    fix = invoke("fix-tracker", "--json", str(run), catalog=db)
    assert fix.exit_code == 1, fix.output  # dry run: the tracker needs a fix
    assert json.loads(fix.stdout)["new_step"] == 4

    pruned = invoke("prune", "--keep-last", "1", "--yes", str(root), catalog=db)
    assert pruned.exit_code == 0, pruned.output
    assert step_dir(run, 4).is_dir() and step_dir(run, 6).is_dir() and not step_dir(run, 2).exists()

    # a good file in place of the bad one (new bytes, new inode): the verdict verify made no longer binds
    bad = shard(step_dir(run, 6), "extra_state", 0)
    bad.unlink()
    shutil.copy2(shard(step_dir(Path(verl_run), 6), "extra_state", 0), bad)
    age(root)
    fresh = scan_json(root, db)
    assert statuses(fresh)[6] == "complete"
    assert "deep-verdict-stale" in codes_of(fresh, 6) and "lr-scheduler-missing" not in codes_of(fresh, 6)
    later = scan_json(root, db)  # the stale verdict was dropped when that scan was recorded: said once
    assert statuses(later)[6] == "complete" and "deep-verdict-stale" not in codes_of(later, 6)
    res = invoke("latest", "--json", str(run), catalog=db)
    assert json.loads(res.stdout)["checkpoint"] == str(step_dir(run, 6))


def test_a_late_shallow_record_and_the_cached_rescan_keep_the_deep_verdict(copy_run, verl_run, tmp_path):
    """A plain judgement made before verify and recorded after it (the TUI's refresh scans without the lock) does not
    erase verify's verdict; the next scan, and the cached re-scan after it, keep it."""
    root, run, db = broken_copy(copy_run, verl_run, tmp_path, _no_scheduler)
    before_verify, _ = browse([str(root)], db)
    assert {c.step: c.status.value for c in before_verify.runs[0].checkpoints}[6] == "complete"
    verified(root, db, "lr-scheduler-missing")
    assert record_if_free(before_verify, db) == ""

    first = scan_json(root, db)
    assert statuses(first)[6] == "incomplete" and "lr-scheduler-missing" in codes_of(first, 6)
    cached = scan_json(root, db)
    assert cached["runs_reused"] == 1  # the verdict cache answered, and it kept verify's verdict
    assert statuses(cached)[6] == "incomplete" and "lr-scheduler-missing" in codes_of(cached, 6)


def test_a_deep_verdict_recorded_after_the_cache_entry_invalidates_it(copy_run, verl_run, tmp_path):
    """The run verdict cache's key covers the deep verdicts kept for the run: one written after the cached verdict
    (here alone, without the rest of verify's record) makes the next scan judge the run afresh, with it."""
    root, run, db = broken_copy(copy_run, verl_run, tmp_path, _no_scheduler)
    scan_json(root, db)
    assert scan_json(root, db)["runs_reused"] == 1
    deep = verify([str(root)])  # not recorded: only its deep verdicts are written below
    conn = sqlite3.connect(db)
    with conn:
        record_deep_verdicts(conn, deep, scan_id=0)
    conn.close()
    after = scan_json(root, db)
    assert after["runs_reused"] == 0
    assert statuses(after)[6] == "incomplete" and "lr-scheduler-missing" in codes_of(after, 6)


@pytest.mark.parametrize("code", sorted(CORRUPTIONS))
def test_every_later_judgement_is_the_worse_of_scan_and_verify(copy_run, verl_run, tmp_path, code):
    """Invariant, per corruption verify alone finds: after verify, each later judgement of step 6 is verify's status
    with verify's findings, and none names or keeps step 6 over step 4 as the checkpoint to resume."""
    root, run, db = broken_copy(copy_run, verl_run, tmp_path, CORRUPTIONS[code])
    doc = verified(root, db, code)
    deep = {f["code"] for f in doc["runs"][0]["checkpoints"][-1]["findings"]} | codes_of(doc, 6)

    for judged in (scan_json(root, db), scan_json(root, db), scan_json(root, db, "--rehash")):
        assert statuses(judged) == statuses(doc)
        assert deep <= codes_of(judged, 6)
    tui, _ = browse([str(root)], db)
    assert {c.step: c.status.value for c in tui.runs[0].checkpoints} == statuses(doc)
    assert json.loads(invoke("latest", "--json", str(run), catalog=db).stdout)["step"] == 4
    plan = json.loads(invoke("prune", "--dry-run", "--json", "--keep-last", "1", str(root), catalog=db).stdout)["plan"]
    assert 4 in {k["step"] for k in plan["keep"]} and 4 not in {d["step"] for d in plan["delete"]}


def test_the_ray_scan_keeps_the_deep_verdict(copy_run, verl_run, tmp_path, monkeypatch):
    """scan --ray's judgement (the driver's judge_cluster over each node's answer, run here as in
    tests/test_cluster_nodes.py): after verify, rank 1's files moved to a second node's disk (a rename: same stat,
    same bytes), step 6 is what verify called it."""
    root, run, db = broken_copy(copy_run, verl_run, tmp_path, _no_scheduler)
    verified(root, db, "lr-scheduler-missing")
    node1 = tmp_path / "node1"
    for f in root.rglob("*_rank_1.pt"):
        os.renames(f, node1 / f.relative_to(root))
    ids = ["a1" * 28, "b2" * 28]
    table = tmp_path / "node_roots.json"
    table.write_text(json.dumps({ids[1]: {str(root): str(node1)}}))
    monkeypatch.setenv(ENV, f"@{table}")
    answers = [ray_scan.scan_on_this_node([str(root)], nid) for nid in ids]
    result = ray_scan.judge_cluster(
        [str(root)],
        answers,
        [],
        memory=NodeMemory(facts={}, last_answered_ns={}),
        now_ns=time.time_ns(),
        in_progress_window_s=60,
        deep=read_deep_verdicts(db),
    )
    step6 = result.runs[0].checkpoints[-1]
    assert step6.step == 6 and step6.status.value == "incomplete"
    assert "lr-scheduler-missing" in {f.code for f in step6.all_findings}


def test_a_damaged_row_is_not_read(tmp_path):
    """A hand-edited deep_verdicts row (bad JSON, a wrong shape) is skipped, as a damaged cached run verdict is:
    no traceback for every later scan."""
    from ckpt_audit.catalog import open_catalog

    db = tmp_path / "c.db"
    open_catalog(db).close()
    conn = sqlite3.connect(db)
    with conn:
        conn.executemany(
            "INSERT INTO deep_verdicts (checkpoint_path, run_path, scan_id, judged_ns, findings, files)"
            " VALUES (?, 'r', 1, 0, ?, ?)",
            [
                ("a", "[]", "{not json"),
                ("b", "[]", "[[1, 2]]"),
                ("c", '[{"severity": "nope"}]', "[]"),
                ("d", "[]", "[]"),
            ],
        )
    conn.close()
    assert sorted(read_deep_verdicts(db)) == ["d"]


def test_the_tuis_refresh_after_its_verify_keeps_the_verdict(copy_run, verl_run, tmp_path):
    """In the TUI: `v` (verify the run) finds step 6 broken; `r` (the background rescan, a plain scan) keeps it so."""
    from textual.widgets import DataTable
    from tui_pilot import drive, open_run, settle

    from tui.app import AuditApp

    root, run, db = broken_copy(copy_run, verl_run, tmp_path, _no_scheduler)
    app = AuditApp(catalog_path=db, roots=[str(root)])
    key = str(step_dir(run, 6).resolve())

    async def script(pilot):
        screen = await open_run(pilot)
        table = screen.query_one("#checkpoints", DataTable)

        def status() -> str:
            return str(table.get_row_at(table.get_row_index(key))[2])

        assert "complete" in status() and "incomplete" not in status()
        await pilot.press("v")
        await settle(pilot)
        assert app.last_error is None and "incomplete" in status()
        verified_view = app.snapshot
        await pilot.press("r")
        await settle(pilot)
        assert app.last_error is None and app.snapshot is not verified_view  # the plain rescan's view now
        assert "incomplete" in status()

    drive(app, script)
