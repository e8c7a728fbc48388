"""The session itself: a catalog held under its lock, with the actions as calls (see ckpt_audit.session).

Opening: `with open_session(catalog_path, roots=...) as s:` checks the roots, probes the catalog, then holds the
lock for the whole body; it raises SessionError (a bad root or catalog: exit 3) or lock.Locked (exit 4) and
never waits. The catalog itself is opened on first write, so a scan reads files before sqlite_utils is imported.

A new action is one more method (as `plan_fix_tracker` then `fix_tracker`): do the work, write through
`self.catalog`.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from ckpt_audit import lock
from ckpt_audit.models import IN_PROGRESS_WINDOW_S
from ckpt_audit.roots import ScanError, check_root

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from ckpt_audit.answers import Pruned, PrunePreview, Recorded, TrackerPlan, TrackerWrite
    from ckpt_audit.catalog.store import Catalog
    from ckpt_audit.export.result import ExportResult
    from ckpt_audit.lifecycle.prune import Outcome
    from ckpt_audit.lifecycle.retention import Policy, PrunePlan
    from ckpt_audit.lifecycle.survivors import Executor, SurvivorCheck
    from ckpt_audit.models import FileFacts, Run, ScanResult
    from ckpt_audit.rules.deep_verdict import DeepVerdict
    from ckpt_audit.scan import Reader
    from ckpt_audit.scan.scrub import ScrubPolicy

StrPath = str | os.PathLike[str]  # a catalog path as the front ends hold it (the CLI: str; the TUI: Path)
Locked = lock.Locked


class Progress(Protocol):
    """The one progress callback every action takes and every front end's bar implements: `done` of `total` units
    (bytes read by scan, verify and a survivor re-read; tensors written by export; plan items acted on by prune)
    and, where there is one, the item just finished (a tensor's name, a prune outcome's one-line account).
    Callers of fewer arguments (the scan's (done, total)) fit it as they are."""

    def __call__(self, done: int, total: int, item: str = "", /) -> None: ...


class SessionError(Exception):
    """A root that cannot be scanned or a catalog that cannot be used: a one-line error (exit 3)."""


class PlanError(ValueError):
    """A prune request the scanned tree cannot honour (a --pin that is no checkpoint, a metric no record has):
    a wrong input, a usage error (exit 2)."""


class Session:
    """A catalog under its lock (made by `open_session`); `catalog_path` None: no catalog, nothing recorded."""

    def __init__(self, catalog_path: StrPath | None, roots: Sequence[str]) -> None:
        self.catalog_path = catalog_path
        self.roots = tuple(roots)  # the checked, real roots the session was opened for
        self._catalog: Catalog | None = None
        self._previous: Mapping[str, FileFacts] | None = None

    # ---------------------------------------------------------------------------------------- reads

    @property
    def previous(self) -> Mapping[str, FileFacts] | None:
        """The catalogued facts a scan may reuse by stat, read once with bare sqlite3 when first looked up (a re-scan
        whose every run keeps its cached verdict never reads them)."""
        if self._previous is None and self.catalog_path is not None:
            from ckpt_audit.catalog.manifest import LazyManifest

            self._previous = LazyManifest(self.catalog_path)
        return self._previous

    @property
    def catalog(self) -> Catalog | None:
        """The catalog open for writing (opened on first use: sqlite_utils costs a noticeable share of start-up)."""
        if self._catalog is None and self.catalog_path is not None:
            from ckpt_audit.catalog import open_catalog

            self._catalog = open_catalog(self.catalog_path)
        return self._catalog

    # ---------------------------------------------------------------------------------------- actions

    def scan(
        self,
        roots: Sequence[str | Path] | None = None,
        *,
        workers: int = 2,
        rehash: bool = False,
        progress: Progress | None = None,
        in_progress_window_s: float = IN_PROGRESS_WINDOW_S,
        scrub: ScrubPolicy | None = None,
        now_ns: int | None = None,
        record: bool = True,
        reader: Reader | None = None,
        cached_verdicts: bool = False,
        kept_models: bool = True,
    ) -> Recorded:
        """Scan `roots` (default: the session's) reusing the catalogued hashes; record it unless `record` is False
        (prune records its scan only once it deletes). `reader`: who reads the files (Reader; default this
        process; scan --ray's shared placement spreads them over the cluster's nodes). `cached_verdicts`: reuse
        the catalog's run verdicts where nothing they read moved (scan.verdicts; the cron scan's); `kept_models`
        False: their models stay in the catalog unless the result's runs are walked (what `scan -q` reads needs
        none: models.LazyRuns)."""
        verdicts, previous = None, self.previous
        if cached_verdicts and self.catalog_path is not None and record:
            from ckpt_audit.catalog.manifest import LazyManifest
            from ckpt_audit.catalog.verdicts import CatalogVerdicts

            # one read-only connection for everything the scan reads of the catalog
            verdicts = CatalogVerdicts(self.catalog_path)
            previous = LazyManifest(self.catalog_path, connect=verdicts.connection)
        try:
            result = scan_any(
                list(self.roots if roots is None else roots),
                workers=workers,
                rehash=rehash,
                verdicts=verdicts,
                previous=previous,
                progress=progress,
                in_progress_window_s=in_progress_window_s,
                scrub=scrub,
                now_ns=now_ns,
                reader=reader,
                deep=read_kept_deep(self.catalog_path, conn=verdicts.connection() if verdicts is not None else None),
                kept_models=kept_models,
            )
        finally:
            if verdicts is not None:
                verdicts.close()  # the kept runs' rows (LaterRows) reopen it if a report asks for them
        from ckpt_audit.answers import Recorded  # after the reads: off the scan's start-up (issue 16)

        return Recorded(result=result, scan_id=self.record(result, rehash=rehash) if record else None)

    def verify(
        self,
        paths: Sequence[str | Path],
        *,
        workers: int = 2,
        rehash: bool = True,
        progress: Progress | None = None,
        in_progress_window_s: float = IN_PROGRESS_WINDOW_S,
        scrub: ScrubPolicy | None = None,
    ) -> Recorded:
        """Scan `paths`, then deepen, and record it. `rehash` True: every file is re-read by content whatever its
        stat says, as `ckpt-audit verify` does unless --trust-cache."""
        from ckpt_audit.answers import Recorded

        result = verify_paths(
            paths,
            workers=workers,
            rehash=rehash,
            previous=self.previous,
            progress=progress,
            in_progress_window_s=in_progress_window_s,
            scrub=scrub,
        )
        return Recorded(result=result, scan_id=self.record(result, rehash=rehash))

    def kept_deep(self) -> dict[str, DeepVerdict]:
        """The deep verdicts the catalog keeps, read now: every judgement but verify's own binds to them."""
        return read_kept_deep(self.catalog_path)

    def record(self, result: ScanResult, *, rehash: bool = False) -> int | None:
        """Record a scan made elsewhere (the demo's, a browse); returns its scan id (None without a catalog)."""
        cat = self.catalog
        return None if cat is None else cat.record_scan(result, rehash=rehash)

    def plan_prune(
        self,
        policy: Policy,
        *,
        pins: Iterable[str] = (),
        now_ns: int,
        check: bool = True,
        scanned: ScanResult | None = None,
        executor: Executor | None = None,
    ) -> PrunePreview:
        """The executable plan: scan the session's roots (not recorded: prune records its scan only once it
        deletes), fill any best-N rule with its metric's values, plan, and (`check`) re-read what the plan counts
        on, so the plan shown is the checked one. Writes nothing; hand the preview back whole to `prune`. Raises
        PlanError. `scanned` / `executor`: a scan made elsewhere and who re-reads and deletes (prune --ray's union
        scan and its nodes: session.cluster.plan_prune_on_cluster)."""
        import dataclasses

        from ckpt_audit.answers import PrunePreview
        from ckpt_audit.lifecycle.links import links_for
        from ckpt_audit.lifecycle.prune import find_trash
        from ckpt_audit.lifecycle.retention import KeepBest, metric_problem, plan_prune, read_metric
        from ckpt_audit.lifecycle.survivors import SurvivorCheck

        if scanned is None:
            scanned = self.scan(now_ns=now_ns, record=False).result
        runs = tuple(scanned.runs)
        rules = []
        for rule in policy.rules:
            if isinstance(rule, KeepBest):
                values = read_metric(runs, rule.metric)
                if problem := metric_problem(runs, rule.metric, values):
                    raise PlanError(problem)
                rule = dataclasses.replace(rule, values=values)
            rules.append(rule)
        known = {c.path for r in runs for c in r.checkpoints}
        from ckpt_audit.remote import is_remote, normal

        pin_paths = frozenset(normal(str(p)) if is_remote(p) else os.path.realpath(p) for p in pins)
        if unknown := sorted(pin_paths - known):
            raise PlanError(f"--pin {unknown[0]} matches no scanned checkpoint")
        policy = dataclasses.replace(policy, rules=tuple(rules))
        links = links_for(self.roots, runs)
        plan = plan_prune(runs, policy, now_ns=now_ns, pins=pin_paths, links=links)
        # the plan shown (and asked about) is the one whose survivors were re-read
        reread = None if executor is None else executor.reread
        survivors = verify_plan(plan, runs, read=reread) if check else SurvivorCheck(plan=plan, runs=runs)
        reclaim = tuple(sorted({r.path for r in runs} | {os.path.dirname(c.path) for r in runs for c in r.checkpoints}))
        return PrunePreview(
            scanned=scanned,
            check=survivors,
            checked=check,
            trash=tuple(find_trash(reclaim)),
            reclaim_dirs=reclaim,
            executor=executor,
        )

    def prune(
        self,
        preview: PrunePreview,
        *,
        confirmed: bool,
        progress: Progress | None = None,
        reread_progress: Progress | None = None,
    ) -> Pruned:
        """Carry out `preview` (plan_prune's, or `preview_of` a plan made elsewhere): re-read what its plan counts on
        now, immediately before the first deletion, then delete the checked plan crash-safely, logged in the
        catalog. Both front ends call this once they may act: after a person confirmed the plan (`confirmed`: if
        the re-read changes what goes, nothing is deleted and the result is None) or at once (prune --yes: the
        checked plan is executed). First the scan the plan came from is recorded and what the re-read found is kept
        (a failure must outlive the next cached scan). `progress`: each outcome as it happens, counted against
        the checkpoints the checked plan deletes, its line as the item."""
        from ckpt_audit.answers import Pruned
        from ckpt_audit.catalog.lifecycle import LifecycleLog
        from ckpt_audit.lifecycle import prune

        plan, executor = preview.plan, preview.executor
        reread = None if executor is None else executor.reread
        check = verify_plan(plan, preview.check.runs, progress=reread_progress, read=reread)
        cat = self.catalog
        if cat is not None:
            if preview.scanned is not None:
                cat.record_scan(preview.scanned)
            cat.record_rereads(check.rereads)
        if confirmed and {i.path for i in check.plan.delete} != {i.path for i in plan.delete}:
            return Pruned(check=check, result=None)
        result = (prune.execute if executor is None else executor.execute)(
            check.plan,
            catalog=None if cat is None else LifecycleLog(cat.db),
            reclaim_dirs=preview.reclaim_dirs,
            progress=None if progress is None else _per_outcome(progress, len(check.plan.delete)),
            reread=check.outcomes(),
        )
        return Pruned(check=check, result=result)

    def export(self, step_dir: str | Path, to: str | Path, **options) -> ExportResult:
        """Export one checkpoint to a HuggingFace directory, recorded in the catalog
        (options: export.orchestrator.export_checkpoint's). Raises ExportError / ExportRefused."""
        from ckpt_audit.catalog.lifecycle import LifecycleLog
        from ckpt_audit.export.orchestrator import export_checkpoint
        from ckpt_audit.session.export_terms import unreadable

        cat = self.catalog
        try:
            return export_checkpoint(step_dir, to, catalog=None if cat is None else LifecycleLog(cat.db), **options)
        except OSError as exc:
            raise unreadable(exc) from None

    def plan_fix_tracker(
        self,
        run: str | Path,
        *,
        in_progress_window_s: float = IN_PROGRESS_WINDOW_S,
        now_ns: int | None = None,
    ) -> TrackerPlan:
        """Scan `run` (recorded: the catalog sees the run now), read its tracker and plan the repair
        (lifecycle.tracker_fix.plan_fix). Writes no tracker. Raises SessionError when `run` is not one run."""
        from ckpt_audit.answers import TrackerPlan
        from ckpt_audit.lifecycle.tracker_fix import plan_fix, read_state, tracker_of

        scanned = self.scan([run], in_progress_window_s=in_progress_window_s)
        the_run = run_named(scanned.result, run)
        state = read_state(tracker_of(the_run))
        now = time.time_ns() if now_ns is None else now_ns
        fix = plan_fix(the_run, state, now_ns=now, in_progress_window_ns=int(in_progress_window_s * 1e9))
        steps = frozenset(os.path.basename(c.path) for c in the_run.checkpoints)
        target = next((c for c in the_run.checkpoints if c.path == fix.new_path), None)
        return TrackerPlan(fix=fix, step_names=steps, planned_ns=now, target=target)

    def fix_tracker(self, plan: TrackerPlan, *, workers: int = 2) -> TrackerWrite:
        """Read the target by content now (hash + CRC of every file against the scan, lifecycle.survivors.reread:
        the scan's verdict may come from a stat cache that never sees bit rot), record what that read, and only if
        it holds rewrite the tracker as `plan.fix` says (needed, not refused), logged in the catalog
        (tracker_fixes). Raises tracker_fix.FixError."""
        from ckpt_audit.answers import TrackerWrite
        from ckpt_audit.lifecycle.survivors import reread
        from ckpt_audit.lifecycle.tracker_fix import apply_fix

        assert plan.target is not None and plan.target.path == plan.fix.new_path
        check = reread(plan.target, workers=workers)
        if self.catalog is not None:
            self.catalog.record_rereads([check])
        if not check.ok:
            return TrackerWrite(reread=check)
        backup = apply_fix(plan.fix, step_names=plan.step_names)
        if self.catalog is not None:
            from ckpt_audit.catalog.tracker_log import record_fix

            record_fix(self.catalog.db, plan.fix, at_ns=plan.planned_ns, backup_path=backup)
        return TrackerWrite(reread=check, backup=backup)

    def _close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None


@contextlib.contextmanager
def open_session(catalog_path: StrPath | None, *, roots: Sequence[str | Path] = ()) -> Iterator[Session]:
    """Check `roots`, probe the catalog, hold its lock for the body. Raises SessionError or lock.Locked at once."""
    from ckpt_audit.catalog.manifest import CatalogError, probe

    try:
        real = [check_root(r) for r in roots]
    except ScanError as exc:
        raise SessionError(str(exc)) from None
    if catalog_path is None:
        yield Session(None, real)
        return
    try:
        probe(catalog_path)
        with lock.hold(lock.lock_path_for(catalog_path)):
            session = Session(catalog_path, real)
            try:
                yield session
            finally:
                session._close()
    except (CatalogError, ScanError) as exc:
        raise SessionError(str(exc)) from None


def run_named(result: ScanResult, run: str | Path) -> Run:
    """The run `run` names in a scan of it; a path that is not one run directory is a SessionError (exit 3)."""
    from ckpt_audit.remote import is_remote, normal

    real = normal(str(run)) if is_remote(run) else os.path.realpath(run)
    match = [r for r in result.runs if r.path == real]
    if match:
        return match[0]
    if len(result.runs) > 1:
        raise SessionError(f"{real} holds {len(result.runs)} runs; name one of them")
    if result.runs:
        raise SessionError(f"{real} is not a run directory (its run is {result.runs[0].path})")
    raise SessionError(f"{real} is not a checkpoint run (no tracker, no global_step_N)")


def verify_paths(paths: Sequence[str | Path], **options) -> ScanResult:
    from ckpt_audit.verify import verify  # torch, lazily: only deep checks need it

    return verify(list(paths), **options)


def read_kept_deep(catalog_path: StrPath | None, *, conn: sqlite3.Connection | None = None) -> dict[str, DeepVerdict]:
    from ckpt_audit.catalog.deep_verdicts import read_deep_verdicts

    return read_deep_verdicts(catalog_path, conn=conn)


def scan_any(roots: Sequence[str | Path], **options) -> ScanResult:
    """scan.scan, or for s3:// roots the remote scan (ckpt_audit.remote.scan: listing and stored checksums,
    the same layouts and verdicts); a remote root's trouble is a ScanError like a local one's."""
    from ckpt_audit.remote import RemoteError, is_remote
    from ckpt_audit.scan import scan  # when a command scans: ls, show and the TUI's reads load none of it

    if not any(is_remote(r) for r in roots):
        return scan(roots, **options)
    from ckpt_audit.remote.scan import scan_remote

    keep = ("previous", "now_ns", "rehash")
    try:
        return scan_remote(
            [str(r) for r in roots],
            window_s=options.get("in_progress_window_s", IN_PROGRESS_WINDOW_S),
            **{k: v for k, v in options.items() if k in keep},
        )
    except RemoteError as exc:
        raise ScanError(str(exc)) from None


def preview_of(plan: PrunePlan, runs: Sequence[Run]) -> PrunePreview:
    """A plan made from a scan already recorded (the TUI's, from its snapshot) as a preview `Session.prune` takes:
    not re-read yet, no trash to reclaim beyond the plan's own run directories."""
    from ckpt_audit.answers import PrunePreview
    from ckpt_audit.lifecycle.survivors import SurvivorCheck

    check = SurvivorCheck(plan=plan, runs=tuple(runs))
    return PrunePreview(scanned=None, check=check, checked=False, trash=(), reclaim_dirs=())


def verify_plan(plan: PrunePlan, runs: Sequence[Run], **options) -> SurvivorCheck:
    """Re-read what `plan` counts on (lifecycle.survivors.verify_plan); nothing is written."""
    from ckpt_audit.lifecycle.survivors import verify_plan

    return verify_plan(plan, runs, **options)


def _per_outcome(progress: Progress, total: int) -> Callable[[Outcome], None]:
    """prune.execute's per-outcome callback as a Progress: the count so far and the outcome's line."""
    done = 0

    def tick(outcome: Outcome) -> None:
        nonlocal done
        done += 1
        detail = f" ({outcome.detail})" if outcome.detail else ""
        progress(done, max(total, done), f"{outcome.action}: {outcome.path}{detail}")

    return tick
