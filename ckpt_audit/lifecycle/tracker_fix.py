"""Tracker repair: point `latest_checkpointed_iteration.txt` at the newest checkpoint a resume can use.

verl resumes (`resume_mode=auto`) from whatever the tracker names, and trains from step 0 when it names nothing it
can find (docs/verl-format.md §4). `plan_fix` decides from a fresh scan (pure, tested by equality);
`apply_fix` writes it: the old content kept beside the tracker, the new one written to a temporary file, fsynced
and renamed over the tracker (what verl's SFT trainer does), after checking the tracker did not change since the
plan. Same target as the resume gate (`lifecycle.latest`): complete, or whole beyond a lagging tracker.
Which file a run's tracker is, what it names and how a fix renders it are its layout's (`Layout.tracker`): a
DeepSpeed run's is `<save_dir>/latest`, naming a tag directory by name, written by the same safe write.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from ckpt_audit.killpoints import OpCounter
from ckpt_audit.layouts import run_tracker, tracker_by_file
from ckpt_audit.layouts.tracker import Tracker
from ckpt_audit.layouts.tracker import content_for as content_for  # what verl writes (re-exported)
from ckpt_audit.lifecycle.latest import why_not
from ckpt_audit.models import Checkpoint, Run, Status

BACKUP_INFIX = ".ckpt-audit-old-"  # <tracker>.ckpt-audit-old-<ns>: the content before a fix
TMP_INFIX = ".ckpt-audit-tmp-"


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackerState:
    """The tracker as read just before planning (lstat + bytes)."""

    path: str
    exists: bool
    is_link: bool = False
    is_file: bool = True
    content: bytes | None = None  # None: missing, or could not be read
    mtime_ns: int = 0
    error: str = ""  # why it could not be read


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackerFix:
    run_path: str
    tracker_path: str
    problem: str  # ok | missing | unreadable | garbage | dangling | names-<status> | published-early | behind
    old_content: bytes | None
    old_step: int | None
    new_step: int | None = None  # None: nothing to write
    new_path: str | None = None
    refused: str = ""  # why the fix must not be made now ("" when it may)
    detail: str = ""

    @property
    def needed(self) -> bool:
        return self.new_step is not None

    @property
    def new_content(self) -> bytes | None:
        """What is written, as the tracker renders its target (verl's: the step; DeepSpeed's `latest`: the tag)."""
        if self.new_step is None or self.new_path is None:
            return None
        return _tracker_at(self.tracker_path).render(self.new_path, self.new_step)

    def to_dict(self) -> dict:
        return {
            "run": self.run_path,
            "tracker": self.tracker_path,
            "problem": self.problem,
            "old_content": None if self.old_content is None else self.old_content.decode("utf-8", "replace"),
            "old_step": self.old_step,
            "new_step": self.new_step,
            "new_path": self.new_path,
            "new_content": None if self.new_content is None else self.new_content.decode(),
            "refused": self.refused or None,
            "detail": self.detail,
        }


def _tracker_at(path: str) -> Tracker:
    """The tracker a file at `path` is (plan_fix only ever names a layout's tracker file)."""
    found = tracker_by_file(os.path.basename(path))
    assert found is not None, path
    return found


def tracker_of(run: Run) -> str:
    """The file a run's resume reads to find its checkpoint."""
    return run_tracker(run.layout).path(run.path)


def plan_fix(run: Run, tracker: TrackerState, *, now_ns: int, in_progress_window_ns: int) -> TrackerFix:
    """What the tracker should say, and whether it may be rewritten now."""
    kind = run_tracker(run.layout)
    ckpts = sorted((c for c in run.checkpoints if _resolves(kind, c)), key=lambda c: c.step)
    content = tracker.content
    old_step, named = (None, None) if content is None else kind.named(content.decode("utf-8", "replace"), ckpts)
    base: dict[str, Any] = dict(
        run_path=run.path, tracker_path=tracker.path, old_content=tracker.content, old_step=old_step
    )
    tag = kind.takes_tag
    target = next((c for c in reversed(ckpts) if why_not(c, run) is None), None)
    if not tracker.exists:
        problem = "missing"
    elif tracker.content is None:
        problem = "unreadable"
    elif not tracker.content.strip() if tag else (old_step is None or old_step < 0):
        problem = "garbage"  # a tag: empty (DeepSpeed loads `<save_dir>/`); a step: not a number
    elif named is None:
        problem = "dangling"
    elif (no := why_not(named, run)) is not None:
        early = no.reasons == ("tracker-published-early",)
        old_layout = named.status is Status.COMPLETE and "megatron-old-layout" in no.reasons
        problem = "published-early" if early else "names-old-layout" if old_layout else f"names-{named.status.value}"
    elif target is not None and target.step > named.step:
        problem = "behind"
    else:
        return TrackerFix(**base, problem="ok", detail=f"the tracker names step {old_step}, the newest resumable")
    old = tracker.content.decode("utf-8", "replace").strip() if tag and tracker.content else old_step
    refused = kind.refusal or _refusal(run, tracker, problem, target, now_ns=now_ns, window_ns=in_progress_window_ns)
    if target is None:
        return TrackerFix(**base, problem=problem, refused=refused or "no complete checkpoint to point the tracker at")
    return TrackerFix(
        **base,
        problem=problem,
        new_step=target.step,
        new_path=target.path,
        refused=refused,
        detail=f"{_what(problem, old, tag)}{_aside(run, kind, old_step, problem)}: point it at step {target.step}",
    )


def _resolves(kind: Tracker, ckpt: Checkpoint) -> bool:
    """Whether the resume finds `ckpt` from a tracker naming it (nor may a tracker be pointed at it otherwise): verl
    opens exactly `<run>/global_step_<N>`, DeepSpeed a tag whose name survives `latest` read back stripped."""
    return kind.resolves(os.path.basename(ckpt.path), ckpt.step)


def _aside(run: Run, kind: Tracker, step: int | None, problem: str) -> str:
    """For a dangling tracker: the step directory verl cannot open that holds its step (`global_step_06`)."""
    if problem != "dangling":
        return ""
    names = [os.path.basename(c.path) for c in run.checkpoints if c.step == step and not _resolves(kind, c)]
    return f" ({names[0]} is, but verl never resolves that name: rename it to resume from it)" if names else ""


def _what(problem: str, old: int | str | None, tag: bool) -> str:
    if tag:
        return {
            "missing": "no `latest` (load_checkpoint(tag=None) trains from scratch)",
            "garbage": "`latest` is empty (load_checkpoint(tag=None) looks for the shards in the save directory)",
            "dangling": f"`latest` names {old!r}, which is no tag here (load_checkpoint(tag=None) fails)",
            "behind": f"`latest` names {old} but newer tags are whole",
        }.get(problem, f"`latest` names {old}, which is {problem.removeprefix('names-')}")
    return {
        "missing": "no tracker (resume_mode=auto would train from step 0)",
        "garbage": "the tracker is not a step number (resume raises ValueError)",
        "dangling": f"the tracker names step {old}; global_step_{old} is not there (verl would train from step 0)",
        "behind": f"the tracker names step {old} but newer checkpoints are whole",
    }.get(problem, f"the tracker names step {old}, which is {problem.removeprefix('names-')}")


def _refusal(run: Run, tracker: TrackerState, problem: str, target, *, now_ns: int, window_ns: int) -> str:
    """Why the tracker must not be touched now; "" when it may (after the layout's own refusal, Tracker.refusal)."""
    if tracker.is_link:
        return "the tracker is a symbolic link: not replacing a link (fix its target by hand)"
    if tracker.exists and not tracker.is_file:
        return "the tracker is not a regular file"
    if problem == "unreadable":
        return f"the tracker could not be read ({tracker.error or 'unreadable'}): not rewriting what was not read"
    if problem == "names-old-layout":  # whole, in the layout verl >= 0.9.1 refuses: migrating it keeps the progress
        return (
            "it is whole, in the pre-v2 Megatron layout verl >= 0.9.1 refuses: migrate each of its role directories "
            "(python scripts/migrate_megatron_checkpoint_layout.py --checkpoint DIR) rather than resume an older step"
        )
    busy = [c.step for c in run.checkpoints if c.status is Status.IN_PROGRESS]
    if busy:
        return f"step {busy[-1]} is being written (in-progress): the run looks alive; run again when it stops"
    if tracker.exists and now_ns - tracker.mtime_ns < window_ns:
        return f"the tracker was written {(now_ns - tracker.mtime_ns) / 1e9:.0f}s ago: the run looks alive"
    if any(f.code == "tracker-published-early" for f in run.findings):
        return "files of the checkpoint the tracker names are still changing: the run looks alive"
    unknown = [
        c.step for c in run.checkpoints if c.status is Status.UNKNOWN and (target is None or c.step > target.step)
    ]
    if unknown:
        return f"step {unknown[-1]} could not be read (unknown): not moving the tracker past what was not read"
    return ""


class FixError(Exception):
    """The fix could not be written (one line); the tracker is as it was."""


def apply_fix(fix: TrackerFix, *, step_names: frozenset[str] | None = None) -> str | None:
    """Write `fix` (needed, not refused). Returns the backup path (None when there was no tracker).

    Re-checks that the tracker still holds what the plan read (and, given `step_names`, that the run holds the same
    step directories: a save that began since the scan wins); writes the old bytes beside it first, then the new
    content to a temporary file in the same directory, fsync, rename over the tracker, fsync the directory. Each of
    those four steps is a kill point (ckpt_audit.killpoints): killed after any of them, the tracker holds the old or
    the new content, whole.
    """
    assert fix.needed and not fix.refused
    new_content = fix.new_content
    assert new_content is not None  # a needed, unrefused fix names its target
    path = fix.tracker_path
    directory = os.path.dirname(path)
    try:
        current = _read_plain(path)
    except OSError as exc:
        raise FixError(f"cannot re-read {path}: {exc.strerror or exc}") from None
    if current != fix.old_content:
        raise FixError(f"{path} changed since it was read: not rewriting it (run again)")
    if step_names is not None and _step_names(fix.run_path, _tracker_at(path)) != step_names:
        raise FixError(f"{fix.run_path} gained or lost a step directory since it was read: not rewriting (run again)")
    stamp = time.time_ns()
    backup = None
    tmp = f"{directory}/.{os.path.basename(path)}{TMP_INFIX}{os.getpid()}"
    ops = OpCounter.from_env()
    try:
        if fix.old_content is not None:
            backup = f"{path}{BACKUP_INFIX}{stamp}"
            _write_new(backup, fix.old_content)
        ops.tick()
        _write_new(tmp, new_content)
        ops.tick()
        os.replace(tmp, path)
        ops.tick()
        _fsync_dir(directory)
        ops.tick()
        _remove_killed_temporaries(directory, os.path.basename(path))
    except OSError as exc:
        _unlink_quietly(tmp)
        if backup is not None and _unchanged(path, fix.old_content):
            _unlink_quietly(backup)  # nothing changed: leave no litter
        raise FixError(f"cannot write the tracker in {directory}: {exc.strerror or exc}") from None
    return backup


def _remove_killed_temporaries(directory: str, name: str) -> None:
    """Temporary files an earlier fix left when it was killed before its rename: only ours, by their name; the
    tracker now holds what they would have become or older content a fix has just replaced."""
    prefix = f".{name}{TMP_INFIX}"
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for n in names:
        if n.startswith(prefix) and n[len(prefix) :].isdigit():
            _unlink_quietly(os.path.join(directory, n))


def _step_names(run_path: str, kind: Tracker) -> frozenset[str]:
    """The run's step directories now, as its tracker tells them (a tag's: directories holding its shards, a custom
    tag too)."""
    try:
        if kind.takes_tag:
            return frozenset(n for n in os.listdir(run_path) if _holds(os.path.join(run_path, n), kind))
        return frozenset(n for n in os.listdir(run_path) if kind.step_entry(n))
    except OSError:
        return frozenset()


def _holds(path: str, kind: Tracker) -> bool:
    try:
        return os.path.isdir(path) and not os.path.islink(path) and any(map(kind.step_entry, os.listdir(path)))
    except OSError:
        return False


def _unchanged(path: str, old: bytes | None) -> bool:
    try:
        return _read_plain(path) == old
    except OSError:
        return False


def _read_plain(path: str) -> bytes | None:
    """The tracker's bytes; None when it does not exist. Never follows a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(64 * 1024)


def read_state(path: str) -> TrackerState:
    """lstat and read the tracker (no link is followed)."""
    import stat as statmod

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return TrackerState(path=path, exists=False)
    except OSError as exc:
        return TrackerState(path=path, exists=True, error=exc.strerror or str(exc))
    if statmod.S_ISLNK(st.st_mode):
        return TrackerState(path=path, exists=True, is_link=True, mtime_ns=st.st_mtime_ns)
    if not statmod.S_ISREG(st.st_mode):
        return TrackerState(path=path, exists=True, is_file=False, mtime_ns=st.st_mtime_ns)
    try:
        content = _read_plain(path)
    except OSError as exc:
        return TrackerState(path=path, exists=True, mtime_ns=st.st_mtime_ns, error=exc.strerror or str(exc))
    return TrackerState(path=path, exists=True, content=content, mtime_ns=st.st_mtime_ns)


def _write_new(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
