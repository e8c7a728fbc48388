"""Why a checkpoint stays or goes: the stable reason slugs a prune plan gives each checkpoint, which of them no
policy or selection can override (`PROTECTED`), and what each means to a person (`EXPLAIN`)."""

from __future__ import annotations

from enum import StrEnum


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
