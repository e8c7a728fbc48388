"""A one-line strip that shows what a worker is doing: a label and a progress bar, hidden when idle."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar


class ActivityBar(Horizontal):
    DEFAULT_CLASSES = "idle"

    def compose(self) -> ComposeResult:
        yield Label("", id="activity-label")
        yield ProgressBar(total=None, show_eta=False, id="activity-bar")

    def show(self, label: str, done: float | None = None, total: float | None = None) -> None:
        self.remove_class("idle")
        self.query_one("#activity-label", Label).update(label)
        bar = self.query_one("#activity-bar", ProgressBar)
        bar.update(total=total if total else None, progress=done or 0)

    def hide(self) -> None:
        self.add_class("idle")
