"""The prune plan: every checkpoint of the scanned runs decided, kept or deleted, with its reasons.

`plan_prune()` is pure (no clock, no filesystem): the caller passes `now_ns`, the policy (with keep-best's values
already read) and the links under the roots. Rules only ever look at COMPLETE checkpoints; the invariants on top of
them (the package's docstring) are decided here, per run (`_decide_run`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ckpt_audit.lifecycle.latest import resumes_as_is
from ckpt_audit.lifecycle.links import Links
from ckpt_audit.lifecycle.retention.policy import Policy
from ckpt_audit.lifecycle.retention.reasons import Reason
from ckpt_audit.models import Checkpoint, Run, Status
from ckpt_audit.rules.tracker import ahead_of_tracker

_BROKEN = {Status.INCOMPLETE: Reason.INCOMPLETE, Status.CORRUPT: Reason.CORRUPT, Status.HUSK: Reason.HUSK}


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanItem:
    """One checkpoint's fate: the scanned checkpoint itself (prune re-checks it against disk) and why."""

    checkpoint: Checkpoint
    reasons: tuple[Reason, ...]
    linked_from: tuple[str, ...] = ()  # the links that keep it (Reason.LINKED)

    @property
    def path(self) -> str:
        return self.checkpoint.path

    @property
    def run_path(self) -> str:
        return self.checkpoint.run_path

    @property
    def step(self) -> int:
        return self.checkpoint.step

    @property
    def size_bytes(self) -> int:
        return self.checkpoint.size_bytes

    @property
    def protected(self) -> bool:
        return any(r.protected for r in self.reasons)

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "run": self.run_path,
            "step": self.step,
            "status": str(self.checkpoint.status),
            "size_bytes": self.size_bytes,
            "reasons": [str(r) for r in self.reasons],
            "protected": self.protected,
            **({"linked_from": list(self.linked_from)} if self.linked_from else {}),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """A path the caller asked about (selected for deletion, or pinned) that the plan did not honour."""

    path: str
    reasons: tuple[Reason, ...]

    def to_dict(self) -> dict:
        return {"path": self.path, "reasons": [str(r) for r in self.reasons]}


@dataclass(frozen=True, slots=True, kw_only=True)
class PrunePlan:
    """What goes (in deletion order: broken first, then oldest), what stays, and why."""

    policy: Policy
    now_ns: int
    delete: tuple[PlanItem, ...] = ()
    keep: tuple[PlanItem, ...] = ()
    refused: tuple[Refusal, ...] = ()
    links: Links = field(default_factory=Links)  # the links under the roots the plan was made with

    @property
    def bytes_freed(self) -> int:
        return sum(i.size_bytes for i in self.delete)

    @property
    def bytes_kept(self) -> int:
        return sum(i.size_bytes for i in self.keep)

    @property
    def empty(self) -> bool:
        return not self.delete

    def to_dict(self) -> dict:
        return {
            "policy": self.policy.describe(),
            "now_ns": self.now_ns,
            "bytes_freed": self.bytes_freed,
            "bytes_kept": self.bytes_kept,
            "delete": [i.to_dict() for i in self.delete],
            "keep": [i.to_dict() for i in self.keep],
            "refused": [r.to_dict() for r in self.refused],
        }


