"""The real TUI driven through Textual's Pilot at 80x24, over real checkpoint trees and a real catalog.

Trees come from the harness (`verl_run`, real multi-process FSDP, from tests/conftest.py); the Pilot helpers are
in tui_pilot.py. What stray keys must not do is in test_tui_safety.py.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from click.testing import CliRunner
from textual.widgets import DataTable, Input
from tui_pilot import confirm_delete, drive, open_run, settle, steps_on_disk, text_of, wait_armed

from ckpt_audit import lock
from ckpt_audit.catalog import open_catalog
from ckpt_audit.catalog.lifecycle import LifecycleLog
from ckpt_audit.cli import cli
from ckpt_audit.codes import explain
from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
from ckpt_audit.models import format_size
from tui.app import AuditApp
from tui.screens.checkpoints import CheckpointsScreen
from tui.screens.confirm import ConfirmPrune
from tui.screens.details import DetailsScreen
from tui.screens.help import HelpScreen
from tui.screens.prompt import ExportPrompt, NumberPrompt
from tui.screens.runs import RunsScreen


@pytest.fixture
def tree(verl_run, copy_run) -> tuple[Path, Path]:
    """(root, run dir): a private copy of the session run, safe to prune."""
    run = Path(copy_run(verl_run))
    return run.parent.parent, run


def test_navigation_runs_checkpoints_details_help(tree, tmp_path):
    root, run = tree
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        assert app.last_error is None
        runs = app.screen.query_one("#runs", DataTable)
        assert runs.row_count == 1
        row = runs.get_row_at(0)
        scanned = app.snapshot.runs[0]
        assert row[0] == scanned.name and row[1] == str(len(scanned.checkpoints))
        assert row[3] == str(scanned.latest_complete.step)
        if (run / "metrics.jsonl").exists():  # the harness logs loss per step: the runs view draws its curve
            assert scanned.metrics_path and 2 <= len(row[6]) <= 12 and set(row[6]) <= set("▁▂▃▄▅▆▇█ ")

        screen = await open_run(pilot)
        table = screen.query_one("#checkpoints", DataTable)
        assert table.row_count == len(scanned.checkpoints)
        assert [int(table.get_row_at(i)[1]) for i in range(table.row_count)] == sorted(
            (c.step for c in scanned.checkpoints), reverse=True
        )

        await pilot.press("down", "enter")
        await pilot.pause()
        details = app.screen
        assert isinstance(details, DetailsScreen)
        ckpt = details.checkpoint
        files = details.query_one("#files", DataTable)
        assert files.row_count == len(ckpt.all_files)
        kinds = {str(files.get_row_at(i)[0]) for i in range(files.row_count)}
        assert {"model", "optim", "extra_state"} <= kinds
        assert any(str(files.get_row_at(i)[4]) == "ok" for i in range(files.row_count))  # CRCs checked
        assert f"step {ckpt.step}" in text_of(details, "#ckpt-title")

        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("escape")
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, RunsScreen)

    drive(app, script)


def test_filter_and_sort(tree, tmp_path):
    root, _ = tree
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        screen = await open_run(pilot)
        table = screen.query_one("#checkpoints", DataTable)
        steps = sorted(c.step for c in screen.run.checkpoints)
        middle = steps[1]

        await pilot.press("slash", *str(middle))
        await pilot.pause()
        assert [table.get_row_at(i)[1] for i in range(table.row_count)] == [str(middle)]
        await pilot.press("enter")  # ends the edit (the box goes with its focus), keeps the filter
        await pilot.pause()
        assert isinstance(app.screen, CheckpointsScreen) and table.has_focus and table.row_count == 1
        assert not screen.query_one("#filter", Input).display and f"filter '{middle}'" in text_of(screen, "#run-title")
        await pilot.press("escape")  # clears the filter
        await pilot.pause()
        assert table.row_count == len(steps) and isinstance(app.screen, CheckpointsScreen)

        await pilot.press("slash", *"tracker-target")  # filter by plan reason
        await pilot.pause()
        assert [table.get_row_at(i)[1] for i in range(table.row_count)] == [str(screen.run.tracker_step)]
        await pilot.press("escape")
        await pilot.pause()

        await pilot.press("s")  # same key, ascending
        await pilot.pause()
        assert [int(table.get_row_at(i)[1]) for i in range(table.row_count)] == steps
        await pilot.press("s")  # next key: size, largest first
        await pilot.pause()
        sizes = [c.size_bytes for c in sorted(screen.run.checkpoints, key=lambda c: -c.size_bytes)]
        shown = [
            next(c for c in screen.run.checkpoints if str(c.step) == table.get_row_at(i)[1]).size_bytes
            for i in range(table.row_count)
        ]
        assert shown == sizes

    drive(app, script)


def test_one_job_at_a_time(tree, tmp_path):
    root, _ = tree
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        assert not app.busy
        assert app.rescan() is True
        assert app.busy and app.rescan() is False  # refused while the first scan runs, not queued or cancelled
        await settle(pilot)
        assert not app.busy and app.last_error is None and app.snapshot.runs

    drive(app, script)


def test_details_explain_findings_of_a_truncated_shard(tree, tmp_path):
    root, run_dir = tree
    step_dir = sorted(run_dir.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))[0]
    shard = next((step_dir / "actor").glob("model_world_size_*_rank_0.pt"))
    os.truncate(shard, shard.stat().st_size // 2)
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        screen = await open_run(pilot)
        table = screen.query_one("#checkpoints", DataTable)
        await pilot.press(*["down"] * (table.row_count - 1), "enter")  # the oldest step: the damaged one
        await pilot.pause()
        details = app.screen
        assert isinstance(details, DetailsScreen) and details.ckpt_path == str(step_dir.resolve())
        assert "corrupt" in text_of(details, "#ckpt-title")
        findings = text_of(details, "#findings")
        assert "truncated" in findings and shard.name in findings and explain("truncated") in findings

        await pilot.press("v")  # deep verify in a worker; the view takes the verified checkpoint
        await settle(pilot)
        assert app.last_error is None and app.last_verify is not None and app.last_verify.deep
        verified = {c.path: c for r in app.last_verify.runs for c in r.checkpoints}[details.ckpt_path]
        assert details.checkpoint is verified and "corrupt" in text_of(details, "#ckpt-title")
        await pilot.press("escape")
        await pilot.pause()
        row = table.get_row_at(table.get_row_index(str(step_dir.resolve())))
        assert "corrupt" in str(row[2]) and int(str(row[6])) >= 1 and "delete: corrupt" in str(row[7])

    drive(app, script)


def test_selection_recomputes_plan_and_protected_refuses(tree, tmp_path):
    root, _ = tree
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        screen = await open_run(pilot)
        run = screen.run
        newest, middle, oldest = sorted(run.checkpoints, key=lambda c: -c.step)[:3]

        # The cursor starts on the newest complete checkpoint (also the tracker's target): it refuses.
        await pilot.press("space")
        await pilot.pause()
        assert screen.plan.empty and not screen.select
        assert f"step {newest.step} cannot be deleted" in screen.notice
        assert "newest complete checkpoint" in screen.notice

        await pilot.press("down", "space")
        await pilot.pause()
        expected = plan_prune([run], Policy(), now_ns=screen.plan.now_ns, select=frozenset({middle.path}))
        assert [i.path for i in screen.plan.delete] == [middle.path] == [i.path for i in expected.delete]
        assert screen.plan.bytes_freed == expected.bytes_freed == middle.size_bytes
        assert f"frees {format_size(middle.size_bytes)}" in text_of(screen, "#plan")

        await pilot.press("space")  # oldest too
        await pilot.pause()
        assert screen.plan.bytes_freed == middle.size_bytes + oldest.size_bytes

        await pilot.press("up", "space")  # unmark the middle one again
        await pilot.pause()
        assert [i.path for i in screen.plan.delete] == [oldest.path]

        # Preset: keep the last 1 marks every other complete checkpoint (except the protected newest).
        await pilot.press("l")
        await pilot.pause()
        assert isinstance(app.screen, NumberPrompt)
        await pilot.press("backspace", "1", "enter")
        await pilot.pause()
        assert app.screen is screen
        expected = plan_prune([run], Policy(rules=(KeepLast(n=1),)), now_ns=screen.plan.now_ns)
        assert (
            {i.path for i in screen.plan.delete}
            == {i.path for i in expected.delete}
            == {c.path for c in run.checkpoints if c.path != newest.path}
        )
        assert screen.plan.bytes_freed == expected.bytes_freed

        # Unmarking one the policy deletes keeps it by hand (a pin for this session).
        await pilot.press(*["down"] * len(run.checkpoints))
        await pilot.pause()
        bottom = screen.current_path()
        first = min(run.checkpoints, key=lambda c: c.step)
        assert bottom == first.path and first.path in {i.path for i in screen.plan.delete}
        await pilot.press("space")
        await pilot.pause()
        assert bottom not in {i.path for i in screen.plan.delete}

    drive(app, script)


def test_confirm_cancel_then_real_prune(tree, tmp_path):
    root, run_dir = tree
    cat_path = tmp_path / "cat.db"
    app = AuditApp(catalog_path=cat_path, roots=[str(root)])
    before = steps_on_disk(run_dir)

    async def script(pilot):
        screen = await open_run(pilot)
        await pilot.press("d")  # nothing marked: no dialog
        await pilot.pause()
        assert app.screen is screen and "nothing marked" in screen.notice

        await pilot.press("down", "space")
        await pilot.pause()
        doomed = screen.plan.delete[0].checkpoint
        await pilot.press("d")
        await pilot.pause()
        dialog = app.screen
        assert isinstance(dialog, ConfirmPrune)
        rows = dialog.query_one("#doomed", DataTable)
        assert rows.row_count == 1 and rows.get_row_at(0)[0] == str(doomed.step)
        await pilot.press("n")
        await settle(pilot)
        assert app.screen is screen and "cancelled" in screen.notice
        assert steps_on_disk(run_dir) == before

        await pilot.press("d")
        await pilot.pause()
        await confirm_delete(pilot)  # the deliberate act: Y once the dialog is armed (a plain y no longer deletes)
        assert app.last_error is None
        assert steps_on_disk(run_dir) == [s for s in before if s != doomed.step]
        # The views refreshed from a rescan: the run now holds what is on disk, the plan is empty again.
        assert sorted(c.step for c in screen.run.checkpoints) == steps_on_disk(run_dir)
        assert screen.query_one("#checkpoints", DataTable).row_count == len(before) - 1
        assert screen.plan.empty
        runs_row = app.screen_stack[1].query_one("#runs", DataTable).get_row_at(0)
        assert runs_row[1] == str(len(before) - 1)

    drive(app, script)
    with open_catalog(cat_path) as cat:
        prunes = LifecycleLog(cat.db).prunes()
    assert len(prunes) == 1 and prunes[0]["planned_delete"] == 1


def test_export_from_details(tree, tmp_path):
    root, _ = tree
    out = tmp_path / "exported"
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        await open_run(pilot)
        await pilot.press("enter")
        await pilot.pause()
        details = app.screen
        assert isinstance(details, DetailsScreen)
        await pilot.press("x")
        await pilot.pause()
        prompt = app.screen
        assert isinstance(prompt, ExportPrompt)
        await wait_armed(pilot, prompt)  # keys before that are type-ahead, and ignored
        prompt.query_one("#export-to", Input).value = str(out)
        await pilot.press("enter")  # ends the path: the focus moves to Export
        await pilot.pause()
        assert app.screen is prompt and app.focused is prompt.query_one("#export-go")
        await pilot.press("enter")  # presses Export
        await settle(pilot)
        assert app.last_error is None, app.last_error
        assert app.screen is details

    drive(app, script)
    assert app.last_export is not None and app.last_export.verified
    assert Path(app.last_export.out_dir) == out.resolve()
    assert sorted(p.name for p in out.glob("*.safetensors"))


def test_catalog_mode_and_locked_catalog(tree, tmp_path):
    """Without roots the TUI shows the runs the catalog knows; a cron run holding the lock does not block it."""
    root, run_dir = tree
    cat_path = tmp_path / "cat.db"
    first = AuditApp(catalog_path=cat_path, roots=[str(root)])
    drive(first, lambda pilot: asyncio.sleep(0))
    assert first.snapshot.unrecorded == ""

    second = AuditApp(catalog_path=cat_path)

    async def script(pilot):
        assert second.last_error is None
        assert [r.path for r in second.snapshot.runs] == [str(run_dir.resolve())]
        # What a cron `ckpt-audit scan` holds while it records: the flock and an open write transaction.
        writer = sqlite3.connect(cat_path, isolation_level=None)
        try:
            with lock.hold(lock.lock_path_for(cat_path)):
                writer.execute("BEGIN IMMEDIATE")
                writer.execute("DELETE FROM files")  # uncommitted: WAL readers still see every hash
                await pilot.press("r")
                await settle(pilot)
                writer.execute("ROLLBACK")
        finally:
            writer.close()
        assert second.last_error is None
        assert second.snapshot.runs and second.snapshot.unrecorded == "catalog locked by another run"
        assert second.snapshot.files_reused > 0  # hashes read from the catalog under the open write transaction
        assert "not recorded" in text_of(pilot.app.screen, "#runs-summary")

    drive(second, script)


def test_cli_tui_rejects_missing_root_in_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["tui", str(tmp_path / "nope")], standalone_mode=False)
    assert result.exit_code != 0
    proc = ckpt_audit("tui", tmp_path / "nope", timeout=60)
    assert proc.returncode == 3
    assert proc.stderr.strip().count("\n") == 0 and "not a directory" in proc.stderr
