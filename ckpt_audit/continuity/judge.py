"""Judging a metric at one resume: did it jump further than its own recent noise explains?

Robust statistics over the `window` points logged before the resume: a Theil-Sen line (median slope over all
pairs of points, median intercept) follows the trend, and the noise is 1.4826 x the MAD of the residuals, so one
spike inside the window moves neither. The score is the median residual of the first `after` points logged after
the resume, in noise units: a single noisy point after a resume does not cry wolf, a level shift does. A noisy run
has a wide noise band, so its ordinary wobble stays inside `threshold`. Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_audit.continuity.metrics import Series

MAD_TO_SIGMA = 1.4826  # MAD of a normal sample times this estimates its standard deviation
DEFAULT_WINDOW = 20
DEFAULT_THRESHOLD = 6.0
DEFAULT_AFTER = 3
MIN_POINTS = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Judgement:
    metric: str
    resume_step: int  # the checkpoint step training resumed from
    index: int  # index into the series of the first point after the resume
    n_before: int  # points in the window actually used
    n_after: int
    window_first_step: int | None
    window_last_step: int | None
    slope: float  # trend per step fitted over the window
    intercept: float  # trend value at resume_step
    noise: float  # robust sigma of the window's residuals (floored)
    after_residual: float  # median residual of the first points after the resume
    score: float  # after_residual / noise
    threshold: float
    jumped: bool
    sufficient: bool  # False when the window held fewer than MIN_POINTS points (no verdict)

    def expected(self, step: int) -> float:
        return self.intercept + self.slope * (step - self.resume_step)

    def to_dict(self) -> dict:
        return {
            "metric": self.metric,
            "resume_step": self.resume_step,
            "n_before": self.n_before,
            "n_after": self.n_after,
            "window": [self.window_first_step, self.window_last_step],
            "slope": _num(self.slope),
            "expected": _num(self.intercept),
            "noise": _num(self.noise),
            "after_residual": _num(self.after_residual),
            "score": _num(self.score),
            "threshold": self.threshold,
            "jumped": self.jumped,
            "sufficient": self.sufficient,
        }


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def crossing_index(steps: Sequence[int], resume_step: int) -> int | None:
    """Index of the first point of the last stretch that continues past `resume_step`: the points after the resume.

    In a log whose counter restarts (1..10 then 9..15, resumed from 8) that is the second 9, not the first.
    """
    found = None
    for i, s in enumerate(steps):
        if s > resume_step and (i == 0 or steps[i - 1] <= resume_step or steps[i - 1] >= s):
            found = i
    return found


def judge_resume(
    series: Series | Sequence[tuple[int, float]],
    resume_step: int,
    *,
    window: int = DEFAULT_WINDOW,
    threshold: float = DEFAULT_THRESHOLD,
    after: int = DEFAULT_AFTER,
    index: int | None = None,
) -> Judgement:
    """Judge the metric at a resume from checkpoint `resume_step` (the first new step is normally resume_step+1).

    `series`: a Series, or (step, value) pairs in log order. `index`: the first point after the resume when the
    caller knows it (resume_points does); otherwise found with crossing_index. Pure.
    """
    if not isinstance(series, Series):
        series = Series.from_pairs(series)
    steps, values = series.steps, series.values
    if index is None:
        index = crossing_index(steps, resume_step)
    if index is None:
        index = len(steps)
    # walking back from the resume: points up to the checkpoint (skipping the thrown-away steps past it), only the
    # stretch logged just before the resume (stop at the previous restart of the counter), at most `window`
    tail: list[tuple[int, float]] = []
    for i in range(index - 1, -1, -1):
        s, v = steps[i], values[i]
        if s > resume_step or not math.isfinite(v):
            continue
        if tail and s >= tail[-1][0]:
            break
        tail.append((s, v))
        if len(tail) == window:
            break
    tail.reverse()
    post: list[tuple[int, float]] = []
    for i in range(index, len(steps)):
        if i > index and steps[i] <= steps[i - 1]:
            break  # the next attempt's stretch
        if math.isfinite(values[i]):
            post.append((steps[i], values[i]))
        if len(post) == after:
            break
    nonfinite_after = any(not math.isfinite(values[i]) for i in range(index, min(index + after, len(values))))
    base: dict[str, Any] = dict(
        metric=series.metric,
        resume_step=resume_step,
        index=index,
        n_before=len(tail),
        n_after=len(post),
        window_first_step=tail[0][0] if tail else None,
        window_last_step=tail[-1][0] if tail else None,
        threshold=threshold,
    )
    if len(tail) < MIN_POINTS or (not post and not nonfinite_after):
        return Judgement(
            **base,
            slope=0.0,
            intercept=tail[-1][1] if tail else math.nan,
            noise=math.nan,
            after_residual=math.nan,
            score=math.nan,
            jumped=False,
            sufficient=False,
        )
    slopes = [(v2 - v1) / (s2 - s1) for k, (s1, v1) in enumerate(tail) for s2, v2 in tail[k + 1 :] if s2 > s1]
    slope = statistics.median(slopes) if slopes else 0.0
    intercept = statistics.median(v - slope * (s - resume_step) for s, v in tail)
    resid = [v - (intercept + slope * (s - resume_step)) for s, v in tail]
    centre = statistics.median(resid)
    mad = statistics.median(abs(r - centre) for r in resid)
    # a perfectly smooth window (deterministic toy runs) still needs a noise floor, relative to the level
    floor = 1e-6 * max(abs(intercept), 1e-12)
    noise = max(MAD_TO_SIGMA * mad, floor)
    if nonfinite_after:  # NaN/inf right after a resume is the loudest jump there is
        residual, score = math.inf, math.inf
    else:
        residual = statistics.median(v - (intercept + slope * (s - resume_step)) for s, v in post) - centre
        score = residual / noise
    return Judgement(
        **base,
        slope=slope,
        intercept=intercept + centre,
        noise=noise,
        after_residual=residual,
        score=score,
        jumped=abs(score) > threshold,
        sufficient=True,
    )
