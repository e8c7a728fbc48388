"""`ckpt-audit continuity` through the session: a run's metrics logs judged around every resume, with the steps
of its checkpoints taken from the catalog (read-only, without the lock) when one is named."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_audit.session.core import SessionError, StrPath
from ckpt_audit.session.reads import reading

if TYPE_CHECKING:  # pragma: no cover
    from ckpt_audit.continuity.audit import ContinuityResult
    from ckpt_audit.continuity.resume_points import CheckpointRef


def audit_metrics(
    metrics: Sequence[Path], *, catalog_path: StrPath | None = None, run_path: Path | None = None, **options
) -> ContinuityResult:
    """Read the metrics logs (files, or directories of TensorBoard event files) and judge every resume
    (continuity.audit.audit_log's `options`); with a catalog, its checkpoints of the run those logs belong to (or
    `run_path`) are the resume points. A log or catalog that cannot be used is a SessionError (exit 3)."""
    from ckpt_audit.continuity.audit import audit_log
    from ckpt_audit.continuity.metrics import MetricsError, read_metrics

    try:
        log = read_metrics(metrics)
        checkpoints = () if catalog_path is None else _catalog_checkpoints(Path(catalog_path), run_path, metrics)
        return audit_log(log, checkpoints=checkpoints, **options)
    except MetricsError as exc:
        raise SessionError(str(exc)) from None


def _catalog_checkpoints(catalog: Path, run_path: Path | None, metrics: Sequence[Path]) -> tuple[CheckpointRef, ...]:
    from ckpt_audit.continuity.resume_points import CheckpointRef

    if not catalog.is_file():
        raise SessionError(f"catalog {catalog} does not exist (run ckpt-audit scan first)")
    with reading(catalog) as cat:
        runs = cat.runs()
        if run_path is not None:
            wanted = os.path.realpath(run_path)
            run = next((r for r in runs if os.path.realpath(r["path"]) == wanted), None)
        else:
            files = {os.path.realpath(p) for p in metrics}
            run = next((r for r in runs if r["metrics_path"] and os.path.realpath(r["metrics_path"]) in files), None)
            if run is None:
                dirs = {os.path.dirname(f) for f in files}
                run = next((r for r in runs if os.path.realpath(r["path"]) in dirs), None)
        if run is None:
            raise SessionError(
                f"no run in catalog {catalog} for {run_path or ', '.join(map(str, metrics))}; name it with --run"
            )
        rows = cat.checkpoints(run["path"])
    return tuple(
        CheckpointRef(step=int(r["step"]), complete=r["status"] == "complete", mtime_ns=int(r["mtime_ns"] or 0))
        for r in rows
    )
