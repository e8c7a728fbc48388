"""The one service layer under both front ends: a catalog held under its lock, with the actions as calls.

The CLI and the TUI do the same thing for the same action because both call these: `scan`, `verify`,
`plan_prune` then `prune`, `export` (and `record` for a scan made elsewhere). Every catalog write either front end
makes goes through a `Session`, which exists only while its lock (ckpt_audit/lock.py) is held, so a write never
overlaps a cron run.
Front ends only parse, call, render and map errors to exit codes; nothing here prints.

Opening: `with open_session(catalog_path, roots=...) as s:` checks the roots, probes the catalog, then holds the
lock for the whole body; it raises SessionError (a bad root or catalog: exit 3) or lock.Locked (exit 4) and
never waits. The catalog itself is opened on first write, so a scan reads files before sqlite_utils is imported.

Reads never wait for the lock: `browse` scans with the catalogued hashes (a WAL read, fine while a cron run
writes) and records through a session only if the lock is free; `latest` (the resume gate) does the same for one
run; `reading` opens the catalog read-only for `ls`, `show` and viewers.

A new action is one more method (as `plan_fix_tracker` then `fix_tracker`): do the work, write through
`self.catalog`.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ckpt_audit import lock, scanner
from ckpt_audit.answers import LatestAnswer, Pruned, PrunePreview, Recorded, TrackerPlan, TrackerWrite
from ckpt_audit.models import IN_PROGRESS_WINDOW_S

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from ckpt_audit.catalog.store import Catalog
    from ckpt_audit.lifecycle.export import ExportResult
    from ckpt_audit.lifecycle.prune import Outcome, PruneResult
    from ckpt_audit.lifecycle.retention import Policy, PrunePlan
    from ckpt_audit.models import FileFacts, Run, ScanResult
    from ckpt_audit.rules.deep_verdict import DeepVerdict
    from ckpt_audit.scrub import ScrubPolicy

Progress = Callable[[int, int], None]
StrPath = str | os.PathLike[str]  # a catalog path as the front ends hold it (the CLI: str; the TUI: Path)
Locked = lock.Locked


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
        reader: scanner.Reader | None = None,
        cached_verdicts: bool = False,
    ) -> Recorded:
        """Scan `roots` (default: the session's) reusing the catalogued hashes; record it unless `record` is False
        (prune records its scan only once it deletes). `reader`: who reads the files (scanner.Reader; default this
        process; scan --ray's shared placement spreads them over the cluster's nodes). `cached_verdicts`: reuse
        the catalog's run verdicts where nothing they read moved (ckpt_audit.verdict_cache; the cron scan's)."""
        verdicts = None
        if cached_verdicts and self.catalog_path is not None and record:
            from ckpt_audit.catalog.verdicts import CatalogVerdicts

            verdicts = CatalogVerdicts(self.catalog_path)
        result = scan_any(
            list(self.roots if roots is None else roots),
            workers=workers,
            rehash=rehash,
            verdicts=verdicts,
            previous=self.previous,
            progress=progress,
            in_progress_window_s=in_progress_window_s,
            scrub=scrub,
            now_ns=now_ns,
            reader=reader,
            deep=self.kept_deep(),
        )

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
        result = _verify(
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
        return _kept_deep(self.catalog_path)

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
        scanned: ScanResult | None = None,
        reread: Callable | None = None,
        check: bool = True,
    ) -> PrunePreview:
        """Scan the session's roots (not recorded: prune records its scan only once it deletes), fill any best-N
        rule with its metric's values, plan, and (`check`) re-read what the plan counts on, so the plan shown is
        the checked one. Writes nothing. Raises PlanError. prune --ray passes the cluster's union scan (`scanned`)
        and its nodes' re-read (`reread`)."""
        import dataclasses

        from ckpt_audit.lifecycle.links import links_for
        from ckpt_audit.lifecycle.prune import find_trash
        from ckpt_audit.lifecycle.retention import KeepBest, metric_problem, plan_prune, read_metric
        from ckpt_audit.lifecycle.survivors import SurvivorCheck

        if scanned is None:
            scanned = self.scan(now_ns=now_ns, record=False).result
        runs = scanned.runs
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
        survivors = self.check_survivors(plan, runs, reread=reread) if check else SurvivorCheck(plan=plan, runs=runs)
        reclaim = tuple(sorted({r.path for r in runs} | {os.path.dirname(c.path) for r in runs for c in r.checkpoints}))
        return PrunePreview(
            scanned=scanned, check=survivors, checked=check, trash=tuple(find_trash(reclaim)), reclaim_dirs=reclaim
        )

    def check_survivors(
        self, plan: PrunePlan, runs: Sequence[Run], *, progress: Progress | None = None, reread: Callable | None = None
    ):
        """Re-read what `plan` counts on (lifecycle.survivors.verify_plan); nothing is written."""
        from ckpt_audit.lifecycle.survivors import verify_plan

        return verify_plan(plan, runs, progress=progress, read=reread)

    def prune(
        self,
        plan: PrunePlan,
        runs: Sequence[Run],
        *,
        confirmed: bool,
        scanned: ScanResult | None = None,
        reclaim_dirs: Iterable[str] = (),
        progress: Callable[[Outcome], None] | None = None,
        reread_progress: Progress | None = None,
        reread: Callable | None = None,
        execute: Callable[..., PruneResult] | None = None,
    ) -> Pruned:
        """Re-read what `plan` counts on now, immediately before the first deletion (`check_survivors`), then delete
        the checked plan crash-safely, logged in the catalog. Both front ends call this once they may act: after a
        person confirmed `plan` (`confirmed`: if the re-read changes what goes, nothing is deleted and the result is
        None) or at once (prune --yes: the checked plan is executed). First the scan the plan came from
        (`scanned`) is recorded and what the re-read found is kept (a failure must outlive the next cached scan).
        `reread` / `execute`: who re-reads a checkpoint and who carries the plan out (prune --ray: the nodes)."""
        from ckpt_audit.catalog.lifecycle import LifecycleLog
        from ckpt_audit.lifecycle import prune

        check = self.check_survivors(plan, runs, progress=reread_progress, reread=reread)
        cat = self.catalog
        if cat is not None:
            if scanned is not None:
                cat.record_scan(scanned)
            cat.record_rereads(check.rereads)
        if confirmed and {i.path for i in check.plan.delete} != {i.path for i in plan.delete}:
            return Pruned(check=check, result=None)
        result = (execute or prune.execute)(
            check.plan,
            catalog=None if cat is None else LifecycleLog(cat.db),
            reclaim_dirs=reclaim_dirs,
            progress=progress,
            reread=check.outcomes(),
        )
        return Pruned(check=check, result=result)

    def export(self, step_dir: str | Path, to: str | Path, **options) -> ExportResult:
        """Export one checkpoint to a HuggingFace directory, recorded in the catalog
        (options: lifecycle.export.export_checkpoint's). Raises ExportError / ExportRefused."""
        from ckpt_audit.catalog.lifecycle import LifecycleLog
        from ckpt_audit.lifecycle.export import export_checkpoint

        cat = self.catalog
        return export_checkpoint(step_dir, to, catalog=None if cat is None else LifecycleLog(cat.db), **options)

    def plan_fix_tracker(
        self,
        run: str | Path,
        *,
        in_progress_window_s: float = IN_PROGRESS_WINDOW_S,
        now_ns: int | None = None,
    ) -> TrackerPlan:
        """Scan `run` (recorded: the catalog sees the run now), read its tracker and plan the repair
        (lifecycle.tracker_fix.plan_fix). Writes no tracker. Raises SessionError when `run` is not one run."""
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
        real = [scanner.check_root(r) for r in roots]
    except scanner.ScanError as exc:
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
    except (CatalogError, scanner.ScanError) as exc:
        raise SessionError(str(exc)) from None


