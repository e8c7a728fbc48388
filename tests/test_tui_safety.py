"""Invariant 9 (issue 11): no deletion by stray keys. The real app over a trainer-written tree and a real catalog.

Focus sits where the screen says it does (a visible filter box has the focus, or is gone); the prune confirmation
answers only a deliberate act (Y, or Tab to Delete and Enter) once armed, and drops every key typed before it was
shown; a checkpoint that could not be read in full is never offered for deletion.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label
from tui_pilot import (
    confirm_delete,
    drive,
    open_run,
    read_late,
    settle,
    steps_on_disk,
    text_of,
    type_ahead,
    typed,
    wait_armed,
)

from ckpt_audit.lifecycle.retention import EXPLAIN, Reason
from ckpt_audit.models import Status, format_size
from tui import cells
from tui.app import AuditApp
from tui.screens.armed import ArmedModal
from tui.screens.checkpoints import CheckpointsScreen
from tui.screens.confirm import ConfirmPrune
from tui.screens.details import DetailsScreen
from tui.screens.help import HelpScreen
from tui.screens.runs import RunsScreen

# What a cat, a sleeve or a user typing into the wrong place sends: every key that once deleted or exported
# (d y, x ... Enter), a preset (e), and Enters. No Y, Tab or q: those are the deliberate acts (and quit).
BURST = ("d", "y", "x", "e", "p", "enter", "d", "y", "x", "e", "p", "enter", "y", "enter")


@pytest.fixture
def tree(verl_run, copy_run) -> tuple[Path, Path]:
    """(root, run dir): a private copy of the session run, safe to prune."""
    run = Path(copy_run(verl_run))
    return run.parent.parent, run


def written_outside(tmp_path: Path, run: Path) -> list[str]:
    """Everything under the test's directory but the run and the catalog: where an export would land."""
    return sorted(str(p) for p in tmp_path.rglob("*") if not p.is_relative_to(run) and not p.name.startswith("cat.db"))


def assert_focus_honest(app: AuditApp) -> None:
    """On a full screen a visible text box is where keys go. A dialog keeps the focus inside itself (a form may
    move it between its fields and buttons), and an arming one gives it to nothing: it drops keys."""
    screen = app.screen
    if isinstance(screen, ModalScreen):
        assert app.focused is None or app.focused.screen is screen
        if isinstance(screen, ArmedModal) and not screen.armed:
            assert app.focused is None, f"{type(screen).__name__} focused {app.focused} before it armed"
        return
    for box in screen.query(Input):
        if box.display:
            assert box.has_focus, f"{box.id} is on screen without the focus; keys go to {app.focused}"


async def mark_one(pilot, screen: CheckpointsScreen) -> str:
    """Mark the second-newest checkpoint for deletion; returns its path."""
    await pilot.press("down", "space")
    await pilot.pause()
    assert len(screen.plan.delete) == 1
    return screen.plan.delete[0].path


def test_enter_in_filter_hides_the_box_so_d_y_deletes_nothing(tree, tmp_path):
    root, run_dir = tree
    before = steps_on_disk(run_dir)
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        screen = await open_run(pilot)
        await mark_one(pilot, screen)
        box = screen.query_one("#filter", Input)
        table = screen.query_one("#checkpoints", DataTable)

        await pilot.press("slash", *str(before[0]), "enter")  # filter, then Enter: the edit ends
        await pilot.press("d", "y")  # the user who thinks they are still typing in the filter
        await settle(pilot)
        assert steps_on_disk(run_dir) == before and app.last_prune is None
        assert isinstance(app.screen, ConfirmPrune)  # the box was gone, so `d` went to the table and asked
        await pilot.press("escape")
        await pilot.pause()
        assert_focus_honest(app)
        assert not box.display and table.has_focus and screen.filter_text == str(before[0])

        # Leaving the box any other way (a click on the table) takes it off screen too; Escape clears.
        await pilot.press("slash", "x")
        await pilot.pause()
        assert box.display and box.has_focus
        await pilot.click("#checkpoints")
        await pilot.pause()
        assert_focus_honest(app)
        assert not box.display and table.has_focus
        await pilot.press("escape")  # clears the filter, still on this screen
        await pilot.pause()
        assert app.screen is screen and screen.filter_text == "" and table.row_count == len(before)
        await pilot.press("slash", "1", "escape")
        await pilot.pause()
        assert_focus_honest(app)
        assert app.screen is screen and not box.display and table.has_focus and screen.filter_text == ""

    drive(app, script)
    assert steps_on_disk(run_dir) == before and app.last_prune is None


