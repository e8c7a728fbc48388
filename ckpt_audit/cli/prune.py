"""`ckpt-audit prune`: scan, plan by policy, show the plan, delete only when told to (crash-safe)."""

from __future__ import annotations

import sys
import time

import click

from ckpt_audit.cli.common import DURATION, catalog_option, emit_json, ray_option, session
from ckpt_audit.exitcodes import ExitCode


@click.command("prune")
@click.argument("roots", nargs=-1, required=True, type=click.Path())  # a str: an s3:// URL stays whole
@click.option(
    "--keep-last", type=click.IntRange(0), metavar="N", help="Keep the last N complete checkpoints of each run."
)
@click.option(
    "--keep-every", type=click.IntRange(1), metavar="K", help="Keep checkpoints whose step is a multiple of K."
)
@click.option(
    "--keep-within", type=DURATION, metavar="DURATION", help="Keep checkpoints newer than this (90m, 36h, 7d, 2w)."
)
@click.option(
    "--keep-best",
    type=click.IntRange(0),
    metavar="N",
    help="Keep the best N by --metric from the run's metrics JSONL (OpenRLHF: each tag's metric.json).",
)
@click.option("--metric", default="loss", show_default=True, help="Metric for --keep-best.")
@click.option(
    "--mode", type=click.Choice(["min", "max"]), default="min", show_default=True, help="Best is lowest or highest."
)
@click.option(
    "--pin",
    "pins",
    multiple=True,
    type=click.Path(),
    metavar="STEP_DIR",
    help="Never delete this checkpoint (repeatable).",
)
@click.option(
    "--stale-after",
    type=DURATION,
    default="1h",
    show_default=True,
    metavar="DURATION",
    help="An uncommitted checkpoint older than this is abandoned and removed.",
)
@click.option("--dry-run", is_flag=True, help="Show the plan and exit 0 without deleting or asking.")
@click.option("-y", "--yes", is_flag=True, help="Delete without asking (cron).")
@click.option(
    "--read-data",
    is_flag=True,
    help="s3:// roots: read every object by content (download) for the plan and the survivor re-read, instead of "
    "by store checksum (docs/remote.md).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (plan and outcome) to stdout.")
