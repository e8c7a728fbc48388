"""The reuse stage: the one place a scan decides, file by file, whether to read a file or to reuse what the catalog
holds of it. Three caches behind one interface:

    kept runs   a settled run whose stored verdict key still matches (scan.verdicts) keeps its verdict: its
                catalogued files are not read, and its model comes from the catalog, all kept runs in one query;
    stat cache  any other file whose stat matches a clean catalog row reuses that row (read.vouched);
    scrub       a rolling share of what the two would reuse is read again by content (scan.scrub); a kept run's
                file that reads back different makes the run judged afresh.

Everything else is read. The stage runs in two steps around the reads: `first()` names what must be read before
the kept runs can be decided (every file no cache vouches for, the kept runs' files without a row, the scrub's
share); `settle()` decides the kept runs from what those reads found and names what is left to read (the files of a
run that turned out to be judged afresh, when their rows cannot vouch). What was reused is the stage's explicit
marker (`reused_paths()`, `runs`, `kept_rows()`), which reduce and the record step take as it is.
"""

from __future__ import annotations

import heapq
import itertools
import os
from bisect import bisect_left
from collections.abc import Generator, Iterable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter

import ckpt_audit.scan.verdicts as vc
from ckpt_audit.codes import finding
from ckpt_audit.layouts import Layout, file_kind
from ckpt_audit.models import FileKind, Finding, Run, RunSummary, ShardFile, format_size
from ckpt_audit.readers import hashing
from ckpt_audit.scan.read import reused, vouched
from ckpt_audit.scan.scrub import ScrubPlan, ScrubPolicy, oldest_first, plan_ordered
from ckpt_audit.scan.walk import subtree
from ckpt_audit.tree import FileFacts, Tree


@dataclass(frozen=True, slots=True, kw_only=True)
class Caches:
    """What a root's scan may reuse: the stat cache (`previous`: path -> catalogued facts; a lazy manifest loads on
    first lookup), the kept verdicts (`verdicts`: None, judge every run), the scrub (None: reuse without re-reading).
    `rehash`: reuse nothing (every file read, every run judged; what is read is kept)."""

    previous: Mapping[str, FileFacts | ShardFile] = field(default_factory=dict)
    verdicts: vc.Source | None = None
    scrub: ScrubPolicy | None = None
    rehash: bool = False
    deep_stamps: Mapping[str, str] = field(default_factory=dict)  # run -> its recorded deep verdicts (vc.deep_stamps)
    # the kept runs' models decoded now (a consumer will walk them: --json, the text report); False: answered from
    # their summaries, decoded only if asked for later (models.LazyRuns; a cron `scan -q` never asks)
    kept_models: bool = True


