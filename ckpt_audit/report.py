"""Rendering a ScanResult: the `--json` document and the text report (shared by scan, demo and verify)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping

from ckpt_audit.models import Checkpoint, Component, Finding, Run, ScanResult, Severity, ShardFile, run_summaries
from ckpt_audit.units import format_age, format_size

FAIL_ON = {"info": Severity.INFO, "warning": Severity.WARNING, "error": Severity.ERROR}


def failing(result: ScanResult, fail_on: Severity) -> list[Finding]:
    return [f for f in result.all_findings if f.severity >= fail_on]


def summary(result: ScanResult) -> dict:
    every = result.all_findings
    statuses: dict[str, int] = {}
    checkpoints = 0
    for run in run_summaries(result.runs):  # a kept run's model is not decoded for the summary line
        checkpoints += len(run.checkpoints)
        for _path, _step, status in run.checkpoints:
            statuses[status.value] = statuses.get(status.value, 0) + 1
    return {
        "runs": len(result.runs),
        "checkpoints": checkpoints,
        "statuses": statuses,
        "errors": sum(1 for f in every if f.severity is Severity.ERROR),
        "warnings": sum(1 for f in every if f.severity is Severity.WARNING),
        "infos": sum(1 for f in every if f.severity is Severity.INFO),
    }


Verified = Mapping[str, "int | None"]  # path -> when its content was last read in full (None: never)


def oldest_verified(paths: Iterable[str], verified: Verified) -> int | None:
    """A checkpoint's last verification by content: its least recently verified file's (None if one never was)."""
    times = [verified.get(p) for p in paths]
    return None if not times or None in times else min(times)  # type: ignore[type-var]


def file_doc(f: ShardFile, verified: Verified | None = None) -> dict:
    return {
        "path": f.path,
        "kind": f.kind.value,
        "rank": f.rank,
        "world_size": f.world_size,
        "size_bytes": f.size_bytes,
        "mtime_ns": f.mtime_ns,
        "inode": f.inode,
        "hash": f.hash,
        "crc_ok": f.crc_ok,
        "verified_ns": (verified or {}).get(f.path),
    }


def component_doc(c: Component, verified: Verified | None = None) -> dict:
    return {
        "role": c.role,
        "path": c.path,
        "layout": c.layout,
        "world_size": c.world_size,
        "size_bytes": c.size_bytes,
        "files": [file_doc(f, verified) for f in c.files],
        "findings": [f.to_dict() for f in c.findings],
    }


def checkpoint_doc(c: Checkpoint, verified: Verified | None = None) -> dict:
    return {
        "step": c.step,
        "path": c.path,
        "status": c.status.value,
        "world_size": c.world_size,
        "size_bytes": c.size_bytes,
        "mtime_ns": c.mtime_ns,
        "verified_ns": oldest_verified((f.path for f in c.all_files), verified or {}),
        "components": [component_doc(x, verified) for x in c.components],
        "files": [file_doc(f, verified) for f in c.files],
        "findings": [f.to_dict() for f in c.findings],
    }


def run_doc(r: Run, verified: Verified | None = None) -> dict:
    latest = r.latest_complete
    return {
        "path": r.path,
        "name": r.name,
        "layout": r.layout,
        "tracker_step": r.tracker_step,
        "latest_complete_step": latest.step if latest else None,
        "metrics_path": r.metrics_path,
        "size_bytes": r.size_bytes,
        "findings": [f.to_dict() for f in r.findings],
        "checkpoints": [checkpoint_doc(c, verified) for c in r.checkpoints],
    }


def scan_document(result: ScanResult, *, scan_id: int | None, catalog: str | None, exit_code: int) -> dict:
    verified = {p: f.verified_ns for p, f in result.file_facts.items()}
    return {
        "command": "scan",
        "scan_id": scan_id,
        "catalog": catalog,
        "roots": list(result.roots),
        "started_ns": result.started_ns,
        "finished_ns": result.finished_ns,
        "files_hashed": result.files_hashed,
        "files_reused": result.files_reused,
        "runs_reused": len(result.runs_reused),
        "bytes_hashed": result.bytes_hashed,
        "files_scrubbed": result.files_scrubbed,
        "bytes_scrubbed": result.bytes_scrubbed,
        "summary": summary(result),
        "exit_code": exit_code,
        "findings": [f.to_dict() for f in result.findings],
        "runs": [run_doc(r, verified) for r in result.runs],
        **({} if result.cluster is None else {"cluster": cluster_doc(result.cluster)}),
    }


def cluster_doc(view) -> dict:
    """scan --ray: the nodes that answered or not, and which nodes hold each file (logical path)."""
    return {
        "answered": list(view.answered),
        "silent": list(view.silent),
        "holders": {p: sorted(c.node_id for c in copies) for p, copies in sorted(view.copies.items())},
    }


def age_str(mtime_ns: int, now_ns: int | None = None) -> str:
    """`units.format_age` against the clock unless `now_ns` is given."""
    return format_age(mtime_ns, now_ns or time.time_ns())


def finding_line(f: Finding) -> str:
    rank = f" [rank {f.rank}]" if f.rank is not None else ""
    return f"  {f.severity.label:<7} {f.code:<24} {f.path}{rank}: {f.message}"


def render_text(result: ScanResult, *, quiet: bool = False, fail_on: Severity = Severity.ERROR) -> Iterator[str]:
    """Human report. quiet: only the findings at or above fail_on (nothing when clean)."""
    if quiet:
        for f in failing(result, fail_on):
            yield finding_line(f).strip()
        return
    for f in result.findings:
        yield finding_line(f)
    for run in result.runs:
        latest = run.latest_complete
        tracker = run.tracker_step if run.tracker_step is not None else "-"
        yield (
            f"{run.name}  ({run.path})  layout {run.layout}  tracker {tracker}"
            f"  latest complete {latest.step if latest else '-'}"
        )
        yield f"  {'step':>8}  {'status':<12} {'W':>3}  {'size':>10}  {'age':>5}  findings"
        for c in run.checkpoints:
            n_err = sum(1 for f in c.all_findings if f.severity is Severity.ERROR)
            n_warn = sum(1 for f in c.all_findings if f.severity is Severity.WARNING)
            note = ", ".join(
                x for x in (f"{n_err} error(s)" if n_err else "", f"{n_warn} warning(s)" if n_warn else "") if x
            )
            ws = c.world_size if c.world_size is not None else "-"
            yield f"  {c.step:>8}  {c.status.value:<12} {ws:>3}  {c.size_str:>10}  {age_str(c.mtime_ns):>5}  {note}"
        for f in run.findings:
            yield finding_line(f)
        for c in run.checkpoints:
            for f in c.all_findings:
                if f.severity > Severity.INFO:
                    yield finding_line(f)
    s = summary(result)
    secs = (result.finished_ns - result.started_ns) / 1e9
    yield (
        f"scanned {s['runs']} run(s), {s['checkpoints']} checkpoint(s): {result.files_hashed} file(s) hashed "
        f"({format_size(result.bytes_hashed)}; {result.files_scrubbed} of them scrubbed, "
        f"{format_size(result.bytes_scrubbed)}), {result.files_reused} reused, in {secs:.2f} s; "
        f"{s['errors']} error(s), {s['warnings']} warning(s)"
    )
