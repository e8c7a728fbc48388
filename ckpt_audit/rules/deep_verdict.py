"""A deep verdict kept: what `verify` (or `scan --deep`) found of a checkpoint binds every later judgement of it
while the files it read are unchanged.

A plain scan reads no tensors, so it cannot see what verify saw (a rank's optimizer shard from another step, an
extra_state without its scheduler). Forgetting that verdict would call the checkpoint complete again, and prune
would keep it over the last one that really resumes. So the catalog keeps each checkpoint's deep findings with the
facts of the files verify read (catalog.deep_verdicts), and `rules.status.judge` adds them back (`carried`): the
status is then the worse of the scan's and verify's. Once any of those files differs (stat or content hash), a file
is added or one is gone, the verdict no longer describes these bytes: it is reported as stale (info) instead.

Imported only when the catalog holds a deep verdict (its dataclass is defined here, off a plain scan's start-up).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ckpt_audit.codes import finding
from ckpt_audit.models import Checkpoint, Finding, Severity

# (path, size_bytes, mtime_ns, inode, content hash or None): a file as a verdict read it, keyed as the catalog keys
# files (the stat cache's own key) plus what its content hashed to
FileKey = tuple[str, int, int, int, str | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepVerdict:
    """What verify found of one checkpoint beyond the scan, and the files it read."""

    checkpoint_path: str
    run_path: str
    judged_ns: int  # when verify read the files (its scan's start)
    findings: tuple[Finding, ...]  # the findings verify added to the scan's
    files: tuple[FileKey, ...]  # every file of the checkpoint as verify saw it, sorted by path


def files_of(ckpt: Checkpoint) -> tuple[FileKey, ...]:
    """The checkpoint's files as a verdict keys them."""
    return tuple(sorted((f.path, f.size_bytes, f.mtime_ns, f.inode, f.hash) for f in ckpt.all_files))


def carried(ckpt: Checkpoint, verdict: DeepVerdict) -> tuple[Finding, ...]:
    """The findings a recorded deep verdict adds to a checkpoint judged now: its own findings and an info saying so
    while every file it read is unchanged; otherwise one info saying it is stale (it no longer binds)."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(verdict.judged_ns / 1e9))
    errors = sum(1 for f in verdict.findings if f.severity is Severity.ERROR)
    what = f"{len(verdict.findings)} finding(s), {errors} error(s)"
    now = files_of(ckpt)
    if now != verdict.files:
        return (
            finding(
                "deep-verdict-stale",
                ckpt.path,
                f"verify at {when} found {what}; {_first_change(verdict.files, now)} since, so that verdict no longer "
                "binds: run verify again",
            ),
        )
    have = set(ckpt.all_findings)
    kept = tuple(f for f in verdict.findings if f not in have)
    note = finding(
        "deep-verdict-kept",
        ckpt.path,
        f"verify at {when} found {what}; the files it read are unchanged, so that verdict still stands",
    )
    return (*kept, note)


def _first_change(then: tuple[FileKey, ...], now: tuple[FileKey, ...]) -> str:
    before, after = {f[0]: f for f in then}, {f[0]: f for f in now}
    for path in sorted(before.keys() | after.keys()):
        if path not in after:
            return f"{path} is gone"
        if path not in before:
            return f"{path} was added"
        if before[path] != after[path]:
            return f"{path} changed"
    return "its files changed"  # pragma: no cover - the tuples differ, so some path does
