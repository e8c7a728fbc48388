"""Continuity of training metrics around resumes: read logs, find resume points, judge each one, plot it.

Never imports torch. `sparkline` is imported by the TUI; `judge_resume` by the harness's W -> W' check.
"""

from ckpt_audit.continuity.judge import Judgement, judge_resume
from ckpt_audit.continuity.metrics import MetricLog, MetricsError, Record, Series, read_metrics
from ckpt_audit.continuity.sparkline import sparkline

__all__ = ["Judgement", "MetricLog", "MetricsError", "Record", "Series", "judge_resume", "read_metrics", "sparkline"]
