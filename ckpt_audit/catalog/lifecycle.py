"""Catalog records of lifecycle actions: executed prune plans (with every reason) and exports (with hashes).

The schema lives in `migrations.py` (m002_lifecycle, m003_trust), written out there as applied. `LifecycleLog` wraps
the catalog's sqlite-utils Database; `ckpt_audit.lifecycle.prune.execute(catalog=LifecycleLog(...))` writes through
it. A prune's plan is written before anything is touched and each outcome as it happens, so a killed prune leaves a
`started` row that says what it meant to do; the next one records reclaiming the trash the killed one left.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ckpt_audit.export.result import ExportResult
    from ckpt_audit.lifecycle.prune import Outcome, PruneResult
    from ckpt_audit.lifecycle.retention import PrunePlan
    from ckpt_audit.models import Finding


class LifecycleLog:
    """Writes prunes and exports into an open catalog (`db`: catalog.sqlite.Db, the sqlite-utils calls on sqlite3)."""

    def __init__(self, db) -> None:
        self.db = db

    # ------------------------------------------------------------------ prune

    def record_prune_start(self, *, exec_id: str, plan: PrunePlan, started_ns: int) -> None:
        now = time.time_ns()
        with self.db.atomic():
            self.db["prunes"].insert(
                {
                    "exec_id": exec_id,
                    "started_ns": started_ns,
                    "finished_ns": None,
                    "status": "started",
                    "policy": plan.policy.describe(),
                    "planned_delete": len(plan.delete),
                    "planned_bytes": plan.bytes_freed,
                    "bytes_freed": None,
                    "plan": json.dumps(plan.to_dict()),
                }
            )
            rows = [_item_row(exec_id, i, "planned", now) for i in plan.delete]
            rows += [_item_row(exec_id, i, "kept", now) for i in plan.keep]
            if rows:
                self.db["prune_items"].insert_all(rows, batch_size=500)

    def record_prune_outcome(self, *, exec_id: str, outcome: Outcome) -> None:
        with self.db.atomic():
            self.db["prune_items"].insert(
                {
                    "exec_id": exec_id,
                    "path": outcome.path,
                    "run_path": outcome.run_path,
                    "step": outcome.step,
                    "action": str(outcome.action),
                    "reasons": json.dumps(list(outcome.reasons)),
                    "detail": outcome.detail,
                    "size_bytes": outcome.size_bytes,
                    "at_ns": time.time_ns(),
                }
            )
            if str(outcome.action) in ("deleted", "reclaimed") and self.db["checkpoints"].exists():
                from ckpt_audit.catalog.store import refresh_run_summaries

                self.db.execute("UPDATE checkpoints SET present = 0 WHERE path = ?", [outcome.path])
                if outcome.run_path is not None:
                    refresh_run_summaries(self.db.conn, [outcome.run_path])

    def record_prune_finish(self, *, exec_id: str, result: PruneResult) -> None:
        with self.db.atomic():
            self.db.execute(
                "UPDATE prunes SET finished_ns = ?, status = 'finished', bytes_freed = ? WHERE exec_id = ?",
                [result.finished_ns, result.bytes_freed, exec_id],
            )

    def prunes(self) -> list[dict]:
        return list(
            self.db.query(
                "SELECT exec_id, started_ns, finished_ns, status, policy, planned_delete, "
                "planned_bytes, bytes_freed FROM prunes ORDER BY started_ns"
            )
        )

    def prune_items(self, exec_id: str) -> list[dict]:
        rows = self.db.query("SELECT * FROM prune_items WHERE exec_id = ? ORDER BY id", [exec_id])
        return [{**r, "reasons": json.loads(r["reasons"])} for r in rows]

    # ------------------------------------------------------------------ export

    def record_export(self, result: ExportResult, *, tick: Callable[[], None] | None = None) -> int:
        """One export with its files, in one transaction (`tick`: the kill-test seam, called inside it)."""
        with self.db.atomic():
            export_id = (
                self.db["exports"]
                .insert(
                    {
                        "created_ns": time.time_ns(),
                        "source": result.source,
                        "role_dir": result.role_dir,
                        "out_dir": result.out_dir,
                        "source_kind": result.source_kind,
                        "world_size": result.world_size,
                        "dtype": result.dtype,
                        "tensors": result.tensors,
                        "total_bytes": result.total_bytes,
                        "verified": int(result.verified),
                        "warnings": json.dumps(list(result.warnings)),
                        "source_files": json.dumps(
                            [list(f) for f in result.source_files]
                        ),  # as re-read for this export
                        "source_verified": int(result.source_verified),
                        "override": result.override,
                    }
                )
                .last_pk
            )
            if tick is not None:
                tick()
            self.db["export_files"].insert_all(
                [
                    {"export_id": export_id, "path": f.path, "size_bytes": f.size_bytes, "hash": f.hash}
                    for f in result.files
                ],
                batch_size=500,
            )
        return int(export_id)

    def known_places(self) -> list[tuple[str, str]]:
        """(what, path) of every scanned root, run and checkpoint the catalog knows: an export never goes there."""
        if not self.db["scans"].exists():
            return []
        roots = {p for (doc,) in self.db.execute("SELECT roots FROM scans") for p in json.loads(doc)}
        out = [("scanned root", p) for p in sorted(roots)]
        out += [("run", p) for (p,) in self.db.execute("SELECT path FROM runs")]
        out += [("checkpoint", p) for (p,) in self.db.execute("SELECT path FROM checkpoints")]
        return out

    def export_source(self, path: str) -> tuple[str | None, dict[str, dict], tuple[Finding, ...]]:
        """The catalog's view of the checkpoint at or above `path`: (status, manifest of its present files by
        path, findings of its last scan). (None, {}, ()) when the catalog has never seen it."""
        from ckpt_audit import models

        if not self.db["checkpoints"].exists():
            return None, {}, ()
        row = self.db.execute(
            "SELECT path, status, last_scan_id FROM checkpoints WHERE present = 1 AND "
            "(path = ? OR substr(?, 1, length(path) + 1) = path || '/') ORDER BY length(path) DESC LIMIT 1",
            [path, path],
        ).fetchone()
        if row is None:
            return None, {}, ()
        ckpt, status, scan_id = row
        manifest = {
            r["path"]: r
            for r in self.db.query(
                "SELECT path, hash, size_bytes, mtime_ns, inode FROM files WHERE checkpoint_path = ? AND present = 1",
                [ckpt],
            )
        }
        findings = tuple(
            models.Finding(
                severity=models.Severity[r["severity"].upper()], code=r["code"], path=r["path"], message=r["message"]
            )
            for r in self.db.query(
                "SELECT severity, code, path, message FROM findings WHERE checkpoint_path = ? "
                "AND scan_id = ? ORDER BY id",
                [ckpt, scan_id],
            )
        )
        return status, manifest, findings

    def exports(self) -> list[dict]:
        out = []
        for r in self.db.query("SELECT * FROM exports ORDER BY id"):
            files = list(
                self.db.query(
                    "SELECT path, size_bytes, hash FROM export_files WHERE export_id = ? ORDER BY path", [r["id"]]
                )
            )
            out.append(
                {
                    **r,
                    "warnings": json.loads(r["warnings"]),
                    "source_files": json.loads(r["source_files"]),
                    "files": files,
                }
            )
        return out


def _item_row(exec_id: str, item, action: str, now: int) -> dict:
    return {
        "exec_id": exec_id,
        "path": item.path,
        "run_path": item.run_path,
        "step": item.step,
        "action": action,
        "reasons": json.dumps([str(r) for r in item.reasons]),
        "detail": "",
        "size_bytes": item.size_bytes,
        "at_ns": now,
    }
