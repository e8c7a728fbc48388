"""Checkpoints of one run, with the live prune plan.

The plan shown is always `plan_prune([run], policy, pins, select)`, recomputed on every toggle: the same
function, with the same inputs, that `ckpt-audit prune` runs. Toggling a checkpoint only edits those inputs:
a kept one is added to `select`; a selected one leaves it; one the policy deletes is pinned (kept by hand);
a pinned one is unpinned. Whatever plan_prune refuses (protected checkpoints) is taken back, with its reason.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Static

from ckpt_audit.models import Checkpoint, Run, format_size
from ckpt_audit.session.terms import EXPLAIN, KeepEvery, KeepLast, Policy, PrunePlan, plan_prune
from tui import cells
from tui.activity import ActivityBar
from tui.snapshot import Snapshot

SORTS = ("step", "size", "age", "status", "findings")


class CheckpointsScreen(Screen):
    BINDINGS = [
        Binding("space", "toggle", "Mark"),
        Binding("d", "delete", "Delete"),
        Binding("l", "keep_last", "Last N"),
        Binding("e", "keep_every", "Every"),
        Binding("slash", "filter", "Filter"),
        Binding("s", "sort", "Sort"),
        Binding("c", "clear", "Clear", show=False),
        Binding("enter", "details", "Open", priority=True),
        Binding("escape", "back", "Back", show=False),
        Binding("r", "rescan", "Rescan", show=False),
        Binding("v", "verify", "Verify", show=False),
    ]

    def __init__(self, run_path: str) -> None:
        super().__init__()
        self.run_path = run_path
        self.policy = Policy()
        self.select: set[str] = set()
        self.pins: set[str] = set()
        self.sort_by = "step"
        self.descending = True
        self.filter_text = ""
        self.plan: PrunePlan | None = None
        self.notice = ""
        self._shown: list[str] = []  # row keys in the table, in order
        self._drawn: dict[str, tuple] = {}  # path -> the fate its plan cells show
        self._run_size = 0

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="run-title", classes="summary")
        yield Input(placeholder="filter: step, status, reason or finding code (Esc clears)", id="filter")
        yield DataTable(id="checkpoints", cursor_type="row", zebra_stripes=True)
        yield Static(id="plan", classes="plan")
        yield Static(id="notice", classes="notice")
        yield ActivityBar()
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#checkpoints", DataTable)
        table.add_column(" ", key="mark", width=1)
        table.add_column("step", key="step")
        table.add_column("status", key="status", width=13)
        table.add_column("size", key="size")
        table.add_column("age", key="age")
        table.add_column("W", key="w")
        table.add_column("find", key="find")
        table.add_column("plan", key="plan")
        self.query_one("#filter", Input).display = False
        self.refresh_from(self.app.snapshot)
        table.focus()

    # ------------------------------------------------------------------------------------------ model

    @property
    def run(self) -> Run | None:
        return self.app.snapshot.run(self.run_path)

    def compute_plan(self, select: set[str] | None = None, pins: set[str] | None = None) -> PrunePlan | None:
        run = self.run
        if run is None:
            return None
        return plan_prune(
            [run],
            self.policy,
            now_ns=time.time_ns(),
            pins=frozenset(self.pins if pins is None else pins),
            select=frozenset(self.select if select is None else select),
            links=self.app.snapshot.links,
        )

    def refresh_from(self, snap: Snapshot) -> None:
        run = snap.run(self.run_path)
        if run is None:
            self.plan = None
            self.query_one("#checkpoints", DataTable).clear()
            self.query_one("#run-title", Static).update(Text("this run is gone from the last scan", style="red"))
            return
        known = {c.path for c in run.checkpoints}
        self.select &= known
        self.pins &= known
        self.plan = self.compute_plan()
        self._shown = []  # new scan: every cell may differ, rebuild
        self._run_size = run.size_bytes
        self.redraw()

    def _fates(self) -> dict[str, tuple[bool, tuple]]:
        """path -> (deleted?, reasons) from the current plan."""
        assert self.plan is not None
        out = {i.path: (True, i.reasons) for i in self.plan.delete}
        out.update({i.path: (False, i.reasons) for i in self.plan.keep})
        return out

    def rows(self) -> list[Checkpoint]:
        """The checkpoints shown, filtered and sorted as asked."""
        run = self.run
        if run is None or self.plan is None:
            return []
        fates = self._fates()
        terms = self.filter_text.lower().split()

        def text(c: Checkpoint) -> str:
            deleted, reasons = fates[c.path]
            return " ".join(
                [
                    str(c.step),
                    str(c.status),
                    "delete" if deleted else "keep",
                    *map(str, reasons),
                    *(f.code for f in c.all_findings),
                ]
            ).lower()

        shown = [c for c in run.checkpoints if all(t in text(c) for t in terms)]
        key = {
            "step": lambda c: c.step,
            "size": lambda c: c.size_bytes,
            "age": lambda c: -c.mtime_ns,
            "status": lambda c: (str(c.status), c.step),
            "findings": lambda c: (len(c.all_findings), c.step),
        }[self.sort_by]
        return sorted(shown, key=key, reverse=self.descending)

    # ------------------------------------------------------------------------------------------ view

    def redraw(self) -> None:
        run = self.run
        table = self.query_one("#checkpoints", DataTable)
        fates = self._fates()
        rows = self.rows()
        if [c.path for c in rows] == self._shown:
            # Same rows in the same order (a toggle, a preset): only the plan's two columns can change, and
            # only where a fate changed. Rebuilding thousands of rows per keypress would lag.
            for c in rows:
                if fates[c.path] != self._drawn.get(c.path):
                    mark, plan = self._plan_cells(*fates[c.path])
                    table.update_cell(c.path, "mark", mark)
                    table.update_cell(c.path, "plan", plan)
        else:
            keep = self.current_path()
            table.clear()
            now = time.time_ns()
            for c in rows:
                mark, plan = self._plan_cells(*fates[c.path])
                n_find = len(c.all_findings)
                table.add_row(
                    mark,
                    str(c.step),
                    cells.badge(c.status),
                    c.size_str,
                    cells.age(c.mtime_ns, now),
                    str(c.world_size) if c.world_size else "-",
                    Text(str(n_find), style="yellow" if n_find else "dim"),
                    plan,
                    key=c.path,
                )
            if keep is not None and keep in fates and any(c.path == keep for c in rows):
                table.move_cursor(row=table.get_row_index(keep))
            self._shown = [c.path for c in rows]
        self._drawn = fates
        order = "↓" if self.descending else "↑"
        self.query_one("#run-title", Static).update(
            Text(
                f"{run.name} · {len(run.checkpoints)} checkpoints · {format_size(self._run_size)} · "
                f"tracker {run.tracker_step if run.tracker_step is not None else '-'} · sort {self.sort_by}{order}"
                + (f" · filter '{self.filter_text}'" if self.filter_text else "")
            )
        )
        plan = self.plan
        self.query_one("#plan", Static).update(
            Text.assemble(
                ("Plan: ", "bold"),
                f"{plan.policy.describe()} · ",
                (
                    f"delete {len(plan.delete)} · frees {format_size(plan.bytes_freed)}",
                    "bold red" if plan.delete else "",
                ),
                f" · keeps {len(plan.keep)}",
            )
        )

    @staticmethod
    def _plan_cells(deleted: bool, reasons: tuple) -> tuple[Text, Text]:
        protected = any(r.protected for r in reasons)
        mark = Text("✗", style="bold red") if deleted else Text("◆" if protected else " ", style="bold cyan")
        plan = Text(
            ("delete: " if deleted else "keep: ") + ", ".join(map(str, reasons)),
            style="red" if deleted else ("bold" if protected else "dim"),
        )
        return mark, plan

    def current_path(self) -> str | None:
        table = self.query_one("#checkpoints", DataTable)
        if table.row_count == 0:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def say(self, message: str, *, warn: bool = False) -> None:
        self.notice = message
        self.query_one("#notice", Static).update(Text(message, style="yellow" if warn else ""))
        if warn:
            self.notify(message, severity="warning")

    # ------------------------------------------------------------------------------------------ actions

    def action_toggle(self) -> None:
        path = self.current_path()
        if path is None or self.plan is None:
            return
        step = next(c.step for c in self.run.checkpoints if c.path == path)
        deleted, reasons = self._fates()[path]
        if path in self.pins:
            self.pins.discard(path)
        elif deleted:
            if path in self.select:
                self.select.discard(path)
            else:
                self.pins.add(path)  # the policy deletes it; keep it by hand
        elif protected := [r for r in reasons if r.protected]:  # plan_prune's own verdict on it
            return self.refuse(step, protected)
        else:
            self.select.add(path)
        plan = self.compute_plan()
        if refusal := next((r for r in plan.refused if r.path == path), None):
            self.select.discard(path)
            return self.refuse(step, refusal.reasons)
        self.plan = plan
        now_deleted = any(i.path == path for i in self.plan.delete)
        self.say(
            f"step {step} {'marked for deletion' if now_deleted else 'kept'}; "
            f"plan frees {format_size(self.plan.bytes_freed)}"
        )
        self.redraw()
        self.query_one("#checkpoints", DataTable).action_cursor_down()

    def refuse(self, step: int, reasons) -> None:
        self.say(f"step {step} cannot be deleted: " + "; ".join(EXPLAIN[r] for r in reasons), warn=True)

    def action_details(self) -> None:
        if isinstance(self.focused, Input):  # Enter (a priority binding) in the filter box ends the filter edit
            self.end_filter_edit()
            return
        path = self.current_path()
        if path is None:
            return
        from tui.screens.details import DetailsScreen

        self.app.push_screen(DetailsScreen(path))

    # The filter box is on screen exactly while it has the focus: a visible box must be where keys go, or `d`
    # typed "into the filter" would reach the table. Ending the edit (Enter, a click elsewhere, Tab) hides it and
    # keeps the filter, which the title line shows; Escape clears it.

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def end_filter_edit(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = False
        self.query_one("#checkpoints", DataTable).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self.filter_text = event.value.strip()
            self.redraw()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            self.end_filter_edit()

    def on_input_blurred(self, event: Input.Blurred) -> None:
        if event.input.id == "filter" and event.input.display:
            self.end_filter_edit()

    def action_back(self) -> None:
        box = self.query_one("#filter", Input)
        if box.display or self.filter_text:  # Escape clears a filter first, shown or not
            box.value = ""
            self.filter_text = ""
            self.end_filter_edit()
            self.redraw()
            return
        self.app.pop_screen()

    def action_sort(self) -> None:
        i = SORTS.index(self.sort_by)
        if self.descending:
            self.descending = False
        else:
            self.sort_by, self.descending = SORTS[(i + 1) % len(SORTS)], True
        self.redraw()

    def action_keep_last(self) -> None:
        from tui.screens.prompt import NumberPrompt

        def chosen(n: int | None) -> None:
            if n is not None:
                self.set_policy(Policy(rules=(KeepLast(n=n),)))

        self.app.push_screen(NumberPrompt("Keep the last N complete checkpoints. N =", default=2), chosen)

    def action_keep_every(self) -> None:
        from tui.screens.prompt import NumberPrompt

        def chosen(k: int | None) -> None:
            if k is not None:
                self.set_policy(Policy(rules=(KeepEvery(k=k),)))

        steps = [c.step for c in self.run.checkpoints if c.step > 0] if self.run else []
        default = 2 * min(steps) if steps else 100
        self.app.push_screen(NumberPrompt("Keep every step divisible by K. K =", default=default), chosen)

    def set_policy(self, policy: Policy) -> None:
        """A preset replaces the policy and drops hand edits: the preset alone decides what is marked."""
        self.policy = policy
        self.select.clear()
        self.pins.clear()
        self.plan = self.compute_plan()
        self.say(f"preset: {policy.describe()}; plan frees {format_size(self.plan.bytes_freed)}")
        self.redraw()

    def action_clear(self) -> None:
        self.set_policy(Policy())

    def action_delete(self) -> None:
        if self.plan is None or self.plan.empty:
            self.say("nothing marked for deletion", warn=True)
            return
        from tui.screens.confirm import ConfirmPrune

        plan = self.plan

        def confirmed(ok: bool | None) -> None:
            if ok and self.app.prune(plan):
                self.say(f"deleting {len(plan.delete)} checkpoint(s)…")
                self.select.clear()
                self.pins.clear()
            else:
                self.say("cancelled: nothing deleted")

        self.app.push_screen(ConfirmPrune(plan), confirmed)

    def action_rescan(self) -> None:
        self.app.rescan()

    def action_verify(self) -> None:
        self.app.verify([self.run_path])
