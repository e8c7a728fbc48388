"""scan --ray: the node-local placement on a Ray cluster (ckpt_audit.session.cluster), recorded and rendered as a
scan."""

from __future__ import annotations

import os

import click

from ckpt_audit.cli.common import (
    CommandError,
    check_junit_writable,
    emit_json,
    session,
    write_junit_report,
    write_metrics_file,
)
from ckpt_audit.exitcodes import ExitCode


def run_ray_scan(
    ctx: click.Context,
    roots,
    *,
    address: str,
    as_json: bool,
    quiet: bool,
    fail_on: str,
    in_progress_window: float,
    catalog,
    workers: int = 1,
    rehash: bool = False,
    deep: bool = False,
    scrub=None,
    metrics_file=None,
    gone_after_ns: int | None = None,
    junit_xml: str | None = None,
    **_ignored,
) -> None:
    """Map on every alive node (each reusing the catalog's facts about its own copies), reduce here, judge over
    the union, record which node holds what. Without Ray, or with --deep: one line, exit 2."""
    from ckpt_audit import report
    from ckpt_audit.session import SessionError
    from ckpt_audit.session.cluster import RayUnavailable, connect_ray, scan_on_cluster

    if deep:
        click.echo(f"ckpt-audit: {DEEP_REFUSED}", err=True)
        ctx.exit(int(ExitCode.USAGE))
    try:
        connect_ray(address)
    except RayUnavailable as exc:
        click.echo(f"ckpt-audit: {ctx.info_name} {exc}", err=True)
        ctx.exit(int(ExitCode.USAGE))
    except SessionError as exc:
        raise CommandError(str(exc)) from None
    check_junit_writable(junit_xml)
    threshold = report.FAIL_ON[fail_on]
    with session(ctx, roots, catalog) as s:
        recorded = scan_on_cluster(
            s,
            roots,
            address=address,
            in_progress_window_s=in_progress_window,
            workers=workers,
            rehash=rehash,
            scrub=scrub,
            gone_after_s=None if gone_after_ns is None else gone_after_ns / 1e9,
        )
    result, scan_id = recorded.result, recorded.scan_id
    if metrics_file is not None:
        write_metrics_file(metrics_file, result, scrub)
    code = ExitCode.FINDINGS if report.failing(result, threshold) else ExitCode.OK
    if junit_xml is not None:
        from ckpt_audit.report_junit import scan_suite

        write_junit_report(junit_xml, [scan_suite(result, threshold, name=ctx.info_name or "scan")])
    if as_json:
        doc = report.scan_document(result, scan_id=scan_id, catalog=os.fspath(s.catalog_path), exit_code=int(code))
        emit_json({**doc, "command": ctx.info_name, "deep": False, "ray": True})
    else:
        for line in report.render_text(result, quiet=quiet, fail_on=threshold):
            click.echo(line)
    ctx.exit(int(code))


DEEP_REFUSED = "scan --ray --deep is not supported: run `ckpt-audit verify` on each node (docs/ray.md)"
