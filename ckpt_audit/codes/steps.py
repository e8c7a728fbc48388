"""The tracker and step names, and saves that finish out of order (rules/tracker.py, rules/save_order.py).

One entry per code, in docs/codes.md's order.
"""

from __future__ import annotations

from ckpt_audit.codes.entry import INFO, Code, E, W

TABLE: tuple[Code, ...] = (
    # tracker and step names
    Code(
        code="tracker-missing",
        severity=W,
        explanation="no latest_checkpointed_iteration.txt: resume_mode=auto starts training from scratch",
    ),
    Code(
        code="tracker-empty",
        severity=E,
        explanation="the tracker file is empty (crash while writing it): resume raises ValueError",
    ),
    Code(
        code="tracker-invalid",
        severity=E,
        explanation="the tracker does not hold a decimal step number: resume raises ValueError",
    ),
    Code(
        code="tracker-dangling",
        severity=E,
        explanation=(
            "the tracker names a step that is missing or not complete: verl silently trains from scratch or fails "
            "to load"
        ),
    ),
    Code(
        code="tracker-unread",
        severity=W,
        explanation=(
            "the tracker exists but could not be read (permission, I/O error, a link out of the root, past 64 KiB):"
            " which step resume loads is unknown, so prune keeps every checkpoint of the run"
        ),
    ),
    Code(
        code="tracker-behind",
        severity=W,
        explanation=(
            "whole checkpoints are newer than the tracker's step: resume loads an older one; prune keeps them "
            "(protected) until the tracker moves or a person decides"
        ),
    ),
    # saves that finish out of order (rules/save_order.py)
    Code(
        code="untracked-complete",
        severity=W,  # as tracker-missing: a job resuming with resume_path is unharmed
        explanation="complete checkpoints but no tracker (FSDP async_save never writes it, verl #7952): "
        "resume_mode=auto trains from step 0 and overwrites them; fix-tracker repairs it",
    ),
    Code(
        code="tracker-published-early",
        severity=W,
        explanation="the tracker names a checkpoint whose files were written after it and are still changing "
        "(async save, verl #8000): a crash now resumes from a half-written checkpoint",
    ),
    Code(
        code="remote-copy-unfinished",
        severity=E,
        explanation="the run's saved config copies every save to HDFS (default_hdfs_dir) but the checkpoint the "
        "tracker published is not complete locally: the remote copy was made from an unfinished save",
    ),
    Code(
        code="step-out-of-range",
        severity=W,
        explanation="a step directory's number is past 2^63-1: it cannot be a training step and is not catalogued",
    ),
    Code(
        code="misnamed-step",
        severity=W,
        explanation="a step directory named global_steps_N (the docs' typo) or similar: verl never reads it",
    ),
    Code(
        code="in-progress",
        severity=INFO,
        explanation=(
            "the checkpoint is being written now (recent and not yet committed by the tracker); judged on a later scan"
        ),
    ),
    Code(
        code="husk",
        severity=INFO,
        explanation="only data.pt (or nothing resumable) is left: the usual remains of retention",
    ),
    Code(code="no-complete-checkpoint", severity=E, explanation="the run has checkpoints but none is complete"),
)
