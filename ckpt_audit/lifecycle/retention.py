"""Retention: which checkpoints to keep, as a pure plan over scanned runs.

Policies compose as a union (a checkpoint is kept if ANY rule keeps it), the way Orbax's
`AnyPreservationPolicy` does. Rules only ever look at COMPLETE checkpoints: incomplete, corrupt, husk and
stale uncommitted directories are removed first and never count toward N. On top of every rule sit the
invariants no policy or hand selection can break: the newest complete checkpoint of each run, the tracker's
target, pinned and in-progress checkpoints, whole checkpoints newer than a lagging tracker, and anything that
could not be read in full are kept.

`plan_prune()` is pure (no clock, no filesystem): the caller passes `now_ns` and, for best-N, the metric
values (`read_metric()` reads them with continuity's metrics reader; `metric_problem()` refuses a metric that
would rank nothing). `ckpt_audit.lifecycle.survivors` re-reads what a plan counts on before
`ckpt_audit.lifecycle.prune.execute()` carries it out.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Literal, Protocol

from ckpt_audit.continuity.metrics import MetricLog, MetricsError, read_metrics
from ckpt_audit.lifecycle.latest import resumes_as_is
from ckpt_audit.lifecycle.links import Links
from ckpt_audit.models import Checkpoint, Run, Status
from ckpt_audit.readers import bounded_json
from ckpt_audit.rules import deepspeed as ds_rules
from ckpt_audit.rules.tracker import ahead_of_tracker
from ckpt_audit.units import NS_PER_S, format_duration

METRIC_JSON_LIMIT = 64 * 1024  # OpenRLHF's metric.json is two keys

DEFAULT_STALE_AFTER_NS = 3600 * NS_PER_S  # an uncommitted save older than this is abandoned, not running


class Reason(StrEnum):
    """Why a checkpoint stays or goes; stable slugs (JSON, catalog, docs)."""

    # kept, and no policy or selection can change that
    NEWEST_COMPLETE = "newest-complete"
    NEWEST_RESUMABLE = "newest-resumable"  # newest complete the trainer resumes as is, when the newest is not
    TRACKER_TARGET = "tracker-target"
    TRACKER_UNREAD = "tracker-unread"  # the tracker could not be read: any checkpoint may be the one resume loads
    PINNED = "pinned"
    IN_PROGRESS = "in-progress"
    UNREAD = "unread"  # something inside could not be read: no evidence it is disposable
    AHEAD_OF_TRACKER = "ahead-of-tracker"  # whole, but newer than the tracker: the tracker lags, not the save
    LINKED = "linked"  # a symbolic link elsewhere under the roots leads into it (another run's warm start)
    REPLICA_CONFLICT = "replica-conflict"  # its copies (or the tracker's) differ between nodes: a conflict to settle
    # kept by a rule
    KEEP_LAST = "keep-last"
    KEEP_EVERY = "keep-every"
    KEEP_WITHIN = "keep-within"
    KEEP_BEST = "keep-best"
    NO_RULES = "no-rules"  # no keep rule given: complete checkpoints stay, only broken ones go
    UNCOMMITTED_RECENT = "uncommitted-recent"  # newer than the tracker but young: maybe an async save
    NEWEST_OF_PARTIAL_RUN = "newest-of-partial-run"  # run with nothing complete (e.g. one node's disk)
    UNSAFE = "unsafe"  # would run code on resume: not resumable, but kept for a person to judge (or select)
    # deleted
    INCOMPLETE = "incomplete"
    CORRUPT = "corrupt"
    HUSK = "husk"
    UNCOMMITTED_STALE = "uncommitted-stale"
    NOT_KEPT = "not-kept"  # complete, but no rule keeps it
    SELECTED = "selected"  # picked by hand
    # a hand selection or pin that could not be honoured
    UNKNOWN_PATH = "unknown-path"

    @property
    def protected(self) -> bool:
        return self in PROTECTED


PROTECTED = frozenset(
    {
        Reason.NEWEST_COMPLETE,
        Reason.NEWEST_RESUMABLE,
        Reason.TRACKER_TARGET,
        Reason.TRACKER_UNREAD,
        Reason.PINNED,
        Reason.IN_PROGRESS,
        Reason.UNREAD,
        Reason.AHEAD_OF_TRACKER,
        Reason.LINKED,
        Reason.REPLICA_CONFLICT,
    }
)

EXPLAIN: dict[Reason, str] = {
    Reason.NEWEST_COMPLETE: "newest complete checkpoint of its run (never deleted)",
    Reason.NEWEST_RESUMABLE: "newest checkpoint a resume can continue from; newer ones are model only (never deleted)",
    Reason.TRACKER_TARGET: "the tracker names it: resume loads it (never deleted)",
    Reason.TRACKER_UNREAD: "the run's tracker could not be read (tracker-unread): it may name this one (never deleted)",
    Reason.PINNED: "pinned (never deleted)",
    Reason.IN_PROGRESS: "being written now (never deleted)",
    Reason.UNREAD: "could not be read in full: no evidence it is disposable (never deleted)",
    Reason.AHEAD_OF_TRACKER: "whole but newer than the tracker (tracker-behind): never deleted as abandoned",
    Reason.LINKED: "a symbolic link outside it leads into it: deleting it breaks that path (kept while it exists)",
    Reason.REPLICA_CONFLICT: "copies on different nodes differ (replica-differs): a conflict for a person to settle, "
    "not corruption; every copy kept (never deleted)",
    Reason.KEEP_LAST: "among the last N complete",
    Reason.KEEP_EVERY: "step is a multiple of K",
    Reason.KEEP_WITHIN: "newer than the keep-within duration",
    Reason.KEEP_BEST: "among the best N by the metric",
    Reason.NO_RULES: "no keep rule given: complete checkpoints are kept",
    Reason.UNCOMMITTED_RECENT: "newer than the tracker but recent: may still be committing",
    Reason.NEWEST_OF_PARTIAL_RUN: "newest of a run with no complete checkpoint (maybe one node's share)",
    Reason.UNSAFE: "unsafe to resume (a pickle reaches code): kept for a person to judge; select it to delete",
    Reason.INCOMPLETE: "incomplete: cannot be resumed",
    Reason.CORRUPT: "corrupt: cannot be resumed",
    Reason.HUSK: "husk: nothing resumable left in it",
    Reason.UNCOMMITTED_STALE: "newer than the tracker and abandoned",
    Reason.NOT_KEPT: "complete, but no keep rule keeps it",
    Reason.SELECTED: "selected by hand",
    Reason.UNKNOWN_PATH: "matches no scanned checkpoint",
}

_BROKEN = {Status.INCOMPLETE: Reason.INCOMPLETE, Status.CORRUPT: Reason.CORRUPT, Status.HUSK: Reason.HUSK}


# ---------------------------------------------------------------------------------------------------- rules


class Rule(Protocol):
    reason: Reason

    def keeps(self, run: Run, complete: Sequence[Checkpoint], now_ns: int) -> frozenset[str]:
        """Paths (of `complete`, sorted newest first) this rule keeps."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepLast:
    n: int
    reason: Reason = field(default=Reason.KEEP_LAST, init=False, repr=False)

    def keeps(self, run: Run, complete: Sequence[Checkpoint], now_ns: int) -> frozenset[str]:
        return frozenset(c.path for c in complete[: max(self.n, 0)])

    def describe(self) -> str:
        return f"keep the last {self.n} complete"


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepEvery:
    k: int
    reason: Reason = field(default=Reason.KEEP_EVERY, init=False, repr=False)

    def keeps(self, run: Run, complete: Sequence[Checkpoint], now_ns: int) -> frozenset[str]:
        if self.k <= 0:
            return frozenset()
        return frozenset(c.path for c in complete if c.step % self.k == 0)

    def describe(self) -> str:
        return f"keep every step divisible by {self.k}"


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepWithin:
    duration_ns: int
    reason: Reason = field(default=Reason.KEEP_WITHIN, init=False, repr=False)

    def keeps(self, run: Run, complete: Sequence[Checkpoint], now_ns: int) -> frozenset[str]:
        cutoff = now_ns - self.duration_ns
        return frozenset(c.path for c in complete if c.mtime_ns >= cutoff)

    def describe(self) -> str:
        return f"keep those newer than {format_duration(self.duration_ns)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepBest:
    """Best N by a metric; `values` maps run path -> step -> value (see `read_metric`).

    A checkpoint whose step has no finite value is never kept by this rule (other rules may keep it).
    Ties break toward the newer step, so the choice is deterministic.
    """

    n: int
    metric: str
    mode: Literal["min", "max"] = "min"
    values: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    reason: Reason = field(default=Reason.KEEP_BEST, init=False, repr=False)

    def keeps(self, run: Run, complete: Sequence[Checkpoint], now_ns: int) -> frozenset[str]:
        series = self.values.get(run.path, {})
        scored = [(series[c.step], c) for c in complete if c.step in series and math.isfinite(series[c.step])]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda vc: (sign * vc[0], -vc[1].step))
        return frozenset(c.path for _, c in scored[: max(self.n, 0)])

    def describe(self) -> str:
        return f"keep the best {self.n} by {self.mode} {self.metric}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """The union of `rules`; with no rules every complete checkpoint is kept (prune removes only broken ones)."""

    rules: tuple[KeepLast | KeepEvery | KeepWithin | KeepBest, ...] = ()
    stale_after_ns: int = DEFAULT_STALE_AFTER_NS

    def describe(self) -> str:
        if not self.rules:
            return "no keep rule: keep every complete checkpoint"
        return "; ".join(r.describe() for r in self.rules)


# ---------------------------------------------------------------------------------------------------- plan


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


# ---------------------------------------------------------------------------------------------------- inputs


def read_metric(runs: Sequence[Run], metric: str) -> dict[str, dict[int, float]]:
    """Read `metric` per step from each run's metrics log with continuity's reader (`ckpt-audit continuity` reads
    the same values: flat, nested or verl-logger records, console lines; the last record of a step wins, since
    resumed runs log a step again). Runs without a readable log are left out; unparsable lines are skipped."""
    out: dict[str, dict[int, float]] = {}
    for run in runs:
        if run.metrics_path and not isinstance(log := _metric_log(run.metrics_path), str):
            out[run.path] = log.series(metric).by_step() if metric in log.metric_names else {}
        elif not run.metrics_path and (tagged := _tag_metrics(run, metric)) is not None:
            out[run.path] = tagged
    return out


def _tag_metrics(run: Run, metric: str) -> dict[int, float] | None:
    """OpenRLHF's per-tag metric.json (the value its own keep-best and rotation rank by), where its key is `metric`;
    None when no checkpoint of the run has one."""
    found, out = False, {}
    # a best_ tag's value is its own step's eval; the regular tag of that step records the eval before it
    for c in sorted(run.checkpoints, key=lambda c: c.path.rsplit("/", 1)[-1].startswith("best")):
        try:
            doc = bounded_json.loads(_small_file(f"{c.path}/{ds_rules.METRIC_JSON}"), max_bytes=METRIC_JSON_LIMIT)
        except (OSError, ValueError):
            continue
        found = True
        key, value = ds_rules.read_metric_json(doc)
        if key == metric and value is not None and math.isfinite(value):
            out[c.step] = value
    return out if found else None


def _small_file(path: str) -> bytes:
    """Up to METRIC_JSON_LIMIT + 1 bytes of a regular file (a FIFO put there must not block prune)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.read(fd, METRIC_JSON_LIMIT + 1)
    finally:
        os.close(fd)


