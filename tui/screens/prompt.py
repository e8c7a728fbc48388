"""Small modal questions: a positive whole number (policy presets) and an export destination."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

DTYPES = (("checkpoint's own dtype", ""), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"))


class NumberPrompt(ModalScreen[int | None]):
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


class ExportPrompt(ModalScreen[tuple[str, str | None] | None]):
    """Where to write the HuggingFace directory, and in which dtype."""

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

    def on_mount(self) -> None:
        self.query_one("#export-to", Input).focus()

    def _submit(self) -> None:
        to = self.query_one("#export-to", Input).value.strip()
        if not to:
            return
        dtype = self.query_one("#export-dtype", Select).value or None
        self.dismiss((str(Path(to).expanduser()), dtype))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "export-go":
            self._submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
