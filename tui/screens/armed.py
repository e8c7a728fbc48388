"""A dialog that a stray key cannot answer: it is deaf until armed, a moment after it is shown.

Type-ahead is the danger: keys meant for the screen below, or buffered while the app was busy (a plan being
computed, a scan finishing), reach whatever is on top when they are finally read. So every key stamped before
the dialog was shown or within ARM_S after it is dropped (AuditApp.on_event asks `admits` before any binding
or widget sees the key), and nothing inside has the focus until then. Cancel keys (Escape) are always
admitted: backing out is never dangerous.
"""

from __future__ import annotations

import time
from typing import TypeVar

from textual import events

from tui.screens.modal import Modal

ARM_S = 0.5  # shorter than anyone reads a dialog, longer than a burst of buffered keys takes to drain

ResultType = TypeVar("ResultType")


class ArmedModal(Modal[ResultType]):
    AUTO_FOCUS = ""  # nothing focused until armed: a buffered Enter has no button to press
    FOCUS_WHEN_ARMED = ""  # selector of the widget that takes the focus once armed (the safe choice)
    CANCEL_KEYS = frozenset({"escape"})  # admitted at once: backing out is never dangerous

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.arms_at: float | None = None  # time.monotonic(): the clock Textual stamps events with (POSIX)
        self.ignored = 0  # keys dropped: typed before the dialog was ready

    def on_mount(self) -> None:
        self.arms_at = time.monotonic() + ARM_S
        self.set_timer(ARM_S, self._arm)

    def _arm(self) -> None:
        self.armed = True
        if self.FOCUS_WHEN_ARMED:
            self.query_one(self.FOCUS_WHEN_ARMED).focus()

    def key_ignored(self) -> None:
        """Hook: a key was dropped (`self.ignored` counts them); it may arrive before the dialog is composed."""

    def admits(self, event: events.Key) -> bool:
        """Whether `event` may reach this dialog: a cancel key always, any other only once armed and only if it
        was pressed after arming (a key typed earlier but read late is still type-ahead)."""
        if event.key in self.CANCEL_KEYS:
            return True
        if self.armed and self.arms_at is not None and event.time >= self.arms_at:
            return True
        self.ignored += 1
        self.key_ignored()
        return False
