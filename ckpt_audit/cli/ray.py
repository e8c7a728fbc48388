"""scan --ray: the node-local placement on a Ray cluster (ckpt_audit.cluster), recorded and rendered as a scan."""

from __future__ import annotations

import os

import click

from ckpt_audit.cli.common import emit_json, session
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
    **_ignored,
) -> None:
    """Map on every alive node, reduce here, judge over the union, record. Without Ray: one line, exit 2."""
    from ckpt_audit import report
    from ckpt_audit.cluster import ray_scan

    try:
        ray_scan.import_ray()
    except ray_scan.RayUnavailable as exc:
        click.echo(f"ckpt-audit: {exc}", err=True)
        ctx.exit(int(ExitCode.USAGE))
    threshold = report.FAIL_ON[fail_on]
    logical = [os.path.abspath(os.fspath(r)) for r in roots]
    with session(ctx, roots, catalog) as s:
        result = ray_scan.scan_cluster(logical, address=address, in_progress_window_s=in_progress_window)
        scan_id = s.record(result)
    code = ExitCode.FINDINGS if report.failing(result, threshold) else ExitCode.OK
    if as_json:
        doc = report.scan_document(result, scan_id=scan_id, catalog=os.fspath(s.catalog_path), exit_code=int(code))
        emit_json({**doc, "command": ctx.info_name, "deep": False, "ray": True})
    else:
        for line in report.render_text(result, quiet=quiet, fail_on=threshold):
            click.echo(line)
    ctx.exit(int(code))
