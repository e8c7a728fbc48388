"""The scan pipeline: walk, read, reuse, reduce.

`scan_partial(root)` walks one root and reads its files into a serialisable `Partial` (no judgement that needs
another subtree); `reduce(partials)` merges them and lets the layouts build runs, so the same code can run one map
task per node of a cluster and reduce centrally. Whether a file is read or reused is the reuse stage's alone
(scan.reuse). No torch, no textual: this is the cron path.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import ckpt_audit.scan.verdicts as vc
from ckpt_audit.codes import finding
from ckpt_audit.layouts import Layout, enclosing_step_dir, load_layouts
from ckpt_audit.models import IN_PROGRESS_WINDOW_S, Finding, many_objects
from ckpt_audit.remote import is_remote  # the package's light __init__ only
from ckpt_audit.roots import ScanError, check_root
from ckpt_audit.scan.read import Progress, Reader, read_all, reading
from ckpt_audit.scan.reduce import reduce
from ckpt_audit.scan.reuse import Caches, ReuseStage
from ckpt_audit.scan.scrub import ScrubPolicy
from ckpt_audit.scan.walk import files_under, walk, without_trash
from ckpt_audit.tree import FileFacts, Tree

if TYPE_CHECKING:
    from pathlib import Path

    from ckpt_audit.models import ScanResult, ShardFile
    from ckpt_audit.rules.deep_verdict import DeepVerdict
    from ckpt_audit.tree import Partial


def scan(
    roots: Sequence[str | Path],
    *,
    workers: int = 2,
    rehash: bool = False,
    previous: Mapping[str, FileFacts | ShardFile] | None = None,
    progress: Progress | None = None,
    in_progress_window_s: float = IN_PROGRESS_WINDOW_S,
    now_ns: int | None = None,
    scrub: ScrubPolicy | None = None,
    reader: Reader | None = None,
    verdicts: vc.Source | None = None,
    deep: Mapping[str, DeepVerdict] | None = None,
    kept_models: bool = True,
) -> ScanResult:
    """Scan `roots`: directories above runs, runs, or step directories (and paths inside them).

    `verdicts`: where kept run verdicts are (scan.verdicts.Source); None: every run is judged afresh.
    `deep`: the deep verdicts the catalog keeps (catalog.deep_verdicts), which bind each checkpoint's judgement
    while the files they read are unchanged (rules.deep_verdict); None: the shallow verdict alone (verify's own scan).
    `kept_models`: decode the kept runs' models during the scan; False: `runs` answers them from their stored
    summaries and decodes them only when walked (models.LazyRuns: what `scan -q` and the record step read needs none).

    `scrub` re-reads a rolling share of the files the catalog could vouch for (scan.scrub); None: reuse them all.
    Its budget is shared by the roots, in order.

    A path at or inside a step directory scans that checkpoint alone: its run is walked (the tracker and the
    neighbours' names are needed to judge it) but only the checkpoint's files are read, and the result holds
    only that checkpoint, so recording it changes nothing else in the catalog.
    """
    # the one pause of the cyclic GC: the walk, the facts and the kept runs' models are objects by the hundred
    # thousand, none in a cycle, and each collection would walk the whole growing heap again (bench/README.md)
    if any(is_remote(r) for r in roots):  # the session scans these (ckpt_audit.remote.scan)
        raise ScanError("s3:// roots are read by scan, ls, show, latest and compare only (docs/remote.md)")
    with many_objects():
        started = time.time_ns()
        real_roots = [check_root(r) for r in roots]
        walk_roots, focus = focus_of(real_roots)
        layouts = load_layouts()
        now = now_ns if now_ns is not None else started
        window_ns = int(in_progress_window_s * 1e9)
        deep = deep or {}
        # a run seen by two nested roots would mix kept and judged facts; a checkpoint asked for alone is judged
        kept = None if focus or vc.nested(walk_roots) else verdicts
        stamps = vc.deep_stamps(deep)
        partials: list[Partial] = []
        for r in walk_roots:
            caches = Caches(
                previous=previous if previous is not None else {},  # not `or`: a lazy manifest loads on bool()
                verdicts=kept,
                scrub=_budget_left(scrub, partials),
                rehash=rehash,
                deep_stamps=stamps,
                kept_models=kept_models,
            )
            partials.append(
                scan_partial(
                    r,
                    workers=workers,
                    progress=progress,
                    layouts=layouts,
                    focus=focus,
                    caches=caches,
                    now_ns=now,
                    reader=reader,
                    window_ns=window_ns,
                )
            )
        from ckpt_audit.rules.status import ScanContext  # made on first use, as is the judged model: off start-up

        ctx = ScanContext(now_ns=now, in_progress_window_ns=window_ns, deep=deep)
        result = reduce(partials, ctx=ctx, layouts=layouts, kept=kept)
        if focus:
            result = only_checkpoints(result, focus, whole=frozenset(walk_roots) - {os.path.dirname(f) for f in focus})
        return replace(result, roots=tuple(real_roots), started_ns=started, finished_ns=time.time_ns())


def _budget_left(scrub: ScrubPolicy | None, done: Sequence[Partial]) -> ScrubPolicy | None:
    if scrub is None or scrub.budget_bytes is None:
        return scrub
    return replace(scrub, budget_bytes=max(0, scrub.budget_bytes - sum(p.bytes_scrubbed for p in done)))


def focus_of(real_roots: Sequence[str]) -> tuple[list[str], frozenset[str]]:
    """(directories to walk, checkpoint directories asked for by a path at or inside them).

    A checkpoint is judged with its run (tracker, world size of its neighbours), so for a path inside a step
    directory the run is walked instead; a root that is not inside any step directory is walked as it is.
    """
    walk_roots: list[str] = []
    focus: set[str] = set()
    for root in real_roots:
        step_dir = enclosing_step_dir(root)
        target = os.path.dirname(step_dir) if step_dir else root
        if step_dir:
            focus.add(step_dir)
        if target not in walk_roots:
            walk_roots.append(target)
    # a run asked for whole and also through one of its steps: the whole run wins
    focus = {f for f in focus if not any(f.startswith(r.rstrip("/") + "/") and r in real_roots for r in walk_roots)}
    return walk_roots, frozenset(focus)


def only_checkpoints(result: ScanResult, focus: frozenset[str], *, whole: frozenset[str]) -> ScanResult:
    """The result cut down to the checkpoints in `focus` (runs under a root in `whole` are kept entire).

    Run-level judgements about checkpoints that were not read do not belong to a focused result: the tracker's
    verdict on its target is kept only when the target is one of them.
    """
    runs = []
    for run in result.runs:
        if any(run.path == w or run.path.startswith(w.rstrip("/") + "/") for w in whole):
            runs.append(run)
            continue
        keep = tuple(c for c in run.checkpoints if c.path in focus)
        if not keep:
            continue
        kept_steps = {c.step for c in keep}
        found = tuple(
            f
            for f in run.findings
            if f.code not in RUN_WIDE_CODES
            and not (f.code == "tracker-dangling" and run.tracker_step not in kept_steps)
        )
        runs.append(replace(run, checkpoints=keep, findings=found))
    return replace(result, runs=tuple(runs))


# findings about a run's checkpoints taken together: a focused scan did not read them all
RUN_WIDE_CODES = frozenset({"no-complete-checkpoint", "tracker-behind", "hf-last-checkpoint-unusable"})


# -- map ------------------------------------------------------------------------------------------------------


def scan_partial(
    root: str,
    *,
    workers: int = 2,
    progress: Progress | None = None,
    layouts: Sequence[Layout] | None = None,
    focus: frozenset[str] = frozenset(),
    caches: Caches | None = None,
    now_ns: int | None = None,
    reader: Reader | None = None,
    window_ns: int = int(IN_PROGRESS_WINDOW_S * 1e9),
) -> Partial:
    """Walk `root`, let the reuse stage say what to read, read it, and bundle the facts (nothing judged yet)."""
    now = now_ns if now_ns is not None else time.time_ns()
    caches = caches if caches is not None else Caches()
    layouts = layouts if layouts is not None else load_layouts()
    tree, stats, found = walk(root)
    owners = claim_runs(tree, layouts)
    if not owners:  # cron must not report "clean" for an empty mount point
        found.append(finding("no-runs", root, "no checkpoint runs found under this root"))
    run_files = files_under(owners, stats)
    paths, leftovers = files_to_read(run_files, stats, focus)
    found.extend(leftovers)
    stage = ReuseStage(
        root,
        tree=tree,
        stats=stats,
        owners=owners,
        run_files=run_files,
        walk_findings=found,
        layouts=layouts,
        caches=caches,
        focus=bool(focus),
        now_ns=now,
        window_ns=window_ns,
    )
    first, overdue = stage.first(paths)
    found.extend(overdue)
    # the scrub's re-reads take the catalog's structure facts when the bytes read back the same; --rehash re-parses
    reader = reader or (read_all if caches.rehash else functools.partial(read_all, reparse=False))
    read = reading(reader, stats, stage.lookup(), stage.kinds, workers=workers, now_ns=now, progress=progress)
    total = sum(stats[p].st_size for p in first)
    again = stage.settle(dict(read(first, total=total)))
    if again:  # rows the stat cache cannot vouch for after all (a row from an older release): read them now
        stage.facts.update(read(again, total=total + sum(stats[p].st_size for p in again)))
    return _partial(root, tree, found, stage, owners, paths)


def claim_runs(tree: Tree, layouts: Sequence[Layout]) -> dict[str, str]:
    """Run dir -> the layout that claims it first (as reduce decides)."""
    owners: dict[str, str] = {}
    for layout in layouts:
        for d in layout.find_runs(tree):
            owners.setdefault(d, layout.name)
    return owners


def files_to_read(
    run_files: Mapping[str, list[str]], stats: Mapping[str, os.stat_result], focus: frozenset[str]
) -> tuple[list[str], list[Finding]]:
    """The runs' files, sorted, outside prune's trash (and the findings for what it holds); for a checkpoint asked
    for alone, its files and the run's own (tracker), not its neighbours'."""
    below = [p for files in run_files.values() for p in files]
    # runs hold disjoint files unless nested; sorting the runs' sorted lists together is a merge (timsort)
    paths, leftovers = without_trash(sorted(set(below) if vc.nested(list(run_files)) else below), stats)
    if focus:
        paths = [p for p in paths if _in_focus(p, focus)]
    return paths, leftovers


def _in_focus(path: str, focus: frozenset[str]) -> bool:
    parent = os.path.dirname(path)
    return any(path.startswith(f + "/") or parent == os.path.dirname(f) for f in focus)


def _partial(root: str, tree: Tree, found: list[Finding], stage: ReuseStage, owners, paths) -> Partial:
    facts, read, scrubbed = stage.facts, stage.read_paths, stage.scrub.paths
    hashed = [p for p in read if facts[p].hash is not None]
    from ckpt_audit.tree import Partial  # made on first use, as is the judged model: off start-up

    return Partial(
        root=root,
        tree=tree,
        facts=facts,
        findings=tuple(found),
        files_hashed=len(hashed),
        files_reused=len(paths) - len(read),
        reused_paths=stage.reused_paths(paths),
        bytes_hashed=sum(facts[p].size_bytes for p in hashed),
        files_scrubbed=sum(1 for p in scrubbed if facts[p].hash is not None),
        bytes_scrubbed=sum(facts[p].size_bytes for p in scrubbed if facts[p].hash is not None),
        run_digests=stage.digests,
        reused_runs=stage.runs,
        kept_models=stage.models,
        kept_reread=frozenset(stage.reread),
        reused_rows=stage.kept_rows(),
        owners=owners,
    )