@ray_option(
    "Plan over the union of a Ray cluster's node-local disks and delete on the nodes holding each checkpoint "
    "(docs/ray.md; needs the extra: pip install 'ckpt-audit[ray]', else exit 2)."
)
@catalog_option
@click.pass_context
def prune_command(
    ctx,
    roots,
    keep_last,
    keep_every,
    keep_within,
    keep_best,
    metric,
    mode,
    pins,
    stale_after,
    dry_run,
    yes,
    read_data,
    as_json,
    ray_address,
    catalog,
) -> None:
    """Delete checkpoints no keep rule wants, never the last good one.

    A checkpoint is kept if ANY rule keeps it. Incomplete, corrupt, husk and abandoned uncommitted directories
    go first and never count toward N. Never deleted, whatever the rules: the newest complete checkpoint of
    each run, the tracker's target, pinned and in-progress checkpoints. With no --keep-* rule only broken
    checkpoints go. Each checkpoint is first renamed to .ckpt-audit-trash-* (out of the trainer's sight), then
    removed; trash left by an interrupted prune is removed by the next one. Executed plans are logged in the
    catalog with every reason.

    Deletion needs evidence: a checkpoint with anything unreadable inside, one being written (a fresh, even
    empty, step directory), and whole checkpoints newer than a lagging tracker are kept. Before deleting in a
    run, its newest complete checkpoint and the tracker's target are re-read in full (hash and CRC against the
    scan, whatever the stat says); one that fails is marked corrupt and the plan recomputed before anything
    goes. --keep-best with a --metric no record has, or a run without a metrics log, is a usage error.

    Without --yes the plan is shown and you are asked; when stdin is not a terminal prune refuses (exit 2).

    s3:// roots (docs/remote.md): the same plan; survivors re-read by store checksum (--read-data: by content);
    each step's prefix listed again, then exactly its listed objects deleted one by one, a rank shard first, so
    that an interrupted prune leaves it incomplete.

    Exit codes: 0 done (or nothing to do, or --dry-run), 1 a checkpoint the plan counted on failed its
    re-read (plan recomputed), 2 usage (or refused to prompt), 3 error (bad root or catalog, or a deletion
    failed), 4 another run holds the catalog lock, 130 interrupted.

    \b
    Example:
        ckpt-audit prune /ckpts --keep-last 3 --dry-run
        ckpt-audit prune /ckpts --keep-last 2 --keep-every 1000 --keep-best 1 --metric loss --yes
        ckpt-audit prune runs/ --keep-within 7d --pin runs/p/e/global_step_500 --json --yes
        ckpt-audit prune s3://bucket/ckpts --keep-last 5 --yes
    """
    from ckpt_audit.session import PlanError
    from ckpt_audit.session.stores import is_remote
    from ckpt_audit.session.terms import KeepBest, KeepEvery, KeepLast, KeepWithin, Policy

    if any(is_remote(r) for r in roots) and (ray_address is not None or not all(is_remote(r) for r in roots)):
        raise click.UsageError("s3:// roots are pruned on their own: not with local roots, not with --ray")
    if read_data and not is_remote(roots[0]):
        raise click.UsageError("--read-data is for s3:// roots (a local prune re-reads by content already)")

    rules: list = []
    if keep_last is not None:
        rules.append(KeepLast(n=keep_last))
    if keep_every is not None:
        rules.append(KeepEvery(k=keep_every))
    if keep_within is not None:
        rules.append(KeepWithin(duration_ns=keep_within))
    if keep_best is not None:
        rules.append(KeepBest(n=keep_best, metric=metric, mode=mode))  # the session reads the metric's values
    policy = Policy(rules=tuple(rules), stale_after_ns=stale_after)
    if ray_address is not None:
        from ckpt_audit.cli.ray_prune import connect, report_nodes
        from ckpt_audit.session.cluster import plan_prune_on_cluster

        connect(ctx, ray_address)

    with session(ctx, roots, catalog) as s:
        try:
            # the preview is checked for a person to read (--dry-run, the prompt); --yes reads once, just before acting
            check = dry_run or not yes
            if is_remote(roots[0]):
                from ckpt_audit.session.stores import plan_prune_remote

                preview = plan_prune_remote(
                    s, policy, pins=pins, now_ns=time.time_ns(), check=check, read_data=read_data
                )
            elif ray_address is not None:
                preview = plan_prune_on_cluster(
                    s, roots, policy, pins=pins, address=ray_address, now_ns=time.time_ns(), check=check
                )
            else:
                preview = s.plan_prune(policy, pins=pins, now_ns=time.time_ns(), check=check)
        except PlanError as exc:
            raise click.UsageError(str(exc)) from None
        roots, plan, trash = list(s.roots), preview.plan, list(preview.trash)
        cluster = preview.executor if ray_address is not None else None  # the Ray nodes, reported after the prune
        if not as_json:
            _render_plan(plan, trash)
            _render_check(preview.check, "" if preview.checked else "immediately before the first deletion")
            if preview.checked and not dry_run:
                click.echo("  (read again after you confirm, immediately before the first deletion)")
        if (plan.empty and not trash) or dry_run:
            _finish(ctx, as_json, preview.check, trash, None, roots=roots, cluster=cluster)
        if not yes:
            if not sys.stdin.isatty():
                if as_json:
                    emit_json(_document(preview.check, trash, None, roots, cluster))
                click.echo(
                    "ckpt-audit: refusing to prompt: stdin is not a terminal; re-run with --yes to "
                    "delete, or --dry-run to only show the plan",
                    err=True,
                )
                ctx.exit(int(ExitCode.USAGE))
            if not click.confirm(
                f"Delete {len(plan.delete)} checkpoint(s) and {len(trash)} leftover(s)?", default=False, err=True
            ):
                click.echo("nothing deleted", err=True)
                ctx.exit(int(ExitCode.OK))
        done = s.prune(preview, confirmed=not yes, progress=None if as_json else _progress)
    check, outcome = done.check, done.result
    if not as_json:
        _render_check(check, "just now, " + ("immediately before the first deletion" if yes else "after confirmation"))
        if check.failed and outcome is not None:
            click.echo("plan recomputed after the failed re-read; executed:")
            _render_plan(check.plan, trash)
        elif outcome is None:
            failed = ", ".join(f"step {r.checkpoint.step} is now {r.status}" for r in check.failed)
            click.echo(
                f"nothing deleted: the plan you confirmed counted on what failed its re-read after confirmation "
                f"({failed}); run prune again to review the new plan",
                err=True,
            )
    if cluster is not None:
        report_nodes(cluster)
    _finish(ctx, as_json, check, trash, outcome, roots=roots, cluster=cluster)


