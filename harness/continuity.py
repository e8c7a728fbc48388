"""resume-test's W->W' verdict on the logged metrics: the judgement `ckpt-audit continuity` gives real logs.

Across a world-size change the loss cannot match the straight run bit for bit, so each metric of the resumed run is
judged at the restart exactly as `ckpt-audit continuity metrics.jsonl --metric M --resume-at k` would judge it (a
jump beyond the metric's own recent noise, steps logged twice or skipped). The straight run, judged at the same
step, is the control: where the judgement fires on a run that never stopped (k inside the warmup's bend) it cannot
tell a jump from the curve, and the test says so instead of passing or crying wolf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckpt_audit.continuity.audit import ContinuityResult, audit_log
from ckpt_audit.continuity.judge import Judgement
from ckpt_audit.continuity.metrics import MetricLog, read_metrics
from ckpt_audit.models import Severity


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricJudgement:
    metric: str
    resume_step: int
    resumed: ContinuityResult
    control: ContinuityResult | None

    @property
    def judgement(self) -> Judgement | None:
        return self.resumed.points[0].judgement if self.resumed.points else None

    @property
    def control_judgement(self) -> Judgement | None:
        return self.control.points[0].judgement if self.control and self.control.points else None

    @property
    def inconclusive(self) -> bool:
        """The judgement fires on the uninterrupted run too: at this step it cannot tell a jump from the curve."""
        j, c = self.judgement, self.control_judgement
        return j is not None and j.sufficient and c is not None and c.jumped

    def problems(self) -> list[str]:
        """What keeps this metric from passing: the judgement's findings, or a verdict it cannot give here (an
        inconclusive metric adds exactly one line, saying so, in place of its metric-jump)."""
        j, c, k = self.judgement, self.control_judgement, self.resume_step
        if j is None:
            return [f"continuity: no {self.metric} logged after step {k} to judge"]
        out = [
            f"continuity: {f.code}: {f.message}"
            for f in self.resumed.findings
            if f.severity >= Severity.WARNING and not (self.inconclusive and f.code == "metric-jump")
        ]
        if not j.sufficient:
            out.append(f"continuity: only {j.n_before} {self.metric} points up to step {k}; restart later to judge")
        elif self.inconclusive:
            out.append(
                f"continuity: {self.metric} inconclusive at step {k}: the uninterrupted run 'jumps' there "
                f"too ({c.score:+.1f} x its noise; resumed {j.score:+.1f}); restart later (--resume-step)"
            )
        return out

    def to_json(self) -> dict:
        """The judgement in `ckpt-audit continuity --json`'s terms, the control's beside it."""
        j, c = self.judgement, self.control_judgement
        return {
            "judgement": j.to_dict() if j else None,
            "control": c.to_dict() if c else None,
            "findings": [f.to_dict() for f in self.resumed.findings],
            "problems": self.problems(),
        }


def judge_metrics(resumed_run: Path, straight_run: Path, k: int, metrics: Sequence[str]) -> tuple[MetricJudgement, ...]:
    """Each of `metrics` the resumed run logged, judged at step k, with the straight run's judgement as control."""
    resumed, straight = _read(resumed_run), _read(straight_run)
    if resumed is None:
        return ()
    return tuple(
        MetricJudgement(
            metric=m,
            resume_step=k,
            resumed=audit_log(resumed, metric=m, resume_at=[k]),
            control=audit_log(straight, metric=m, resume_at=[k])
            if straight is not None and m in straight.metric_names
            else None,
        )
        for m in metrics
        if m in resumed.metric_names
    )


def _read(run_dir: Path) -> MetricLog | None:
    log = run_dir / "metrics.jsonl"
    return read_metrics([log]) if log.is_file() else None
