"""Node-local placement on Ray: one map task per alive node, pinned to it, scanning that node's copy of each root.

Ray is imported inside the functions only (the cron path without --ray never loads it). Each task runs exactly
`scan.scan_partial` on the node's directory (noderoots: CKPT_AUDIT_NODE_ROOTS) and rebases the partial onto the
logical root; the driver reduces the partials with `scan.reduce`, so completeness is judged over the union.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ckpt_audit.catalog.node_memory import NodeMemory
from ckpt_audit.layouts import ScanContext, enclosing_step_dir, load_layouts
from ckpt_audit.models import ClusterView, FileFacts, NodeCopy, ScanResult
from ckpt_audit.scan import Caches, focus_of, only_checkpoints, reduce, scan_partial
from ckpt_audit.scan.scrub import ScrubPolicy
from ckpt_audit.tree import Partial, Tree

from .connect import connect
from .noderoots import ENV, NodePartials, local_path, parse_node_roots, rebase, rebase_facts

DEFAULT_GONE_AFTER_S = 86_400.0  # a node silent this long is gone: see findings.py and docs/ray.md


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeScanOptions:
    """What a node's scan honours of the local scan's options (--workers, --rehash, the scrub). The scrub's
    budget is per node: each node reads its own disk."""

    workers: int = 1
    rehash: bool = False
    scrub: ScrubPolicy | None = None
    now_ns: int | None = None
    focus: frozenset[str] = frozenset()  # checkpoints asked for alone (logical step dirs): scan.focus_of


HOLD_ENV = "CKPT_AUDIT_TEST_NODE_HOLD"  # test seam: a directory; unset (always, outside tests) it costs a lookup


def _hold(node_id: str) -> None:
    """Tests kill a node while its scan runs: the task says it started, then waits while `<dir>/<node>.hold`
    exists (at most a minute)."""
    where = os.environ.get(HOLD_ENV)
    if not where:
        return
    with open(os.path.join(where, f"{node_id}.started"), "w"):
        pass
    hold = os.path.join(where, f"{node_id}.hold")
    deadline = time.monotonic() + 60
    while os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.05)


def scan_on_this_node(
    roots: Sequence[str],
    node_id: str,
    previous: Mapping[str, FileFacts] | None = None,
    options: NodeScanOptions = NodeScanOptions(),
) -> NodePartials:
    """The map task body (runs on the worker): scan this node's copy of each logical root, reusing what the
    catalog knows of this node's copies (`previous`, keyed by logical path)."""
    _hold(node_id)
    mapping = parse_node_roots(os.environ.get(ENV), node_id=node_id)
    layouts = load_layouts()
    out: list = []
    focus = frozenset(local_path(mapping, f) for f in options.focus)
    for root in roots:
        local = local_path(mapping, root)
        if not os.path.isdir(local):
            continue  # this node holds nothing of that root
        scrub = options.scrub
        if scrub is not None and scrub.budget_bytes is not None:  # one budget for this node's roots together
            scrub = replace(scrub, budget_bytes=max(0, scrub.budget_bytes - sum(p.bytes_scrubbed for p in out)))
        part = scan_partial(
            local,
            workers=options.workers,
            caches=Caches(
                previous=rebase_facts(previous or {}, old=root, new=local), scrub=scrub, rehash=options.rehash
            ),
            layouts=layouts,
            now_ns=options.now_ns,
            focus=focus,
        )
        out.append(rebase(part, local=local, logical=root))
    return NodePartials(node_id=node_id, partials=tuple(out))


