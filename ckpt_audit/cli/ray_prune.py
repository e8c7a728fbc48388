"""prune --ray: plan over the union of a Ray cluster's node-local disks, execute on the nodes
(ckpt_audit.session.cluster)."""

from __future__ import annotations

import click

from ckpt_audit.cli.common import CommandError
from ckpt_audit.exitcodes import ExitCode


def connect(ctx: click.Context, address: str) -> None:
    """Before the catalog is touched: without the extra one line, exit 2; the cluster unreachable one line, exit 3."""
    from ckpt_audit.session import SessionError
    from ckpt_audit.session.cluster import RayUnavailable, connect_ray

    try:
        connect_ray(address)
    except RayUnavailable as exc:
        click.echo(f"ckpt-audit: prune {exc}", err=True)
        ctx.exit(int(ExitCode.USAGE))
    except SessionError as exc:
        raise CommandError(str(exc)) from None


def report_nodes(cluster) -> None:
    """After execution: the nodes that did not answer and what they leave partly pruned (stderr)."""
    ran = cluster.last
    if ran is None:
        return
    for node in ran.silent:
        why = f": {cluster.errors[node]}" if node in cluster.errors else ""
        click.echo(f"ckpt-audit: node {node} did not answer the prune{why}", err=True)
    for path in ran.partly:
        click.echo(f"ckpt-audit: partly pruned (the next prune --ray finishes it): {path}", err=True)