def metric_problem(runs: Sequence[Run], metric: str, values: Mapping[str, Mapping[int, float]]) -> str | None:
    """Why best-N by `metric` (`values` from `read_metric`) would rank nothing in some run, else None.

    Keeping the best of nothing keeps nothing, and every other complete checkpoint would go: a metric no record
    has (a typo) or a run without a metrics log is a wrong input, not a policy. Runs with nothing complete
    have nothing to rank and are not asked.
    """
    for run in sorted(runs, key=lambda r: r.path):
        complete = [c for c in run.checkpoints if c.status is Status.COMPLETE]
        if not complete:
            continue
        series = values.get(run.path)
        if series is None:  # neither a metrics log nor any metric.json gave this run a series
            if not run.metrics_path:
                return (
                    f"--keep-best: run {run.path} has no metrics log (metrics.jsonl) or metric.json to rank its "
                    "checkpoints by"
                )
            log = _metric_log(run.metrics_path)
            return f"--keep-best: {log}" if isinstance(log, str) else f"--keep-best: cannot read {run.metrics_path}"
        if not series:
            if not run.metrics_path:
                return f"--metric {metric!r}: no metric.json of {run.path} records it"
            names = metric_names(run.metrics_path)
            return f"--metric {metric!r}: no record in {run.metrics_path} has it" + (
                f" (it logs: {', '.join(names)})" if names else ""
            )
        if not any(math.isfinite(series.get(c.step, math.nan)) for c in complete):
            return (
                f"--metric {metric!r}: no complete checkpoint of {run.path} has a logged value "
                f"(steps {', '.join(str(c.step) for c in complete)})"
            )
    return None


def metric_names(path: str) -> list[str]:
    """The metrics a log holds, to name them when --metric has a typo."""
    log = _metric_log(path)
    return [] if isinstance(log, str) else sorted(log.metric_names)


def _metric_log(path: str) -> MetricLog | str:
    """The run's metrics log, or the one-line reason it cannot be read."""
    try:
        return read_metrics([path])
    except MetricsError as exc:
        return str(exc)
