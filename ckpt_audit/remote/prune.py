"""`prune s3://…`: the local prune's plan carried out on an object store, where there is no rename.

The plan is the local one (the same scan judging, retention planner and survivor check, through Session.prune);
this module gives it the two parts that differ, as `prune --ray` does (Session.prune's `reread` and `execute`):

- **reread**: a checkpoint the plan counts on is read again just before the first deletion, by store checksum
  (one HEAD per object: size and every full-object checksum the scan recorded, which the scan had matched against
  the catalog's local copy) or, with `read_data`, by content (downloaded, xxh3 and zip CRCs against the scan).
  An object gone, another size or checksum, or nothing left to compare with fails it, as locally.
- **execute**: each planned checkpoint's prefix is listed again first; an object that appeared, vanished or changed
  since the scan, an upload begun under it, or the tracker naming it now: skipped, nothing of it deleted. Then
  exactly the keys the scan listed under it are deleted one by one (never a prefix delete), in an order that makes
  it visibly incomplete from the first deletion on: first one rank shard of each component (`deletion_order`;
  checked against the layout's own judgement before anything goes), then the rest. A kill at any point leaves a
  step the next scan calls incomplete (never complete, never named by `latest`), which the next prune deletes.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_audit.codes import UNREAD_CODES, finding
from ckpt_audit.killpoints import OpCounter
from ckpt_audit.layouts import load_layouts
from ckpt_audit.layouts.tracker import resume_step, tracker_path
from ckpt_audit.lifecycle.prune import Action, Outcome, PruneLog, PruneResult
from ckpt_audit.lifecycle.retention import PlanItem, PrunePlan
from ckpt_audit.lifecycle.survivors import Reread, content_findings
from ckpt_audit.models import Checkpoint, FileFacts, Finding, ScanResult, ShardFile, Status
from ckpt_audit.remote import RemoteError
from ckpt_audit.remote.scan import tree_of
from ckpt_audit.remote.store import Obj, Store

Progress = Callable[[int, int], None]


@dataclass
class RemotePrune:
    """Session.prune's `reread` and `execute` for the remote roots of `scanned` (the scan the plan came from)."""

    scanned: ScanResult
    read_data: bool = False
    _store: Store | None = field(default=None, repr=False)

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store(self.scanned.roots[0])
        return self._store

    # ---------------------------------------------------------------------------------------- survivor check

    def reread(self, ckpt: Checkpoint, *, workers: int = 2, progress: Progress | None = None) -> Reread:
        """`ckpt` read again now: by HEAD (store checksums against the scan's), or by content with `read_data`."""
        del workers  # the HEADs run on the client's event loop; downloads one at a time
        files = [f.path for f in ckpt.all_files]
        started = time.time_ns()
        found: list[Finding] = []
        nread = 0
        if self.read_data:
            for f in ckpt.all_files:
                got, n = self._read_back(f)
                found.extend(got)
                nread += n
                if progress is not None:
                    progress(nread, ckpt.size_bytes)
        else:
            try:
                heads = self.store.heads(files)
            except RemoteError as exc:
                heads = dict.fromkeys(files, exc)
            for url in files:
                found.extend(_head_findings(url, self.scanned.file_facts.get(url), heads[url]))
        found.sort(key=lambda f: (f.path, f.code))
        codes = {f.code for f in found}
        status = Status.COMPLETE if not codes else Status.UNKNOWN if codes & UNREAD_CODES else Status.CORRUPT
        return Reread(
            checkpoint=ckpt, bytes_read=nread, files=len(files), findings=tuple(found), status=status, read_ns=started
        )

    def _read_back(self, was: ShardFile) -> tuple[list[Finding], int]:
        """The object downloaded and digested: (findings against the scan's hash and CRCs, bytes read)."""
        from ckpt_audit.readers.hashing import digest_file

        url = was.path
        with tempfile.TemporaryDirectory(prefix="ckpt-audit-reread-") as tmp:
            local = os.path.join(tmp, os.path.basename(url))
            try:
                self.store.download(url, local)
                got = digest_file(local)
            except FileNotFoundError:
                return [finding("file-vanished", url, "gone when re-read")], 0
            except (RemoteError, OSError) as exc:
                return [finding("unreadable", url, f"cannot re-read: {exc}")], 0
        if was.hash is None:
            return [finding("remote-unverified", url, "the scan recorded no hash of it to compare with")], 0
        out = content_findings(url, was.kind, got)
        if got.hash != was.hash or got.size_bytes != was.size_bytes:
            out.append(finding("remote-checksum-mismatch", url, "its content changed since the scan (xxh3 differs)"))
        return out, got.size_bytes

    # ---------------------------------------------------------------------------------------- deletion

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
        """Delete `plan.delete` in order (module docstring), logged as the local prune logs (PruneLog).
        `reclaim_dirs`: unused (a store has no trash: an interrupted prune leaves incomplete steps, which the next
        plan deletes)."""
        del reclaim_dirs
        ops = OpCounter.from_env()
        log = PruneLog.start(plan, catalog=catalog, progress=progress, exec_id=exec_id, reread=reread)
        for item in plan.delete:
            log.done(self._delete(item, ops))
        return log.finish()

    def _delete(self, item: PlanItem, ops: OpCounter) -> Outcome:
        base: dict[str, Any] = {
            "path": item.path,
            "step": item.step,
            "run_path": item.run_path,
            "reasons": tuple(str(r) for r in item.reasons),
        }
        listed = listed_under(self.scanned.file_facts, item.path)
        try:
            why = self._changed_since_plan(item, listed)
        except RemoteError as exc:
            return Outcome(action=Action.FAILED, detail=f"left intact: {exc}", **base)
        if why:
            return Outcome(action=Action.SKIPPED, detail=why, **base)
        order = deletion_order(item.checkpoint, listed)
        if still := complete_without(item, self.scanned.file_facts, order[:1] if order else []):
            return Outcome(action=Action.SKIPPED, detail=f"left whole: {still}", **base)
        for n, url in enumerate(order):
            try:
                self.store.delete(url)
            except RemoteError as exc:
                left = "left intact" if n == 0 else f"{n} of {len(order)} objects deleted, left incomplete"
                return Outcome(action=Action.FAILED, detail=f"{left}: {exc}", **base)
            ops.tick()
        return Outcome(action=Action.DELETED, size_bytes=item.size_bytes, **base)

    def _changed_since_plan(self, item: PlanItem, listed: Mapping[str, tuple[int, int]]) -> str | None:
        """Why the step's prefix, listed again now, is not what the scan listed (or the tracker names it now)."""
        now = {o.url: (o.size, o.mtime_ns) for o in self.store.objects(item.path)}
        if not now:
            return "gone already"
        rel = lambda u: u[len(item.path) + 1 :]  # noqa: E731
        if new := sorted(set(now) - set(listed)):
            return f"written since the scan: {rel(new[0])}"
        if moved := sorted(u for u in listed if now.get(u) != listed[u]):
            return f"planned object {'vanished' if moved[0] not in now else 'changed'}: {rel(moved[0])}"
        if uploads := self.store.uploads(item.path):
            return f"an upload is in progress under it: {rel(uploads[0])}"
        try:
            tracker = resume_step(self.store.read(tracker_path(item.run_path), 64))
        except FileNotFoundError:
            tracker = None
        return "the tracker names it now" if tracker == item.step else None


