"""`ckpt-audit continuity`: the watched metric around every resume of a run, from its metrics logs."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ckpt_audit.cli.common import CommandError, check_junit_writable, emit_json, junit_option, write_junit_report
from ckpt_audit.exitcodes import ExitCode

FAIL_ON = ("info", "warning", "error")


@click.command("continuity")
@click.argument("metrics", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--metric",
    default=None,
    metavar="NAME",
    help="Metric to watch (default: loss, else the first *loss metric). Reward metrics work too.",
)
@click.option(
    "--resume-at",
    "resume_at",
    type=click.IntRange(0),
    multiple=True,
    metavar="STEP",
    help="A checkpoint step the run resumed from (repeatable), for logs that show no trace of it.",
)
@click.option(
    "--catalog",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Catalog to take the run's checkpoint steps from (resume targets, resumed-from-older).",
)
@click.option(
    "--run",
    "run_path",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The run directory in the catalog (default: the run whose metrics file this is, or its folder).",
)
@click.option(
    "--at-checkpoints",
    is_flag=True,
    help="With --catalog: also judge the metric at every checkpoint step (appended logs leave no trace).",
)
@click.option(
    "--window",
    type=click.IntRange(3),
    default=20,
    show_default=True,
    help="Points before each resume that define its trend and noise.",
)
@click.option(
    "--threshold",
    type=click.FloatRange(0, min_open=True),
    default=6.0,
    show_default=True,
    help="A jump counts when the first points after a resume leave the trend by this many noise units.",
)
@click.option(
    "--after",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Points after the resume whose median is compared (1: any single spike counts).",
)
@click.option(
    "--time-gap",
    type=click.FloatRange(0),
    default=60.0,
    show_default=True,
    metavar="SECONDS",
    help="A pause in the log's timestamps longer than this (and 20x the usual interval) marks a restart.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write an SVG of the metric around each resume, with window and threshold band.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (with schema_version) to stdout.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing when clean; else only the failing findings.")
@click.option(
    "--fail-on",
    type=click.Choice(FAIL_ON),
    default="warning",
    show_default=True,
    help="Exit 1 when a finding at or above this severity is present.",
)
@junit_option
@click.pass_context
def continuity_command(
    ctx: click.Context,
    metrics,
    metric,
    resume_at,
    catalog,
    run_path,
    at_checkpoints,
    window,
    threshold,
    after,
    time_gap,
    plot_path,
    as_json,
    quiet,
    fail_on,
    junit_xml,
) -> None:
    """Judge the watched metric at every resume in METRICS... (JSON lines, CSV, TensorBoard events).

    Finds the resumes (step counter reset or repeated, a new file per attempt, a pause in the timestamps, the
    catalog's checkpoint steps, or --resume-at) and at each one reports: a jump beyond what the metric's own
    recent noise explains (median/MAD over --window points), steps logged twice, steps skipped, and a resume from
    an older checkpoint than the newest complete one. Files are read in the order given; a directory stands for
    its TensorBoard event files, oldest first (verl's tensorboard_log/PROJECT/EXPERIMENT).

    Exit codes: 0 clean, 1 findings at/above --fail-on, 2 usage, 3 error (unreadable log, unknown metric, bad
    catalog).

    \b
    Example:
        ckpt-audit continuity runs/demo/exp/metrics.jsonl
        ckpt-audit continuity attempt1.jsonl attempt2.jsonl --metric critic/score/mean --plot resume.svg
        ckpt-audit continuity metrics.jsonl --catalog catalog.db --json | jq '.findings[].code'
        ckpt-audit continuity tensorboard_log/my_project/my_exp --metric actor/pg_loss
        ckpt-audit continuity metrics.jsonl --junit-xml continuity.xml   # a CI test report per resume
    """
    from ckpt_audit.models import Severity
    from ckpt_audit.session import SessionError
    from ckpt_audit.session.continuity import audit_metrics

    for p in metrics:
        if not (p.is_file() or p.is_dir()):
            raise CommandError(f"{p}: no such file or directory")
    check_junit_writable(junit_xml)
    try:
        result = audit_metrics(
            metrics,
            catalog_path=catalog,
            run_path=run_path,
            metric=metric,
            resume_at=resume_at,
            window=window,
            threshold=threshold,
            after=after,
            time_gap_s=time_gap,
            judge_checkpoints=at_checkpoints,
        )
    except SessionError as exc:
        raise CommandError(str(exc)) from None
    if plot_path is not None:
        write_plot(plot_path, result)
    level = Severity[fail_on.upper()]
    failing = [f for f in result.findings if f.severity >= level]
    code = ExitCode.FINDINGS if failing else ExitCode.OK
    if junit_xml is not None:
        from ckpt_audit.report_junit import continuity_suite

        write_junit_report(junit_xml, [continuity_suite(result, level)])
    if as_json:
        emit_json(_document(result, exit_code=int(code), plot=plot_path))
    elif quiet:
        for f in failing:
            click.echo(_finding_line(f).strip())
    else:
        for line in _render(result, plot_path):
            click.echo(line)
    ctx.exit(int(code))


def write_plot(path: Path, result) -> None:
    """The SVG of a ContinuityResult at `path` (continuity --plot, resume-test --plot); a one-line error if not."""
    from ckpt_audit.continuity.plot import render_svg

    try:
        path.write_text(render_svg(result), encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from None


def _around(line: str, cut: int) -> str:
    """One sparkline on one scale, with a bar where the resume falls."""
    return f"{line[:cut]}|{line[cut:]}"


def _finding_line(f) -> str:
    return f"  {f.severity.label:<7} {f.code:<20} {f.path}: {f.message}"


def _render(result, plot_path):
    from ckpt_audit.continuity.sparkline import sparkline

    s = result.series
    yield (
        f"{', '.join(result.paths)}: {result.metric}, {len(s)} points, steps {min(s.steps)}-{max(s.steps)}, "
        f"{len(result.points)} resume point(s)"
    )
    for pr in result.points:
        p, j = pr.point, pr.judgement
        lo, hi = max(0, p.index - result.window), min(len(s), p.index + result.window // 2)
        verdict = "no verdict" if not j.sufficient else ("JUMP" if j.jumped else "ok")
        score = f"{j.score:+.1f}" if j.sufficient else "-"
        yield (
            f"  resume from step {p.resume_step} (first logged {p.first_step}; {'+'.join(p.sources)}"
            f"{', inferred' if p.inferred else ''}): {verdict}  score {score} / {result.threshold:g}  "
            f"{_around(sparkline(s.values[lo:hi]), p.index - lo)}"
        )
    if result.findings:
        yield "findings:"
        for f in result.findings:
            yield _finding_line(f)
    else:
        yield "no findings"
    if plot_path is not None:
        yield f"plot: {plot_path}"


def _document(result, *, exit_code: int, plot) -> dict:
    s = result.series
    counts = {"error": 0, "warning": 0, "info": 0}
    for f in result.findings:
        counts[f.severity.label] += 1
    return {
        "paths": list(result.paths),
        "metric": result.metric,
        "points": len(s),
        "first_step": min(s.steps),
        "last_step": max(s.steps),
        "window": result.window,
        "threshold": result.threshold,
        "resume_points": [
            {**pr.point.to_dict(), "judgement": pr.judgement.to_dict(), "findings": [f.code for f in pr.findings]}
            for pr in result.points
        ],
        "findings": [f.to_dict() for f in result.findings],
        "summary": counts,
        "plot": os.fspath(plot) if plot is not None else None,
        "exit_code": exit_code,
    }
