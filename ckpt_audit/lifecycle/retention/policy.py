"""Keep rules and the policy they make: each rule names the complete checkpoints of a run it keeps; a policy is
their union (Orbax's `AnyPreservationPolicy`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ckpt_audit.lifecycle.retention.reasons import Reason
from ckpt_audit.models import Checkpoint, Run
from ckpt_audit.units import NS_PER_S, format_duration

DEFAULT_STALE_AFTER_NS = 3600 * NS_PER_S  # an uncommitted save older than this is abandoned, not running


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