def browse(
    roots: Sequence[str], catalog_path: StrPath | None, *, deep: bool = False, progress: Progress | None = None
) -> tuple[ScanResult, str]:
    """Scan (`deep`: verify, re-reading every file) `roots` without waiting for the lock, reusing the catalogued
    hashes, then record it if the lock is free. Returns the result and "" or why it was not recorded: a busy
    catalog is no error for a viewer (the cron run that holds it records its own scan)."""
    previous = _previous(catalog_path)
    if deep:
        result = _verify(roots, previous=previous, progress=progress, rehash=True)
    else:
        result = scanner.scan(list(roots), previous=previous, progress=progress, deep=_kept_deep(catalog_path))
    return result, record_if_free(result, catalog_path)


def record_if_free(result: ScanResult, catalog_path: StrPath | None) -> str:
    """Record `result` through a session if the lock is free; "" or why it was not recorded."""
    if catalog_path is None:
        return "no catalog"
    try:
        with open_session(catalog_path) as session:
            session.record(result)
    except lock.Locked:
        return "catalog locked by another run"
    except sqlite3.OperationalError as exc:  # a writer outside the lock kept the database busy
        return f"catalog busy ({exc})"
    except (OSError, SessionError) as exc:  # a catalog this user may read but not write: browsing goes on
        return f"catalog not writable ({getattr(exc, 'strerror', None) or exc})"
    return ""


