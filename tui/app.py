"""The App: owns the current Snapshot and runs every blocking operation (scan, verify, prune, export) in a
worker thread, so the screens stay responsive; screens only render the snapshot and ask the App to act."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from textual import events, work
from textual.app import App
from textual.binding import Binding

from ckpt_audit.cli.common import CommandError, require_torch
from ckpt_audit.models import Checkpoint, ScanResult, Severity, format_size
from ckpt_audit.session import catalog_runs
from tui.activity import ActivityBar
from tui.screens.armed import ArmedModal
from tui.snapshot import Snapshot, scan_roots, verify_paths

THROTTLE_NS = 100_000_000  # progress reaches the UI at most ten times a second


class AuditApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "ckpt-audit"
    ENABLE_COMMAND_PALETTE = False  # every action has a key; the palette's footer slot is better spent on them
    BINDINGS = [
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, *, catalog_path: Path | None, roots: Sequence[str] = ()) -> None:
        super().__init__()
        self.catalog_path = catalog_path
        self.roots = tuple(str(Path(r).resolve()) for r in roots)
        self.snapshot = Snapshot()
        self.last_error: str | None = None
        self.catalog_roots: tuple[str, ...] = ()
        self.last_prune = None
        self.last_survivors = (
            None  # the survivor check of the last prune (ckpt_audit.lifecycle.survivors.SurvivorCheck)
        )
        self.last_export = None
        self.last_verify: ScanResult | None = None

    def on_mount(self) -> None:
        from tui.screens.runs import RunsScreen

        self.push_screen(RunsScreen())
        if self.roots:
            self.rescan()
        elif self.catalog_path is not None:
            self.load_catalog()

    async def on_event(self, event: events.Event) -> None:
        # The one gate for type-ahead: a key an armed dialog does not admit (pressed before it was shown, or while
        # it arms) is dropped here, before any binding, the App's included, or widget sees it.
        if isinstance(event, events.Key) and isinstance(self.screen, ArmedModal) and not self.screen.admits(event):
            return
        await super().on_event(event)

    # ------------------------------------------------------------------------------------------ actions

    def action_help(self) -> None:
        from tui.screens.help import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    # ------------------------------------------------------------------------------------------ jobs

    # One job at a time: a scan racing a prune would show a half-deleted tree, and thread workers cannot be
    # cancelled mid-way, so a second request is refused (and says so) instead of queued or cancelling.

    def load_catalog(self) -> bool:
        return self._start(self._load_catalog_job)

    def rescan(self) -> bool:
        return self._start(self._rescan_job)

    def verify(self, paths: Sequence[str]) -> bool:
        try:  # without torch every shard would read as not-loadable: say what to install instead
            require_torch("verify")
        except CommandError as exc:
            self.last_error = exc.format_message()
            self.notify(self.last_error, severity="error", timeout=10)
            return False
        return self._start(self._verify_job, list(paths))

    def prune(self, plan) -> bool:
        return self._start(self._prune_job, plan)

    def export(self, ckpt: Checkpoint, to: str, dtype: str | None) -> bool:
        return self._start(self._export_job, ckpt, to, dtype)

    @property
    def busy(self) -> bool:
        return any(w.group == "io" and not w.is_finished for w in self.workers)

    def _start(self, job, *args) -> bool:
        if self.busy:
            self.notify("busy with the previous job: try again when it is done", severity="warning")
            return False
        self.last_error = None
        job(*args)
        return True

    @work(thread=True, group="io", exit_on_error=False)
    def _load_catalog_job(self) -> None:
        """No roots given: rescan the runs the catalog knows (cheap: unchanged files reuse their hashes)."""
        self._busy("reading catalog")
        try:
            self.catalog_roots = catalog_runs(self.catalog_path)
        except Exception as exc:  # noqa: BLE001 - the UI reports it in one line and keeps running
            return self._failed("reading the catalog", exc)
        if not self.catalog_roots:
            self.call_from_thread(self._hide)
            return self.call_from_thread(
                self.notify,
                "the catalog knows no runs: start with `ckpt-audit tui ROOT`",
                severity="warning",
                timeout=10,
            )
        self._scan()

    @work(thread=True, group="io", exit_on_error=False)
    def _rescan_job(self) -> None:
        self._scan()

    def _scan(self, done: str = "") -> None:
        roots = self.scan_targets()
        if not roots:
            return self.call_from_thread(
                self.notify, "nothing to scan: start with `ckpt-audit tui ROOT`", severity="warning"
            )
        self._busy("scanning")
        try:
            snap = scan_roots(roots, self.catalog_path, progress=self._progress("scanning"))
        except Exception as exc:  # noqa: BLE001
            return self._failed("scanning", exc)
        message = done or f"scanned {len(snap.runs)} run(s)"
        if self.catalog_path is not None and snap.unrecorded:
            message += f" (not recorded: {snap.unrecorded})"
        self.call_from_thread(self._set_snapshot, snap, message)

    @work(thread=True, group="io", exit_on_error=False)
    def _verify_job(self, paths: Sequence[str]) -> None:
        self._busy("verifying")
        try:
            result = verify_paths(paths, self.catalog_path, progress=self._progress("verifying"))
        except Exception as exc:  # noqa: BLE001
            return self._failed("verifying", exc)
        self.last_verify = result
        self.call_from_thread(self._merge_verified, result)

    @work(thread=True, group="io", exit_on_error=False)
    def _prune_job(self, plan) -> None:
        from ckpt_audit.session import open_session, preview_of
        from ckpt_audit.session.terms import Action

        def progress(done: int, total: int, _line: str = "", /) -> None:
            self.call_from_thread(self._show, f"deleting {done}/{total}", done, total)

        planned = {i.run_path for i in (*plan.delete, *plan.keep)}
        runs = [r for r in self.snapshot.runs if r.path in planned]
        self._busy("re-reading survivors")
        try:
            with open_session(self.catalog_path) as session:
                # what the plan counts on is re-read now, after confirmation; a changed verdict: nothing is deleted
                done = session.prune(
                    preview_of(plan, runs),
                    confirmed=True,
                    progress=progress,
                    reread_progress=self._progress("re-reading survivors"),
                )
        except Exception as exc:  # noqa: BLE001 - lock.Locked included: a cron run is busy, try again later
            return self._failed("pruning", exc)
        check, result = done.check, done.result
        self.last_survivors = check
        if result is None:  # the re-read changed what goes: nothing deleted
            return self._stale_plan(check)
        summary = (
            f"deleted {result.count(Action.DELETED)}, skipped {result.count(Action.SKIPPED)}, "
            f"failed {result.count(Action.FAILED)}; freed {format_size(result.bytes_freed)}, "
            f"re-read {format_size(result.bytes_reread)}"
        )
        self.last_prune = result
        # What is on disk now is the truth: rescan rather than edit the snapshot by hand.
        self._scan(done=summary)

    def _stale_plan(self, check) -> None:
        """A survivor failed its re-read: nothing is deleted; show the runs as they are now, with a new plan."""
        fresh = {r.path: r for r in check.runs}
        snap = replace(
            self.snapshot, runs=tuple(fresh.get(r.path, r) for r in self.snapshot.runs), loaded_ns=time.time_ns()
        )
        failed = ", ".join(f"step {r.checkpoint.step} is {r.status}" for r in check.failed)
        self.call_from_thread(
            self._set_snapshot, snap, f"nothing deleted: re-read after confirmation: {failed}; review the new plan"
        )

    @work(thread=True, group="io", exit_on_error=False)
    def _export_job(self, ckpt: Checkpoint, to: str, dtype: str | None) -> None:
        from ckpt_audit.session import open_session

        self._busy("exporting")
        tick = self._progress("exporting")
        try:
            with open_session(self.catalog_path) as session:
                result = session.export(
                    ckpt.path,
                    to,
                    dtype=dtype,
                    protected_roots=self.scan_targets(),
                    progress=tick,
                )
        except Exception as exc:  # noqa: BLE001 - ExportError carries a one-line reason
            return self._failed("exporting", exc)
        self.last_export = result
        self.call_from_thread(
            self._done,
            f"exported step {ckpt.step} to {result.out_dir} "
            f"({result.tensors} tensors, {format_size(result.total_bytes)})",
        )

    # ------------------------------------------------------------------------------------------ plumbing

    def scan_targets(self) -> tuple[str, ...]:
        """The roots given on the command line, else the runs the catalog knows."""
        return self.roots or self.catalog_roots

    def _set_snapshot(self, snap: Snapshot, message: str) -> None:
        self.snapshot = snap
        for screen in self.screen_stack:
            refresh = getattr(screen, "refresh_from", None)
            if refresh is not None and screen.is_mounted:  # one still mounting reads the snapshot in on_mount
                refresh(snap)
        self._done(message)

    def _merge_verified(self, result: ScanResult) -> None:
        """Put verified checkpoints (with their deep findings) in place of the scanned ones."""
        fresh = {c.path: c for r in result.runs for c in r.checkpoints}
        runs = tuple(
            replace(r, checkpoints=tuple(fresh.get(c.path, c) for c in r.checkpoints)) for r in self.snapshot.runs
        )
        bad = sum(1 for c in fresh.values() for f in c.all_findings if f.severity is Severity.ERROR)
        self._set_snapshot(
            replace(self.snapshot, runs=runs, loaded_ns=time.time_ns()),
            f"verified: {bad} error finding(s) in {len(fresh)} checkpoint(s)",
        )

    def _progress(self, label: str):
        last = 0

        def tick(done: int, total: int, _item: str = "", /) -> None:  # a session.Progress
            nonlocal last
            now = time.monotonic_ns()
            if now - last >= THROTTLE_NS or done >= total:
                last = now
                self.call_from_thread(self._show, label, done, total)

        return tick

    def _busy(self, label: str) -> None:
        self.call_from_thread(self._show, label, None, None)

    def _failed(self, what: str, exc: Exception) -> None:
        self.last_error = f"{what} failed: {exc}"
        self.call_from_thread(self._hide)
        self.call_from_thread(self.notify, self.last_error, severity="error", timeout=10)

    def _show(self, label: str, done: float | None, total: float | None) -> None:
        for bar in self.screen.query(ActivityBar):
            bar.show(label, done, total)

    def _hide(self) -> None:
        for screen in self.screen_stack:
            for bar in screen.query(ActivityBar):
                bar.hide()

    def _done(self, message: str) -> None:
        self._hide()
        self.notify(message, timeout=4)