class ReuseStage:
    """Read-or-reuse for one root's files (`paths`, sorted; `run_files`: settled-run candidates come from them)."""

    def __init__(
        self,
        root: str,
        *,
        tree: Tree,
        stats: Mapping[str, os.stat_result],
        owners: Mapping[str, str],
        run_files: Mapping[str, list[str]],
        walk_findings: Sequence[Finding],
        layouts: Sequence[Layout],
        caches: Caches,
        focus: bool,
        now_ns: int,
        window_ns: int,
    ) -> None:
        self.root, self.stats, self.owners, self.layouts, self.caches = root, stats, owners, layouts, caches
        self.now_ns, self.window_ns = now_ns, window_ns
        settled: dict[str, vc.Settled] = {}
        if caches.verdicts is not None and not focus:  # --rehash judges every run afresh, and keeps what it judged
            settled = vc.settled_runs(run_files, tree, stats, walk_findings, now_ns=now_ns, window_ns=window_ns)
        self.digests = {r: s.digest for r, s in settled.items()}
        # --store-checksums: a kept verdict would leave its files unread, without the checksums asked for
        fresh = caches.rehash or hashing.store_checksums_enabled()
        self.kept = _Kept.of(settled, caches.verdicts) if settled and not fresh else _Kept()
        self.facts: dict[str, FileFacts] = {}  # what is reused by stat, then what is read
        self.kinds: dict[str, FileKind] = {}
        self.read_paths: list[str] = []
        self.scrub = ScrubPlan()
        self.prior: dict[str, FileFacts | None] = {}  # the kept runs' files read now -> their catalog facts
        self.runs: dict[str, tuple[str, RunSummary]] = {}  # the kept runs: run -> (key, summary)
        self.models: dict[str, Run] = {}  # their models, when decoded now (Caches.kept_models)
        self.rows: list[tuple[list[str], set[str]]] = []  # the kept runs' files, and those of them read now
        self.reread: list[str] = []  # the kept runs' catalogued files the scrub read again (same content)

    def kind(self, path: str) -> FileKind:
        if path not in self.kinds:
            self.kinds[path] = file_kind(path, self.layouts)
        return self.kinds[path]

    def first(self, paths: Sequence[str]) -> tuple[list[str], list[Finding]]:
        """(what to read first, findings: the scrub's overdue files). Everything else is reused by stat now."""
        kept, previous, rehash = self.kept, self.caches.previous, self.caches.rehash
        todo: list[str] = sorted(kept.unrowed)
        for p in todo:
            self.kind(p)
        cached: dict[str, FileFacts] = {}
        # a kept run's files are left out: its verdict may stand (settle() decides, once its unrowed are read)
        for p in kept.outside(paths):
            prev, kind = previous.get(p), self.kind(p)
            if not rehash and vouched(prev, self.stats[p], kind):
                cached[p] = prev
            else:
                todo.append(p)
        self.scrub = plan = self._plan_scrub(cached)
        for p, prev in cached.items():
            if p in plan.paths:
                todo.append(p)
            else:
                self.facts[p] = reused(p, prev, self.stats[p])
        scrubbed_rowed = sorted(p for p in plan.paths if p not in cached)  # the kept runs' (kept.rowed)
        # the catalog's facts of the kept runs' files read now (hash-drift compares them), looked up by path: the
        # whole manifest is loaded only if some run is judged afresh
        self.prior = dict.fromkeys(kept.unrowed)
        self.prior.update(kept.full_facts([*scrubbed_rowed, *kept.unrowed]))
        for p in scrubbed_rowed:
            self.kind(p)
            todo.append(p)
        self.read_paths.extend(todo)
        return todo, self._overdue(plan)

    def lookup(self) -> Mapping[str, FileFacts | ShardFile | None]:
        """What a read compares a file against (hash drift, the scrub's re-reads): the catalog facts looked up for
        the kept runs' files, then the stat cache."""
        return _Chain(self.prior, self.caches.previous)

    def settle(self, read: Mapping[str, FileFacts]) -> list[str]:
        """Decide the kept runs from the facts read (`read` holds every file first() named); what else to read."""
        self.facts.update(read)
        kept, facts, previous = self.kept, self.facts, self.caches.previous
        names = [layout.name for layout in self.layouts]
        # the few files each run has read now, grouped once (a run may hold a hundred thousand files)
        unrowed = kept.by_run(kept.unrowed)
        scrubbed = kept.by_run(p for p in self.scrub.paths if kept.rowed(p))
        standing: dict[str, str] = {}
        for run in kept.runs:
            key = vc.run_key(
                run,
                self.digests[run],
                layout=self.owners[run],
                layouts=names,
                window_ns=self.window_ns,
                unrowed={p: facts[p] for p in unrowed.get(run, ())},
                deep=self.caches.deep_stamps.get(run, ""),
            )
            # a scrubbed file that read back different: the verdict was judged from other bytes
            steady = all(_same(facts[p], self.prior.get(p)) for p in scrubbed.get(run, ()))
            if key == kept.stored[run].key and steady:
                standing[run] = key
        if self.caches.kept_models and standing and kept.source is not None:
            # decoded now: a row that cannot be read back, or whose summary does not match it, is judged afresh
            models = kept.source.runs(standing)
            self.models = {r: m for r, m in models.items() if RunSummary.of(m) == kept.stored[r].summary}
            standing = {r: key for r, key in standing.items() if r in self.models}
        again: list[str] = []
        for run, files in kept.runs.items():
            if run in standing:  # its summary answers; its model is decoded only if asked for (models.LazyRuns)
                self.runs[run] = (standing[run], kept.stored[run].summary)
                self.reread.extend(scrubbed.get(run, ()))
                self.rows.append((files, {*unrowed.get(run, ()), *scrubbed.get(run, ())}))  # less a few read now
                continue
            for p in files:  # judged afresh: its files are reused by stat or read, as in any re-scan
                if p in facts:
                    continue
                prev = previous.get(p)
                if vouched(prev, self.stats[p], self.kind(p)):
                    facts[p] = reused(p, prev, self.stats[p])
                else:
                    again.append(p)
        self.read_paths.extend(again)
        return again

    def reused_paths(self, paths: Sequence[str]) -> frozenset[str]:
        """Of `paths` (the root's files), those not read: their stored rows stand (the record step writes none)."""
        return frozenset(paths).difference(self.read_paths)

    def kept_rows(self) -> Mapping[str, vc.Row]:
        """The kept runs' files not read now -> their catalog rows, read when first asked for (vc.LaterRows)."""
        return vc.LaterRows(self.kept.source, self.root, self.rows) if self.rows and self.kept.source else {}

    def _plan_scrub(self, cached: Mapping[str, FileFacts]) -> ScrubPlan:
        policy, kept, stats = self.caches.scrub, self.kept, self.stats
        if policy is None:
            return ScrubPlan()
        # every file either cache would reuse, with when it was last read by content: the stat cache's here, the
        # kept runs' from the catalog in verified order (a million rows not loaded to take a few)
        verified = {p: f.verified_ns or 0 for p, f in cached.items()}
        newest = [max(verified.values())] if verified else []
        with closing(self._kept_files(newest_first=True)) as latest:
            newest.extend(v for _p, v, _size in itertools.islice(latest, 1))
        if not newest:
            return ScrubPlan()
        mine = ((p, v, stats[p].st_size) for p, v in oldest_first(verified))
        # their bytes: the kept runs' as the digest pass added them up, less their unrowed files' (a stat looked up
        # for each of a million catalog paths cost ~0.7 s at 1M files)
        total = sum(map(_SIZE, map(stats.__getitem__, cached))) + kept.bytes
        total -= sum(map(_SIZE, map(stats.__getitem__, kept.unrowed)))
        with closing(self._kept_files(newest_first=False)) as theirs:  # the query ends with the plan
            return plan_ordered(
                heapq.merge(mine, theirs, key=_AGE),
                newest_ns=max(newest),
                total_bytes=total,
                now_ns=self.now_ns,
                policy=policy,
                budget_bytes=policy.budget_bytes,
            )

    def _kept_files(self, *, newest_first: bool) -> Generator[tuple[str, int, int]]:
        """The kept runs' rowed files in verified order, from the catalog as iterated, with their size as the walk
        saw it."""
        kept = self.kept
        if not kept.runs or kept.source is None:
            return
        for p, v, _size in kept.source.verified_order(list(kept.runs), newest_first=newest_first):
            if kept.rowed(p):  # a row of a file gone since (the run will not stand) is not the scrub's
                yield p, v, self.stats[p].st_size

    def _overdue(self, plan: ScrubPlan) -> list[Finding]:
        if not plan.overdue_files:
            return []
        return [
            finding(
                "scrub-overdue",
                self.root,
                f"{plan.overdue_files} file(s), {format_size(plan.overdue_bytes)}, last verified "
                "by content a scrub period or more ago were not re-read: the --scrub-budget is too small for the "
                "period",
            )
        ]


