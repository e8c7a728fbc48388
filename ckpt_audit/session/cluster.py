"""scan --ray, prune --ray and export --ray through the session: ckpt_audit.cluster places the reads, deletions and
export shards on a Ray cluster's nodes, and the session injects it as the scan's reader, the prune's re-reader and
executor, and the export's writer of output files.

Ray is imported only here, and only when a command asks for it: front ends call `connect_ray` before they open the
catalog, so that a missing extra (exit 2) or a cluster nobody answers (exit 3) is one line and touches nothing.
The logical roots are spelled as scan --ray spells them (absolute, links not
resolved): CKPT_AUDIT_NODE_ROOTS and the catalog's node memory are keyed by them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ckpt_audit.models import IN_PROGRESS_WINDOW_S
from ckpt_audit.session.core import Session, SessionError, StrPath

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from ckpt_audit.answers import PrunePreview, Recorded
    from ckpt_audit.catalog.node_memory import NodeMemory
    from ckpt_audit.cluster.shared import RayReader
    from ckpt_audit.lifecycle.retention import Policy
    from ckpt_audit.scan.scrub import ScrubPolicy


class RayUnavailable(Exception):
    """The optional Ray extra is not installed (or cannot start): a usage error (exit 2)."""


def is_ray_address(value: str) -> bool:
    """Whether a front end's --ray value names a cluster: "auto", HOST:PORT or ray://HOST:PORT (cluster.connect's
    host_port, the same parse the connection uses)."""
    from ckpt_audit.cluster.connect import host_port

    return value == "auto" or host_port(value) is not None


def connect_ray(address: str | None):
    """The ray module, connected to `address`; front ends call it before they open the catalog. Raises
    RayUnavailable (one line to show after the command's name), or SessionError where the cluster cannot be reached
    (one line, at once: not after Ray's minutes of retries)."""
    from ckpt_audit.cluster import connect

    try:
        return connect.connect(address)
    except connect.RayUnavailable as exc:
        raise RayUnavailable(str(exc)) from None
    except connect.RayConnectError as exc:
        raise SessionError(str(exc)) from None


def scan_on_cluster(
    s: Session,
    roots: Iterable[str | Path],
    *,
    address: str,
    in_progress_window_s: float = IN_PROGRESS_WINDOW_S,
    workers: int = 1,
    rehash: bool = False,
    scrub: ScrubPolicy | None = None,
    gone_after_s: float | None = None,
) -> Recorded:
    """The node-local placement: map on every alive node (each reusing the catalog's facts about its own copies),
    reduce here, judge over the union, record which node holds what."""
    from ckpt_audit.answers import Recorded
    from ckpt_audit.cluster import ray_scan

    connect_ray(address)
    result = ray_scan.scan_cluster(
        _logical(roots),
        address=address,
        in_progress_window_s=in_progress_window_s,
        options=ray_scan.NodeScanOptions(workers=workers, rehash=rehash, scrub=scrub),
        memory=node_memory(s.catalog_path),
        gone_after_s=ray_scan.DEFAULT_GONE_AFTER_S if gone_after_s is None else gone_after_s,
        deep=s.kept_deep(),
    )
    return Recorded(result=result, scan_id=s.record(result, rehash=rehash))


def plan_prune_on_cluster(
    s: Session,
    roots: Iterable[str | Path],
    policy: Policy,
    *,
    pins: Iterable[str] = (),
    address: str,
    now_ns: int,
    check: bool = True,
) -> PrunePreview:
    """Session.plan_prune over the node-local scan of `roots`, judged over the union (silent nodes protect what
    they may hold), with the cluster as re-reader and executor and each node's trash; hand it back to
    Session.prune as any preview. `preview.executor` is the cluster handle (cluster.ray_prune.Cluster: after
    execution, `last` says which nodes did not answer and what they left partly pruned)."""
    from ckpt_audit.cluster import ray_prune, ray_scan

    logical = _logical(roots)
    memory = node_memory(s.catalog_path)
    connect_ray(address)
    scanned = ray_scan.scan_cluster(
        logical,
        address=address,
        in_progress_window_s=IN_PROGRESS_WINDOW_S,
        memory=memory,
        now_ns=now_ns,
        deep=s.kept_deep(),
    )
    known = set(memory.last_answered_ns) | set(memory.facts)
    scanned = ray_prune.protect_silent(scanned, ray_scan.held_before(memory, logical), known)
    cluster = ray_prune.Cluster(logical, scanned)
    preview = s.plan_prune(policy, pins=pins, now_ns=now_ns, scanned=scanned, executor=cluster, check=check)
    trash, _seen = cluster.trash(preview.plan)
    return dataclasses.replace(preview, trash=tuple(trash))


def shared_reader(roots: Sequence[str | Path], *, address: str, placement: str) -> RayReader | None:
    """The reader of scan --ray's shared placement (each shared root's files read on every alive node), or None
    when `placement` is or resolves to node-local. Raises RayUnavailable or SessionError."""
    from ckpt_audit.cluster import shared

    ray = connect_ray(address)
    logical = [os.path.realpath(os.path.abspath(os.fspath(r))) for r in roots]
    chosen, nodes = shared.resolve_placement(ray, placement, logical)
    return shared.RayReader(nodes=nodes) if chosen == "shared" else None


def export_runner(address: str, *, jobs: int | None):
    """export --ray's writer of output files (cluster.ray_export.RayFiles), connected to `address`: hand it to
    Session.export as `run_files`. `jobs`: most shard tasks at once (None: Ray's CPUs decide). Raises RayUnavailable
    (the extra is missing) or SessionError (the cluster cannot be reached)."""
    from ckpt_audit.cluster import ray_export

    connect_ray(address)
    return ray_export.RayFiles(jobs=jobs)


def node_memory(catalog_path: StrPath | None) -> NodeMemory:
    """What the catalog knows of each node's copies (none without a catalog). Raises SessionError."""
    from ckpt_audit.catalog.manifest import CatalogError
    from ckpt_audit.catalog.node_memory import NodeMemory, read_nodes

    if catalog_path is None:
        return NodeMemory(facts={}, last_answered_ns={})
    try:
        return read_nodes(catalog_path)
    except CatalogError as exc:
        raise SessionError(str(exc)) from None


def _logical(roots: Iterable[str | Path]) -> list[str]:
    return [os.path.abspath(os.fspath(r)) for r in roots]
