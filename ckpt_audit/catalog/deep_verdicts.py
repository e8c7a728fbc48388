"""The catalog's side of kept deep verdicts (ckpt_audit.rules.deep_verdict): recording what a verify found beyond the
scan, and reading it back for every later scan (bare sqlite3: a WAL read beside a running writer, off start-up).

Table `deep_verdicts` (migration m008): one row per checkpoint verify found something in, with the facts of the
files it read. A later verify of the checkpoint replaces the row (or deletes it when it finds nothing); a recorded
scan that found the row stale (a file it read changed) deletes it.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import TYPE_CHECKING

from ckpt_audit.catalog.manifest import findings_from_json, findings_to_json, query_read_only
from ckpt_audit.models import run_summaries

if TYPE_CHECKING:  # pragma: no cover
    from ckpt_audit.models import ScanResult
    from ckpt_audit.rules.deep_verdict import DeepVerdict


def read_deep_verdicts(
    path: str | os.PathLike[str] | None, *, conn: sqlite3.Connection | None = None
) -> dict[str, DeepVerdict]:
    """checkpoint path -> its kept deep verdict; {} without a catalog (or one older than m008). Raises CatalogError.
    `conn`: a scan's one read-only connection to the catalog (manifest.query_read_only)."""
    if path is None:
        return {}
    sql = "SELECT checkpoint_path, run_path, judged_ns, findings, files FROM deep_verdicts"
    rows = query_read_only(path, sql, conn=conn)
    if not rows:  # no catalog, or no such table yet: nothing kept
        return {}
    from ckpt_audit.rules.deep_verdict import DeepVerdict  # defined only when some verdict is kept

    out: dict[str, DeepVerdict] = {}
    for ckpt, run, judged, found, files in rows:
        try:
            out[ckpt] = DeepVerdict(
                checkpoint_path=ckpt,
                run_path=run,
                judged_ns=judged,
                findings=findings_from_json(found, ckpt),
                files=tuple((p, size, mtime, inode, h) for p, size, mtime, inode, h in json.loads(files)),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            continue  # an edited or damaged row, as a damaged cached run verdict (catalog.verdicts): not read
    return out


def record_deep_verdicts(conn: sqlite3.Connection, result: ScanResult, scan_id: int) -> None:
    """Keep what a deep scan found beyond the shallow one (`result.deep_found`), with its checkpoints' files as read;
    and drop the verdicts this scan found stale (files changed since: they no longer bind)."""
    stale = sorted(  # from the summaries: a kept run's model is not decoded (models.LazyRuns)
        {
            (ckpt,)
            for s in run_summaries(result.runs)
            for ckpt, f in s.findings
            if f.code == "deep-verdict-stale" and ckpt
        }
    )
    conn.executemany("DELETE FROM deep_verdicts WHERE checkpoint_path = ?", stale)
    if not result.deep_found:
        return
    from ckpt_audit.rules.deep_verdict import files_of

    ckpts = {c.path: c for r in result.runs for c in r.checkpoints}
    for path, found in sorted(result.deep_found.items()):
        ckpt = ckpts.get(path)
        if ckpt is None:
            continue
        if not found:
            conn.execute("DELETE FROM deep_verdicts WHERE checkpoint_path = ?", [path])
            continue
        conn.execute(
            "INSERT OR REPLACE INTO deep_verdicts (checkpoint_path, run_path, scan_id, judged_ns, findings, files)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            [path, ckpt.run_path, scan_id, result.started_ns, findings_to_json(found), json.dumps(files_of(ckpt))],
        )
