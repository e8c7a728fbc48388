"""The last word before deleting: exactly what goes, how big it is, and why; answered only on purpose.

Deleting takes a deliberate act once the dialog is armed (see armed.py): `Y` (shift+y, a key no stray burst of
lower-case letters holds), or Tab to the Delete button and Enter (or a click on it). The focus starts on Cancel;
`n` and Escape cancel at any time. A lower-case `y`, the old answer, only says how to confirm.
"""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, DataTable, Label

from ckpt_audit.models import format_size
from ckpt_audit.session.terms import PrunePlan
from tui import cells
from tui.screens.armed import ArmedModal

HOW_TO_CONFIRM = "Y (shift+y) deletes, as does Tab to Delete, Enter. n or Esc cancels."


class ConfirmPrune(ArmedModal[bool]):
    FOCUS_WHEN_ARMED = "#cancel"
    CANCEL_KEYS = frozenset({"escape", "n"})
    BINDINGS = [
        Binding("n", "cancel", "Cancel"),
        Binding("escape", "cancel", "Cancel"),
    ]

    def __init__(self, plan: PrunePlan) -> None:
        super().__init__()
        self.plan = plan

    def compose(self) -> ComposeResult:
        plan = self.plan
        with Vertical(classes="dialog wide"):
            yield Label(
                Text.assemble(
                    ("Delete ", "bold"),
                    (f"{len(plan.delete)} checkpoint(s)", "bold red"),
                    (f", freeing {format_size(plan.bytes_freed)}?", "bold"),
                ),
                id="confirm-title",
            )
            yield DataTable(id="doomed", cursor_type="row", show_cursor=False)
            yield Label(
                Text(
                    "Each is renamed to a trash name first, then removed; a re-check against disk "
                    "skips anything changed since the scan.",
                    style="dim",
                )
            )
            yield Label(Text(HOW_TO_CONFIRM, style="bold"), id="confirm-how")
            with Horizontal(classes="buttons"):
                yield Button("Cancel (n)", id="cancel")  # first: Tab from it goes to Delete, Shift+Tab does not
                yield Button("Delete (Y)", variant="error", id="confirm")

    def on_mount(self) -> None:
        table = self.query_one("#doomed", DataTable)
        table.add_columns("step", "status", "size", "why", "path")
        for item in self.plan.delete:
            table.add_row(
                str(item.step),
                cells.badge(item.checkpoint.status),
                format_size(item.size_bytes),
                ", ".join(map(str, item.reasons)),
                _short(item.path),
                key=item.path,
            )
        if self.ignored:
            self.key_ignored()

    def key_ignored(self) -> None:
        for label in self.query("#confirm-how").results(Label):  # none yet while the dialog is being composed
            label.update(
                Text.assemble(
                    (HOW_TO_CONFIRM, "bold"),
                    (f"\n({self.ignored} key(s) typed before this dialog was ready were ignored)", "dim"),
                )
            )

    def on_key(self, event: events.Key) -> None:
        # Y is read here, not bound: a binding also fires for a key typed before the dialog was pushed that is
        # still on its way up the screen below (bindings resolve against the top screen), while only keys sent
        # to this dialog, each admitted by the gate, get here.
        if event.character == "Y":
            event.stop()
            self.action_confirm()
        elif event.character == "y":
            event.stop()
            self.notify(HOW_TO_CONFIRM, severity="warning")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "confirm":
            self.action_confirm()
        else:
            self.action_cancel()

    def action_confirm(self) -> None:
        if self.armed:  # a click in the first moment is as suspect as a key
            self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)


def _short(path: str) -> str:
    """project/experiment/global_step_N: enough to be unambiguous in the list."""
    return "/".join(path.rstrip("/").split("/")[-3:])
