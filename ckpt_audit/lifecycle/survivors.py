"""The survivor check: before a plan deletes anything in a run, re-read by content what it counts on.

A plan deletes older checkpoints because a newer one will carry the run: the newest complete checkpoint and the
tracker's target. Their verdict usually comes from a stat-keyed cache, which never sees bit rot (a flipped byte
keeps size and mtime). So, before anything goes, each of them is read again in full (xxh3 hash and zip CRCs,
`hashing.digest_files`) and compared with the hash the scan recorded, whatever the stat says. One that fails is
re-judged (corrupt, unreadable, or being written) and the plan recomputed by the pure `retention.plan_prune`;
the new survivor is checked in turn, until every checkpoint the plan counts on has been re-read and held.

The CLI and the TUI both reach it through `Session.prune`, which runs it at the moment of the act (after any
confirmation, immediately before the first deletion); deletion (`prune.execute`) only ever gets its plan.
`reread` alone serves any act that relies on one checkpoint (fix-tracker's target).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from ckpt_audit.codes import UNREAD_CODES, finding
from ckpt_audit.lifecycle.latest import resumes_as_is
from ckpt_audit.lifecycle.prune import Action, Outcome, PruneResult
from ckpt_audit.lifecycle.retention import PrunePlan, Reason, plan_prune
from ckpt_audit.models import Checkpoint, FileKind, Finding, Run, Status, format_size
from ckpt_audit.readers import hashing
from ckpt_audit.rules import files as file_rules
from ckpt_audit.units import format_utc

Progress = Callable[[int, int], None]  # (bytes re-read, bytes to re-read in this round)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reread:
    """One counted-on checkpoint, read again in full."""

    checkpoint: Checkpoint  # as the plan saw it
    bytes_read: int
    files: int
    findings: tuple[Finding, ...] = ()  # empty: every file read back to the hash the scan recorded
    status: Status = Status.COMPLETE  # what it is now: complete, or corrupt / unknown / in-progress
    read_back: tuple[tuple[str, hashing.FileDigest], ...] = ()  # files read in full with their stat unchanged
    read_ns: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict:
        return {
            "path": self.checkpoint.path,
            "run": self.checkpoint.run_path,
            "step": self.checkpoint.step,
            "ok": self.ok,
            "status": str(self.status),
            "bytes_read": self.bytes_read,
            "files": self.files,
            "read_ns": self.read_ns,
            "findings": [f.to_dict() for f in self.findings],
        }

    def as_outcome(self) -> Outcome:
        detail = (
            f"matches the scan, read {format_utc(self.read_ns)}"
            if self.ok
            else f"now {self.status}: "
            + "; ".join(f"{f.code} {os.path.relpath(f.path, self.checkpoint.path)}" for f in self.findings[:3])
        )
        return Outcome(
            path=self.checkpoint.path,
            action=Action.REREAD,
            detail=detail,
            step=self.checkpoint.step,
            run_path=self.checkpoint.run_path,
            size_bytes=self.bytes_read,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SurvivorCheck:
    plan: PrunePlan  # the plan to execute: recomputed with every failed survivor re-judged
    runs: tuple[Run, ...]  # the runs it was planned from (failed survivors carry their new status and findings)
    rereads: tuple[Reread, ...] = ()

    @property
    def bytes_reread(self) -> int:
        return sum(r.bytes_read for r in self.rereads)

    @property
    def failed(self) -> tuple[Reread, ...]:
        return tuple(r for r in self.rereads if not r.ok)

    def outcomes(self) -> tuple[Outcome, ...]:
        return tuple(r.as_outcome() for r in self.rereads)

    def to_dict(self) -> dict:
        return {"bytes_reread": self.bytes_reread, "checked": [r.to_dict() for r in self.rereads]}

    def describe(self, when: str = "") -> str:
        """One line: what was re-read, when (`when`, else the clock time the reads began) and what it found."""
        if not self.rereads:
            return "survivor check: nothing to delete, nothing re-read"
        bad = self.failed
        files = sum(r.files for r in self.rereads)
        when = when or f"at {format_utc(min(r.read_ns for r in self.rereads))}"
        return (
            f"survivor check: re-read {len(self.rereads)} checkpoint(s) the plan counts on {when}, "
            f"{format_size(self.bytes_reread)} in {files} file(s): "
            + ("all match the scan" if not bad else f"{len(bad)} FAILED, plan recomputed")
        )


class Executor(Protocol):
    """Who re-reads a checkpoint and carries a plan out when not this process (`reread` and prune.execute here;
    prune --ray: cluster.ray_prune.Cluster, on the nodes holding each checkpoint)."""

    def reread(self, ckpt: Checkpoint, *, workers: int = 2, progress: Progress | None = None) -> Reread:
        """As `reread` below, where the checkpoint's bytes are."""
        ...

    def execute(
        self,
        plan: PrunePlan,
        *,
        catalog=None,
        progress: Callable[[Outcome], None] | None = None,
        reclaim_dirs: Iterable[str] = (),
        exec_id: str | None = None,
        reread: Iterable[Outcome] = (),
    ) -> PruneResult:
        """As lifecycle.prune.execute."""
        ...


