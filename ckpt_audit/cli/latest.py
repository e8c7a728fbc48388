"""`ckpt-audit latest RUN`: the resume gate for job scripts (ckpt_audit/lifecycle/latest.py decides)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import click

from ckpt_audit.cli.common import DURATION, CommandError, catalog_option, emit_json, resolve_catalog
from ckpt_audit.exitcodes import ExitCode


def scan_run(run: Path, *, previous, in_progress_window: float, rehash: bool = False):
    """(ScanResult, Run) of one run directory, reusing the catalog's facts for files whose stat is unchanged."""
    from ckpt_audit import scanner

    try:
        real = scanner.check_root(run)
        result = scanner.scan([real], previous=previous, in_progress_window_s=in_progress_window, rehash=rehash)
    except scanner.ScanError as exc:
        raise CommandError(str(exc)) from None
    return result, pick_run(result, run)


def pick_run(result, run: Path):
    """The run `run` names in a scan of it; a path that is not one run directory is a one-line error (exit 3)."""
    real = os.path.realpath(run)
    match = [r for r in result.runs if r.path == real]
    if match:
        return match[0]
    if len(result.runs) > 1:
        raise CommandError(f"{real} holds {len(result.runs)} runs; name one of them")
    if result.runs:
        raise CommandError(f"{real} is not a run directory (its run is {result.runs[0].path})")
    raise CommandError(f"{real} is not a checkpoint run (no tracker, no global_step_N)")


def previous_facts(cat_path: Path) -> dict:
    """The catalog's per-file facts; {} when it is absent or unreadable (the run is then read in full)."""
    from ckpt_audit.catalog.manifest import CatalogError, read_previous

    try:
        return read_previous(cat_path)
    except CatalogError:
        return {}


def record(cat_path: Path, *results) -> str:
    """Record the scans if the catalog's lock is free; "" or why not. A job script's gate never waits for, nor
    fails on, a cron scan holding the lock or a catalog it may not write."""
    from ckpt_audit.session import record_if_free

    for r in results:
        if why := record_if_free(r, cat_path):
            return why
    return ""


@click.command("latest")
@click.argument("run", type=click.Path(path_type=Path))
@click.option(
    "--verified",
    is_flag=True,
    help="Only a checkpoint read by content (hash + CRC of every file) within --period; one read longer ago is "
    "re-read now.",
)
@click.option(
    "--period",
    type=DURATION,
    default="7d",
    show_default=True,
    help="With --verified: how recent the last content read must be (scan's --scrub-period).",
)
@click.option(
    "--in-progress-window",
    type=click.FloatRange(0),
    default=300.0,
    show_default=True,
    metavar="SECONDS",
    help="An uncommitted checkpoint written this recently is in-progress, never the answer.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document: the answer and every newer checkpoint passed over, with the reasons.",
)
@catalog_option
@click.pass_context
def latest_command(ctx: click.Context, run, verified, period, in_progress_window, as_json, catalog) -> None:
    """Print the newest complete checkpoint of RUN, for a job script's resume_from_path.

    Complete means what a resume needs: every rank's shards, no error finding, not unsafe, not being written,
    committed by the tracker or whole beyond a lagging one. RUN is scanned with the catalog's cache (files whose
    size, mtime and inode are unchanged are not re-read), so a stale or absent catalog still gives a true answer;
    the scan is recorded when the catalog's lock is free. With --verified the answer must also have been read by
    content within --period (scan's scrub keeps that true on a nightly cron), or is re-read now.

    Exit codes: 0 a checkpoint was printed, 1 none is resumable (the reason on stderr, one line), 2 usage, 3 error
    (RUN is not a run).

    \b
    Example:
        ckpt=$(ckpt-audit latest --verified /ckpts/proj/exp) || exit 1
        python3 -m verl.trainer.main_ppo trainer.resume_mode=resume_path trainer.resume_from_path=$ckpt ...
        ckpt-audit latest --json /ckpts/proj/exp | jq '.passed_over[].reasons'
    """
    from ckpt_audit.lifecycle.latest import gate, oldest_verified

    cat_path = resolve_catalog(catalog)
    previous = previous_facts(cat_path)
    result, the_run = scan_run(run, previous=previous, in_progress_window=in_progress_window)
    scans = [result]
    verified_at = {p: f.verified_ns for p, f in result.file_facts.items()}
    reread: set[str] = set()
    now = time.time_ns()
    while True:
        g = gate(
            the_run,
            verified=verified_at if verified else None,
            now_ns=now,
            period_ns=period,
            reread=frozenset(reread),
        )
        if g.reread is None:
            break
        # read the candidate by content now; what that read finds (hash drift, a bad CRC) is its verdict
        focused, _ = _reread(g.reread.path, previous, in_progress_window)
        scans.append(focused)
        fresh = {c.path: c for r in focused.runs for c in r.checkpoints}
        the_run = replace(the_run, checkpoints=tuple(fresh.get(c.path, c) for c in the_run.checkpoints))
        verified_at.update({p: f.verified_ns for p, f in focused.file_facts.items()})
        reread.add(g.reread.path)
    not_recorded = record(cat_path, *scans)
    code = ExitCode.OK if g.chosen is not None else ExitCode.FINDINGS
    if as_json:
        chosen = g.chosen
        emit_json(
            {
                "command": "latest",
                "run": the_run.path,
                "tracker_step": the_run.tracker_step,
                "checkpoint": None if chosen is None else chosen.path,
                "step": None if chosen is None else chosen.step,
                "verified_ns": None if chosen is None else oldest_verified(chosen, verified_at),
                "reread": sorted(reread),
                # the catalog's cache at work: files reused by stat vs read by content for this answer
                "files_reused": scans[0].files_reused,
                "files_read": sum(s.files_hashed for s in scans),
                "passed_over": [p.to_dict() for p in g.passed_over],
                "reason": g.reason or None,
                "recorded": not not_recorded,
                "not_recorded": not_recorded or None,  # why not (a cron scan holds the lock, read-only catalog)
                "exit_code": int(code),
            }
        )
    elif g.chosen is not None:
        click.echo(g.chosen.path)
    if g.chosen is None:
        click.echo(f"ckpt-audit: {g.reason}", err=True)
    ctx.exit(int(code))


def _reread(path: str, previous, in_progress_window: float):
    from ckpt_audit import scanner

    result = scanner.scan([path], previous=previous, in_progress_window_s=in_progress_window, rehash=True)
    return result, os.path.dirname(path)
