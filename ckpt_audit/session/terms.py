"""The nouns a front end passes to the session or matches in what it hands back, for prune: keep rules
and their policy, the links a plan respects, the plan and why each item is in it (`EXPLAIN`), an execution's
outcome kinds (scan's scrub policy: session.scan_terms).

Planning is pure (no IO, no catalog), so a viewer may re-plan as a person toggles rules and checkpoints
(`plan_prune`, `read_metric`): the TUI's preview is the CLI's plan. What acts goes through `Session.prune`.
The errors of the heavier actions sit beside them: session.export_terms, session.tracker_terms.
"""

from ckpt_audit.lifecycle.links import Links, links_for
from ckpt_audit.lifecycle.prune import Action
from ckpt_audit.lifecycle.retention import (
    EXPLAIN,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepWithin,
    Policy,
    PrunePlan,
    plan_prune,
    read_metric,
)

__all__ = [
    "EXPLAIN",
    "Action",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepWithin",
    "Links",
    "Policy",
    "PrunePlan",
    "links_for",
    "plan_prune",
    "read_metric",
]