def latest(
    run: str | Path,
    catalog_path: StrPath | None,
    *,
    verified: bool = False,
    max_age_ns: int = 0,
    in_progress_window_s: float = IN_PROGRESS_WINDOW_S,
) -> LatestAnswer:
    """The resume gate for `run` (lifecycle.latest.gate): scan it with the catalogued hashes (a stale or absent
    catalog still gives a true answer); with `verified`, read the candidate by content now (hash + CRC of every
    file against the catalog; `max_age_ns` > 0: unless it was read within that age), falling back to the next
    one when that read fails; then record the scans if the lock is free: a job script's gate never waits for, nor
    fails on, a cron scan holding the lock or a catalog it may not write. Raises SessionError when `run` is not one
    run."""
    from ckpt_audit.lifecycle.latest import gate, oldest_verified

    previous = _previous_or_empty(catalog_path)
    deep = _kept_deep_or_empty(catalog_path)
    started = time.time_ns()  # a file read by content from here on was read "now"
    try:
        real = scanner.check_root(run)
        result = scan_any([real], previous=previous, in_progress_window_s=in_progress_window_s, deep=deep)
    except scanner.ScanError as exc:
        raise SessionError(str(exc)) from None
    the_run = run_named(result, run)
    scans = [result]

    def read_at(scan: ScanResult) -> dict[str, int | None]:
        # when each file was last read by content; with no max age only this call's reads count (never a catalog
        # time, which a clock stepped back could place after `started`)
        return {p: f.verified_ns for p, f in scan.file_facts.items() if max_age_ns or not f.reused}

    verified_at = read_at(result)
    reread: set[str] = set()
    while True:
        g = gate(
            the_run,
            verified=verified_at if verified else None,
            now_ns=started,
            max_age_ns=max_age_ns,
            reread=frozenset(reread),
        )
        if g.reread is None:
            break
        # read the candidate by content now; what that read finds (hash drift, a bad CRC) is its verdict
        focused = scan_any(
            [g.reread.path], previous=previous, in_progress_window_s=in_progress_window_s, rehash=True, deep=deep
        )
        scans.append(focused)
        fresh = {c.path: c for r in focused.runs for c in r.checkpoints}
        the_run = replace(the_run, checkpoints=tuple(fresh.get(c.path, c) for c in the_run.checkpoints))
        verified_at.update(read_at(focused))
        reread.add(g.reread.path)
    not_recorded = ""
    for s in scans:
        if not_recorded := record_if_free(s, catalog_path):
            break
    return LatestAnswer(
        run=the_run,
        gate=g,
        verified_ns=None if g.chosen is None else oldest_verified(g.chosen, verified_at),
        reread=tuple(sorted(reread)),
        files_reused=scans[0].files_reused,
        files_read=sum(s.files_hashed for s in scans),
        not_recorded=not_recorded,
    )


def scan_any(roots: Sequence[str | Path], **options) -> ScanResult:
    """scanner.scan, or for s3:// roots the remote scan (ckpt_audit.remote.scan: listing and stored checksums,
    the same layouts and verdicts); a remote root's trouble is a scanner.ScanError like a local one's."""
    from ckpt_audit.remote import RemoteError, is_remote

    if not any(is_remote(r) for r in roots):
        return scanner.scan(roots, **options)
    from ckpt_audit.remote.scan import scan_remote

    keep = ("previous", "now_ns", "rehash")
    try:
        return scan_remote(
            [str(r) for r in roots],
            window_s=options.get("in_progress_window_s", IN_PROGRESS_WINDOW_S),
            **{k: v for k, v in options.items() if k in keep},
        )
    except RemoteError as exc:
        raise scanner.ScanError(str(exc)) from None


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


@contextlib.contextmanager
def reading(catalog_path: StrPath) -> Iterator[Catalog]:
    """The catalog opened read-only, without the lock: `ls`, `show` and viewers answer while a cron run writes (a
    WAL read), for a user who can write neither the catalog nor its directory. Raises SessionError."""
    from ckpt_audit.catalog import CatalogError, read_catalog

    try:
        cat = read_catalog(catalog_path)
    except CatalogError as exc:
        raise SessionError(str(exc)) from None
    with cat:
        yield cat


def _verify(paths: Sequence[str | Path], **options) -> ScanResult:
    from ckpt_audit.verify import verify  # torch, lazily: only deep checks need it

    return verify(list(paths), **options)


def _previous(catalog_path: StrPath | None) -> dict | None:
    """The catalogued facts to reuse by stat (a WAL read: fine while a cron scan writes); None without a catalog."""
    if catalog_path is None or not os.path.exists(catalog_path):
        return None
    from ckpt_audit.catalog.manifest import read_previous

    return read_previous(catalog_path)


def _kept_deep(catalog_path: StrPath | None) -> dict[str, DeepVerdict]:
    from ckpt_audit.catalog.deep_verdicts import read_deep_verdicts

    return read_deep_verdicts(catalog_path)


def _kept_deep_or_empty(catalog_path: StrPath | None) -> dict[str, DeepVerdict]:
    """The kept deep verdicts; {} when the catalog is absent or unreadable (as _previous_or_empty)."""
    from ckpt_audit.catalog.manifest import CatalogError

    try:
        return _kept_deep(catalog_path)
    except CatalogError:
        return {}


def _previous_or_empty(catalog_path: StrPath | None) -> dict:
    """The catalogued facts; {} when the catalog is absent or unreadable (the run is then read in full)."""
    from ckpt_audit.catalog.manifest import CatalogError

    try:
        return _previous(catalog_path) or {}
    except CatalogError:
        return {}
