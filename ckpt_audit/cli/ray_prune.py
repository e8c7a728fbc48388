"""prune --ray: plan over the union of a Ray cluster's node-local disks, execute on the nodes (ckpt_audit.cluster)."""

from __future__ import annotations

import dataclasses
import os

import click

from ckpt_audit.exitcodes import ExitCode


def require_ray(ctx: click.Context) -> None:
    """Without the extra: one line, exit 2 (before the catalog is touched)."""
    from ckpt_audit.cluster import ray_scan

    try:
        ray_scan.import_ray()
    except ray_scan.RayUnavailable:
        click.echo("ckpt-audit: prune --ray needs the optional extra: pip install 'ckpt-audit[ray]'", err=True)
        ctx.exit(int(ExitCode.USAGE))


def plan_on_cluster(s, roots, policy, *, pins, address: str, now_ns: int, check: bool = True):
    """The node-local scan of `roots`, judged over the union (silent nodes protect what they may hold), planned
    and (`check`) survivor-checked exactly as a local prune, and each node's trash. Returns the preview and the cluster
    handle whose `execute` Session.prune runs. The logical roots are spelled as scan --ray spells them (absolute,
    links not resolved): CKPT_AUDIT_NODE_ROOTS and the catalog's node memory are keyed by them."""
    from ckpt_audit.cli.ray import _node_memory
    from ckpt_audit.cluster import ray_prune, ray_scan
    from ckpt_audit.models import IN_PROGRESS_WINDOW_S

    roots = [os.path.abspath(os.fspath(r)) for r in roots]
    memory = _node_memory(s.catalog_path)
    scanned = ray_scan.scan_cluster(
        roots,
        address=address,
        in_progress_window_s=IN_PROGRESS_WINDOW_S,
        memory=memory,
        now_ns=now_ns,
        deep=s.kept_deep(),
    )
    known = set(memory.last_answered_ns) | set(memory.facts)
    scanned = ray_prune.protect_silent(scanned, ray_scan.held_before(memory, roots), known)
    cluster = ray_prune.Cluster(roots, scanned)
    preview = s.plan_prune(policy, pins=pins, now_ns=now_ns, scanned=scanned, reread=cluster.reread, check=check)
    trash, _seen = cluster.trash(preview.plan)
    return dataclasses.replace(preview, trash=tuple(trash)), cluster


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
