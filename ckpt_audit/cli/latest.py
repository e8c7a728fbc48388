"""`ckpt-audit latest RUN`: the resume gate for job scripts (ckpt_audit/lifecycle/latest.py decides)."""

from __future__ import annotations

import click

from ckpt_audit.cli.common import DURATION, CommandError, catalog_option, emit_json, resolve_catalog
from ckpt_audit.exitcodes import ExitCode
from ckpt_audit.models import IN_PROGRESS_WINDOW_S


@click.command("latest")
@click.argument("run", type=click.Path())  # a str: an s3:// URL stays whole (docs/remote.md)
@click.option(
    "--verified",
    is_flag=True,
    help="Read the answer by content now (hash + CRC of every file, against the catalog) before naming it; one "
    "that fails is passed over for the next. What was read, and when, goes to stderr.",
)
@click.option(
    "--max-age",
    type=DURATION,
    default=None,
    metavar="DURATION",
    help="With --verified: accept a content read within this age (e.g. 1h) instead of reading now.",
)
@click.option("--period", "period", type=DURATION, default=None, hidden=True)  # the old name of --max-age
@click.option(
    "--in-progress-window",
    type=click.FloatRange(0),
    default=IN_PROGRESS_WINDOW_S,
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
@click.option(
    "--print",
    "what",
    type=click.Choice(["path", "tag"]),
    default="path",
    show_default=True,
    help="path: the checkpoint's directory (resume_from_path, HF's resume_from_checkpoint); tag: a DeepSpeed "
    "run's tag name, for load_checkpoint(save_dir, tag=...).",
)
@catalog_option
@click.pass_context
def latest_command(
    ctx: click.Context, run, verified, max_age, period, in_progress_window, as_json, what, catalog
) -> None:
    """Print the newest complete checkpoint of RUN, for a job script's resume_from_path.

    Complete means what a resume needs: every rank's shards, no error finding, not unsafe, not being written,
    committed by the tracker or whole beyond a lagging one. RUN is scanned with the catalog's cache (files whose
    size, mtime and inode are unchanged are not re-read), so a stale or absent catalog still gives a true answer;
    the scan is recorded when the catalog's lock is free. With --verified the answer is read by content now (every
    file's hash and zip CRCs, compared with the catalog): a checkpoint whose bytes rotted since the last scan is
    passed over and the next one read, and what was read is recorded. --max-age accepts a content read within
    that age instead (scan's scrub keeps one within --scrub-period on a nightly cron).

    For a DeepSpeed save directory, --print tag prints the tag (global_step6) to pass to
    load_checkpoint(save_dir, tag=...); the default stays the directory.

    Exit codes: 0 a checkpoint was printed, 1 none is resumable (the reason on stderr, one line, after
    --verified's), 2 usage (--print tag on a run that is not a DeepSpeed save directory), 3 error (RUN is not a
    run).

    \b
    Example:
        ckpt=$(ckpt-audit latest --verified /ckpts/proj/exp) || exit 1
        python3 -m verl.trainer.main_ppo trainer.resume_mode=resume_path trainer.resume_from_path=$ckpt ...
        ckpt-audit latest --json /ckpts/proj/exp | jq '.passed_over[].reasons'
        tag=$(ckpt-audit latest --verified --print tag /ckpts/ds/save_dir) || exit 1   # load_checkpoint(tag=$tag)
    """
    from ckpt_audit.session import SessionError, latest

    max_age_ns = max_age if max_age is not None else period or 0
    try:
        answer = latest(
            run,
            resolve_catalog(catalog),
            verified=verified,
            max_age_ns=max_age_ns,
            in_progress_window_s=in_progress_window,
        )
    except SessionError as exc:
        raise CommandError(str(exc)) from None
    g = answer.gate
    if what == "tag" and not answer.takes_tag:  # only DeepSpeed's load takes a tag
        # named by what its checkpoints hold: a verl run's layout is verl's run structure, Megatron's or FSDP's alike
        kinds = sorted({c.layout for ckpt in answer.run.checkpoints for c in ckpt.components}) or [answer.run.layout]
        raise click.UsageError(f"--print tag: {answer.run.path} is a {' + '.join(kinds)} run, not a DeepSpeed one")
    tag = answer.tag
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
                "tag": tag,
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
        click.echo(tag if what == "tag" else g.chosen.path)
    if verified:
        _say_what_was_read(answer, max_age_ns)
    if g.chosen is None:
        click.echo(f"ckpt-audit: {g.reason}", err=True)
    ctx.exit(int(code))


def _say_what_was_read(answer, max_age_ns: int) -> None:
    """stderr: each checkpoint read by content for this answer and what it was found to be, or when the answer
    was last read if a read within --max-age stood for it."""
    import time

    from ckpt_audit.models import format_size
    from ckpt_audit.units import format_ago, format_duration, format_utc

    passed = {p.path: p for p in answer.gate.passed_over}
    for c in sorted((c for c in answer.run.checkpoints if c.path in answer.reread), key=lambda c: -c.step):
        p = passed.get(c.path)
        verdict = "good, the answer" if p is None else f"{p.status} ({', '.join(p.reasons[:3])}): passed over"
        click.echo(
            f"ckpt-audit: read step {c.step} by content just now ({len(c.all_files)} file(s), "
            f"{format_size(c.size_bytes)}): {verdict}",
            err=True,
        )
    chosen = answer.gate.chosen
    if chosen is not None and chosen.path not in answer.reread and answer.verified_ns is not None:
        why = f"within --max-age {format_duration(max_age_ns)}" if max_age_ns else "by this call's scan"
        click.echo(
            f"ckpt-audit: step {chosen.step} last read by content at {format_utc(answer.verified_ns)} "
            f"({format_ago(answer.verified_ns, time.time_ns())}), {why}: not re-read",
            err=True,
        )
