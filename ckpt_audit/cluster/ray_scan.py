"""Node-local placement on Ray: one map task per alive node, pinned to it, scanning that node's copy of each root.

Ray is imported inside the functions only (the cron path without --ray never loads it). Each task runs exactly
`scanner.scan_partial` on the node's directory (noderoots: CKPT_AUDIT_NODE_ROOTS) and rebases the partial onto the
logical root; the driver reduces the partials with `scanner.reduce`, so completeness is judged over the union.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

from ckpt_audit.layouts import ScanContext, load_layouts
from ckpt_audit.models import ScanResult
from ckpt_audit.scanner import reduce, scan_partial

from .noderoots import ENV, NodePartials, parse_node_roots, rebase

RAY_MISSING = "scan --ray needs the optional extra: pip install 'ckpt-audit[ray]'"


class RayUnavailable(RuntimeError):
    """Ray is not installed: the one-line message above."""


def import_ray():
    try:
        import ray  # noqa: PLC0415 - optional extra, loaded only for --ray
    except ImportError:
        raise RayUnavailable(RAY_MISSING) from None
    return ray


def scan_on_this_node(roots: Sequence[str], node_id: str) -> NodePartials:
    """The map task body (runs on the worker): scan this node's copy of each logical root."""
    mapping = parse_node_roots(os.environ.get(ENV), node_id=node_id)
    layouts = load_layouts()
    out = []
    for root in roots:
        local = mapping.get(root, root)
        if not os.path.isdir(local):
            continue  # this node holds nothing of that root
        out.append(rebase(scan_partial(local, workers=1, layouts=layouts), local=local, logical=root))
    return NodePartials(node_id=node_id, partials=tuple(out))


def node_local_map(roots: Sequence[str], *, address: str | None = None, timeout_s: float = 600.0):
    """One pinned task per alive node; returns (answers, silent node ids)."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    task = ray.remote(num_cpus=0)(scan_on_this_node)
    listed = ray.nodes()
    nodes = [n["NodeID"] for n in listed if n.get("Alive")]
    dead = [n["NodeID"] for n in listed if not n.get("Alive")]  # died since joining: it may hold the missing ranks
    refs = {
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote(
            list(roots), n
        ): n
        for n in nodes
    }
    answers: list[NodePartials] = []
    silent: list[str] = list(dead)
    for ref, node in refs.items():
        try:
            answers.append(ray.get(ref, timeout=timeout_s))
        except Exception:  # noqa: BLE001 - a dead node, a lost task or a timeout all mean: this node did not answer
            silent.append(node)
    return answers, silent


def reduce_nodes(answers: Sequence[NodePartials], *, now_ns: int, in_progress_window_ns: int) -> ScanResult:
    """The driver's reduce over every node's partials: exactly the local scan's reduce."""
    parts = [p for a in answers for p in a.partials]
    ctx = ScanContext(now_ns=now_ns, in_progress_window_ns=in_progress_window_ns)
    return reduce(parts, ctx=ctx, layouts=load_layouts())


def scan_cluster(
    roots: Sequence[str], *, address: str | None, in_progress_window_s: float, now_ns: int | None = None
) -> ScanResult:
    """scan --ray: the node-local map, the driver's reduce and the multi-node findings, as one ScanResult."""
    import time

    from .findings import judge_nodes  # noqa: PLC0415 - findings imports this module's NodePartials

    started = time.time_ns()
    answers, silent = node_local_map(roots, address=address)
    now = now_ns if now_ns is not None else started
    reduced = reduce_nodes(answers, now_ns=now, in_progress_window_ns=int(in_progress_window_s * 1e9))
    result = judge_nodes(reduced, answers, silent)
    return replace(result, roots=tuple(roots), started_ns=started, finished_ns=time.time_ns())