def plan_prune(
    runs: Sequence[Run],
    policy: Policy,
    *,
    now_ns: int,
    pins: frozenset[str] = frozenset(),
    select: frozenset[str] = frozenset(),
    links: Links | None = None,
) -> PrunePlan:
    """Decide every checkpoint of `runs`. Pure: same inputs, same plan.

    `pins` and `select` are checkpoint paths (as in `Checkpoint.path`). A selected checkpoint is deleted even
    if a rule keeps it, unless an invariant protects it; then it is kept and listed in `refused`. `links`: the
    symbolic links under the scanned roots (`links.find_links`); one that leads into a checkpoint from outside
    every checkpoint this plan deletes keeps it.
    """
    known = {c.path for r in runs for c in r.checkpoints}
    delete: list[tuple[tuple, PlanItem]] = []
    keep: list[PlanItem] = []
    refused: list[Refusal] = [Refusal(path=p, reasons=(Reason.UNKNOWN_PATH,)) for p in sorted((select | pins) - known)]

    for run in sorted(runs, key=lambda r: r.path):
        for ckpt, reasons in _decide_run(run, policy, now_ns=now_ns, pins=pins):
            keeping = any(_is_keep(r) for r in reasons)
            if ckpt.path in select:
                if any(r.protected for r in reasons):
                    refused.append(Refusal(path=ckpt.path, reasons=tuple(r for r in reasons if r.protected)))
                else:
                    reasons, keeping = [*(r for r in reasons if not _is_keep(r)), Reason.SELECTED], False
            item = PlanItem(checkpoint=ckpt, reasons=_ordered(reasons))
            if keeping:
                keep.append(item)
            else:
                broken = any(r in _DELETE_FIRST for r in reasons)
                delete.append(((0 if broken else 1, ckpt.mtime_ns, ckpt.step, ckpt.path), item))

    delete.sort(key=lambda pair: pair[0])
    links = links or Links()
    going, linked = _keep_linked([item for _, item in delete], links)
    refused += [Refusal(path=i.path, reasons=(Reason.LINKED,)) for i in linked if i.path in select]
    return PrunePlan(
        policy=policy,
        now_ns=now_ns,
        delete=tuple(going),
        keep=(*keep, *linked),
        refused=tuple(sorted(refused, key=lambda r: r.path)),
        links=links,
    )


def _keep_linked(delete: list[PlanItem], links: Links) -> tuple[list[PlanItem], list[PlanItem]]:
    """Split `delete` (in order) into what still goes and what a link keeps. A link inside another checkpoint that
    goes keeps nothing (that one goes first); a link anywhere else does, and what it keeps may hold links that keep
    more in turn."""
    if not links.found:
        return delete, []
    paths = {i.path: i for i in delete}
    # each link into a planned checkpoint, with the planned checkpoint it lies in (None: outside them all)
    into = {p: [(ln, _holder(ln, paths)) for ln in links.into(p)] for p in paths}
    waiting_on: dict[str, list[str]] = {}  # checkpoint -> those its links lead into
    for p, found in into.items():
        for _ln, h in found:
            if h is not None:
                waiting_on.setdefault(h, []).append(p)
    stack = [p for p, found in into.items() if any(h is None for _ln, h in found)]
    linked = set(stack)
    while stack:  # a kept checkpoint's links keep what they lead into
        for p in waiting_on.get(stack.pop(), ()):
            if p not in linked:
                linked.add(p)
                stack.append(p)
    kept = []
    for p in (i.path for i in delete if i.path in linked):
        item = paths[p]
        reasons = (*(r for r in item.reasons if r not in (Reason.NOT_KEPT, Reason.SELECTED)), Reason.LINKED)
        sources = tuple(ln for ln, h in into[p] if h is None or h in linked)
        kept.append(replace(item, reasons=_ordered(reasons), linked_from=sources))
    # a checkpoint that others going link into goes after them (the executor skips one a link still leads into)
    order: list[PlanItem] = []
    left = [i for i in delete if i.path not in linked]
    while left:
        waiting = {i.path for i in left}
        ready = [i for i in left if not any(h in waiting for _ln, h in into[i.path])] or left  # a cycle: skipped
        order.extend(ready)
        left = [i for i in left if i not in ready]
    return order, kept


def _holder(link: str, checkpoints: Mapping[str, object]) -> str | None:
    """The checkpoint among `checkpoints` (paths) that `link` lies in, if any."""
    d = os.path.dirname(link)
    while d and d != "/":
        if d in checkpoints:
            return d
        d = os.path.dirname(d)
    return None


_DELETE_FIRST = frozenset({Reason.INCOMPLETE, Reason.CORRUPT, Reason.HUSK, Reason.UNCOMMITTED_STALE})
_DELETE = _DELETE_FIRST | {Reason.NOT_KEPT, Reason.SELECTED}
_ORDER = {r: i for i, r in enumerate(Reason)}


