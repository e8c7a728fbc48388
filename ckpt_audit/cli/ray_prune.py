"""prune --ray: plan over the union of a Ray cluster's node-local disks, execute on the nodes
(ckpt_audit.session.cluster)."""

from __future__ import annotations

import click

from ckpt_audit.exitcodes import ExitCode


def require_ray(ctx: click.Context) -> None:
    """Without the extra: one line, exit 2 (before the catalog is touched)."""
    from ckpt_audit.session.cluster import RayUnavailable, require_ray

    try:
        require_ray()
    except RayUnavailable:
        click.echo("ckpt-audit: prune --ray needs the optional extra: pip install 'ckpt-audit[ray]'", err=True)
        ctx.exit(int(ExitCode.USAGE))


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