def _finish(ctx, as_json, check, trash, outcome, *, roots, cluster=None) -> None:
    from ckpt_audit.models import format_size
    from ckpt_audit.session.terms import Action

    if as_json:
        emit_json(_document(check, trash, outcome, roots, cluster))
    elif outcome is not None:
        click.echo(
            f"deleted {outcome.count(Action.DELETED)}, reclaimed {outcome.count(Action.RECLAIMED)}, "
            f"skipped {outcome.count(Action.SKIPPED)}, failed {outcome.count(Action.FAILED)}; "
            f"freed {format_size(outcome.bytes_freed)}, re-read {format_size(check.bytes_reread)} "
            f"(execution {outcome.exec_id})"
        )
    if outcome is not None and not outcome.ok:
        ctx.exit(int(ExitCode.ERROR))
    ctx.exit(int(ExitCode.FINDINGS if check.failed else ExitCode.OK))


def _document(check, trash, outcome, roots, cluster=None) -> dict:
    extra = {} if cluster is None else {"ray": cluster.document()}  # prune --ray: nodes, partly pruned
    return {
        "command": "prune",
        "roots": list(roots),
        "plan": check.plan.to_dict(),
        "survivors": check.to_dict(),
        "trash": [{"path": t.path, "original_name": t.original_name, "exec_id": t.exec_id} for t in trash],
        "executed": outcome is not None,
        "result": outcome.to_dict() if outcome is not None else None,
        **extra,
    }


def _render_plan(plan, trash) -> None:
    from ckpt_audit.models import format_size
    from ckpt_audit.session.terms import EXPLAIN

    click.echo(f"policy: {plan.policy.describe()}")
    rows = [("DELETE", i) for i in plan.delete] + [("keep", i) for i in plan.keep]
    rows.sort(key=lambda r: (r[1].run_path, r[1].step))
    for what, item in rows:
        name = "/".join(item.run_path.rstrip("/").split("/")[-2:])
        why = ", ".join(str(r) for r in item.reasons) + "".join(f" <- {link}" for link in item.linked_from)
        click.echo(
            f"  {what:<6} {name:<32} step {item.step:>8}  {str(item.checkpoint.status):<11} "
            f"{format_size(item.size_bytes):>10}  {why}"
        )
    for r in plan.refused:
        click.echo(f"  refused {r.path}: {', '.join(EXPLAIN[x] for x in r.reasons)}")
    for t in trash:
        click.echo(f"  RECLAIM {t.path} (left by interrupted prune {t.exec_id})")
    click.echo(
        f"frees {format_size(plan.bytes_freed)} in {len(plan.delete)} checkpoint(s); keeps "
        f"{format_size(plan.bytes_kept)} in {len(plan.keep)}"
        + (f"; {len(trash)} leftover trash dir(s)" if trash else "")
    )


def _render_check(check, when: str) -> None:
    """The survivor check's line (what was re-read, when, the verdict) and each failure; with no re-read yet and
    a `when`, when it will happen."""
    if not check.rereads and when and not check.plan.empty:
        click.echo(f"survivor check: what the plan counts on is re-read {when}")
        return
    click.echo(check.describe(when))
    for r in check.failed:
        click.echo(f"  FAILED re-read: step {r.checkpoint.step} of {r.checkpoint.run_path} is now {r.status}")
        for f in r.findings:
            click.echo(f"    {f.code}: {f.path}: {f.message}")


def _progress(_done: int, _total: int, line: str = "", /) -> None:
    click.echo(line, err=True)  # each outcome's line, as it happens
