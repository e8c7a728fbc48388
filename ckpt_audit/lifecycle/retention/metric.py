"""Keep-best's input: a metric's value per step of each run, read as `ckpt-audit continuity` reads it (or from
OpenRLHF's per-tag metric.json), and the refusal of a metric that would rank nothing."""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping, Sequence

from ckpt_audit.continuity.metrics import MetricLog, MetricsError, read_metrics
from ckpt_audit.models import Run, Status
from ckpt_audit.readers import bounded_json
from ckpt_audit.rules import deepspeed as ds_rules

METRIC_JSON_LIMIT = 64 * 1024  # OpenRLHF's metric.json is two keys


def read_metric(runs: Sequence[Run], metric: str) -> dict[str, dict[int, float]]:
    """Read `metric` per step from each run's metrics log with continuity's reader (`ckpt-audit continuity` reads
    the same values: flat, nested or verl-logger records, console lines; the last record of a step wins, since
    resumed runs log a step again). Runs without a readable log are left out; unparsable lines are skipped."""
    out: dict[str, dict[int, float]] = {}
    for run in runs:
        if run.metrics_path and not isinstance(log := _metric_log(run.metrics_path), str):
            out[run.path] = log.series(metric).by_step() if metric in log.metric_names else {}
        elif not run.metrics_path and (tagged := _tag_metrics(run, metric)) is not None:
            out[run.path] = tagged
    return out


def _tag_metrics(run: Run, metric: str) -> dict[int, float] | None:
    """OpenRLHF's per-tag metric.json (the value its own keep-best and rotation rank by), where its key is `metric`;
    None when no checkpoint of the run has one."""
    found, out = False, {}
    # a best_ tag's value is its own step's eval; the regular tag of that step records the eval before it
    for c in sorted(run.checkpoints, key=lambda c: c.path.rsplit("/", 1)[-1].startswith("best")):
        try:
            doc = bounded_json.loads(_small_file(f"{c.path}/{ds_rules.METRIC_JSON}"), max_bytes=METRIC_JSON_LIMIT)
        except (OSError, ValueError):
            continue
        found = True
        key, value = ds_rules.read_metric_json(doc)
        if key == metric and value is not None and math.isfinite(value):
            out[c.step] = value
    return out if found else None


def _small_file(path: str) -> bytes:
    """Up to METRIC_JSON_LIMIT + 1 bytes of a regular file (a FIFO put there must not block prune)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.read(fd, METRIC_JSON_LIMIT + 1)
    finally:
        os.close(fd)


def metric_problem(runs: Sequence[Run], metric: str, values: Mapping[str, Mapping[int, float]]) -> str | None:
    """Why best-N by `metric` (`values` from `read_metric`) would rank nothing in some run, else None.

    Keeping the best of nothing keeps nothing, and every other complete checkpoint would go: a metric no record
    has (a typo) or a run without a metrics log is a wrong input, not a policy. Runs with nothing complete
    have nothing to rank and are not asked.
    """
    for run in sorted(runs, key=lambda r: r.path):
        complete = [c for c in run.checkpoints if c.status is Status.COMPLETE]
        if not complete:
            continue
        series = values.get(run.path)
        if series is None:  # neither a metrics log nor any metric.json gave this run a series
            if not run.metrics_path:
                return (
                    f"--keep-best: run {run.path} has no metrics log (metrics.jsonl) or metric.json to rank its "
                    "checkpoints by"
                )
            log = _metric_log(run.metrics_path)
            return f"--keep-best: {log}" if isinstance(log, str) else f"--keep-best: cannot read {run.metrics_path}"
        if not series:
            if not run.metrics_path:
                return f"--metric {metric!r}: no metric.json of {run.path} records it"
            names = metric_names(run.metrics_path)
            return f"--metric {metric!r}: no record in {run.metrics_path} has it" + (
                f" (it logs: {', '.join(names)})" if names else ""
            )
        if not any(math.isfinite(series.get(c.step, math.nan)) for c in complete):
            return (
                f"--metric {metric!r}: no complete checkpoint of {run.path} has a logged value "
                f"(steps {', '.join(str(c.step) for c in complete)})"
            )
    return None


def metric_names(path: str) -> list[str]:
    """The metrics a log holds, to name them when --metric has a typo."""
    log = _metric_log(path)
    return [] if isinstance(log, str) else sorted(log.metric_names)


def _metric_log(path: str) -> MetricLog | str:
    """The run's metrics log, or the one-line reason it cannot be read."""
    try:
        return read_metrics([path])
    except MetricsError as exc:
        return str(exc)