def node_local_map(
    roots: Sequence[str],
    *,
    address: str | None = None,
    timeout_s: float = 600.0,
    previous: Mapping[str, Mapping[str, FileFacts]] | None = None,
    options: NodeScanOptions = NodeScanOptions(),
):
    """One pinned task per alive node (`previous`: node id -> its catalogued copies); returns (answers, silent
    node ids). A task is not retried: a node that dies mid-scan is silent, not rescheduled elsewhere."""
    ray = connect(address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    task = ray.remote(num_cpus=0, max_retries=0)(scan_on_this_node)
    listed = ray.nodes()
    nodes = [n["NodeID"] for n in listed if n.get("Alive")]
    dead = [n["NodeID"] for n in listed if not n.get("Alive")]  # died since joining: it may hold the missing ranks
    previous = previous or {}
    refs = {
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote(
            list(roots), n, dict(previous.get(n, {})), options
        ): n
        for n in nodes
    }
    answers: list[NodePartials] = []
    silent: list[str] = list(dead)
    deadline = time.monotonic() + timeout_s
    for ref, node in refs.items():
        try:
            answers.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 - a dead node, a lost task or a timeout all mean: this node did not answer
            silent.append(node)
    return answers, silent


def reduce_nodes(
    answers: Sequence[NodePartials], *, now_ns: int, in_progress_window_ns: int, deep: Mapping | None = None
) -> ScanResult:
    """The driver's reduce over every node's partials: exactly the local scan's reduce (`deep`: as scan.scan's)."""
    parts = [p for a in answers for p in a.partials]
    ctx = ScanContext(now_ns=now_ns, in_progress_window_ns=in_progress_window_ns, deep=deep or {})
    return reduce(parts, ctx=ctx, layouts=load_layouts())


def scan_cluster(
    roots: Sequence[str],
    *,
    address: str | None,
    in_progress_window_s: float,
    now_ns: int | None = None,
    options: NodeScanOptions = NodeScanOptions(),
    memory: NodeMemory | None = None,
    gone_after_s: float = DEFAULT_GONE_AFTER_S,
    timeout_s: float = 600.0,
    deep: Mapping | None = None,
) -> ScanResult:
    """scan --ray: the node-local map (each node reusing its catalogued copies, `memory`), the driver's reduce and
    the multi-node findings, as one ScanResult carrying which node holds what (`cluster`). `deep`: the catalog's
    kept deep verdicts, as scan.scan's."""
    memory = memory or NodeMemory(facts={}, last_answered_ns={})
    started = time.time_ns()
    now = now_ns if now_ns is not None else started
    walk, focus = focus_of(list(roots))  # a step directory asked for alone: its run is walked, it alone read
    answers, silent = node_local_map(
        walk,
        address=address,
        previous=memory.facts,
        options=replace(options, now_ns=now, focus=focus),
        timeout_s=timeout_s,
    )
    result = judge_cluster(
        roots,
        answers,
        silent,
        memory=memory,
        now_ns=now,
        in_progress_window_s=in_progress_window_s,
        gone_after_s=gone_after_s,
        deep=deep,
    )
    return replace(result, started_ns=started, finished_ns=time.time_ns())


def judge_cluster(
    roots: Sequence[str],
    answers: Sequence[NodePartials],
    silent: Sequence[str],
    *,
    memory: NodeMemory,
    now_ns: int,
    in_progress_window_s: float,
    gone_after_s: float = DEFAULT_GONE_AFTER_S,
    deep: Mapping | None = None,
) -> ScanResult:
    """The driver's half, pure over what the nodes answered and what the catalog remembers of them: reduce, the
    multi-node findings, and the view of which node holds what for the catalog."""
    from .findings import judge_nodes  # noqa: PLC0415 - findings imports this module's NodePartials

    answered = {a.node_id for a in answers}
    held = held_before(memory, roots)
    # a node that held files under these roots and did not answer is silent, even once Ray no longer lists it
    silent = list(dict.fromkeys([*silent, *sorted({n for ns in held.values() for n in ns} - answered)]))
    gone = {n: t for n in silent if (t := _silent_since(memory, n)) is not None and now_ns - t > gone_after_s * 1e9}
    walk, focus = focus_of(list(roots))
    seen = {p for a in answers for part in a.partials for p in part.facts}
    recalled = {p: tuple(sorted(ns)) for p, ns in held.items() if p not in seen and enclosing_step_dir(p)}
    remembered = [
        NodePartials(node_id=n, partials=recall(walk, {p: memory.facts[n][p] for p, ns in recalled.items() if n in ns}))
        for n in silent
        if n in memory.facts
    ]
    reduced = reduce_nodes(
        [*answers, *remembered], now_ns=now_ns, in_progress_window_ns=int(in_progress_window_s * 1e9), deep=deep
    )
    result = judge_nodes(reduced, answers, silent, recalled=recalled, gone=gone, now_ns=now_ns)
    if focus:  # as the local scan: only the checkpoints asked for (their runs' other steps were not read)
        result = only_checkpoints(result, focus, whole=frozenset(walk) - {os.path.dirname(f) for f in focus})
    return replace(
        result,
        roots=tuple(roots),
        started_ns=now_ns,
        finished_ns=now_ns,
        reused_paths=winners_reused(answers),
        cluster=ClusterView(answered=tuple(a.node_id for a in answers), silent=tuple(silent), copies=copies(answers)),
    )


def recall(walk_roots: Sequence[str], facts: Mapping[str, FileFacts]) -> tuple[Partial, ...]:
    """A silent node's checkpoint files as the catalog last saw them, as partials (one per walk root holding any):
    merged after every answering node's, they keep a checkpoint the node held (in part or whole) in the scan, for
    the judge to call unknown, instead of incomplete or absent."""
    out = []
    for root in walk_roots:
        mine = {p: f for p, f in facts.items() if p.startswith(root.rstrip("/") + "/")}
        if not mine:
            continue
        dirs: dict[str, set[str]] = {root: set()}
        files: dict[str, list[str]] = {}
        for p in mine:
            d, name = p.rsplit("/", 1)
            files.setdefault(d, []).append(name)
            dirs.setdefault(d, set())
            while d != root and d.startswith(root):
                parent, child = d.rsplit("/", 1)
                dirs.setdefault(parent, set()).add(child)
                d = parent
        tree = Tree(
            dirs={d: tuple(sorted(c)) for d, c in dirs.items()},
            files={d: tuple(sorted(n)) for d, n in files.items()},
        )
        out.append(Partial(root=root, tree=tree, facts=mine))
    return tuple(out)


def _silent_since(memory: NodeMemory, node: str) -> int | None:
    """When `node` was last known to answer: its last answer, or for a node that never answered (Ray lists it
    dead, or its task always failed) the first scan that asked it; None for a node the catalog has never seen."""
    answered = memory.last_answered_ns.get(node)
    return answered if answered is not None else memory.first_seen_ns.get(node)


def held_before(memory: NodeMemory, roots: Sequence[str]) -> dict[str, frozenset[str]]:
    """Logical path under `roots` -> the nodes the catalog last saw holding it."""
    below = tuple(r.rstrip("/") + "/" for r in roots)
    out: dict[str, set[str]] = {}
    for node, facts in memory.facts.items():
        for p in facts:
            if p.startswith(below):
                out.setdefault(p, set()).add(node)
    return {p: frozenset(ns) for p, ns in out.items()}


def copies(answers: Sequence[NodePartials]) -> dict[str, tuple[NodeCopy, ...]]:
    """Logical path -> each answering node's copy of it, with that node's own stat."""
    out: dict[str, list[NodeCopy]] = {}
    for a in answers:
        for part in a.partials:
            for p, f in part.facts.items():
                out.setdefault(p, []).append(
                    NodeCopy(
                        node_id=a.node_id,
                        size_bytes=f.size_bytes,
                        mtime_ns=f.mtime_ns,
                        inode=f.inode,
                        hash=f.hash,
                        verified_ns=f.verified_ns,
                    )
                )
    return {p: tuple(c) for p, c in out.items()}


def winners_reused(answers: Sequence[NodePartials]) -> frozenset[str]:
    """The files whose recorded facts (the first partial's, as the merge keeps) were reused: only those may keep
    their stored catalog row."""
    winner: dict[str, bool] = {}
    for a in answers:
        for part in a.partials:
            for p in part.facts:
                winner.setdefault(p, p in part.reused_paths)
    return frozenset(p for p, reused in winner.items() if reused)
