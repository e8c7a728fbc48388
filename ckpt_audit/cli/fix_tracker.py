"""`ckpt-audit fix-tracker RUN`: point the tracker at the newest resumable checkpoint (lifecycle/tracker_fix.py)."""

from __future__ import annotations

from pathlib import Path

import click

from ckpt_audit.cli.common import CommandError, catalog_option, emit_json, session
from ckpt_audit.exitcodes import ExitCode
from ckpt_audit.models import IN_PROGRESS_WINDOW_S


@click.command("fix-tracker")
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--yes", is_flag=True, help="Rewrite the tracker (default: a dry run that says what it would do).")
@click.option(
    "--in-progress-window",
    type=click.FloatRange(0),
    default=IN_PROGRESS_WINDOW_S,
    show_default=True,
    metavar="SECONDS",
    help="A checkpoint or tracker written this recently means the run is alive: refuse.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document with the plan and what was done.")
@catalog_option
@click.pass_context
def fix_tracker_command(ctx: click.Context, run, yes, in_progress_window, as_json, catalog) -> None:
    """Rewrite RUN's latest_checkpointed_iteration.txt to name its newest complete checkpoint.

    Fixes a tracker that is missing (FSDP async_save never writes one), not a step number, names a step that is
    gone or not complete (corrupt, unsafe, incomplete, a husk), or lags behind whole newer checkpoints: each makes
    verl's resume_mode=auto train from step 0, crash, or load older state. The old content is kept beside the
    tracker (latest_checkpointed_iteration.txt.ckpt-audit-old-<ns>); the new one is written to a temporary file,
    fsynced and renamed over it; the change is logged in the catalog (table tracker_fixes). Refuses while the run
    looks alive (a checkpoint being written, a tracker written within --in-progress-window), when the tracker is a
    link or unreadable, or when a newer checkpoint could not be read. With --yes the target is first read by
    content (hash and CRC of every file against the scan, whatever the stat says); one that fails is recorded and
    the fix refused. Works for verl FSDP (PPO, SFT) and Megatron, and for a DeepSpeed save directory, whose
    `latest` gets the tag's name (global_step6), as DeepSpeed's save_checkpoint writes it.

    Exit codes: 0 the tracker is right (or was fixed with --yes), 1 it needs a fix (dry run) or the fix was
    refused (a target that failed its re-read included), 2 usage, 3 error (not a run, the tracker could not be
    written), 4 another run holds the catalog lock.

    \b
    Example:
        ckpt-audit fix-tracker /ckpts/proj/exp          # dry run: what is wrong and what it would write
        ckpt-audit fix-tracker --yes /ckpts/proj/exp    # rewrite it (old content kept beside it)
    """
    from ckpt_audit.session.tracker_terms import FixError

    with session(ctx, [run], catalog) as s:
        plan = s.plan_fix_tracker(run, in_progress_window_s=in_progress_window)
        fix, write = plan.fix, None
        if yes and fix.needed and not fix.refused:
            try:
                write = s.fix_tracker(plan)
            except FixError as exc:
                raise CommandError(str(exc)) from None
    done = write is not None and write.written
    code = ExitCode.OK if done or not (fix.refused or fix.needed) else ExitCode.FINDINGS  # a failed re-read: needed
    if as_json:
        emit_json(
            {
                "command": "fix-tracker",
                **fix.to_dict(),
                "written": done,
                "backup": write.backup if write else None,
                "reread": write.reread.to_dict() if write else None,
                "exit_code": int(code),
            }
        )
        ctx.exit(int(code))
    old = "missing" if fix.old_content is None else repr(fix.old_content.decode("utf-8", "replace")[:40])
    new = None if fix.new_content is None else fix.new_content.decode()
    if fix.problem == "ok":
        click.echo(f"{fix.tracker_path}: ok ({fix.detail})")
    elif fix.refused:
        click.echo(f"{fix.tracker_path}: {fix.problem} (now {old}); not fixed: {fix.refused}", err=True)
    elif write is not None and not done:
        r = write.reread
        click.echo(
            f"{fix.tracker_path}: {fix.problem} (now {old}); not fixed: step {fix.new_step} failed its re-read "
            f"by content just now, before writing: {r.as_outcome().detail} (recorded; run fix-tracker again)",
            err=True,
        )
    elif write is not None and done:
        kept = f"; old content kept in {write.backup}" if write.backup else ""
        checked = write.reread.as_outcome().detail
        click.echo(f"{fix.tracker_path}: {fix.problem}: {old} -> {new} ({fix.new_path}){kept}")
        click.echo(f"re-read step {fix.new_step} by content just now, before writing: {checked}")
    else:
        click.echo(f"{fix.tracker_path}: {fix.problem} (now {old}): would write {new} ({fix.new_path})")
        click.echo("dry run: nothing written; run again with --yes to read the target by content and rewrite it")
    ctx.exit(int(code))