def test_keys_typed_before_the_confirmation_appeared_delete_nothing(tree, tmp_path):
    root, run_dir = tree
    before = steps_on_disk(run_dir)
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        screen = await open_run(pilot)
        await mark_one(pilot, screen)
        # d and its answer in one buffered burst (typed while the plan was computed): the answers reach the app
        # before the dialog exists, and are resolved once it is up. None may answer it.
        await type_ahead(pilot, "d", "y", "Y", "y")
        assert steps_on_disk(run_dir) == before and app.last_prune is None
        assert isinstance(app.screen, ConfirmPrune)
        await pilot.press("escape")
        await settle(pilot)

        # Typed before the dialog was shown, read once it is up (the app was busy): every key but Escape is
        # dropped, the deliberate ones included, armed or not by the time they are read; the dialog says so.
        early = typed("y", "Y", "enter", "tab", "enter", "Y", "space")
        await pilot.press("d")
        dialog = app.screen
        assert isinstance(dialog, ConfirmPrune)
        await read_late(pilot, early)
        assert app.screen is dialog and dialog.ignored == 7
        assert steps_on_disk(run_dir) == before and app.last_prune is None
        await wait_armed(pilot, dialog)
        await read_late(pilot, early)  # still too early, now that it is armed
        assert app.screen is dialog and dialog.ignored == 14 and steps_on_disk(run_dir) == before
        assert "14 key(s) typed before this dialog was ready were ignored" in str(
            dialog.query_one("#confirm-how").content
        )
        assert app.focused is dialog.query_one("#cancel")
        await pilot.press("escape")
        await settle(pilot)

        # Pressed one after the other, as fast as the app reads them: the old answer y is no answer.
        await pilot.press("d", "y")
        await settle(pilot)
        assert isinstance(app.screen, ConfirmPrune) and steps_on_disk(run_dir) == before
        await pilot.press("escape")
        await settle(pilot)

    drive(app, script)
    assert steps_on_disk(run_dir) == before and app.last_prune is None


