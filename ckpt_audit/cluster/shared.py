"""Shared placement: one shared root (Lustre, GPFS, NFS) seen by every node; the files a scan must read are
split over the alive nodes, so many clients read the store at once (docs/ray.md).

Only the reads move. The driver runs the local scan itself (`scan.scan` with `reader=RayReader(...)`): its walk,
the catalog reuse, the scrub, the focus and the reduce are the local scan's, and each node calls the local
`scan.read_file` on its share with the driver's stat. So the catalog is the local scan's by construction.

A file is the smallest share: its hash is one xxh3-128 stream over the whole file, and xxh3 states of byte ranges
cannot be combined into the whole file's hash (CRC-32 could be, the hash cannot); splitting a file would need a
different hash (a tree of chunk hashes), which changes every catalogued hash and manifest. Balance does not need
it: a checkpoint of W ranks has about 3W files, so a node's share is many files, and one file larger than a fair
share is read by one node at one client's rate, no slower than a local scan.

A node that does not see a file as the driver's walk did (missing, or another size, mtime or inode: not the same
file), or that fails, hands its files back and the driver reads them itself: a wrong guess of the placement costs
time, never a verdict.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ckpt_audit.models import FileKind, ShardFile
from ckpt_audit.readers.pool import map_unordered
from ckpt_audit.scan import read_all, read_file
from ckpt_audit.tree import FileFacts

from .noderoots import ENV, parse_node_roots

# Network filesystems whose files every client sees alike (the fs type column of /proc/mounts).
NETWORK_FS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "ceph",
        "fuse.ceph-fuse",
        "beegfs",
        "glusterfs",
        "fuse.glusterfs",
        "panfs",
        "wekafs",
        "fuse.juicefs",
        "orangefs",
        "pvfs2",
        "cifs",
        "smb3",
    }
)
FILE_COST_BYTES = 64 * 1024  # a file's fixed cost (open, stat, headers) in bytes, so many tiny files spread too
PROBE_TIMEOUT_S = 60.0


# -- planning (pure) ------------------------------------------------------------------------------------------


def plan_files(sizes: Mapping[str, int], nodes: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each node's share of the files (path -> bytes): largest first onto the least-loaded node, so no node ends
    more than one file above the mean. Pure; every path lands on exactly one node."""
    if not nodes:
        return {}
    heap = [(0, i) for i in range(len(nodes))]
    shares: list[list[str]] = [[] for _ in nodes]
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        load, i = heapq.heappop(heap)
        shares[i].append(path)
        heapq.heappush(heap, (load + sizes[path] + FILE_COST_BYTES, i))
    return {n: tuple(s) for n, s in zip(nodes, shares)}


def mount_fstype(path: str, mounts: str) -> str | None:
    """The fs type of the mount holding `path`, from /proc/mounts' text (the longest mount point above it)."""
    best, kind = -1, None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        above = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        if above and len(point) >= best:  # the longest mount point; equal: the later line is mounted on top
            best, kind = len(point), parts[2]
    return kind


@dataclass(frozen=True, slots=True)
class RootView:
    """How one machine sees a root: its fs type and the root directory's inode and mtime."""

    fstype: str | None
    inode: int
    mtime_ns: int


def choose_placement(driver: Mapping[str, RootView | None], nodes: Mapping[str, Mapping[str, RootView | None]]) -> str:
    """`auto`'s choice: "shared" only when every root is on a network filesystem for the driver and every alive
    node answered and sees the very same root directory (fs type, inode and mtime); else "node-local".

    Wrong either way costs time, not a verdict: node-local on a shared root has every node read every file (the
    union is the same tree); shared where a node sees other files hands them back to the driver (RayReader)."""
    if not driver or not nodes:
        return "node-local"
    for root, view in driver.items():
        if view is None or view.fstype not in NETWORK_FS:
            return "node-local"
        if any(seen.get(root) != view for seen in nodes.values()):
            return "node-local"
    return "shared"


def root_view(root: str, mounts: str | None = None) -> RootView | None:
    """This machine's RootView of `root` (None: it has no such directory)."""
    try:
        st = os.stat(root)
        if mounts is None:
            with open("/proc/mounts", encoding="utf-8", errors="replace") as fh:
                mounts = fh.read()
    except OSError:
        return None
    return RootView(fstype=mount_fstype(os.path.realpath(root), mounts), inode=st.st_ino, mtime_ns=st.st_mtime_ns)


# -- the node's side ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadJob:
    """One file for a node to read, with what the driver's walk and catalog know of it."""

    path: str
    st: os.stat_result
    prev: FileFacts | ShardFile | None
    kind: FileKind


@dataclass(frozen=True, slots=True)
class ShareAnswer:
    """A node's answer: the facts of the files it read, and those it handed back (it did not see them as the
    driver's walk did)."""

    node_id: str
    facts: dict[str, FileFacts]
    unseen: tuple[str, ...] = ()


def _local(path: str, mapping: Mapping[str, str]) -> tuple[str, str]:
    """(this node's path for logical `path`, the logical root it sits under or "")."""
    for logical in sorted(mapping, key=len, reverse=True):
        if path.startswith(logical + "/"):
            return mapping[logical] + path[len(logical) :], logical
    return path, ""


