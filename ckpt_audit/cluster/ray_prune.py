"""prune --ray: a prune plan made on the driver over the union of the nodes' disks, executed on each node.

The driver scans with the node-local placement (ray_scan), plans with the local planner over the union, and sends
each node only its part of each checkpoint to delete: the checkpoint's files that node reported, with that node's
own stat. The node rebases the part onto its own directory (noderoots) and runs exactly the local crash-safe
`lifecycle.prune.execute` on it (the re-checks against the plan, the rename to `.ckpt-audit-trash-*`, the removal,
the reclaim of earlier trash). So a node killed mid-way leaves its part intact or marked, and the next prune finds
the rest of that checkpoint incomplete (deleted) and the marked part as trash (reclaimed).

On top of the local checks, each node checks its blast radius against its own directory before anything goes
(`blast_radius`): the part must sit strictly inside the node's copy of its root, reached without a symbolic
link, hold no root or run, and no link inside it may lead out of the root. A round in which every node only
checks (`inspect`) comes first, so a checkpoint any node would refuse is left whole on every node.

Protected on the driver, before planning: a checkpoint with files the catalog last saw on a node that is silent
now, and every checkpoint while a silent node is one the catalog has never seen (it may hold part of any).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckpt_audit.codes import finding
from ckpt_audit.killpoints import KILL_AFTER_ENV
from ckpt_audit.lifecycle.links import Links
from ckpt_audit.lifecycle.prune import (
    Action,
    Outcome,
    PruneLog,
    PruneResult,
    TrashDir,
    changed_since_plan,
    execute,
    find_trash,
    linked_now,
    links_now,
)
from ckpt_audit.lifecycle.removable import cannot_remove
from ckpt_audit.lifecycle.retention import PlanItem, PrunePlan
from ckpt_audit.lifecycle.survivors import Reread, reread
from ckpt_audit.models import Checkpoint, ScanResult, Status

from .connect import import_ray
from .noderoots import ENV, parse_node_roots

KILL_DIR_ENV = "CKPT_AUDIT_TEST_NODE_KILL"  # test seam: a directory; <dir>/<node id> holds N: that node's execution
# is SIGKILLed after its N-th filesystem step (killpoints). Unset (always, outside tests) it costs a lookup.


# ---------------------------------------------------------------------------------------------------- driver, pure


def protect_silent(result: ScanResult, held_before: Mapping[str, frozenset[str]], known: Iterable[str]) -> ScanResult:
    """`result` with every checkpoint that may have a part on a silent node made `unknown` (so the planner keeps
    it: `unread`): files the catalog last saw on a silent node (`held_before`: path -> nodes), or any checkpoint at
    all while a silent node is not among the nodes the catalog `known`s."""
    view = result.cluster
    silent = set(view.silent) if view is not None else set()
    if not silent:
        return result
    unseen = sorted(silent - set(known))

    def judged(c: Checkpoint) -> Checkpoint:
        if c.status in (Status.UNKNOWN, Status.IN_PROGRESS):
            return c
        inside = c.path.rstrip("/") + "/"
        on = sorted({n for p, ns in held_before.items() if p.startswith(inside) for n in ns} & silent)
        if unseen:
            why = f"node(s) {', '.join(unseen)} did not answer and the catalog has never seen them: they may hold part"
        elif on:
            why = f"the catalog last saw part of it on node(s) {', '.join(on)}, which did not answer"
        else:
            return c
        return replace(c, status=Status.UNKNOWN, findings=(*c.findings, finding("node-silent", c.path, why)))

    runs = tuple(replace(r, checkpoints=tuple(judged(c) for c in r.checkpoints)) for r in result.runs)
    return replace(result, runs=runs)


def node_part(ckpt: Checkpoint, node: str, copies: Mapping[str, Sequence]) -> Checkpoint | None:
    """The part of `ckpt` on `node` (logical paths, that node's own stat), or None if it holds none of its files."""
    files = []
    for f in ckpt.all_files:
        mine = next((c for c in copies.get(f.path, ()) if c.node_id == node), None)
        if mine is not None:
            files.append(replace(f, size_bytes=mine.size_bytes, mtime_ns=mine.mtime_ns, inode=mine.inode))
    if not files:
        return None
    return replace(ckpt, components=(), files=tuple(files))


def split_plan(plan: PrunePlan, nodes: Sequence[str], copies: Mapping[str, Sequence]) -> dict[str, PrunePlan]:
    """Each node's part of `plan`: the parts it holds of the checkpoints to delete, in the plan's order (the keep
    list too, for the links check). Nodes holding nothing to delete get an empty plan (they still reclaim trash)."""

    def mine(items: Sequence[PlanItem], n: str) -> tuple[PlanItem, ...]:
        parts = ((i, node_part(i.checkpoint, n, copies)) for i in items)
        return tuple(replace(i, checkpoint=p) for i, p in parts if p is not None)

    return {n: replace(plan, delete=mine(plan.delete, n), keep=mine(plan.keep, n), refused=()) for n in nodes}


# ---------------------------------------------------------------------------------------------------- node side


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeReport:
    """What one node says of its part: objections (logical checkpoint path -> (action, why): nothing done to
    it), the trash it holds (logical paths), and, when it executed, the local prune's result (logical paths)."""

    node_id: str
    objections: Mapping[str, tuple[Action, str]] = field(default_factory=dict)
    trash: tuple[TrashDir, ...] = ()
    result: PruneResult | None = None


class _Paths:
    """This node's directory for each logical root (CKPT_AUDIT_NODE_ROOTS), both ways."""

    def __init__(self, roots: Sequence[str], node_id: str) -> None:
        mapping = parse_node_roots(os.environ.get(ENV), node_id=node_id)
        self.pairs = sorted(((r, mapping.get(r, r)) for r in roots), key=lambda p: -len(p[0]))

    def root_of(self, path: str, *, local: bool) -> tuple[str, str] | None:
        for logical, here in self.pairs:
            top = here if local else logical
            if path == top or path.startswith(top + "/"):
                return logical, here
        return None

    def local(self, path: str) -> str:
        if (pair := self.root_of(path, local=False)) is None:
            return path
        return pair[1] + path[len(pair[0]) :]

    def logical(self, path: str) -> str:
        if (pair := self.root_of(path, local=True)) is None:
            return path
        return pair[0] + path[len(pair[1]) :]

    def item(self, item: PlanItem) -> PlanItem:
        c = item.checkpoint
        files = tuple(replace(f, path=self.local(f.path)) for f in c.all_files)
        ckpt = replace(c, path=self.local(c.path), run_path=self.local(c.run_path), components=(), files=files)
        return replace(item, checkpoint=ckpt)

    def outcome(self, o: Outcome) -> Outcome:
        run = None if o.run_path is None else self.logical(o.run_path)
        return replace(o, path=self.logical(o.path), run_path=run)


def blast_radius(path: str, *, root: str, keep_out: Iterable[str] = ()) -> str | None:
    """Why deleting directory `path` could reach past the node's copy of its root `root`, else None: it must sit
    strictly inside `root`, be reached without a symbolic link, hold none of `keep_out` (roots and runs), and no
    link inside it may lead out of `root`."""
    root_real = os.path.realpath(root)
    if not path.startswith(root.rstrip("/") + "/"):
        return f"not inside the node's root {root}"
    parent = os.path.dirname(path)
    if os.path.realpath(parent) != os.path.normpath(os.path.join(root_real, os.path.relpath(parent, root))):
        return f"reached through a symbolic link ({parent} is {os.path.realpath(parent)})"
    inside = path.rstrip("/") + "/"
    if held := next((k for k in keep_out if k == path or k.startswith(inside)), None):
        return f"holds a root or run: {held}"
    for dirpath, dirs, files in os.walk(path, followlinks=False):
        for name in (*dirs, *files):
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                target = os.path.realpath(p)
                if not (target == root_real or target.startswith(root_real + "/")):
                    return f"a link out of the root: {p} -> {target}"
    return None


def _objection(item: PlanItem, paths: _Paths, keep_out: Sequence[str], links: Links):
    """The local checks prune.execute makes, plus the blast radius, without touching anything."""
    path = item.path
    if not os.path.lexists(path):
        return None  # nothing of it here any more: execute says "gone already"
    pair = paths.root_of(path, local=True)
    if pair is None or (why := blast_radius(path, root=pair[1], keep_out=keep_out)):
        return Action.SKIPPED, why or "not under a scanned root"
    if link := linked_now(path, links):
        return Action.SKIPPED, f"a link leads into it: {link}"
    if os.path.isdir(path) and not os.path.islink(path) and (why := cannot_remove(path)):
        return Action.FAILED, f"left intact: {why}"
    if why := changed_since_plan(item):
        return Action.SKIPPED, why
    return None


def prune_on_this_node(
    roots: Sequence[str],
    node_id: str,
    plan: PrunePlan,
    reclaim: Sequence[str],
    keep_out: Sequence[str],
    exec_id: str | None,
) -> NodeReport:
    """The node task: check this node's part of `plan` (logical paths) against its own directory; with an
    `exec_id`, then execute what passed with the local prune (the same exec id on every node)."""
    paths = _Paths(roots, node_id)
    local = replace(
        plan,
        delete=tuple(paths.item(i) for i in plan.delete),
        keep=tuple(paths.item(i) for i in plan.keep),
        links=Links(roots=tuple(here for _logical, here in paths.pairs)),  # links on this node's disk
    )
    keep_out = [paths.local(k) for k in keep_out]
    links = links_now(local)
    objections = {i.path: why for i in local.delete if (why := _objection(i, paths, keep_out, links))}
    dirs = sorted({paths.local(d) for d in reclaim})
    trash = tuple(replace(t, path=paths.logical(t.path)) for t in find_trash(dirs))
    result = None
    if exec_id is not None:
        todo = replace(local, delete=tuple(i for i in local.delete if i.path not in objections))
        with _test_kill(node_id):
            done = execute(todo, reclaim_dirs=dirs, exec_id=exec_id)
        result = replace(done, outcomes=tuple(paths.outcome(o) for o in done.outcomes))
    return NodeReport(
        node_id=node_id,
        objections={paths.logical(p): why for p, why in objections.items()},
        trash=trash,
        result=result,
    )


@contextlib.contextmanager
def _test_kill(node_id: str) -> Iterator[None]:
    """The kill -9 seam for one node's execution (KILL_DIR_ENV): the worker is reused, so the variable the
    local prune reads is set for this execution only. A no-op outside tests."""
    where = os.environ.get(KILL_DIR_ENV)
    path = os.path.join(where, node_id) if where else None
    if path is None or not os.path.exists(path):
        yield
        return
    with open(path, encoding="utf-8") as fh:
        os.environ[KILL_AFTER_ENV] = fh.read().strip()
    try:
        yield
    finally:
        os.environ.pop(KILL_AFTER_ENV, None)


def reread_on_this_node(roots: Sequence[str], node_id: str, part: Checkpoint) -> Reread:
    """The survivor check's re-read of this node's part of a checkpoint, by content, against the scan."""
    paths = _Paths(roots, node_id)
    files = tuple(replace(f, path=paths.local(f.path)) for f in part.all_files)
    got = reread(replace(part, files=files, components=()))
    found = tuple(replace(f, path=paths.logical(f.path)) for f in got.findings)
    return replace(got, checkpoint=part, findings=found, read_back=())


# ---------------------------------------------------------------------------------------------------- driver, Ray


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterExecution:
    """What the nodes did with one plan: each answering node's report, the nodes that did not answer, and the
    checkpoints left partly pruned (some node's part removed or marked, another's not known to be)."""

    reports: tuple[NodeReport, ...]
    silent: tuple[str, ...]
    partly: tuple[str, ...] = ()


class Cluster:
    """The driver's handle on the nodes for one prune: the roots, who answered the scan and which node holds
    which file (`copies`, from the scan's ClusterView). Ray is imported on first use only."""

    def __init__(self, roots: Sequence[str], scanned: ScanResult, *, timeout_s: float = 600.0) -> None:
        view = scanned.cluster
        self.roots = list(roots)
        self.nodes = list(view.answered) if view is not None else []
        self.silent_at_scan = list(view.silent) if view is not None else []
        self.copies = dict(view.copies) if view is not None else {}
        self.keep_out = sorted({*roots, *(r.path for r in scanned.runs)})
        self.reclaim = sorted(
            {r.path for r in scanned.runs} | {os.path.dirname(c.path) for r in scanned.runs for c in r.checkpoints}
        )
        self.timeout_s = timeout_s
        self.last: ClusterExecution | None = None
        self.errors: dict[str, str] = {}  # node -> the error its task raised (a node that answered with a failure)

    def _call(self, fn, per_node: Mapping[str, tuple]) -> tuple[dict[str, Any], list[str]]:
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

        task = ray.remote(num_cpus=0, max_retries=0)(fn)
        refs = {
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote(
                self.roots, n, *args
            ): n
            for n, args in per_node.items()
        }
        got: dict[str, Any] = {}  # node -> what its task returned (a NodeReport or the re-read's Reread)
        silent: list[str] = []
        deadline = time.monotonic() + self.timeout_s
        for ref, node in refs.items():
            try:
                got[node] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.RayTaskError as exc:  # the task raised: an answer, but no report of what it did
                self.errors[node] = str(exc.cause if getattr(exc, "cause", None) else exc).splitlines()[-1][:200]
                silent.append(node)
            except Exception:  # noqa: BLE001 - a dead node, a killed worker or a timeout: this node did not answer
                silent.append(node)
        return got, silent

    def document(self) -> dict:
        """The JSON `ray` block: who answered the scan, who did not answer (the scan, the check or the execution),
        the checkpoints left partly pruned, and the errors a node's task raised."""
        last = self.last
        silent = dict.fromkeys([*self.silent_at_scan, *(last.silent if last else ())])
        return {
            "answered": self.nodes,
            "silent": list(silent),
            "partly_pruned": list(last.partly) if last else [],
            "errors": dict(self.errors),
        }

    # the survivor check, each node re-reading its own part
    def reread(self, ckpt: Checkpoint, *, workers: int = 2, progress=None) -> Reread:  # noqa: ARG002 - on the nodes
        parts = {n: (p,) for n in self.nodes if (p := node_part(ckpt, n, self.copies)) is not None}
        got, silent = self._call(reread_on_this_node, parts)
        found = [f for r in got.values() for f in r.findings]
        found += [finding("unreadable", ckpt.path, f"node {n} did not answer the re-read") for n in silent]
        status = Status.COMPLETE
        if found:
            status = (
                Status.UNKNOWN
                if silent or any(r.status is Status.UNKNOWN for r in got.values())
                else next(r.status for r in got.values() if r.findings)
            )
        return Reread(
            checkpoint=ckpt,
            bytes_read=sum(r.bytes_read for r in got.values()),
            files=sum(r.files for r in got.values()),
            findings=tuple(sorted(found, key=lambda f: (f.path, f.code))),
            status=status,
            read_ns=min((r.read_ns for r in got.values()), default=time.time_ns()),
        )

    def inspect(self, plan: PrunePlan) -> ClusterExecution:
        """Every node checks its part of `plan` and lists its trash; nothing is touched."""
        return self._round(plan, exec_id=None)

    def _round(self, plan: PrunePlan, *, exec_id: str | None) -> ClusterExecution:
        parts = split_plan(plan, self.nodes, self.copies)
        args = {n: (p, self.reclaim, self.keep_out, exec_id) for n, p in parts.items()}
        got, silent = self._call(prune_on_this_node, args)
        reports = tuple(got[n] for n in self.nodes if n in got)
        touched = {i.path for n in silent for i in parts[n].delete}  # sent to a node that did not answer
        partly = (
            ()
            if exec_id is None
            else sorted(i.path for i in plan.delete if i.path in touched or _mixed(i.path, reports))
        )
        return ClusterExecution(reports=reports, silent=tuple(silent), partly=tuple(partly))

    def holders(self, item: PlanItem) -> set[str]:
        """The answering nodes holding part of `item`'s checkpoint."""
        return {n for n in self.nodes if node_part(item.checkpoint, n, self.copies) is not None}

    def trash(self, plan: PrunePlan) -> tuple[list[TrashDir], ClusterExecution]:
        seen = self.inspect(plan)
        return [t for r in seen.reports for t in r.trash], seen

    # a drop-in for lifecycle.prune.execute (Session.prune calls it): the same log, the nodes do the work
    def execute(
        self,
        plan: PrunePlan,
        *,
        catalog=None,
        progress: Callable[[Outcome], None] | None = None,
        reclaim_dirs: Iterable[str] = (),  # noqa: ARG002 - every node reclaims in the scanned runs (self.reclaim)
        exec_id: str | None = None,
        reread: Iterable[Outcome] = (),
    ) -> PruneResult:
        log = PruneLog.start(plan, catalog=catalog, progress=progress, exec_id=exec_id, reread=reread)
        done, exec_id = log.done, log.exec_id
        first = self.inspect(plan)  # a checkpoint any node refuses stays whole on every node
        refused = {p: (n.node_id, why) for n in first.reports for p, why in n.objections.items()}
        silent_before = set(first.silent)
        go = tuple(i for i in plan.delete if i.path not in refused and not self.holders(i) & silent_before)
        for item in plan.delete:
            if item.path in refused:
                holder, (action, why) = refused[item.path]
                done(_outcome(item, action, f"on node {holder}: {why}; nothing removed on any node"))
            elif item not in go:
                quiet = ", ".join(sorted(self.holders(item) & silent_before))
                done(_outcome(item, Action.FAILED, f"left whole on every node: node(s) {quiet} did not answer"))
        ran = self._round(replace(plan, delete=go), exec_id=exec_id)
        all_silent = tuple(dict.fromkeys([*first.silent, *ran.silent]))
        self.last = replace(ran, silent=all_silent)
        for node in ran.reports:
            for o in node.result.outcomes if node.result else ():
                if o.step is None:  # earlier trash: reclaimed, or left marked and why
                    done(replace(o, detail=f"on node {node.node_id}: {o.detail}"))
        for item in go:
            done(_merged(item, ran, self.holders(item)))
        involved = {n for i in plan.delete for n in self.holders(i)}
        for node_id in (n for n in all_silent if n not in involved):  # a node's silence is an error even with no part
            for root in self.roots:
                detail = f"node {node_id} did not answer the prune: its leftover trash, if any, stays for the next one"
                done(Outcome(path=root, action=Action.FAILED, detail=detail))
        return log.finish()


def _outcome(item: PlanItem, action: Action, detail: str, size: int = 0) -> Outcome:
    return Outcome(
        path=item.path,
        action=action,
        detail=detail,
        step=item.step,
        run_path=item.run_path,
        size_bytes=size,
        reasons=tuple(str(r) for r in item.reasons),
    )


def _per_node(path: str, reports: Sequence[NodeReport]) -> dict[str, Outcome]:
    out = {}
    for r in reports:
        for o in r.result.outcomes if r.result else ():
            if o.path == path and o.action is not Action.RECLAIMED:
                out[r.node_id] = o
        if path in r.objections:
            action, why = r.objections[path]
            out[r.node_id] = Outcome(path=path, action=action, detail=why)
    return out


def _mixed(path: str, reports: Sequence[NodeReport]) -> bool:
    """Removed on some node and not on another: partly pruned."""
    got = _per_node(path, reports)
    gone = {n for n, o in got.items() if o.action is Action.DELETED}
    return bool(gone) and any(o.action is not Action.DELETED and o.detail != "gone already" for o in got.values())


def _merged(item: PlanItem, ran: ClusterExecution, holders: set[str]) -> Outcome:
    """One checkpoint's outcome over the nodes that held part of it."""
    got = _per_node(item.path, ran.reports)
    if item.path in ran.partly:
        removed = sorted(n for n, o in got.items() if o.action is Action.DELETED)
        why = [f"removed on node(s) {', '.join(removed)}"] if removed else []
        why += [f"node {n} did not answer" for n in ran.silent if n in holders]
        why += [f"on node {n}: {o.action} ({o.detail})" for n, o in sorted(got.items()) if n not in removed]
        tail = " (a part not removed is intact or marked: the next prune --ray finishes it)"
        return _outcome(item, Action.FAILED, "partly pruned: " + "; ".join(why) + tail)
    bad = {n: o for n, o in got.items() if o.action is not Action.DELETED and o.detail != "gone already"}
    if bad:
        action = Action.FAILED if any(o.action is Action.FAILED for o in bad.values()) else Action.SKIPPED
        return _outcome(item, action, "; ".join(f"on node {n}: {o.detail}" for n, o in sorted(bad.items())))
    if not any(o.action is Action.DELETED for o in got.values()):
        return _outcome(item, Action.SKIPPED, "gone already")
    nodes = sorted(n for n, o in got.items() if o.action is Action.DELETED)
    return _outcome(item, Action.DELETED, f"on node(s) {', '.join(nodes)}", size=item.size_bytes)
