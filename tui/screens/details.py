"""One checkpoint in full: every file (kind, rank, size, hash, CRC) and every finding with its explanation."""

from __future__ import annotations

import os
import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from ckpt_audit.codes import explain
from ckpt_audit.models import Checkpoint
from ckpt_audit.report import oldest_verified
from ckpt_audit.units import format_ago
from tui import cells
from tui.activity import ActivityBar
from tui.snapshot import Snapshot


class DetailsScreen(Screen):
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("x", "export", "Export HF"),
        Binding("v", "verify", "Verify"),
        Binding("r", "rescan", "Rescan"),
    ]

    def __init__(self, ckpt_path: str) -> None:
        super().__init__()
        self.ckpt_path = ckpt_path

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="ckpt-title", classes="summary")
        yield DataTable(id="files", cursor_type="row", zebra_stripes=True)
        with VerticalScroll(id="findings-box"):
            yield Static(id="findings")
        yield ActivityBar()
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#files", DataTable)
        table.add_column("kind", key="kind", width=11)
        table.add_column("rank", key="rank")
        table.add_column("size", key="size")
        table.add_column("hash", key="hash")
        table.add_column("crc", key="crc")
        table.add_column("verified", key="verified")
        table.add_column("file", key="file")
        self.refresh_from(self.app.snapshot)
        table.focus()

    @property
    def checkpoint(self) -> Checkpoint | None:
        for run in self.app.snapshot.runs:
            for c in run.checkpoints:
                if c.path == self.ckpt_path:
                    return c
        return None

    def refresh_from(self, snap: Snapshot) -> None:
        ckpt = self.checkpoint
        table = self.query_one("#files", DataTable)
        table.clear()
        held = [snap.nodes.get(f.path, ()) for f in ckpt.all_files] if ckpt is not None else []
        if any(held) and "nodes" not in table.columns:  # scan --ray recorded which node holds each file
            table.add_column("nodes", key="nodes")
        title = self.query_one("#ckpt-title", Static)
        if ckpt is None:
            title.update(Text(f"{self.ckpt_path} is gone from the last scan", style="red"))
            self.query_one("#findings", Static).update("")
            return
        roles = ", ".join(f"{c.role or '(root)'}:{c.layout}" for c in ckpt.components) or "-"
        now = time.time_ns()
        verified = oldest_verified((f.path for f in ckpt.all_files), snap.verified_ns)
        title.update(
            Text.assemble(
                (f"step {ckpt.step} ", "bold"),
                cells.badge(ckpt.status),
                f" · {ckpt.size_str} · W={ckpt.world_size or '-'} · {len(ckpt.all_files)} files · "
                f"{cells.age(ckpt.mtime_ns, now)} old · verified {format_ago(verified, now)} · {roles}\n",
                (ckpt.path, "dim"),
            )
        )
        for f in sorted(ckpt.all_files, key=lambda f: (str(f.kind), f.rank if f.rank is not None else -1, f.path)):
            table.add_row(
                str(f.kind),
                str(f.rank) if f.rank is not None else "-",
                f.size_str,
                (f.hash or "unreadable")[:10],
                cells.crc(f.crc_ok),
                format_ago(snap.verified_ns.get(f.path), now),
                os.path.relpath(f.path, ckpt.path),
                *([",".join(n[:8] for n in snap.nodes.get(f.path, ())) or "-"] if "nodes" in table.columns else []),
                key=f.path,
            )
        self.query_one("#findings", Static).update(self._findings_text(ckpt))

    @staticmethod
    def _findings_text(ckpt: Checkpoint) -> Text:
        findings = sorted(ckpt.all_findings, key=lambda f: (-f.severity, f.code, f.path))
        out = Text.assemble(cells.badge(ckpt.status), f": {cells.MEANING[ckpt.status]}\n")
        if not findings:
            return out.append("no findings", style="green")
        for f in findings:
            where = os.path.relpath(f.path, ckpt.path) if f.path.startswith(ckpt.path) else f.path
            out.append_text(cells.severity(f.severity))
            out.append(f" {f.code}", style="bold")
            out.append(f"  {where}: {f.message}\n")
            if why := explain(f.code):
                out.append(f"    {why}\n", style="dim italic")
        return out

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_export(self) -> None:
        ckpt = self.checkpoint
        if ckpt is None:
            return
        from tui.screens.prompt import ExportPrompt

        run_dir = ckpt.run_path.rstrip("/")
        # beside the outermost scanned root holding the run: export refuses any --to inside a root
        roots = [r.rstrip("/") for r in self.app.scan_targets() if (run_dir + "/").startswith(r.rstrip("/") + "/")]
        base = os.path.dirname(min(roots, key=len) if roots else run_dir)
        default = os.path.join(base, f"{os.path.basename(run_dir)}-step{ckpt.step}-hf")

        def chosen(answer: tuple[str, str | None] | None) -> None:
            if answer is not None:
                self.app.export(ckpt, answer[0], answer[1])

        self.app.push_screen(ExportPrompt(ckpt.step, default), chosen)

    def action_verify(self) -> None:
        self.app.verify([self.ckpt_path])

    def action_rescan(self) -> None:
        self.app.rescan()
