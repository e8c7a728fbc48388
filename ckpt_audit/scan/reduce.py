"""Merging partials and judging: the layouts build every run not kept from the catalog, and the verdict keys of
the runs judged now are worked out for the catalog to keep."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping, Sequence
from dataclasses import replace
from operator import attrgetter
from typing import TYPE_CHECKING

import ckpt_audit.scan.verdicts as vc
from ckpt_audit.codes import UNREAD_CODES
from ckpt_audit.layouts import Layout, load_layouts
from ckpt_audit.models import Finding, LazyRuns, Run, ScanResult
from ckpt_audit.tree import FileFacts, Tree

if TYPE_CHECKING:
    from ckpt_audit.rules.status import ScanContext
    from ckpt_audit.tree import Partial


def merge_partials(partials: Sequence[Partial]) -> tuple[Tree, Mapping[str, FileFacts], tuple[Finding, ...]]:
    if len(partials) == 1:  # a local scan of one root: nothing to merge (re-sorting each directory cost ~0.5 s/100k)
        return partials[0].tree, partials[0].facts, tuple(partials[0].findings)
    dirs: dict[str, tuple[str, ...]] = {}
    files: dict[str, tuple[str, ...]] = {}
    dir_mtimes: dict[str, int] = {}
    links: dict[str, str] = {}
    facts: dict[str, FileFacts] = {}
    found: list[Finding] = []
    for part in partials:
        links.update(part.tree.links)
        for d, mtime in part.tree.dir_mtime_ns.items():
            dir_mtimes[d] = max(mtime, dir_mtimes.get(d, 0))
        for d, subs in part.tree.dirs.items():
            dirs[d] = tuple(sorted(set(dirs.get(d, ())) | set(subs)))
        for d, names in part.tree.files.items():
            files[d] = tuple(sorted(set(files.get(d, ())) | set(names)))
        for p, f in part.facts.items():
            facts.setdefault(p, f)  # the same path seen from two nodes: the first partial wins
        found.extend(part.findings)
    return Tree(dirs=dirs, files=files, dir_mtime_ns=dir_mtimes, links=links), facts, tuple(found)


def reduce(
    partials: Sequence[Partial],
    *,
    ctx: ScanContext,
    layouts: Sequence[Layout] | None = None,
    kept: vc.Source | None = None,
) -> ScanResult:
    """The scan's result from its partials; `kept`: where the partials' kept runs were found, which decodes their
    models when they were not decoded during the scan."""
    layouts = layouts if layouts is not None else load_layouts()
    tree, facts, walk_findings = merge_partials(partials)
    # "no runs" speaks of a root, not of one node's copy of it: a node whose copy holds none is normal
    found_runs = {p.root for p in partials if not any(f.code == "no-runs" for f in p.findings)}
    walk_findings = tuple(f for f in walk_findings if not (f.code == "no-runs" and f.path in found_runs))
    changed = frozenset(p for p, f in facts.items() if any(x.code == "file-changed-during-scan" for x in f.findings))
    unread = tuple(f for f in walk_findings if f.code in UNREAD_CODES)
    ctx = replace(ctx, changed_paths=ctx.changed_paths | changed, unread=ctx.unread + unread)
    by_name = {layout.name: layout for layout in layouts}
    known = partials[0].owners if len(partials) == 1 else None  # one partial: its tree is the merged tree
    if known is not None and all(name in by_name for name in known.values()):
        owner = {d: by_name[name] for d, name in known.items()}
    else:
        owner = {}
        for layout in layouts:
            for d in layout.find_runs(tree):
                owner.setdefault(d, layout)
    reused = {d: kept for part in partials for d, kept in part.reused_runs.items()}
    judged = [owner[d].build_run(d, tree, facts, ctx) for d in sorted(owner) if d not in reused]
    keys, unrowed = _verdict_keys(partials, judged, tree, facts, ctx, layouts, owner)
    keys |= {d: key for d, (key, _summary) in reused.items()}
    decoded = {d: m for part in partials for d, m in part.kept_models.items()}
    runs: Sequence[Run]
    if decoded.keys() == reused.keys():
        runs = tuple(sorted([*judged, *decoded.values()], key=_PATH))
    else:
        assert kept is not None, "kept runs come from a verdict source"
        runs = LazyRuns(judged, reused, kept.runs)
    # a walk finding inside a checkpoint (or on a run's tracker) now belongs to it: report it once (a kept run has
    # none: a walk finding inside a run leaves it unsettled)
    attached = {f for run in judged for f in (*run.findings, *(x for c in run.checkpoints for x in c.findings))}
    return ScanResult(
        roots=tuple(p.root for p in partials),
        runs=runs,
        findings=tuple(f for f in walk_findings if f not in attached),
        files_hashed=sum(p.files_hashed for p in partials),
        files_reused=sum(p.files_reused for p in partials),
        bytes_hashed=sum(p.bytes_hashed for p in partials),
        reused_paths=frozenset().union(*(p.reused_paths for p in partials)),
        files_scrubbed=sum(p.files_scrubbed for p in partials),
        bytes_scrubbed=sum(p.bytes_scrubbed for p in partials),
        file_facts=vc.WithRows(facts, rows) if (rows := _reused_rows(partials)) else facts,
        run_keys=keys,
        run_unrowed=unrowed,
        runs_reused=frozenset(reused),
        kept_reread=frozenset().union(*(p.kept_reread for p in partials)),
    )


_PATH = attrgetter("path")


def _reused_rows(partials: Sequence[Partial]) -> Mapping[str, tuple]:
    """The reused runs' catalog rows of every partial, still unread (verdicts.LaterRows)."""
    rows = [part.reused_rows for part in partials if part.reused_rows]
    return rows[0] if len(rows) == 1 else ChainMap(*rows)  # type: ignore[arg-type]  # read only: nothing writes


def _verdict_keys(partials, runs, tree, facts, ctx, layouts, owner) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(run -> its verdict cache key, run -> its files the catalog keeps no row for), for the settled runs whose
    every file was read (or reused) cleanly: the catalog keeps these verdicts. A file of the run's checkpoints has a
    catalog row; the rest enter by their facts, and are listed with the verdict (read every scan)."""
    digests = {d: g for part in partials for d, g in part.run_digests.items()}
    names = [layout.name for layout in layouts]
    stamps = vc.deep_stamps(ctx.deep) if ctx.deep else {}
    keys: dict[str, str] = {}
    unrowed: dict[str, list[str]] = {}
    for run in runs:
        if run.path not in digests:
            continue
        files = list(tree.files_below(run.path))
        if not all(p in facts and vc.clean(facts[p]) for p in files):
            continue
        rowed = {f.path for c in run.checkpoints for f in c.all_files}
        unrowed[run.path] = [p for p in files if p not in rowed]
        keys[run.path] = vc.run_key(
            run.path,
            digests[run.path],
            layout=owner[run.path].name,
            layouts=names,
            window_ns=ctx.in_progress_window_ns,
            unrowed={p: facts[p] for p in unrowed[run.path]},
            deep=stamps.get(run.path, ""),
        )
    return keys, unrowed
