"""Driving the real TUI through Textual's Pilot at 80x24: shared by test_tui.py and test_tui_safety.py.

No pytest-asyncio: each test runs its pilot session with asyncio.run.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from textual import events
from textual.widgets import Static

from tui.app import AuditApp
from tui.screens.armed import ArmedModal
from tui.screens.checkpoints import CheckpointsScreen
from tui.screens.runs import RunsScreen

SIZE = (80, 24)
CHARS = {"enter": "\r", "space": " ", "tab": "\t", "escape": "\x1b", "slash": "/", "question_mark": "?"}


def steps_on_disk(run: Path) -> list[int]:
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in run.glob("global_step_*"))


def drive(app: AuditApp, script) -> None:
    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await script(pilot)

    asyncio.run(main())


async def settle(pilot) -> None:
    """Let workers finish and their results reach the UI."""
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def text_of(screen, selector: str) -> str:
    return str(screen.query_one(selector, Static).content)


async def open_run(pilot) -> CheckpointsScreen:
    assert isinstance(pilot.app.screen, RunsScreen)
    await pilot.press("enter")
    await pilot.pause()
    assert isinstance(pilot.app.screen, CheckpointsScreen)
    return pilot.app.screen


def typed(*keys: str) -> list[events.Key]:
    """Key presses stamped now (Textual stamps each event when it is made: for a terminal, when it arrives)."""
    return [events.Key(key, key if len(key) == 1 else CHARS.get(key)) for key in keys]


async def read_late(pilot, keys: list[events.Key]) -> None:
    """Let the app read `keys` now, one after another, as it reads a burst that waited while it was busy."""
    for key in keys:
        pilot.app.post_message(key)
    await settle(pilot)


async def type_ahead(pilot, *keys: str) -> None:
    """Keys typed faster than the app reads them: all stamped now and queued at once. (pilot.press waits for
    each key to be handled before it sends the next.)"""
    await read_late(pilot, typed(*keys))


async def wait_armed(pilot, dialog: ArmedModal) -> None:
    """Wait, as a person reading the dialog would, until it answers keys."""
    for _ in range(200):
        if dialog.armed:
            return
        await pilot.pause(0.05)
    raise AssertionError(f"{type(dialog).__name__} never armed")


async def confirm_delete(pilot) -> None:
    """The deliberate act on an open prune confirmation: wait until it is armed, then press Y."""
    dialog = pilot.app.screen
    assert isinstance(dialog, ArmedModal), dialog
    await wait_armed(pilot, dialog)
    await pilot.press("Y")
    await settle(pilot)