_SIZE = attrgetter("st_size")
_AGE = itemgetter(1, 0)  # (verified_ns, path): the scrub's order


def _same(read: FileFacts, prior: FileFacts | None) -> bool:
    return prior is not None and vc.same_content(read, prior)  # a row gone since: judged afresh


class _Chain(Mapping):
    """`first`, then `second`: the kept runs' catalog facts ahead of the (lazy) manifest."""

    def __init__(self, first: Mapping, second: Mapping) -> None:
        self.first, self.second = first, second

    def __getitem__(self, key):
        return self.first[key] if key in self.first else self.second[key]

    def get(self, key, default=None):
        return self.first[key] if key in self.first else self.second.get(key, default)

    def __iter__(self):
        raise TypeError("not iterable")

    def __len__(self) -> int:
        raise TypeError("no length")


@dataclass(frozen=True, slots=True)
class _Kept:
    """The settled runs of a root that hold a stored verdict, and how their files stand in the catalog."""

    runs: Mapping[str, list[str]] = field(default_factory=dict)  # run -> its files
    stored: Mapping[str, vc.Stored] = field(default_factory=dict)  # run -> its stored verdict
    # the runs' files the catalog kept no row for when the verdict was judged (the tracker, run-level files), as
    # stored with it: read every scan. The rest have a clean row: they are not read unless scrubbed. Their stat is
    # not compared here: the key holds it, and a row changed since the verdict was stored, or no longer vouching
    # by content, would have deleted it (m007, m011), so a matching key vouches
    unrowed: frozenset[str] = frozenset()
    bytes: int = 0  # the size of their files (the runs' Settled.bytes)
    source: vc.Source | None = None

    def rowed(self, path: str) -> bool:
        """`path` is a file one of the runs holds now, with a row."""
        run = next((d for d in vc.ancestors(path) if d in self.runs), None)
        return run is not None and _holds(self.runs[run], path) and path not in self.unrowed

    def outside(self, paths: Sequence[str]) -> list[str]:
        """Of `paths` (sorted), those of no kept run: each run's files are one slice of them (all of `run/`, and no
        other run's: a kept run is never nested), cut by bisection instead of a lookup per file (~0.6 s at 1M)."""
        out: list[str] = []
        at = 0
        for below in sorted(run + "/" for run in self.runs):  # the slices' order ("a/b-c/" sorts before "a/b/")
            inside = subtree(paths, below, at)
            out.extend(paths[at : inside.start])
            at = inside.stop
        out.extend(paths[at:])
        return out

    @classmethod
    def of(cls, settled: Mapping[str, vc.Settled], source: vc.Source | None) -> _Kept:
        if source is None:
            return cls()
        stored = source.stored()
        runs = {r: s.files for r, s in settled.items() if r in stored}
        if not runs:
            return cls()
        # a listed file gone since has moved the run's digest (judged afresh): only those it holds now are read
        unrowed = frozenset(p for r, files in runs.items() for p in stored[r].unrowed if _holds(files, p))
        size = sum(settled[r].bytes for r in runs)
        return cls(runs=runs, stored=stored, unrowed=unrowed, bytes=size, source=source)

    def by_run(self, paths: Iterable[str]) -> dict[str, list[str]]:
        """Of the runs' files `paths`, run -> those under it, sorted (a kept run is never nested in another)."""
        out: dict[str, list[str]] = {}
        for p in sorted(paths):
            run = next(d for d in vc.ancestors(p) if d in self.runs)
            out.setdefault(run, []).append(p)
        return out

    def full_facts(self, paths: Sequence[str]) -> dict[str, FileFacts]:
        return {} if not paths or self.source is None else self.source.facts(paths)


def _holds(files: list[str], path: str) -> bool:
    """`path` is one of `files` (sorted)."""
    i = bisect_left(files, path)
    return i < len(files) and files[i] == path
