"""The last word before deleting: exactly what goes, how big it is, and why."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Label

from ckpt_audit.models import format_size
from ckpt_audit.retention import PrunePlan
from tui import cells


class ConfirmPrune(ModalScreen[bool]):
    BINDINGS = [
        Binding("y", "confirm", "Delete"),
        Binding("n", "cancel", "Cancel"),
        Binding("escape", "cancel", "Cancel"),
    ]

    def __init__(self, plan: PrunePlan) -> None:
        super().__init__()
        self.plan = plan

    def compose(self) -> ComposeResult:
        plan = self.plan
        with Vertical(classes="dialog wide"):
            yield Label(Text.assemble(
                ("Delete ", "bold"), (f"{len(plan.delete)} checkpoint(s)", "bold red"),
                (f", freeing {format_size(plan.bytes_freed)}?", "bold"),
            ))
            yield DataTable(id="doomed", cursor_type="row", show_cursor=False)
            yield Label(Text("Each is renamed to a trash name first, then removed; a re-check against disk "
                             "skips anything changed since the scan.", style="dim"))
            with Horizontal(classes="buttons"):
                yield Button("Delete (y)", variant="error", id="confirm")
                yield Button("Cancel (n)", id="cancel")

    def on_mount(self) -> None:
        table = self.query_one("#doomed", DataTable)
        table.add_columns("step", "status", "size", "why", "path")
        for item in self.plan.delete:
            table.add_row(str(item.step), cells.badge(item.checkpoint.status), format_size(item.size_bytes),
                          ", ".join(map(str, item.reasons)), _short(item.path), key=item.path)
        self.query_one("#cancel", Button).focus()  # the safe choice has the focus

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm")

    def action_confirm(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)


def _short(path: str) -> str:
    """project/experiment/global_step_N: enough to be unambiguous in the list."""
    return "/".join(path.rstrip("/").split("/")[-3:])
