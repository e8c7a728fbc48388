"""Carry out a PrunePlan, crash-safe.

Each checkpoint is first renamed, in one atomic `rename(2)` inside its own directory, to
`.ckpt-audit-trash-<name>-<exec_id>`: no `global_step_*` glob matches it any more, the tracker never names
it, and the name says what it was and which execution marked it. Only then are its files removed. A kill at
any moment therefore leaves each checkpoint either intact under its own name or clearly marked for deletion,
never a half-deleted `global_step_N` that looks resumable. Every execution starts by finishing what an
earlier, killed one left marked (`reclaim_trash`).

Before marking, each checkpoint is re-checked against the plan by stat: still a real directory, every
planned file unchanged (size, mtime, inode), nothing inside (file or directory) written after the scan, and the
tracker not pointing at it now, and no symbolic link outside it leading into it (under the plan's roots, walked
again before the first deletion, each link looked at again as it acts: another run warm-started from it, or a
kept checkpoint whose bytes it holds). Anything else is skipped, never deleted. Then it must be removable in full,
by us, now (`removable.cannot_remove`: permissions, inode flags, mounts). One that is not fails before the rename and
is left intact, never half-deleted under its trash name; a refusal seen only after the rename renames it back while
nothing of it is removed. Trash that cannot be finished is left marked and reported, not failed every time.
Nothing outside the plan is touched.
"""

from __future__ import annotations

import os
import re
import stat
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from ckpt_audit.durable import fsync_dir
from ckpt_audit.killpoints import OpCounter
from ckpt_audit.layouts.tracker import resume_step, tracker_path
from ckpt_audit.lifecycle.links import Links, find_links
from ckpt_audit.lifecycle.removable import cannot_remove
from ckpt_audit.lifecycle.retention import PlanItem, PrunePlan
from ckpt_audit.tree import TRASH_PREFIX

TRASH_RE = re.compile(rf"^{re.escape(TRASH_PREFIX)}(?P<name>.+)-(?P<exec_id>[0-9a-f]{{12}})$")


