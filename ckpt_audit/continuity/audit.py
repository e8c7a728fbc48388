"""One continuity audit: resume points of a metrics log, a judgement at each, and the step-counter findings.

Pure over a MetricLog (no I/O): the CLI reads the files and the catalog, calls `audit_log`, and renders.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckpt_audit.codes import finding
from ckpt_audit.continuity.judge import DEFAULT_AFTER, DEFAULT_THRESHOLD, DEFAULT_WINDOW, Judgement, judge_resume
from ckpt_audit.continuity.metrics import MetricLog, Series
from ckpt_audit.continuity.resume_points import DEFAULT_TIME_GAP_S, CheckpointRef, ResumePoint, resume_points, stride
from ckpt_audit.continuity.zero_step import zero_step_resumes
from ckpt_audit.models import Finding


@dataclass(frozen=True, slots=True, kw_only=True)
class PointResult:
    point: ResumePoint
    judgement: Judgement
    findings: tuple[Finding, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ContinuityResult:
    paths: tuple[str, ...]
    metric: str
    series: Series
    points: tuple[PointResult, ...]
    findings: tuple[Finding, ...]  # every finding, point findings included, in log order
    window: int
    threshold: float


def _span(a: int, b: int) -> str:
    return f"step {a}" if a == b else f"steps {a}-{b}"


def audit_log(
    log: MetricLog,
    *,
    metric: str | None = None,
    resume_at: Iterable[int] = (),
    checkpoints: Iterable[CheckpointRef] = (),
    window: int = DEFAULT_WINDOW,
    threshold: float = DEFAULT_THRESHOLD,
    after: int = DEFAULT_AFTER,
    time_gap_s: float = DEFAULT_TIME_GAP_S,
    judge_checkpoints: bool = False,
) -> ContinuityResult:
    name = log.choose_metric(metric)
    series = log.series(name)
    ckpts = tuple(checkpoints)
    points = resume_points(
        series,
        file_starts=log.file_starts,
        checkpoints=ckpts,
        manual=resume_at,
        time_gap_s=time_gap_s,
        judge_checkpoints=judge_checkpoints,
    )
    steps, st = series.steps, stride(series.steps)
    src = [log.records[p] for p in series.positions]
    at = {p.index: p for p in points}
    out: list[Finding] = [finding("metrics-bad-line", path, f"line {line}: {why}") for path, line, why in log.bad_lines]
    results: list[PointResult] = []
    for i in range(1, len(steps)):
        path = src[i].source
        point = at.get(i)
        if point is None or "checkpoint" in point.sources or point.sources == ("manual",):
            # inside one attempt: every step once, in order, at the usual interval
            prev, cur = steps[i - 1], steps[i]
            if cur == prev:
                out.append(
                    finding(
                        "step-duplicated",
                        path,
                        f"step {cur} ({name}) logged twice in a row (lines {src[i - 1].line} and {src[i].line})",
                    )
                )
            elif cur > prev + st:
                out.append(
                    finding(
                        "step-skipped",
                        path,
                        f"{_span(prev + 1, cur - 1)} never logged (line {src[i].line} jumps from {prev} to {cur})",
                    )
                )
        if point is not None and point.prev_step is not None and "checkpoint" not in point.sources:
            out.extend(_boundary_findings(point, path, src[i].time, ckpts, st))
        if point is None:
            continue
        j = judge_resume(series, point.resume_step, window=window, threshold=threshold, after=after, index=i)
        if j is not None:
            found = []
            if j.jumped:
                found.append(
                    finding(
                        "metric-jump",
                        path,
                        (
                            f"resume from step {point.resume_step}: {name} moved {j.after_residual:+.4g} "
                            f"from its trend ({j.score:+.1f} x its noise {j.noise:.3g} "
                            f"over steps {j.window_first_step}-{j.window_last_step}; threshold {threshold:g})"
                        ),
                    )
                )
            elif not j.sufficient:
                found.append(
                    finding(
                        "metric-window-short",
                        path,
                        (
                            f"resume from step {point.resume_step}: only {j.n_before} points of {name} before it "
                            f"and {j.n_after} after; no verdict on a jump"
                        ),
                    )
                )
            out.extend(found)
            results.append(PointResult(point=point, judgement=j, findings=tuple(found)))
    out.extend(zero_step_resumes(log, name, time_gap_s=time_gap_s))  # attempts with no record of `name` at all
    return ContinuityResult(
        paths=log.paths,
        metric=name,
        series=series,
        points=tuple(results),
        findings=tuple(out),
        window=window,
        threshold=threshold,
    )


def _boundary_findings(
    p: ResumePoint, path: str, first_time: float | None, ckpts: tuple[CheckpointRef, ...], st: int
) -> list[Finding]:
    """Counter checks where a new attempt begins: counted twice, skipped, redone, or resumed from an older one."""
    out: list[Finding] = []
    r, first, prev = p.resume_step, p.first_step, p.prev_step
    assert prev is not None
    if first <= r:
        out.append(
            finding(
                "step-duplicated",
                path,
                (
                    f"resumed from step {r} yet logged {_span(first, r)} again: counted twice "
                    f"(the first step after a resume from {r} is {r + 1})"
                ),
            )
        )
    if not p.inferred and first > r + st:
        out.append(
            finding(
                "step-skipped",
                path,
                (
                    f"{_span(r + 1, first - 1)} never trained: "
                    f"the attempt resumed from step {r} starts counting at {first}"
                ),
            )
        )
    elif p.inferred and first > prev + st:
        out.append(
            finding(
                "step-skipped",
                path,
                (f"{_span(prev + 1, first - 1)} never logged: the log jumps from step {prev} to {first} at a restart"),
            )
        )
    redo_lo, redo_hi = max(first, r + 1), prev
    if redo_hi >= redo_lo:
        out.append(
            finding(
                "steps-redone",
                path,
                (
                    f"{_span(redo_lo, redo_hi)} logged by the previous attempt and again after resuming from step {r} "
                    "(the work since that checkpoint was repeated)"
                ),
            )
        )
    newer = [
        c
        for c in ckpts
        if c.complete
        and r < c.step <= prev
        and (first_time is None or not c.mtime_ns or c.mtime_ns / 1e9 <= first_time)
    ]
    if newer:
        best = max(c.step for c in newer)
        out.append(
            finding(
                "resumed-from-older",
                path,
                (f"resumed from step {r} although step {best} was complete: {_span(r + 1, best)} of work thrown away"),
            )
        )
    return out
