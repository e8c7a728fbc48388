"""Where a run resumed: boundaries in the log, matched with checkpoint steps from the catalog or given by hand.

A boundary is where the series stops being one attempt: the step counter goes back (or repeats), a new file
begins, or the clock jumps. Each boundary becomes a `ResumePoint` whose `resume_step` is the checkpoint the new
attempt started from: given by hand (--resume-at), picked from the catalogued checkpoint steps, or inferred as
"one before the first new step". Pure: no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckpt_audit.continuity.judge import crossing_index
from ckpt_audit.continuity.metrics import Series

DEFAULT_TIME_GAP_S = 60.0  # a pause longer than this (and 20x the usual interval) reads as a restart
GAP_FACTOR = 20.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRef:
    """A checkpoint the run had (from the catalog or a scan)."""

    step: int
    complete: bool = True
    mtime_ns: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePoint:
    index: int  # series index of the first point logged after the resume
    resume_step: int  # the checkpoint step the new attempt started from
    first_step: int  # the first step logged after the resume
    prev_step: int | None  # the last step logged before the boundary (None for a point with no boundary)
    sources: tuple[str, ...]  # "counter-reset", "step-repeat", "file", "time-gap", "catalog", "manual", "checkpoint"
    inferred: bool  # resume_step was guessed as first_step - 1 (no catalog or hand-given step matched)

    def to_dict(self) -> dict:
        return {
            "resume_step": self.resume_step,
            "first_step": self.first_step,
            "prev_step": self.prev_step,
            "sources": list(self.sources),
            "inferred": self.inferred,
        }


def stride(steps: Sequence[int]) -> int:
    """The usual logging interval (median positive step difference; 1 when unknown)."""
    diffs = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return max(1, int(statistics.median(diffs))) if diffs else 1


def boundaries(
    series: Series, *, file_starts: Sequence[int] = (), time_gap_s: float = DEFAULT_TIME_GAP_S
) -> dict[int, list[str]]:
    """Series index -> why a new attempt may begin there. `file_starts` are record indexes (MetricLog.file_starts)."""
    out: dict[int, list[str]] = {}
    steps, pos, times = series.steps, series.positions, series.times
    dts = [b - a for a, b in zip(times, times[1:]) if a is not None and b is not None and b >= a]
    usual = statistics.median(dts) if dts else 0.0
    starts = sorted(set(file_starts) - {0})
    for i in range(1, len(steps)):
        why = []
        if steps[i] < steps[i - 1]:
            why.append("counter-reset")
        elif steps[i] == steps[i - 1]:
            why.append("step-repeat")
        if pos and any(pos[i - 1] < s <= pos[i] for s in starts):
            why.append("file")
        t0, t1 = (times[i - 1], times[i]) if times else (None, None)
        if t0 is not None and t1 is not None and t1 - t0 > max(time_gap_s, GAP_FACTOR * usual):
            why.append("time-gap")
        if why:
            out[i] = why
    return out


def _pick(first: int, known: set[int]) -> int | None:
    """The checkpoint a resume whose first logged step is `first` started from, among `known` steps."""
    if first - 1 in known:
        return first - 1
    if first in known:
        return first  # resumed from `first` yet logged `first` again: counted twice
    below = [k for k in known if k < first]
    return max(below) if below else None


def resume_points(
    series: Series,
    *,
    file_starts: Sequence[int] = (),
    checkpoints: Iterable[CheckpointRef] = (),
    manual: Iterable[int] = (),
    time_gap_s: float = DEFAULT_TIME_GAP_S,
    judge_checkpoints: bool = False,
) -> tuple[ResumePoint, ...]:
    """Every resume point of the series, in log order.

    A plain repeated step (same file, no pause, no checkpoint there) is a double log, not a resume; the caller
    reports it as a duplicate. With `judge_checkpoints`, each catalogued checkpoint step inside the log that is not
    already a resume point is judged too (an appended log may show no other trace of a resume).
    """
    steps = series.steps
    ckpts = list(checkpoints)
    known = {c.step for c in ckpts}
    hand = sorted(set(manual))
    st = stride(steps)
    found: dict[int, ResumePoint] = {}
    for i, why in boundaries(series, file_starts=file_starts, time_gap_s=time_gap_s).items():
        first, prev = steps[i], steps[i - 1]
        matches = [r for r in hand if min(prev, first - 1) - st <= r <= first]
        if matches:
            r = min(matches, key=lambda r: abs(first - 1 - r))
            hand.remove(r)
            found[i] = ResumePoint(
                index=i, resume_step=r, first_step=first, prev_step=prev, sources=(*why, "manual"), inferred=False
            )
            continue
        if why == ["step-repeat"] and not ({first, first - 1} & known):
            continue  # logged twice in a row, nothing suggests a restart
        picked = _pick(first, known)
        if picked is not None:
            found[i] = ResumePoint(
                index=i, resume_step=picked, first_step=first, prev_step=prev, sources=(*why, "catalog"), inferred=False
            )
        else:
            found[i] = ResumePoint(
                index=i, resume_step=first - 1, first_step=first, prev_step=prev, sources=tuple(why), inferred=True
            )
    for r in hand:  # hand-given steps that no boundary explains: a continuous log, judged where it crosses r
        at = crossing_index(steps, r)
        if at is None or at in found:
            continue
        found[at] = ResumePoint(
            index=at,
            resume_step=r,
            first_step=steps[at],
            prev_step=steps[at - 1] if at else None,
            sources=("manual",),
            inferred=False,
        )
    if judge_checkpoints and steps:
        judged = {p.resume_step for p in found.values()}
        for k in sorted(known - judged):
            if not (min(steps) <= k < max(steps)):
                continue
            at = crossing_index(steps, k)
            if at is None or at in found or at == 0:
                continue
            found[at] = ResumePoint(
                index=at,
                resume_step=k,
                first_step=steps[at],
                prev_step=steps[at - 1],
                sources=("checkpoint",),
                inferred=False,
            )
    return tuple(found[i] for i in sorted(found))
