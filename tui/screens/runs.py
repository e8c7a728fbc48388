"""Runs view: every run with its checkpoints, disk use, newest complete step, health and loss curve."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from ckpt_audit.models import Run
from ckpt_audit.session.terms import read_metric
from ckpt_audit.units import format_size
from tui import cells
from tui.activity import ActivityBar
from tui.snapshot import Snapshot

SPARK_POINTS = 12


class RunsScreen(Screen):
    BINDINGS = [
        Binding("enter", "open", "Open", priority=True),
        Binding("r", "rescan", "Rescan"),
    ]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(Text("no runs yet", style="dim"), id="runs-summary", classes="summary")
        yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield ActivityBar()
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#runs", DataTable)
        table.add_column("run", key="run", width=22)
        table.add_column("ckpts", key="n")
        table.add_column("size", key="size")
        table.add_column("newest", key="newest")
        table.add_column("status", key="status")
        table.add_column("scanned", key="scanned")
        table.add_column("loss", key="loss")
        self.refresh_from(self.app.snapshot)

    def refresh_from(self, snap: Snapshot) -> None:
        table = self.query_one("#runs", DataTable)
        keep = self.current_run()
        table.clear()
        now = time.time_ns()
        losses = read_metric(snap.runs, "loss")
        for run in sorted(snap.runs, key=lambda r: r.path):
            newest = run.latest_complete
            table.add_row(
                run.name,
                str(len(run.checkpoints)),
                format_size(run.size_bytes),
                str(newest.step) if newest else Text("none", style="bold red"),
                cells.status_counts([c.status for c in run.checkpoints]),
                cells.age(snap.scanned_ns.get(run.path), now),
                self._spark(losses.get(run.path)),
                key=run.path,
            )
        if keep is not None and keep in {r.path for r in snap.runs}:
            table.move_cursor(row=table.get_row_index(keep))
        total = sum(r.size_bytes for r in snap.runs)
        n_ckpt = sum(len(r.checkpoints) for r in snap.runs)
        self.query_one("#runs-summary", Static).update(
            Text(
                f"{len(snap.runs)} runs · {n_ckpt} checkpoints · {format_size(total)}"
                + (f" · not recorded: {snap.unrecorded}" if snap.unrecorded and self.app.catalog_path else "")
            )
        )

    @staticmethod
    def _spark(series: dict[int, float] | None) -> str:
        if not series:
            return ""
        try:
            from ckpt_audit.continuity.sparkline import sparkline
        except ImportError:  # continuity is optional to this view: a missing curve beats a dead screen
            return ""
        values = [series[s] for s in sorted(series)]
        # Evenly spaced samples over the whole run, so the curve shows its shape, not only its tail.
        stride = max(1, -(-len(values) // SPARK_POINTS))
        return sparkline(values[::stride])

    def current_run(self) -> str | None:
        table = self.query_one("#runs", DataTable)
        if table.row_count == 0:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def current(self) -> Run | None:
        path = self.current_run()
        return self.app.snapshot.run(path) if path else None

    def action_open(self) -> None:
        run = self.current()
        if run is None:
            self.notify("no run selected", severity="warning")
            return
        from tui.screens.checkpoints import CheckpointsScreen

        self.app.push_screen(CheckpointsScreen(run.path))

    def action_rescan(self) -> None:
        self.app.rescan()