def _is_keep(reason: Reason) -> bool:
    return reason not in _DELETE and reason is not Reason.UNKNOWN_PATH


def _ordered(reasons: Iterable[Reason]) -> tuple[Reason, ...]:
    return tuple(sorted(set(reasons), key=_ORDER.__getitem__))


def _decide_run(run: Run, policy: Policy, *, now_ns: int, pins: frozenset[str]) -> list[tuple[Checkpoint, list]]:
    ckpts = sorted(run.checkpoints, key=lambda c: (c.step, c.path))
    complete = sorted((c for c in ckpts if c.status is Status.COMPLETE), key=lambda c: (-c.step, c.path))
    newest = complete[0].path if complete else None
    # a model-only save (HF save_only_model, torchtitan's last save) is whole but restarts the optimizer, and verl
    # >= 0.9.1 refuses the pre-v2 Megatron layout until it is migrated: the newest checkpoint training can continue
    # from as it is is kept too
    newest_resumable = next((c.path for c in complete if resumes_as_is(c)), None)

    kept_by: dict[str, list[Reason]] = {}
    for rule in policy.rules:
        for path in rule.keeps(run, complete, now_ns):
            kept_by.setdefault(path, []).append(rule.reason)

    # With nothing complete we may be looking at one node's share of a multi-node run: keep its newest.
    partial_newest = None
    if newest is None:
        candidates = [c for c in ckpts if c.status not in (Status.HUSK, Status.IN_PROGRESS, Status.UNKNOWN)]
        partial_newest = candidates[-1].path if candidates else None

    ahead = {c.path for c in ahead_of_tracker(ckpts)}
    # the target is protected only while the tracker can be read; unread, it may name any of them
    tracker_unread = any(f.code == "tracker-unread" for f in run.findings)
    out = []
    for c in ckpts:
        reasons: list[Reason] = []
        if c.path == newest:
            reasons.append(Reason.NEWEST_COMPLETE)
        elif c.path == newest_resumable:
            reasons.append(Reason.NEWEST_RESUMABLE)
        # DeepSpeed's latest_universal is a second tracker, for engines that load universal checkpoints
        if (run.tracker_step is not None and c.step == run.tracker_step) or any(
            f.code == "ds-latest-universal-target" for f in c.findings
        ):
            reasons.append(Reason.TRACKER_TARGET)
        if tracker_unread:
            reasons.append(Reason.TRACKER_UNREAD)
        if c.path in pins:
            reasons.append(Reason.PINNED)
        if c.status is Status.IN_PROGRESS:
            reasons.append(Reason.IN_PROGRESS)
        if c.status is Status.UNKNOWN:
            reasons.append(Reason.UNREAD)
        if c.status is Status.UNSAFE:
            reasons.append(Reason.UNSAFE)
        if any(f.code == "replica-differs" for f in c.all_findings):
            reasons.append(Reason.REPLICA_CONFLICT)
        if c.status is Status.COMPLETE:
            reasons.extend(kept_by.get(c.path, ()))
            if not policy.rules:
                reasons.append(Reason.NO_RULES)
            elif c.path not in kept_by:
                reasons.append(Reason.NOT_KEPT)
        elif c.path in ahead:
            reasons.append(Reason.AHEAD_OF_TRACKER)
        elif c.status is Status.UNCOMMITTED:
            fresh = c.mtime_ns >= now_ns - policy.stale_after_ns
            reasons.append(Reason.UNCOMMITTED_RECENT if fresh else Reason.UNCOMMITTED_STALE)
        elif c.status in _BROKEN:
            reasons.append(_BROKEN[c.status])
        if c.path == partial_newest:
            reasons.append(Reason.NEWEST_OF_PARTIAL_RUN)
        # A protected or kept checkpoint carries no delete reasons except what it *is* (broken, stale).
        if any(_is_keep(r) for r in reasons):
            reasons = [r for r in reasons if r is not Reason.NOT_KEPT]
        out.append((c, reasons))
    return out
