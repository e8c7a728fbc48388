"""Rules on the tracker and the run as a whole (docs/verl-format.md §4, §7.1).

The tracker's name, place and parsing belong to `ckpt_audit.layouts.tracker`; the layout passes the paths in."""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_audit.codes import finding
from ckpt_audit.models import Checkpoint, Finding, Severity, Status
from ckpt_audit.rules.status import is_husk


def unread_tracker(
    path: str, *, text: str | None, present: bool, read: Sequence[Finding], walked: Sequence[Finding]
) -> tuple[Finding, ...]:
    """A `tracker-unread` finding (followed by the walk's own findings on the tracker) when the tracker exists but
    its content was not read: a permission or I/O error (`read`: the reader's findings), a link out of the root
    (`walked`), a file past the text limit. The tracker's target is what resume loads: not knowing it must not
    read as having none."""
    if walked:
        why = "; ".join(f.message for f in walked)
    elif present and text is None:
        why = "; ".join(f.message for f in read) or "past the 64 KiB read for text files"
    else:
        return ()
    return (
        finding(
            "tracker-unread",
            path,
            f"{why}: which step resume loads is unknown; prune keeps every checkpoint of this run",
        ),
        *walked,
    )


def check_run(
    run_dir: str,
    tracker_step: int | None,
    checkpoints: Sequence[Checkpoint],
    *,
    tracker_known: bool,
    tracker_path: str,
    target_path: str | None,
) -> tuple[Finding, ...]:
    """The run's findings. `target_path`: the directory resume loads for `tracker_step` (the layout names it)."""
    found: list[Finding] = []
    if not tracker_known and checkpoints:
        found.append(finding("tracker-missing", tracker_path, "no tracker: resume_mode=auto trains from scratch"))
    if tracker_step is not None:
        target = [c for c in checkpoints if c.path == target_path]
        if not target:
            name = (target_path or "").rsplit("/", 1)[-1]
            found.append(
                finding(
                    "tracker-dangling",
                    tracker_path,
                    f"tracker names step {tracker_step} but {name} does not exist: verl trains from scratch",
                )
            )
        elif target[0].status not in (Status.COMPLETE, Status.IN_PROGRESS):
            found.append(
                finding(
                    "tracker-dangling",
                    tracker_path,
                    f"tracker names step {tracker_step}, which is {target[0].status.value}: "
                    "resume fails or loses state",
                )
            )
    if ahead := ahead_of_tracker(checkpoints):
        steps = ", ".join(str(c.step) for c in ahead)
        found.append(
            finding(
                "tracker-behind",
                tracker_path,
                f"tracker names step {tracker_step} but {len(ahead)} newer checkpoint(s) look whole (step {steps}): "
                "resume loads the older one; prune keeps them",
            )
        )
    if checkpoints and not any(c.status in (Status.COMPLETE, Status.IN_PROGRESS) for c in checkpoints):
        found.append(
            finding("no-complete-checkpoint", run_dir, f"none of {len(checkpoints)} checkpoint(s) is complete")
        )
    return tuple(found)


def ahead_of_tracker(checkpoints: Sequence[Checkpoint]) -> tuple[Checkpoint, ...]:
    """Checkpoints newer than the tracker with no error and model shards left: uncommitted only because the
    tracker lags (a save whose tracker write failed, a tracker edited back). Not disposable as abandoned saves."""
    return tuple(
        c
        for c in checkpoints
        if c.status is Status.UNCOMMITTED
        and not is_husk(c)
        and not any(f.severity is Severity.ERROR for f in c.all_findings)
    )
