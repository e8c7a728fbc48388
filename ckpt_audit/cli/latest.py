"""`ckpt-audit latest RUN`: the resume gate for job scripts (ckpt_audit/lifecycle/latest.py decides)."""

from __future__ import annotations

from pathlib import Path

import click

from ckpt_audit.cli.common import DURATION, CommandError, catalog_option, emit_json, resolve_catalog
from ckpt_audit.exitcodes import ExitCode


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
    from ckpt_audit.session import SessionError, latest

    try:
        answer = latest(
            run,
            resolve_catalog(catalog),
            verified=verified,
            period_ns=period,
            in_progress_window_s=in_progress_window,
        )
    except SessionError as exc:
        raise CommandError(str(exc)) from None
    g = answer.gate
    code = ExitCode.OK if g.chosen is not None else ExitCode.FINDINGS
    if as_json:
        chosen = g.chosen
        emit_json(
            {
                "command": "latest",
                "run": answer.run.path,
                "tracker_step": answer.run.tracker_step,
                "checkpoint": None if chosen is None else chosen.path,
                "step": None if chosen is None else chosen.step,
                "verified_ns": answer.verified_ns,
                "reread": list(answer.reread),
                "files_reused": answer.files_reused,
                "files_read": answer.files_read,
                "passed_over": [p.to_dict() for p in g.passed_over],
                "reason": g.reason or None,
                "recorded": not answer.not_recorded,
                "not_recorded": answer.not_recorded or None,
                "exit_code": int(code),
            }
        )
    elif g.chosen is not None:
        click.echo(g.chosen.path)
    if g.chosen is None:
        click.echo(f"ckpt-audit: {g.reason}", err=True)
    ctx.exit(int(code))
