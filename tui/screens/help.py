"""Every key and every status, on one page."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui import cells
from tui.screens.armed import ARM_S
from tui.screens.modal import Modal

KEYS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "Everywhere",
        (
            ("?", "this help"),
            ("q", "quit"),
            ("r", "rescan the roots (in the background)"),
            ("↑↓ PgUp PgDn", "move"),
            ("Esc", "back"),
        ),
    ),
    ("Runs", (("Enter", "open the run's checkpoints"),)),
    (
        "Checkpoints",
        (
            ("Space", "mark / unmark for deletion (protected ones refuse, and say why)"),
            ("l / e", "preset: keep the last N / every K-th step (marks the rest)"),
            ("c", "clear: back to the default plan (only broken checkpoints go)"),
            ("d", "delete what is marked, after a confirmation listing it"),
            ("/", "filter by step, status, plan reason or finding code; Enter keeps it, Esc clears it"),
            ("s", "sort: step, size, age, status, findings (press again to reverse)"),
            ("v", "verify the run (loads tensors)"),
            ("Enter", "details of the checkpoint"),
        ),
    ),
    ("Details", (("x", "export to a HuggingFace directory"), ("v", "verify this checkpoint"))),
    (
        "Confirm delete",
        (
            ("Y", "delete (shift+y): the deliberate act; lower-case y does not delete"),
            ("Tab Enter", "the same: Tab from Cancel to Delete, then Enter"),
            ("n / Esc", "cancel (the focus starts on Cancel)"),
            ("", f"keys typed before the dialog appeared or in its first {ARM_S:g} s are ignored (export too)"),
        ),
    ),
)


class HelpScreen(Modal[None]):
    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for section, keys in KEYS:
            table.add_row(f"[u]{section}[/u]", "")
            for key, what in keys:
                table.add_row(key, what)
        table.add_row("[u]Statuses[/u]", "")
        for status, meaning in cells.MEANING.items():
            table.add_row(cells.badge(status), meaning)
        with VerticalScroll(classes="dialog wide"):
            yield Static(table, id="help")

    def action_close(self) -> None:
        self.dismiss(None)