class Action(StrEnum):
    DELETED = "deleted"
    SKIPPED = "skipped"  # no longer looks as planned: left alone
    FAILED = "failed"  # cannot be removed in full: left intact (found before the rename) or stays marked
    REREAD = "re-read"  # a checkpoint the plan counts on, re-read by content first (ckpt_audit.lifecycle.survivors)
    RECLAIMED = "reclaimed"  # trash left by an earlier, interrupted execution, now removed


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    path: str  # the checkpoint path (for reclaimed trash: the trash directory)
    action: Action
    detail: str = ""  # why skipped/failed; for reclaimed, the execution that marked it
    step: int | None = None
    run_path: str | None = None
    size_bytes: int = 0  # bytes removed (planned size for deletions; counted for reclaimed trash)
    reasons: tuple[str, ...] = ()  # the plan's reasons

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "action": str(self.action),
            "detail": self.detail,
            "step": self.step,
            "run": self.run_path,
            "size_bytes": self.size_bytes,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class PruneResult:
    exec_id: str
    started_ns: int
    finished_ns: int
    outcomes: tuple[Outcome, ...] = ()

    def count(self, action: Action) -> int:
        return sum(o.action is action for o in self.outcomes)

    @property
    def bytes_freed(self) -> int:
        return sum(o.size_bytes for o in self.outcomes if o.action in (Action.DELETED, Action.RECLAIMED))

    @property
    def bytes_reread(self) -> int:
        return sum(o.size_bytes for o in self.outcomes if o.action is Action.REREAD)

    @property
    def ok(self) -> bool:
        return not any(o.action is Action.FAILED for o in self.outcomes)

    def to_dict(self) -> dict:
        return {
            "exec_id": self.exec_id,
            "started_ns": self.started_ns,
            "finished_ns": self.finished_ns,
            "bytes_freed": self.bytes_freed,
            "bytes_reread": self.bytes_reread,
            "outcomes": [o.to_dict() for o in self.outcomes],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class TrashDir:
    path: str
    original_name: str
    exec_id: str


def new_exec_id() -> str:
    return uuid.uuid4().hex[:12]


def execute(
    plan: PrunePlan,
    *,
    catalog=None,
    progress: Callable[[Outcome], None] | None = None,
    reclaim_dirs: Iterable[str] = (),
    exec_id: str | None = None,
    reread: Iterable[Outcome] = (),
) -> PruneResult:
    """Delete `plan.delete` in order; first finish trash left in the plan's run dirs (and `reclaim_dirs`).

    Idempotent: running the same plan again skips what is already gone. `catalog` (a `Catalog`) gets the
    plan before anything is touched and each outcome as it happens. `reread`: the survivor check's outcomes
    (`SurvivorCheck.outcomes()`), logged first with the plan they justified.
    """
    ops = OpCounter.from_env()
    log = PruneLog.start(plan, catalog=catalog, progress=progress, exec_id=exec_id, reread=reread)
    dirs = {os.path.dirname(i.path) for i in (*plan.delete, *plan.keep)} | {i.run_path for i in plan.delete}
    for trash in find_trash(sorted(dirs | set(reclaim_dirs))):
        log.done(_reclaim(trash, ops))
    links = links_now(plan)
    for item in plan.delete:
        log.done(_delete(item, log.exec_id, ops, links))
    return log.finish()


class PruneLog:
    """One execution's log, shared by the local prune and `prune --ray`: the plan is recorded before anything is
    touched, each outcome as it happens (catalog and `progress`), and the result at the end."""

    def __init__(self, exec_id: str, catalog, progress: Callable[[Outcome], None] | None) -> None:
        self.exec_id = exec_id
        self.catalog = catalog
        self.progress = progress
        self.started_ns = time.time_ns()
        self.outcomes: list[Outcome] = []

    @classmethod
    def start(
        cls,
        plan: PrunePlan,
        *,
        catalog,
        progress: Callable[[Outcome], None] | None,
        exec_id: str | None,
        reread: Iterable[Outcome],
    ) -> PruneLog:
        """Record `plan`, then the survivor check's outcomes (`reread`) that justified it."""
        log = cls(exec_id or new_exec_id(), catalog, progress)
        if catalog is not None:
            catalog.record_prune_start(exec_id=log.exec_id, plan=plan, started_ns=log.started_ns)
        for checked in reread:
            log.done(checked)
        return log

    def done(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        if self.catalog is not None:
            self.catalog.record_prune_outcome(exec_id=self.exec_id, outcome=outcome)
        if self.progress is not None:
            self.progress(outcome)

    def finish(self) -> PruneResult:
        result = PruneResult(
            exec_id=self.exec_id,
            started_ns=self.started_ns,
            finished_ns=time.time_ns(),
            outcomes=tuple(self.outcomes),
        )
        if self.catalog is not None:
            self.catalog.record_prune_finish(exec_id=self.exec_id, result=result)
        return result


def find_trash(dirs: Iterable[str]) -> list[TrashDir]:
    """Directories marked for deletion by an earlier execution, directly inside `dirs`."""
    found = []
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            if m := TRASH_RE.match(name):
                found.append(TrashDir(path=os.path.join(d, name), original_name=m["name"], exec_id=m["exec_id"]))
    return found


# ---------------------------------------------------------------------------------------------------- steps


def _delete(item: PlanItem, exec_id: str, ops: OpCounter, links: Links) -> Outcome:
    base: dict[str, Any] = {
        "path": item.path,
        "step": item.step,
        "run_path": item.run_path,
        "reasons": tuple(str(r) for r in item.reasons),
    }
    if link := linked_now(item.path, links):
        return Outcome(action=Action.SKIPPED, detail=f"a link leads into it: {link}", **base)
    # first: a tree we cannot list would also look "changed" (its files cannot be stat'ed), but it is a failure
    if _is_real_dir(item.path) and (why := cannot_remove(item.path)):
        return Outcome(action=Action.FAILED, detail=f"left intact: {why}", **base)
    if why := changed_since_plan(item):
        return Outcome(action=Action.SKIPPED, detail=why, **base)
    parent, name = os.path.split(item.path)
    trash = os.path.join(parent, f"{TRASH_PREFIX}{name}-{exec_id}")
    try:
        os.rename(item.path, trash)  # the one step that takes it out of the trainer's sight
        ops.tick()
        fsync_dir(parent)  # the mark is durable before the first file goes
    except OSError as exc:
        return Outcome(action=Action.FAILED, detail=f"left intact: {_why(exc)}", **base)
    before = ops.n
    try:
        _remove_tree(trash, ops)
    except OSError as exc:  # a refusal the pre-check could not see (a file we may not open, a race)
        if ops.n == before and _restore(trash, item.path):
            return Outcome(action=Action.FAILED, detail=f"left intact (renamed back): {_why(exc)}", **base)
        return Outcome(action=Action.FAILED, detail=f"left marked as {trash}: {_why(exc)}", **base)
    return Outcome(action=Action.DELETED, size_bytes=item.size_bytes, **base)


def _restore(trash: str, original: str) -> bool:
    """Rename a tree nothing was removed from back to its name, unless that name is taken again."""
    if os.path.lexists(original):
        return False
    try:
        os.rename(trash, original)
        fsync_dir(os.path.dirname(original))
    except OSError:
        return False
    return True


def _reclaim(trash: TrashDir, ops: OpCounter) -> Outcome:
    """Finish what an earlier execution marked, if it can be removed in full now; else leave it marked and say why
    (a later prune finishes it once the refusal is lifted: it does not fail every prune after it)."""
    marked = f"marked by execution {trash.exec_id} ({trash.original_name})"
    if _is_real_dir(trash.path) and (why := cannot_remove(trash.path)):
        return Outcome(path=trash.path, action=Action.SKIPPED, detail=f"{marked}; cannot finish, left marked: {why}")
    size = _tree_size(trash.path)
    try:
        _remove_tree(trash.path, ops)
    except OSError as exc:
        return Outcome(path=trash.path, action=Action.FAILED, detail=f"{marked}; {_why(exc)}")
    return Outcome(path=trash.path, action=Action.RECLAIMED, size_bytes=size, detail=marked)


def _why(exc: OSError) -> str:
    return f"{type(exc).__name__}: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")


def changed_since_plan(item: PlanItem) -> str | None:
    """Why `item` no longer looks as it did when planned, or None if it still does."""
    ckpt = item.checkpoint
    try:
        st = os.lstat(ckpt.path)
    except FileNotFoundError:
        return "gone already"
    except OSError as exc:
        return f"cannot stat: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return "no longer a directory"
    tracker = _tracker_step(ckpt.run_path)
    if tracker is not None and tracker == ckpt.step:
        return "the tracker names it now"
    planned = {f.path: f for f in ckpt.all_files}
    for f in planned.values():
        try:
            fst = os.stat(f.path)  # followed, as the scanner records a link inside a root
        except OSError:
            return f"planned file vanished: {os.path.relpath(f.path, ckpt.path)}"
        if fst.st_size != f.size_bytes or fst.st_mtime_ns != f.mtime_ns or (f.inode and fst.st_ino != f.inode):
            return f"planned file changed: {os.path.relpath(f.path, ckpt.path)}"
    limit = max([ckpt.mtime_ns, *(f.mtime_ns for f in planned.values())])
    for dirpath, _dirs, files in os.walk(ckpt.path):
        try:  # an entry made or removed in a directory moves its mtime (the scan's age counts directories)
            if os.lstat(dirpath).st_mtime_ns > limit:
                return f"written since the scan: {os.path.relpath(dirpath, ckpt.path)}/"
        except OSError:
            pass
        for name in files:
            p = os.path.join(dirpath, name)
            if p in planned:
                continue
            try:
                if os.lstat(p).st_mtime_ns > limit:
                    return f"written since the scan: {os.path.relpath(p, ckpt.path)}"
            except OSError:
                continue
    return None


def links_now(plan: PrunePlan) -> Links:
    """The links under the plan's roots (and inside the checkpoints it keeps), walked again now: one made since
    the plan protects its target as the plan's own would."""
    return find_links([*plan.links.roots, *(i.path for i in plan.keep)], near=plan.links.near)


def linked_now(path: str, links: Links) -> str | None:
    """A link that still exists and leads into `path` from outside it (each one is looked at again as we act)."""
    return next((ln for ln in links.into(path) if os.path.lexists(ln)), None)


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _tracker_step(run_path: str) -> int | None:
    try:
        return resume_step(Path(tracker_path(run_path)).read_bytes())
    except OSError:
        return None


def _remove_tree(top: str, ops: OpCounter) -> None:
    """Bottom-up removal that never follows a symlink (a link inside is removed, not its target)."""
    st = os.lstat(top)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(top)
        ops.tick()
        return
    for dirpath, dirs, files in os.walk(top, topdown=False, followlinks=False):
        for name in files:
            os.unlink(os.path.join(dirpath, name))
            ops.tick()
        for name in dirs:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                os.unlink(p)
            else:
                os.rmdir(p)
            ops.tick()
    os.rmdir(top)
    ops.tick()


def _tree_size(top: str) -> int:
    """Bytes under `top`, each inode once (verl's Megatron migration hardlinks every dist_ckpt file 4 times)."""
    sizes: dict[tuple[int, int], int] = {}
    for dirpath, _dirs, files in os.walk(top, followlinks=False):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            sizes[(st.st_dev, st.st_ino)] = st.st_size
    return sum(sizes.values())