def listed_under(facts: Mapping[str, FileFacts], step: str) -> dict[str, tuple[int, int]]:
    """Every object the scan listed under the step's prefix: url -> (size, LastModified)."""
    inside = step.rstrip("/") + "/"
    return {u: (f.size_bytes, f.mtime_ns) for u, f in facts.items() if u.startswith(inside)}


def deletion_order(ckpt: Checkpoint, listed: Mapping[str, object]) -> list[str]:
    """The step's listed keys, first those whose absence makes the layout call it incomplete: the highest rank
    shard of each component (a missing rank; each, so that no component left whole can pass for the step once
    another is gone), else its first planned file; then the rest, by key. Every later state lacks them too."""
    first: list[str] = []
    for c in ckpt.components:
        ranked = [f for f in c.files if f.rank is not None and f.path in listed]
        if ranked:
            first.append(min(ranked, key=lambda f: (-(f.rank or 0), f.path)).path)
    if not first:
        first = sorted(f.path for f in ckpt.all_files if f.path in listed)[:1]
    return first + sorted(set(listed) - set(first))


def complete_without(item: PlanItem, facts: Mapping[str, FileFacts], gone: Sequence[str]) -> str | None:
    """Why the run's layout would still call the step complete with `gone` deleted (None: it would not). The
    evidence that the first deletion leaves a step no scan and no `latest` mistakes for a whole one."""
    if not gone:
        return "no object of it to delete first"
    from ckpt_audit.rules.status import ScanContext

    run = item.run_path
    kept = {u: f for u, f in facts.items() if u.startswith(run + "/") and u not in gone}
    tree = tree_of(run, [Obj(url=u, size=f.size_bytes, mtime_ns=f.mtime_ns) for u, f in kept.items()])
    layout = next((x for x in load_layouts() if run in set(x.find_runs(tree))), None)
    if layout is None:
        return None  # no run left at all: nothing to mistake for a checkpoint
    ctx = ScanContext(now_ns=time.time_ns(), in_progress_window_ns=0)  # completeness only, not age
    judged = layout.build_run(run, tree, kept, ctx)
    ckpt = next((c for c in judged.checkpoints if c.path == item.path), None)
    if ckpt is not None and ckpt.status is Status.COMPLETE:
        return f"deleting {gone[0][len(item.path) + 1 :]} first would leave it looking complete"
    return None


def _head_findings(url: str, was: FileFacts | None, head) -> list[Finding]:
    """One object's HEAD now against what the scan recorded (size and full-object checksums)."""
    if isinstance(head, RemoteError):
        gone = "gone" in str(head)
        code, what = ("file-vanished", "gone when re-read") if gone else ("unreadable", f"cannot re-read: {head}")
        return [finding(code, url, what)]
    if was is None:
        return [finding("remote-unverified", url, "the scan recorded nothing of it to compare with")]
    if head.size != was.size_bytes:
        return [finding("remote-checksum-mismatch", url, f"size {head.size} B, the scan saw {was.size_bytes} B")]
    mine = dict(head.checksums) if head.kind != "COMPOSITE" else {}
    common = sorted(set(mine) & {a for a, _ in was.checksums})
    if not common:
        why = "no full-object store checksum in common with the scan's; --read-data reads it by content"
        return [finding("remote-unverified", url, f"not re-read: {why}")]
    bad = [f"{a} {mine[a]} vs {v}" for a, v in was.checksums if a in mine and mine[a] != v]
    if bad:
        return [finding("remote-checksum-mismatch", url, "store checksum changed since the scan: " + ", ".join(bad))]
    return []