def verify_plan(
    plan: PrunePlan,
    runs: Sequence[Run],
    *,
    workers: int = 2,
    progress: Progress | None = None,
    read: Callable[..., Reread] | None = None,
) -> SurvivorCheck:
    """Re-read what `plan` counts on in every run it deletes from; recompute it until that holds.

    The plan's own inputs are taken back from it (policy, clock, pins, hand selection), so a plan computed by the
    TUI from an older snapshot is checked as it was made. `read`: who re-reads one checkpoint (default `reread`
    here; prune --ray has each node re-read its own part).
    """
    read = read or reread
    pins = frozenset(i.path for i in plan.keep if Reason.PINNED in i.reasons)
    select = frozenset(i.path for i in plan.delete if Reason.SELECTED in i.reasons) | frozenset(
        r.path for r in plan.refused if Reason.UNKNOWN_PATH not in r.reasons
    )
    runs = tuple(runs)
    done: dict[str, Reread] = {}
    while True:
        todo = [c for c in counted_on(plan, runs) if c.path not in done]
        if not todo:
            return SurvivorCheck(plan=plan, runs=runs, rereads=tuple(done.values()))
        fresh = {c.path: read(c, workers=workers, progress=progress) for c in todo}
        done.update(fresh)
        if failed := {p: r for p, r in fresh.items() if not r.ok}:
            runs = tuple(_rejudged(run, failed) for run in runs)
            plan = plan_prune(runs, plan.policy, now_ns=plan.now_ns, pins=pins, select=select, links=plan.links)


def counted_on(plan: PrunePlan, runs: Iterable[Run]) -> list[Checkpoint]:
    """Per run the plan deletes from: its newest complete checkpoint, the newest one the trainer resumes as it is
    (lifecycle.latest.resumes_as_is), and the tracker's target, if complete."""
    deleting = {i.run_path for i in plan.delete}
    out: list[Checkpoint] = []
    for run in sorted(runs, key=lambda r: r.path):
        if run.path not in deleting:
            continue
        complete = [c for c in run.checkpoints if c.status is Status.COMPLETE]
        newest = max(complete, key=lambda c: (c.step, c.path), default=None)
        target = next((c for c in complete if run.tracker_step is not None and c.step == run.tracker_step), None)
        resumable = max((c for c in complete if resumes_as_is(c)), key=lambda c: (c.step, c.path), default=None)
        out.extend(c for c in dict.fromkeys(x for x in (newest, target, resumable) if x is not None))
    return out


def reread(ckpt: Checkpoint, *, workers: int = 2, progress: Progress | None = None) -> Reread:
    """Read every file of `ckpt` again (hash + CRC) and compare with what the scan recorded."""
    recorded = {f.path: f for f in ckpt.all_files}
    total = sum(f.size_bytes for f in recorded.values())
    found: list[Finding] = []
    read_back: list[tuple[str, hashing.FileDigest]] = []
    nread = 0
    started = time.time_ns()
    for path, got in hashing.digest_files(recorded, workers=workers):
        mismatch = _compare(path, recorded[path], got)
        found.extend(mismatch)
        if not isinstance(got, OSError):
            nread += got.size_bytes
            if not any(f.code == "file-changed-during-scan" for f in mismatch):
                read_back.append((path, got))
        if progress is not None:
            progress(nread, total)
    found.sort(key=lambda f: (f.path, f.code))
    return Reread(
        checkpoint=ckpt,
        bytes_read=nread,
        files=len(recorded),
        findings=tuple(found),
        status=_status_for(found),
        read_back=tuple(sorted(read_back)),
        read_ns=started,
    )


def _compare(path: str, was, got: hashing.FileDigest | OSError) -> list[Finding]:
    if isinstance(got, FileNotFoundError):
        return [finding("file-vanished", path, "gone when re-read")]
    if isinstance(got, OSError):
        return [finding("unreadable", path, f"cannot re-read: {got.strerror or type(got).__name__}")]
    moved = (
        got.changed_during_read
        or got.stat_size != was.size_bytes
        or got.mtime_ns != was.mtime_ns
        or (was.inode and got.inode != was.inode)
    )
    if moved:  # rewritten since the scan: a new verdict needs a new scan, the old one is stale either way
        return [finding("file-changed-during-scan", path, "size, mtime or inode moved since the scan")]
    out = content_findings(path, was.kind, got)
    if was.hash is not None and got.hash != was.hash:
        out.append(
            finding(
                "hash-drift",
                path,
                f"content hash changed ({was.hash[:12]}… -> {got.hash[:12]}…) while size, mtime and inode did not",
            )
        )
    return out


def content_findings(path: str, kind: FileKind, got: hashing.FileDigest) -> list[Finding]:
    """What a re-read's digest says of a file's content (the zip rules: truncation, CRCs); its name facts (the
    zip prefix) were judged by the scan and are no content failure."""
    found = file_rules.digest_findings(
        path,
        kind=kind,
        size=got.size_bytes,
        zip_error=got.zip_error,
        crc_bad=got.crc_bad_entries,
        prefix=got.prefix,
        changed=False,
    )
    return [f for f in found if f.code != "zip-prefix-mismatch"]


def _status_for(found: Sequence[Finding]) -> Status:
    codes = {f.code for f in found}
    if not codes:
        return Status.COMPLETE
    if codes & UNREAD_CODES:
        return Status.UNKNOWN  # not read now: no evidence either way, protected
    if "file-changed-during-scan" in codes:
        return Status.IN_PROGRESS  # being rewritten: protected until a scan judges it
    return Status.CORRUPT


def _rejudged(run: Run, failed: Mapping[str, Reread]) -> Run:
    if not any(c.path in failed for c in run.checkpoints):
        return run
    ckpts = tuple(
        replace(c, status=failed[c.path].status, findings=c.findings + failed[c.path].findings)
        if c.path in failed
        else c
        for c in run.checkpoints
    )
    return replace(run, checkpoints=ckpts)
