"""What the Session's actions hand back to the front ends: plain frozen data, made after the work.

The service layer's vocabulary, apart from the actions in ckpt_audit.session: the CLI and the TUI render these
(a preview to confirm, what was pruned, the resume gate's answer) without calling any action themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ckpt_audit.lifecycle.latest import Gate
    from ckpt_audit.lifecycle.prune import PruneResult, TrashDir
    from ckpt_audit.lifecycle.retention import PrunePlan
    from ckpt_audit.lifecycle.survivors import Executor, Reread, SurvivorCheck
    from ckpt_audit.lifecycle.tracker_fix import TrackerFix
    from ckpt_audit.models import Checkpoint, Run, ScanResult


@dataclass(frozen=True, slots=True, kw_only=True)
class PrunePreview:
    """What a prune would do, and everything needed to do it: the scan it came from (recorded when it acts; None:
    already recorded), the plan (`check.plan`; its survivors re-read when `checked`), the trash an interrupted
    prune left in `reclaim_dirs`, and who re-reads and deletes (`executor`; None: this process). Shown, confirmed,
    then handed back whole to `Session.prune`, which re-reads the survivors again at the moment it acts."""

    scanned: ScanResult | None
    check: SurvivorCheck
    checked: bool  # False: planned only (prune --yes: the one re-read is the one before the first deletion)
    trash: tuple[TrashDir, ...]
    reclaim_dirs: tuple[str, ...]
    executor: Executor | None = None  # prune --ray: the cluster's handle (cluster.ray_prune.Cluster)

    @property
    def plan(self) -> PrunePlan:
        return self.check.plan


@dataclass(frozen=True, slots=True, kw_only=True)
class Pruned:
    """What `Session.prune` did: the survivor check made just before the first deletion, and the execution (None:
    the re-read changed what a confirmed plan deletes, so nothing was deleted)."""

    check: SurvivorCheck
    result: PruneResult | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Recorded:
    """A scan (or verify) and the catalog scan id it was recorded under (None: not recorded)."""

    result: ScanResult
    scan_id: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackerPlan:
    """What fix-tracker would write (`fix`), planned from a fresh scan of the run at `planned_ns`; shown, then
    given to `Session.fix_tracker`. `step_names`: the run's step directories as scanned (a save begun since wins)."""

    fix: TrackerFix
    step_names: frozenset[str]
    planned_ns: int
    target: Checkpoint | None = None  # the checkpoint `fix` points the tracker at, as scanned


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackerWrite:
    """What `Session.fix_tracker` did: the target read by content just before writing (`reread`); the tracker was
    rewritten only if that read held (`written`), its old content kept in `backup` (None: there was none)."""

    reread: Reread
    backup: str | None = None

    @property
    def written(self) -> bool:
        return self.reread.ok  # a read that held is always followed by the write (apply_fix raises otherwise)


@dataclass(frozen=True, slots=True, kw_only=True)
class LatestAnswer:
    """The resume gate's answer for one run (`gate.chosen`, or `gate.reason` why none), and what it read."""

    run: Run
    gate: Gate
    verified_ns: int | None  # when the answer was last read by content in full (None: no answer, or never)
    reread: tuple[str, ...]  # checkpoints read by content just now for --verified
    files_reused: int  # the catalog's cache at work: files reused by stat ...
    files_read: int  # ... vs read by content for this answer
    not_recorded: str  # "" when the scans were recorded, else why not (a cron run holds the lock, read-only catalog)
    takes_tag: bool = False  # the run's load names a checkpoint by tag (DeepSpeed's load_checkpoint(save_dir, tag=))

    @property
    def tag(self) -> str | None:
        """The answer as the tag its load takes (the step directory's name); None: no answer, or no tags."""
        chosen = self.gate.chosen
        return chosen.path.rsplit("/", 1)[-1] if chosen is not None and self.takes_tag else None
