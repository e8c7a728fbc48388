"""Resumes that trained nothing: an attempt whose log holds no training step (verl #5725, #7401).

A checkpoint saved exactly at an epoch boundary holds an exhausted dataloader state; on resume verl starts the next
epoch, the restored iterator yields zero batches, and the job exits 0 having logged at most its validation at the
resume step. Attempts are told apart over every record (not one metric): a new file, the step counter going back,
or a pause. An attempt after the first that logs none of the watched training metric trained zero steps.
Pure: no I/O.
"""

from __future__ import annotations

from ckpt_audit.codes import finding
from ckpt_audit.continuity.metrics import MetricLog, Series
from ckpt_audit.continuity.resume_points import DEFAULT_TIME_GAP_S, boundaries
from ckpt_audit.models import Finding


def attempts(log: MetricLog, *, time_gap_s: float = DEFAULT_TIME_GAP_S) -> list[tuple[int, int, str]]:
    """(start, end, file) record ranges of each attempt, in log order; a file with no record is an empty attempt."""
    recs = log.records
    every = Series(
        metric="*",
        steps=tuple(r.step for r in recs),
        values=(0.0,) * len(recs),
        times=tuple(r.time for r in recs),
        positions=tuple(range(len(recs))),
    )
    # a repeated step alone is a double log line, not a new attempt
    cuts = {i for i, why in boundaries(every, time_gap_s=time_gap_s).items() if set(why) - {"step-repeat"}}
    out: list[tuple[int, int, str]] = []
    ends = [*log.file_starts[1:], len(recs)]
    for path, s, e in zip(log.paths, log.file_starts, ends):
        pts = [s, *sorted(c for c in cuts if s < c < e), e]
        out.extend((a, b, path) for a, b in zip(pts, pts[1:]))
    return out


def zero_step_resumes(log: MetricLog, metric: str, *, time_gap_s: float = DEFAULT_TIME_GAP_S) -> tuple[Finding, ...]:
    """One `resume-trained-nothing` finding per attempt after the first that logged no `metric`."""
    out: list[Finding] = []
    spans = attempts(log, time_gap_s=time_gap_s)
    reached: int | None = None
    for k, (a, b, path) in enumerate(spans):
        recs = log.records[a:b]
        trained = [r for r in recs if metric in r.values]
        if k > 0 and not trained and reached is not None:
            where = recs[0] if recs else None
            at = f"line {where.line}" if where else "an empty file"
            step = where.step if where else reached
            out.append(
                finding(
                    "resume-trained-nothing",
                    path,
                    f"the attempt starting at {at} (resumed at step {step}) logged no {metric}: it trained zero steps; "
                    "a checkpoint saved at an epoch boundary restores an exhausted dataloader (verl #5725) and the job "
                    "exits 0 under-trained",
                )
            )
        steps = [r.step for r in trained]
        if steps:
            reached = max(steps) if reached is None else max(reached, *steps)
    return tuple(out)
