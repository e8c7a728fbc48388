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

Its modules: `reasons` (why a checkpoint stays or goes), `policy` (the keep rules), `plan` (`plan_prune`), `metric`
(keep-best's values). Importers use the names below.
"""

from ckpt_audit.lifecycle.retention.metric import metric_problem, read_metric
from ckpt_audit.lifecycle.retention.plan import PlanItem, PrunePlan, Refusal, plan_prune
from ckpt_audit.lifecycle.retention.policy import KeepBest, KeepEvery, KeepLast, KeepWithin, Policy
from ckpt_audit.lifecycle.retention.reasons import EXPLAIN, Reason

__all__ = [
    "EXPLAIN",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepWithin",
    "PlanItem",
    "Policy",
    "PrunePlan",
    "Reason",
    "Refusal",
    "metric_problem",
    "plan_prune",
    "read_metric",
]
