"""Catalog records of tracker repairs (`ckpt-audit fix-tracker`); the table is migration m004_tracker_fixes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ckpt_audit.lifecycle.tracker_fix import TrackerFix


def record_fix(db, fix: TrackerFix, *, at_ns: int, backup_path: str | None) -> None:
    # a step past SQLite's INTEGER (a tracker of 30 digits) raised after the tracker was rewritten: old_content keeps it
    old_step = fix.old_step if fix.old_step is None or abs(fix.old_step) < 2**63 else None
    with db.atomic():
        db["tracker_fixes"].insert(
            {
                "at_ns": at_ns,
                "run_path": fix.run_path,
                "tracker_path": fix.tracker_path,
                "problem": fix.problem,
                "old_content": None if fix.old_content is None else fix.old_content.decode("utf-8", "replace"),
                "old_step": old_step,
                "new_step": fix.new_step,
                "backup_path": backup_path,
            }
        )


def fixes(db, run_path: str | None = None) -> list[dict]:
    """Recorded rewrites, oldest first (of one run, or all)."""
    where, params = ("WHERE run_path = ?", [run_path]) if run_path else ("", [])
    cur = db.execute(f"SELECT * FROM tracker_fixes {where} ORDER BY at_ns, id", params)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]
