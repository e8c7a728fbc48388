"""Shared placement: one shared root (Lustre, GPFS, NFS) seen by every node; its runs are split over the alive
nodes so many clients read at once. The driver lists the runs with a stat-only walk and balances them by bytes
(largest first onto the least-loaded node); each node runs `scanner.scan_partial` on its runs; the driver
reduces the partials with the local scan's reduce. Not split below a run: no byte ranges of a file."""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_audit.layouts import load_layouts
from ckpt_audit.scanner import scan_partial, walk

from .noderoots import NodePartials
from .ray_scan import import_ray


def plan_runs(root: str, n_nodes: int) -> list[list[str]]:
    """Pure over one stat walk: the run directories under `root`, balanced by bytes over `n_nodes` buckets."""
    tree, stats, _ = walk(root)
    runs = sorted({d for layout in load_layouts() for d in layout.find_runs(tree)})
    sizes = {r: sum(stats[p].st_size for p in tree.files_below(r) if p in stats) for r in runs}
    buckets: list[list[str]] = [[] for _ in range(max(1, n_nodes))]
    load = [0] * len(buckets)
    for r in sorted(runs, key=lambda r: (-sizes[r], r)):
        i = load.index(min(load))
        buckets[i].append(r)
        load[i] += sizes[r]
    return buckets


def scan_runs(runs: Sequence[str], node_id: str) -> NodePartials:
    layouts = load_layouts()
    return NodePartials(node_id=node_id, partials=tuple(scan_partial(r, workers=1, layouts=layouts) for r in runs))


def shared_map(root: str, *, address: str | None = None) -> tuple[list[NodePartials], list[list[str]]]:
    """One pinned task per alive node over its share of `root`'s runs; returns the answers and the plan."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    plan = plan_runs(root, len(nodes))
    task = ray.remote(num_cpus=0)(scan_runs)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote(runs, n)
        for n, runs in zip(nodes, plan)
        if runs
    ]
    return list(ray.get(refs)), plan