def test_stray_keys_on_every_screen_delete_and_export_nothing(tree, tmp_path):
    root, run_dir = tree
    before = steps_on_disk(run_dir)
    outside = written_outside(tmp_path, run_dir)
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def back_to_runs(pilot) -> None:
        for _ in range(6):
            if isinstance(app.screen, RunsScreen):
                return
            await pilot.press("escape")
            await settle(pilot)
        assert isinstance(app.screen, RunsScreen), app.screen

    async def burst(pilot, where: str) -> None:
        await type_ahead(pilot, *BURST)
        assert_focus_honest(app)
        assert steps_on_disk(run_dir) == before, f"a burst on {where} deleted"
        assert written_outside(tmp_path, run_dir) == outside and app.last_export is None, f"a burst on {where} exported"

    async def script(pilot):
        await burst(pilot, "the runs view")  # its Enter opens the run: the rest lands on the checkpoints
        await back_to_runs(pilot)

        screen = await open_run(pilot)
        await mark_one(pilot, screen)
        await burst(pilot, "the checkpoints view with a checkpoint marked")
        await back_to_runs(pilot)

        screen = await open_run(pilot)
        await mark_one(pilot, screen)
        await pilot.press("up", "enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailsScreen)
        await burst(pilot, "the details view")  # its x opens the export prompt
        await back_to_runs(pilot)

        screen = await open_run(pilot)
        await mark_one(pilot, screen)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await burst(pilot, "the help screen")
        await back_to_runs(pilot)

        screen = await open_run(pilot)
        await pilot.press("l")  # the number prompt (not armed: it only edits the plan)
        await pilot.pause()
        await burst(pilot, "the keep-last prompt")
        await back_to_runs(pilot)

        # Armed dialogs, reached on purpose and then hit by the burst: Enter on Cancel cancels; in the export
        # prompt the letters go into the path and Enter only moves to the Export button.
        screen = await open_run(pilot)
        await mark_one(pilot, screen)
        await pilot.press("d")
        await wait_armed(pilot, app.screen)
        await burst(pilot, "an armed prune confirmation")
        await back_to_runs(pilot)

        await open_run(pilot)
        await pilot.press("enter", "x")
        await wait_armed(pilot, app.screen)
        await burst(pilot, "an armed export prompt")
        await back_to_runs(pilot)

    drive(app, script)
    assert steps_on_disk(run_dir) == before and app.last_prune is None and app.last_export is None


def test_deliberate_confirmation_deletes(tree, tmp_path):
    """The feature still works: Y once armed, or Tab to Delete and Enter."""
    root, run_dir = tree
    before = steps_on_disk(run_dir)
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        screen = await open_run(pilot)
        doomed = await mark_one(pilot, screen)
        step = int(Path(doomed).name.rsplit("_", 1)[1])
        await pilot.press("d")
        await pilot.pause()
        dialog = app.screen
        assert isinstance(dialog, ConfirmPrune)
        shown = dialog.query_one("#doomed", DataTable)
        assert shown.row_count == 1 and shown.get_row_at(0)[0] == str(step)
        said = " ".join(str(label.content) for label in dialog.query(Label))
        assert "1 checkpoint(s)" in said and format_size(dialog.plan.bytes_freed) in said  # what goes, how big
        assert "Y (shift+y) deletes" in said  # and how to confirm
        await confirm_delete(pilot)
        assert app.last_error is None and steps_on_disk(run_dir) == [s for s in before if s != step]

        left = steps_on_disk(run_dir)
        await pilot.press("down", "space")  # the oldest, now second-newest
        await pilot.pause()
        assert len(screen.plan.delete) == 1
        await pilot.press("d")
        await wait_armed(pilot, app.screen)
        await pilot.press("tab")
        await pilot.pause()
        assert app.focused is app.screen.query_one("#confirm")
        await pilot.press("enter")
        await settle(pilot)
        assert app.last_error is None and steps_on_disk(run_dir) == [max(left)]

    drive(app, script)


def test_cancel_deletes_nothing(tree, tmp_path):
    """Escape and n cancel at once, armed or not; Enter on the armed dialog presses Cancel, where the focus starts."""
    root, run_dir = tree
    before = steps_on_disk(run_dir)
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        screen = await open_run(pilot)
        await mark_one(pilot, screen)
        for keys, wait in (
            (("escape",), False),
            (("n",), False),
            (("escape",), True),
            (("n",), True),
            (("enter",), True),
        ):
            await pilot.press("d")
            await pilot.pause()
            dialog = app.screen
            assert isinstance(dialog, ConfirmPrune)
            if wait:
                await wait_armed(pilot, dialog)
            await pilot.press(*keys)
            await settle(pilot)
            assert app.screen is screen and "cancelled" in screen.notice, keys
            assert steps_on_disk(run_dir) == before

    drive(app, script)
    assert app.last_prune is None


def test_every_status_has_a_badge_and_a_meaning():
    for status in Status:
        assert str(cells.badge(status)).endswith(str(status))
        assert str(cells.status_counts([status])) == f"1{cells.SHORT[status]}"
    assert set(cells.MEANING) == set(Status)


def test_unreadable_checkpoint_is_shown_unknown_and_never_offered(tree, tmp_path):
    """A shard that is a link out of the root could not be read: the step is unknown, protected, and says why."""
    root, run_dir = tree
    before = steps_on_disk(run_dir)
    oldest = run_dir / f"global_step_{before[0]}"
    shard = next((oldest / "actor").glob("model_world_size_*_rank_1.pt"))
    outside = tmp_path / "outside"
    outside.mkdir()
    os.replace(shard, outside / shard.name)
    shard.symlink_to(outside / shard.name)
    app = AuditApp(catalog_path=tmp_path / "cat.db", roots=[str(root)])

    async def script(pilot):
        screen = await open_run(pilot)
        table = screen.query_one("#checkpoints", DataTable)
        path = str(oldest.resolve())
        row = table.get_row_at(table.get_row_index(path))
        assert "? unknown" in str(row[2]) and str(row[7]) == f"keep: {Reason.UNREAD}" and str(row[0]) == "◆"

        await pilot.press(*["down"] * (table.row_count - 1), "space")  # try to mark it
        await pilot.pause()
        assert screen.current_path() == path and screen.plan.empty
        assert EXPLAIN[Reason.UNREAD] in screen.notice

        await pilot.press("l", "backspace", "1", "enter")  # keep only the last one: the rest is marked...
        await pilot.pause()
        assert path not in {i.path for i in screen.plan.delete} and screen.plan.delete  # ...but not this one
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailsScreen)
        findings = text_of(app.screen, "#findings")
        assert cells.MEANING[Status.UNKNOWN] in findings and "symlink-outside-root" in findings
        await pilot.press("escape")
        await pilot.pause()

        await pilot.press("d")
        await pilot.pause()
        assert path not in {str(r.value) for r in app.screen.query_one("#doomed", DataTable).rows}
        await confirm_delete(pilot)
        assert app.last_error is None

    drive(app, script)
    assert oldest.is_dir() and shard.is_symlink() and (outside / shard.name).is_file()
    assert steps_on_disk(run_dir) == [before[0], before[-1]]
