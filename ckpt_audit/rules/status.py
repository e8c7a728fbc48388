"""A checkpoint's status, derived from its findings, the tracker and how recently it was written."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ckpt_audit.codes import CODES, UNREAD_CODES, UNSAFE_CODES, finding
from ckpt_audit.models import IN_PROGRESS_WINDOW_S, Checkpoint, FileKind, Finding, Severity, Status

if TYPE_CHECKING:
    from ckpt_audit.rules.deep_verdict import DeepVerdict


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanContext:
    """What a verdict needs to know of the scan itself (the layouts pass it through to `judge`)."""

    now_ns: int  # wall clock at scan start
    in_progress_window_ns: int = int(IN_PROGRESS_WINDOW_S * 1e9)  # touched this recently, uncommitted: in-progress
    changed_paths: frozenset[str] = frozenset()  # files whose stat changed while the scan read them
    unread: tuple[Finding, ...] = ()  # entries the walk or the readers could not read: their checkpoint is unknown
    # checkpoint path -> what an earlier verify found of it (catalog.deep_verdicts): binds while its files stand
    deep: Mapping[str, DeepVerdict] = field(default_factory=dict)


def is_resumable_role(role: str) -> bool:
    # after retention a step may keep critic/ while actor/ is gone: still a husk for resuming the policy
    return role != "critic"


_SHARDS = frozenset({FileKind.MODEL, FileKind.OPTIM, FileKind.EXTRA_STATE, FileKind.DISTCP})


def is_husk(ckpt: Checkpoint) -> bool:
    """No shard of any resumable role is left (retention removes whole role directories)."""
    return not any(is_resumable_role(c.role) and any(f.kind in _SHARDS for f in c.files) for c in ckpt.components)


def is_in_progress(ckpt: Checkpoint, *, tracker_step: int | None, ctx: ScanContext) -> bool:
    if any(f.path in ctx.changed_paths for f in ckpt.all_files):
        return True
    recent = ctx.now_ns - ckpt.mtime_ns < ctx.in_progress_window_ns
    if recent and not ckpt.all_files:
        # a step directory made a moment ago, nothing in it yet: being written whatever the tracker says (a run
        # resumed from an older step saves again at or below it)
        return True
    committed = tracker_step is not None and ckpt.step <= tracker_step
    return recent and not committed


# verdicts from worst to best: the first that applies is the status (verify's rejudge keeps the same order)
PRECEDENCE = (
    Status.UNKNOWN,
    Status.CORRUPT,
    Status.UNSAFE,
    Status.UNCOMMITTED,
    Status.HUSK,
    Status.INCOMPLETE,
    Status.COMPLETE,
)


def worst(a: Status, b: Status) -> Status:
    """The status that ranks first in PRECEDENCE (statuses outside it, such as in-progress, are kept as they are)."""
    if a not in PRECEDENCE or b not in PRECEDENCE:
        return a if a not in PRECEDENCE else b
    return min(a, b, key=PRECEDENCE.index)


def from_errors(errors: list[Finding] | tuple[Finding, ...]) -> Status:
    """What a set of error findings alone makes of a checkpoint: unknown, corrupt, unsafe, incomplete or complete."""
    if any(f.code in UNREAD_CODES for f in errors):
        return Status.UNKNOWN
    if any(CODES[f.code].corrupts for f in errors if f.code in CODES):
        return Status.CORRUPT
    if any(f.code in UNSAFE_CODES for f in errors):
        return Status.UNSAFE
    return Status.INCOMPLETE if errors else Status.COMPLETE


def unread_inside(ckpt: Checkpoint, ctx: ScanContext) -> tuple[Finding, ...]:
    """The walk's findings of entries below `ckpt` that could not be read (the readers' own are in its findings)."""
    below = ckpt.path.rstrip("/") + "/"
    return tuple(f for f in ctx.unread if f.path == ckpt.path or f.path.startswith(below))


def _soften(found: tuple[Finding, ...]) -> tuple[Finding, ...]:
    return tuple(replace(f, severity=Severity.INFO) if f.severity > Severity.INFO else f for f in found)


def judge(ckpt: Checkpoint, *, tracker_step: int | None, ctx: ScanContext) -> Checkpoint:
    """The checkpoint with its status set (and, while it is being written, its findings softened to info)."""
    if is_in_progress(ckpt, tracker_step=tracker_step, ctx=ctx):
        # a checkpoint being written is short of files by nature: report what is missing, never call it corrupt
        return replace(
            ckpt,
            status=Status.IN_PROGRESS,
            components=tuple(replace(c, findings=_soften(c.findings)) for c in ckpt.components),
            findings=_soften(ckpt.findings)
            + (finding("in-progress", ckpt.path, "being written now; judged on a later scan"),),
        )
    if walked := unread_inside(ckpt, ctx):
        ckpt = replace(ckpt, findings=ckpt.findings + walked)
    if (verdict := ctx.deep.get(ckpt.path)) is not None:  # the status below is then the worse of scan's and verify's
        from ckpt_audit.rules.deep_verdict import carried

        ckpt = replace(ckpt, findings=ckpt.findings + carried(ckpt, verdict))
    errors = [f for f in ckpt.all_findings if f.severity is Severity.ERROR]
    st = from_errors(errors)
    if any(f.code in UNREAD_CODES for f in ckpt.all_findings):
        st = Status.UNKNOWN  # judged on what could not be seen (a warning too): never a husk, never disposable
    if tracker_step is not None and ckpt.step > tracker_step:
        st = worst(st, Status.UNCOMMITTED)
    if is_husk(ckpt):
        st = worst(st, Status.HUSK)
    extra: tuple[Finding, ...] = ()
    if st is Status.HUSK:
        extra = (finding("husk", ckpt.path, "no resumable model shards left (only data.pt or critic/)"),)
    return replace(ckpt, status=st, findings=ckpt.findings + extra)
