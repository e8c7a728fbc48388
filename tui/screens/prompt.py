"""Small modal questions: a positive whole number (policy presets) and an export destination.

The export prompt is armed (armed.py): an export writes gigabytes, so keys typed before it appeared (an `x` and
an Enter in one burst) must not start one, and Enter in its path field only moves to the Export button. The
number prompt only edits the plan, which is shown and confirmed before anything is deleted: it answers at once.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Label, Select

from tui.screens.armed import ArmedModal
from tui.screens.modal import Modal

DTYPES = (("checkpoint's own dtype", ""), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"))


class NumberPrompt(Modal[int | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, *, default: int) -> None:
        super().__init__()
        self.question = question
        self.default = default

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question)
            yield Input(str(self.default), type="integer", id="number")
            yield Label("", id="number-error", classes="error")

    def on_mount(self) -> None:
        self.query_one("#number", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        try:
            n = int(event.value)
        except ValueError:
            n = 0
        if n < 1:
            self.query_one("#number-error", Label).update("a whole number of at least 1, please")
            return
        self.dismiss(n)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ExportPrompt(ArmedModal[tuple[str, str | None] | None]):
    """Where to write the HuggingFace directory, and in which dtype."""

    FOCUS_WHEN_ARMED = "#export-to"
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, step: int, default_to: str) -> None:
        super().__init__()
        self.step = step
        self.default_to = default_to

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(f"Export step {self.step} as a HuggingFace directory to:")
            yield Input(self.default_to, id="export-to")
            yield Select(DTYPES, value="", allow_blank=False, id="export-dtype")
            with Horizontal(classes="buttons"):
                yield Button("Export", variant="primary", id="export-go")
                yield Button("Cancel", id="export-cancel")

    def _submit(self) -> None:
        to = self.query_one("#export-to", Input).value.strip()
        if not to or not self.armed:
            return
        dtype = self.query_one("#export-dtype", Select).value or None
        self.dismiss((str(Path(to).expanduser()), dtype))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        # Enter ends the path, it does not start the export: letters and an Enter typed by accident into an armed
        # prompt only move the focus to Export, which a second, deliberate Enter (or a click) presses.
        self.query_one("#export-go", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "export-go":
            self._submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
