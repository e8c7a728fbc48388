"""`ckpt-audit continuity`: training metrics across resumes (ckpt_audit/continuity/).

One entry per code, in docs/codes.md's order.
"""

from __future__ import annotations

from ckpt_audit.codes.entry import INFO, Code, E, W

TABLE: tuple[Code, ...] = (
    # continuity of training metrics (ckpt-audit continuity)
    Code(
        code="metric-jump",
        severity=E,
        explanation=(
            "after a resume the watched metric left its recent trend by more than --threshold times its own noise "
            "(MAD): the resume did not restore the training state"
        ),
    ),
    Code(
        code="step-duplicated",
        severity=W,
        explanation="a step was logged twice: by a double log line, or a resume from step N that counted N again",
    ),
    Code(
        code="step-skipped",
        severity=W,
        explanation=(
            "steps are missing from the log: the counter jumped, or a resume started counting past the checkpoint "
            "it loaded"
        ),
    ),
    Code(
        code="resumed-from-older",
        severity=W,
        explanation=(
            "a resume loaded an older checkpoint than the newest complete one it had: the steps in between were "
            "silently thrown away"
        ),
    ),
    Code(
        code="steps-redone",
        severity=INFO,
        explanation=(
            "steps logged before a crash were trained again after resuming from the last checkpoint (expected after"
            " a crash between saves)"
        ),
    ),
    Code(
        code="resume-trained-nothing",
        severity=W,
        explanation="an attempt after a resume logged no training step: at an epoch boundary verl restores an "
        "exhausted dataloader and exits 0 having trained zero steps (verl #5725)",
    ),
    Code(
        code="metric-window-short", severity=INFO, explanation="too few points before or after a resume to judge a jump"
    ),
    Code(
        code="metrics-bad-line",
        severity=W,
        explanation="a metrics log line could not be parsed (cut by a crash, or not a step record); it was skipped",
    ),
)