def _as_logical(f: FileFacts, local: str, logical: str) -> FileFacts:
    if local == logical:
        return f
    return replace(
        f, path=logical, findings=tuple(replace(x, path=logical) if x.path == local else x for x in f.findings)
    )


def read_share(jobs: Sequence[ReadJob], node_id: str, *, workers: int, now_ns: int) -> ShareAnswer:
    """The task body (on the node): read each file with the local scan's read_file and the driver's stat."""
    mapping = parse_node_roots(os.environ.get(ENV), node_id=node_id)
    mine: list[tuple[ReadJob, str]] = []
    unseen: list[str] = []
    for job in jobs:
        local, _ = _local(job.path, mapping)
        try:
            st = os.stat(local)
        except OSError:
            unseen.append(job.path)
            continue
        if (st.st_size, st.st_mtime_ns, st.st_ino) != (job.st.st_size, job.st.st_mtime_ns, job.st.st_ino):
            unseen.append(job.path)  # not the file the driver walked: the driver reads it
        else:
            mine.append((job, local))

    def one(item: tuple[ReadJob, str]) -> FileFacts:
        job, local = item
        return _as_logical(read_file(local, job.st, job.prev, kind=job.kind, now_ns=now_ns), local, job.path)

    facts = {job.path: f for (job, _), f in map_unordered(one, mine, workers=workers, name="ckpt-share")}
    return ShareAnswer(node_id=node_id, facts=facts, unseen=tuple(unseen))


# -- the driver's side ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class NodeTally:
    """What one node did over the whole scan (every root)."""

    files: int = 0
    bytes: int = 0
    handed_back: int = 0
    failed: bool = False


@dataclass(slots=True)
class RayReader:
    """A scan.Reader that reads each root's files on the cluster's nodes (plan_files), pinned one task per node
    per root; files a node handed back or a failed node's share are read here, after the others."""

    nodes: Sequence[str]
    tally: dict[str, NodeTally] = field(default_factory=dict)
    read_here: int = 0

    def __call__(
        self,
        paths: Sequence[str],
        stats: Mapping[str, os.stat_result],
        previous: Mapping,
        kinds: Mapping[str, FileKind],
        *,
        workers: int,
        now_ns: int,
    ) -> Iterator[tuple[str, FileFacts]]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

        from .connect import import_ray  # noqa: PLC0415

        ray = import_ray()
        plan = plan_files({p: stats[p].st_size for p in paths}, self.nodes)
        task = ray.remote(num_cpus=0, max_retries=0)(read_share)
        refs = {}
        for node, share in plan.items():
            if share:
                jobs = [ReadJob(path=p, st=stats[p], prev=previous.get(p), kind=kinds[p]) for p in share]
                pinned = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
                refs[pinned.remote(jobs, node, workers=workers, now_ns=now_ns)] = node
        here: list[str] = [] if plan else list(paths)  # no alive node: this process reads everything
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            node = refs[ready[0]]
            t = self.tally.setdefault(node, NodeTally())
            try:
                answer = ray.get(ready[0])
            except Exception:  # noqa: BLE001 - a dead node or a lost task: its share is read here instead
                t.failed = True
                here.extend(plan[node])
                continue
            asked = set(plan[node])
            mine = {p: f for p, f in answer.facts.items() if p in asked}
            t.files += len(mine)
            t.bytes += sum(f.size_bytes for f in mine.values())
            t.handed_back += len(asked) - len(mine)
            here.extend(asked.difference(mine))  # handed back (or, by a bug, left out): never lost
            yield from mine.items()
        self.read_here += len(here)
        yield from read_all(sorted(here), stats, previous, kinds, workers=workers, now_ns=now_ns)


def alive_nodes(ray) -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def probe_views(ray, nodes: Sequence[str], roots: Sequence[str]) -> dict[str, dict[str, RootView | None]]:
    """Each alive node's RootView of each root (its CKPT_AUDIT_NODE_ROOTS copy, if it maps one); a node that does
    not answer within PROBE_TIMEOUT_S is left out (choose_placement then says node-local)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    task = ray.remote(num_cpus=0, max_retries=0)(_views_here)
    refs = {
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote(
            list(roots), n
        ): n
        for n in nodes
    }
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    out: dict[str, dict[str, RootView | None]] = {}
    for ref in ready:
        try:
            out[refs[ref]] = ray.get(ref)
        except Exception:  # noqa: BLE001 - a node that fails the probe is not counted as agreeing
            continue
    return out if len(out) == len(nodes) else {}


def _views_here(roots: Sequence[str], node_id: str) -> dict[str, RootView | None]:
    mapping = parse_node_roots(os.environ.get(ENV), node_id=node_id)
    return {r: root_view(mapping.get(r, r)) for r in roots}


def resolve_placement(ray, placement: str, roots: Sequence[str]) -> tuple[str, list[str]]:
    """(the placement to use, the alive nodes). `auto` probes only when the driver sees every root on a network
    filesystem (otherwise it is node-local without asking the nodes)."""
    nodes = alive_nodes(ray)
    if placement != "auto":
        return placement, nodes
    driver = {r: root_view(r) for r in roots}
    if any(v is None or v.fstype not in NETWORK_FS for v in driver.values()):
        return "node-local", nodes
    return choose_placement(driver, probe_views(ray, nodes, roots)), nodes
