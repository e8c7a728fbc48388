"""scan(): walk roots, hash and validate every file of every run, judge completeness.

Map/reduce-shaped: `scan_partial(root)` walks one root and reads its files into a serialisable `Partial` (no
judgement that needs another subtree); `reduce(partials)` merges them and lets the layouts build runs, so the same
code can run one map task per node of a cluster and reduce centrally. No torch, no textual: this is the cron path.
"""

from __future__ import annotations

import errno
import functools
import os
import stat as statmod
import time
from collections import ChainMap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

from ckpt_audit import verdict_cache
from ckpt_audit.codes import finding
from ckpt_audit.layouts import Layout, file_kind, load_layouts
from ckpt_audit.layouts.verl_fsdp import enclosing_step_dir
from ckpt_audit.models import IN_PROGRESS_WINDOW_S, DcpFacts, FileKind, Finding, format_size, many_objects
from ckpt_audit.readers import hashing, safetensors_header
from ckpt_audit.readers.pool import map_unordered
from ckpt_audit.remote import is_remote, normal  # the package's light __init__ only
from ckpt_audit.rules import files as file_rules
from ckpt_audit.rules import hf_trainer as hf_rules
from ckpt_audit.rules.status import UNREAD_CODES
from ckpt_audit.scrub import Cached, ScrubPlan, ScrubPolicy, plan_scrub
from ckpt_audit.tree import TRASH_PREFIX, FileFacts, PtFacts, Tree, trash_entry

if TYPE_CHECKING:  # made on first use, after the files are read (models.made_on_first_use): start-up, issue 16
    from pathlib import Path

    from ckpt_audit.models import Run, ScanResult, ShardFile
    from ckpt_audit.rules.deep_verdict import DeepVerdict
    from ckpt_audit.rules.status import ScanContext
    from ckpt_audit.tree import Partial

TEXT_NAMES = frozenset(
    {
        "latest_checkpointed_iteration.txt",
        "fsdp_config.json",
        "metadata.json",
        "config.yaml",
        "ckpt_contents.json",
        "latest",
        "latest_universal",
    }
)
# HF Trainer's JSON grows with the run (log_history, weight_map): the first TEXT_LIMIT bytes are read, and the HF
# rules read what they need from a prefix (trainer_state.json is dumped with sorted keys: global_step comes first);
# a weights index is read whole up to INDEX_TEXT_LIMIT (its weight_map is checked against the shards' headers)
PREFIX_TEXT_NAMES = frozenset({"trainer_state.json", *hf_rules.INDEX_FILES})
TEXT_LIMIT = 64 * 1024

Progress = Callable[[int, int], None]  # (bytes done, bytes total), called on the scanning thread
# How the files a scan must read get read: (paths, walk stats, previous facts, kinds, workers=, now_ns=) ->
# (path, FileFacts) as each completes. Default read_all (this process's thread pool); the shared Ray placement
# (cluster/shared.py) spreads the same read_file calls over nodes, so everything else in the scan is unchanged.
Reader = Callable[..., Iterable[tuple[str, FileFacts]]]


class ScanError(Exception):
    """A root that cannot be scanned at all (missing, not a directory): a one-line error, exit 3."""


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
    verdicts: verdict_cache.Source | None = None,
    deep: Mapping[str, DeepVerdict] | None = None,
) -> ScanResult:
    """Scan `roots`: directories above runs, runs, or step directories (and paths inside them).

    `verdicts`: where cached run verdicts are (ckpt_audit.verdict_cache); None: every run is judged afresh.
    `deep`: the deep verdicts the catalog keeps (catalog.deep_verdicts), which bind each checkpoint's judgement
    while the files they read are unchanged (rules.deep_verdict); None: the shallow verdict alone (verify's own scan).

    `scrub` re-reads a rolling share of the files the catalog could vouch for (ckpt_audit.scrub); None: reuse them
    all. Its budget is shared by the roots, in order.

    A path at or inside a step directory scans that checkpoint alone: its run is walked (the tracker and the
    neighbours' names are needed to judge it) but only the checkpoint's files are read, and the result holds
    only that checkpoint, so recording it changes nothing else in the catalog.
    """
    if any(is_remote(r) for r in roots):  # the session scans these (ckpt_audit.remote.scan)
        raise ScanError("s3:// roots are read by scan, ls, show, latest and compare only (docs/remote.md)")
    with many_objects():  # the walk, the facts and a cached run's model: objects by the hundred thousand
        started = time.time_ns()
        real_roots = [check_root(r) for r in roots]
        walk_roots, focus = focus_of(real_roots)
        layouts = load_layouts()
        now = now_ns if now_ns is not None else started
        window_ns = int(in_progress_window_s * 1e9)
        deep = deep or {}
        stamps = verdict_cache.deep_stamps(deep)
        partials: list[Partial] = []
        for r in walk_roots:
            partials.append(
                scan_partial(
                    r,
                    workers=workers,
                    rehash=rehash,
                    previous=previous,
                    progress=progress,
                    layouts=layouts,
                    focus=focus,
                    scrub=_budget_left(scrub, partials),
                    now_ns=now,
                    reader=reader,
                    # a run seen by two nested roots would mix cached and judged facts
                    verdicts=None if focus or verdict_cache.nested(walk_roots) else verdicts,
                    window_ns=window_ns,
                    deep_stamps=stamps,
                )
            )
        from ckpt_audit.rules.status import ScanContext  # made on first use, as is the judged model: off start-up

        ctx = ScanContext(now_ns=now, in_progress_window_ns=window_ns, deep=deep)
        result = reduce(partials, ctx=ctx, layouts=layouts)
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


def check_root(root: str | Path) -> str:
    if is_remote(root):
        return normal(root)  # type: ignore[arg-type]
    path = os.path.abspath(os.fspath(root))
    if not os.path.exists(path):
        raise ScanError(f"root {path} does not exist")
    if not os.path.isdir(path):
        raise ScanError(f"root {path} is not a directory")
    return os.path.realpath(path)


# -- map ------------------------------------------------------------------------------------------------------


def scan_partial(
    root: str,
    *,
    workers: int = 2,
    rehash: bool = False,
    previous: Mapping[str, FileFacts | ShardFile] | None = None,
    progress: Progress | None = None,
    layouts: Sequence[Layout] | None = None,
    focus: frozenset[str] = frozenset(),
    scrub: ScrubPolicy | None = None,
    now_ns: int | None = None,
    reader: Reader | None = None,
    verdicts: verdict_cache.Source | None = None,
    window_ns: int = int(IN_PROGRESS_WINDOW_S * 1e9),
    deep_stamps: Mapping[str, str] | None = None,  # run -> its recorded deep verdicts (verdict_cache.deep_stamps)
) -> Partial:
    previous = previous if previous is not None else {}  # not `or`: a lazy catalog manifest loads on bool()
    now = now_ns if now_ns is not None else time.time_ns()
    tree, stats, walk_findings = walk(root)
    layouts = layouts if layouts is not None else load_layouts()
    owners: dict[str, str] = {}  # run dir -> the layout that claims it first (as reduce decides)
    for layout in layouts:
        for d in layout.find_runs(tree):
            owners.setdefault(d, layout.name)
    if not owners:  # cron must not report "clean" for an empty mount point
        walk_findings.append(finding("no-runs", root, "no checkpoint runs found under this root"))
    run_files = {r: sorted(tree.files_below(r)) for r in owners}
    below = [p for files in run_files.values() for p in files]
    # runs hold disjoint files unless nested; sorting the runs' sorted lists together is a merge (timsort)
    paths, leftovers = _without_trash(sorted(set(below) if verdict_cache.nested(list(owners)) else below), stats)
    if focus:  # a checkpoint asked for alone: read its files and the run's own (tracker), not its neighbours'
        paths = [p for p in paths if _in_focus(p, focus)]
    walk_findings.extend(leftovers)
    settled: dict[str, verdict_cache.Settled] = {}
    if verdicts is not None and not focus:  # --rehash judges every run afresh, and keeps what it judged
        settled = verdict_cache.settled_runs(run_files, tree, stats, walk_findings, now_ns=now, window_ns=window_ns)
    digests = {r: s.digest for r, s in settled.items()}
    # --store-checksums: a cached verdict would leave its files unread, without the checksums asked for
    fresh = rehash or hashing.store_checksums_enabled()
    cand = _Candidates.of(root, settled, verdicts) if verdicts and settled and not fresh else _Candidates()
    facts: dict[str, FileFacts] = {}
    todo: list[str] = list(cand.unrowed)
    cached: dict[str, FileFacts] = {}
    kinds = {p: file_kind(p, layouts) for p in paths if p not in cand.rowed}  # what each file is meant to be
    for p in paths:
        if p in cand.rowed or p in cand.unrowed:
            continue  # a candidate run's file: its verdict may stand (decided once its unrowed files are read)
        prev = previous.get(p)
        if not rehash and _vouched(prev, stats[p], kinds[p]):
            cached[p] = prev
        else:
            todo.append(p)
    plan = _plan_scrub(cached, now_ns=now, policy=scrub, more=cand.scrubbable(stats))
    if plan.overdue_files:
        walk_findings.append(
            finding(
                "scrub-overdue",
                root,
                f"{plan.overdue_files} file(s), {format_size(plan.overdue_bytes)}, last verified "
                "by content a scrub period or more ago were not re-read: the --scrub-budget is too small for the "
                "period",
            )
        )
    for p, prev in cached.items():
        if p in plan.paths:
            todo.append(p)
        else:
            facts[p] = _reused(p, prev, stats[p])
    scrubbed_rowed = sorted(p for p in plan.paths if p in cand.rowed)
    scrubbed_set = frozenset(scrubbed_rowed)
    # the catalog's facts of the candidates' files read now (hash-drift compares them), looked up by path: the
    # whole manifest is loaded only if some run is judged afresh
    prior: dict[str, FileFacts | None] = dict.fromkeys(cand.unrowed)
    prior.update(cand.full_facts([*scrubbed_rowed, *cand.unrowed]))
    for p in scrubbed_rowed:
        kinds[p] = file_kind(p, layouts)
        todo.append(p)
    lookup = _Chain(prior, previous)
    total = sum(stats[p].st_size for p in todo)
    # the scrub's re-reads take the catalog's structure facts when the bytes read back the same; --rehash re-parses
    reader = reader or (read_all if rehash else functools.partial(read_all, reparse=False))
    read = _reading(reader, stats, lookup, kinds, workers=workers, now_ns=now, progress=progress)
    for p, fact in read(todo, total=total):
        facts[p] = fact
    reused_runs: dict[str, tuple[str, Run]] = {}  # run -> (its key, its cached model)
    reused_rows: list[str] = []  # their files not read now: the catalog rows stand for them (read if asked for)
    again: list[str] = []
    for run, files in cand.runs.items():
        mine = [p for p in files if p in cand.rowed]
        key = verdict_cache.run_key(
            run,
            digests[run],
            layout=owners[run],
            layouts=[layout.name for layout in layouts],
            window_ns=window_ns,
            unrowed={p: facts[p] for p in files if p not in cand.rowed},
            deep=(deep_stamps or {}).get(run, ""),
        )
        steady = all(verdict_cache.same_content(facts[p], prior[p]) for p in mine if p in scrubbed_set)
        model = cand.source.run(run) if key == cand.stored[run] and steady else None
        if model is not None:
            reused_runs[run] = (key, model)
            reused_rows.extend(p for p in mine if p not in facts)
            continue
        for p in mine:  # judged afresh: its files are reused by stat or read, as in any re-scan
            if p in facts:
                continue
            kinds[p] = file_kind(p, layouts)
            prev = previous.get(p)
            if _vouched(prev, stats[p], kinds[p]):
                facts[p] = _reused(p, prev, stats[p])
            else:
                again.append(p)
    if again:  # rows the stat cache cannot vouch for after all (a row from an older release): read them now
        total += sum(stats[p].st_size for p in again)
        for p, fact in read(again, total=total):
            facts[p] = fact
        todo.extend(again)
    hashed = sum(1 for p in todo if facts[p].hash is not None)
    from ckpt_audit.tree import Partial  # made on first use, as is the judged model: off start-up

    return Partial(
        root=root,
        tree=tree,
        facts=facts,
        findings=tuple(walk_findings),
        files_hashed=hashed,
        files_reused=len(paths) - len(todo),
        reused_paths=frozenset(paths).difference(todo),
        bytes_hashed=sum(facts[p].size_bytes for p in todo if facts[p].hash is not None),
        files_scrubbed=sum(1 for p in plan.paths if facts[p].hash is not None),
        bytes_scrubbed=sum(facts[p].size_bytes for p in plan.paths if facts[p].hash is not None),
        run_digests=digests,
        reused_runs=reused_runs,
        reused_rows=verdict_cache.LaterRows(cand.source, root, reused_rows) if reused_rows else {},
        owners=owners,
    )


def _reading(reader: Reader, stats, previous, kinds, *, workers: int, now_ns: int, progress: Progress | None):
    """`reader` over a list of paths, batch after batch, with the byte progress carried across the batches."""
    done = 0

    def read(paths: list[str], *, total: int) -> Iterator[tuple[str, FileFacts]]:
        nonlocal done
        for p, fact in reader(sorted(paths), stats, previous, kinds, workers=workers, now_ns=now_ns):
            done += stats[p].st_size
            if progress is not None:
                progress(done, total)
            yield p, fact

    return read


class _Chain(Mapping):
    """`first`, then `second`: the scrubbed candidate files' catalog facts ahead of the (lazy) manifest."""

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


_NONE: Mapping = MappingProxyType({})  # the maps of an empty _Candidates(): one read-only empty mapping for all


class _Candidates(NamedTuple):
    """The settled runs of a root that hold a cached verdict, and how their files stand in the catalog. (A NamedTuple:
    one is made before the first file is read, and a frozen slotted dataclass costs ~1.3 ms to define, issue 16.)"""

    runs: Mapping[str, list[str]] = _NONE  # run -> its files
    stored: Mapping[str, str] = _NONE  # run -> its cached verdict's key
    verified: Mapping[str, int] = _NONE  # catalogued files read cleanly once -> when last
    # files with a clean catalog row: not read unless scrubbed. Their stat is not compared here: the key holds it,
    # and a row changed since the verdict was stored would have deleted it (m007), so a matching key vouches
    rowed: frozenset[str] = frozenset()
    unrowed: tuple[str, ...] = ()  # the rest (the tracker, run-level files, anything new): read now
    source: verdict_cache.Source | None = None

    @classmethod
    def of(cls, root: str, settled: Mapping[str, verdict_cache.Settled], source: verdict_cache.Source):
        stored = source.stored()
        runs = {r: s.files for r, s in settled.items() if r in stored}
        if not runs:
            return cls()
        verified = source.verified(root)
        rowed = frozenset(p for files in runs.values() for p in files if p in verified)
        unrowed = tuple(p for files in runs.values() for p in files if p not in rowed)
        return cls(runs=runs, stored=stored, verified=verified, rowed=rowed, unrowed=unrowed, source=source)

    def scrubbable(self, stats: Mapping[str, os.stat_result]) -> list[tuple[str, int, int]]:
        verified = self.verified  # scrub.Cached's fields, as plain tuples
        return [(p, stats[p].st_size, verified[p]) for p in self.rowed]

    def full_facts(self, paths: Sequence[str]) -> dict[str, FileFacts]:
        return {} if not paths or self.source is None else self.source.facts(paths)


def _vouched(prev: FileFacts | ShardFile | None, st: os.stat_result, kind: FileKind) -> bool:
    """The catalog vouches for this file: same stat, its content was read cleanly once (a row written before
    verified_ns existed lacks the structure facts the rules read), and it was recorded under today's rules."""
    return (
        isinstance(prev, FileFacts)
        and _same_stat(prev, st)
        and prev.hash is not None
        and prev.verified_ns is not None
        and file_rules.judged_as(kind, prev.findings)
        and _has_dcp_facts(kind, prev)
        and (bool(prev.checksums) or not hashing.store_checksums_enabled())  # scan --store-checksums fills them in
    )


def _plan_scrub(
    cached: Mapping[str, FileFacts],
    *,
    now_ns: int,
    policy: ScrubPolicy | None,
    more: Sequence[Cached | tuple[str, int, int]] = (),
) -> ScrubPlan:
    if policy is None:
        return ScrubPlan()
    return plan_scrub(
        [(p, f.size_bytes, f.verified_ns or 0) for p, f in cached.items()] + list(more),
        now_ns=now_ns,
        policy=policy,
        budget_bytes=policy.budget_bytes,
    )


def _in_focus(path: str, focus: frozenset[str]) -> bool:
    parent = os.path.dirname(path)
    return any(path.startswith(f + "/") or parent == os.path.dirname(f) for f in focus)


def _without_trash(paths: list[str], stats: Mapping[str, os.stat_result]) -> tuple[list[str], list[Finding]]:
    """The paths outside prune's trash, and one finding per trash entry: an interrupted prune's leftovers are
    being deleted, so hashing them would only spend I/O, but the disk they hold is worth a line in cron's mail."""
    if f"/{TRASH_PREFIX}" not in "\n".join(paths):  # nearly always: one search in C instead of one per path
        return paths, []
    keep: list[str] = []
    trash: dict[str, list[int]] = {}
    for p in paths:
        if (entry := trash_entry(p)) is None:
            keep.append(p)
        else:
            trash.setdefault(entry, []).append(stats[p].st_size)
    found = [
        finding(
            "prune-leftover",
            entry,
            f"marked for deletion by an interrupted prune: {len(sizes)} file(s), "
            f"{format_size(sum(sizes))}; the next `ckpt-audit prune` reclaims it",
        )
        for entry, sizes in trash.items()
    ]
    return keep, found


def _same_stat(prev: FileFacts | ShardFile, st: os.stat_result) -> bool:
    return prev.size_bytes == st.st_size and prev.mtime_ns == st.st_mtime_ns and prev.inode == st.st_ino


def _wants_text(path: str) -> bool:
    name = path[path.rfind("/") + 1 :]  # os.path.basename without its fspath checks: once per file per scan
    return name in TEXT_NAMES or name in PREFIX_TEXT_NAMES


def _read_text(path: str, st: os.stat_result) -> str | None:
    name = os.path.basename(path)
    limit = hf_rules.INDEX_TEXT_LIMIT if name in hf_rules.INDEX_FILES else TEXT_LIMIT
    if st.st_size > limit and name not in PREFIX_TEXT_NAMES:
        return None
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return None


def _reused(path: str, prev: FileFacts, st: os.stat_result) -> FileFacts:
    """The catalog's row of `path` with what the catalog does not keep read again: a small JSON file's text, and a
    .safetensors file's header (_header_again)."""
    if _wants_text(path):
        return replace(prev, reused=True, text=_read_text(path, st))
    if path.endswith(".safetensors") and prev.size_bytes > 0:
        return replace(_header_again(prev), reused=True)
    return prev


def _header_again(prev: FileFacts) -> FileFacts:
    """`prev` with its safetensors header read and checked now (one small read): its tensor names (the index is
    checked against them; the catalog does not keep them), and the header judged by today's rules, not by the ones
    in force when the row was recorded."""
    found, names = _safetensors(prev.path)
    kept = tuple(f for f in prev.findings if not f.code.startswith("safetensors-"))
    return replace(prev, tensors=names, findings=kept + found)


def read_all(
    paths: Sequence[str],
    stats: Mapping[str, os.stat_result],
    previous: Mapping,
    kinds: Mapping[str, FileKind],
    *,
    workers: int,
    now_ns: int,
    reparse: bool = True,
) -> Iterator[tuple[str, FileFacts]]:
    """read_file over the file thread pool (hashing and CRC release the GIL), as each file completes."""
    return map_unordered(
        lambda p: read_file(p, stats[p], previous.get(p), kind=kinds[p], now_ns=now_ns, reparse=reparse),
        paths,
        workers=workers,
        name="ckpt-scan",
    )


def read_file(
    path: str,
    st: os.stat_result,
    prev: FileFacts | ShardFile | None,
    *,
    kind: FileKind,
    now_ns: int | None = None,
    reparse: bool = True,
) -> FileFacts:
    """Everything one file tells without judging its neighbours. Never raises for a bad file.

    `kind` is what the layouts call the file by its name (layouts.file_kind); the file rules depend on it.

    A clean read (the stat held still) is stamped verified at `now_ns` (default: now); content that differs from
    `prev` under the same stat is hash-drift, and stays so while the stat and the drifted content stay.

    `reparse` False: when the bytes read back as `prev` recorded them (same stat, same xxh3-128, same CRC verdict),
    everything else `prev` holds was derived from these very bytes, so the pickle, DCP metadata and safetensors
    header are not parsed again (the scrub's re-reads; `--rehash` re-parses, for a newer reader).
    """
    base = FileFacts(path=path, size_bytes=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)
    try:
        d = hashing.digest_file(path)
    except FileNotFoundError:
        return replace(base, findings=(finding("file-vanished", path, "listed, then gone before it was read"),))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return replace(base, findings=(finding("unreadable", path, f"cannot read: {reason}"),))
    changed = d.changed_during_read or d.stat_size != st.st_size or d.mtime_ns != st.st_mtime_ns
    if not reparse and not changed and _same_bytes(prev, st, d, kind):
        return replace(
            _header_again(prev) if path.endswith(".safetensors") and prev.size_bytes > 0 else prev,
            reused=False,
            text=_read_text(path, st) if _wants_text(path) else None,
            verified_ns=(now_ns if now_ns is not None else time.time_ns()),
            checksums=d.checksums or prev.checksums,
        )
    found = list(
        file_rules.digest_findings(
            path,
            kind=kind,
            size=d.size_bytes,
            zip_error=d.zip_error,
            crc_bad=d.crc_bad_entries,
            prefix=d.prefix,
            changed=changed,
            local_mismatch=d.local_header_mismatch,
        )
    )
    found.extend(_drift(path, st, prev, d.hash) if not changed else ())
    pt = None
    if file_rules.reads_structure(path, kind=d.kind, is_zip=d.is_zip, zip_error=d.zip_error):
        pt, more = _structure(path)
        found.extend(more)
    if d.item_pickles:  # a .distcp's items: DCP's load unpickles each, bytes items with the full unpickler
        found.extend(_item_pickles(path, d.item_pickles))
    dcp, more = _dcp_facts(path) if kind is FileKind.DCP_METADATA else (None, ())
    found.extend(more)
    tensors = None
    if path.endswith(".safetensors") and d.size_bytes > 0 and not changed:
        more, tensors = _safetensors(path)
        found.extend(more)
    return replace(
        base,
        size_bytes=d.size_bytes,
        mtime_ns=d.mtime_ns,
        inode=d.inode,
        hash=d.hash,
        crc_ok=d.crc_ok,
        pt=pt,
        text=_read_text(path, st) if _wants_text(path) else None,
        dcp=dcp,
        tensors=tensors,
        findings=tuple(found),
        verified_ns=None if changed else (now_ns if now_ns is not None else time.time_ns()),
        # the same xxh3-128 is the same bytes: their store checksums stand (--rehash without --store-checksums)
        checksums=d.checksums or (prev.checksums if _same_hash(prev, d) and not changed else ()),
    )


def _same_bytes(prev: FileFacts | ShardFile | None, st: os.stat_result, d: hashing.FileDigest, kind: FileKind) -> bool:
    """`prev` is a row the catalog vouches for (_vouched) and these are exactly the bytes it was read from."""
    return (
        _vouched(prev, st, kind)
        and (prev.hash, prev.crc_ok, prev.size_bytes) == (d.hash, d.crc_ok, d.size_bytes)
        and not d.crc_bad_entries
        and d.zip_error is None
    )


def _same_hash(prev: FileFacts | ShardFile | None, d: hashing.FileDigest) -> bool:
    return isinstance(prev, FileFacts) and (prev.hash, prev.size_bytes) == (d.hash, d.size_bytes)


def _drift(path: str, st: os.stat_result, prev: FileFacts | ShardFile | None, new_hash: str) -> tuple[Finding, ...]:
    """hash-drift when the content moved under an unchanged stat; a drift found before is kept while the file
    still holds the drifted content (re-reading rotten bytes must not make them good)."""
    if prev is None or prev.hash is None or not _same_stat(prev, st):
        return ()
    if prev.hash != new_hash:
        return (
            finding(
                "hash-drift",
                path,
                f"content hash changed ({prev.hash[:12]}… -> {new_hash[:12]}…) while size, mtime and inode did not",
            ),
        )
    return tuple(f for f in getattr(prev, "findings", ()) if f.code == "hash-drift")


def _safetensors(path: str) -> tuple[tuple[Finding, ...], tuple[str, ...] | None]:
    """(findings, tensor names: None unless the header is one safetensors loads) of a .safetensors file."""
    try:
        header = safetensors_header.read(path)
    except OSError as exc:
        return (finding("unreadable", path, f"cannot read the safetensors header: {exc.strerror or exc}"),), None
    found = tuple(finding(p.code, path, p.message, tensor=p.tensor) for p in header.problems)
    return found, None if header.problems else header.names


def _structure(path: str) -> tuple[PtFacts | None, tuple[Finding, ...]]:
    # imported on the first pickle read, not at start-up: the first file is opened (and hashed) without it
    from ckpt_audit.readers import deepspeed_meta, megatron_meta, pt_structure

    try:
        s = pt_structure.read_pt_structure(path)
    except OSError as exc:
        return None, (finding("unreadable", path, f"cannot read data.pkl: {exc.strerror or exc}"),)
    except Exception as exc:  # noqa: BLE001 - a reader bug on odd input must become a finding, not a crash
        return None, (finding("bad-pickle", path, f"{type(exc).__name__}: {exc}"),)
    meshes = sorted({len(t.mesh_ranks or ()) or _prod(t.mesh_shape) for t in s.tensors if t.is_dtensor} - {0})
    facts = PtFacts(
        prefix=s.prefix,
        n_tensors=len(s.tensors),
        n_dtensors=sum(1 for t in s.tensors if t.is_dtensor),
        mesh_sizes=tuple(meshes),
        top_keys=s.keys,
        meta=deepspeed_meta.read_meta(s.tree) or megatron_meta.read_meta(s.tree),
    )
    return facts, file_rules.structure_findings(path, problems=s.problems, unsafe_globals=s.unsafe_globals)


def _item_pickles(path: str, pickles: tuple[tuple[str, bytes | None], ...]) -> tuple[Finding, ...]:
    from ckpt_audit.readers import distcp_items  # on the first .distcp: it loads the unpickler, off start-up

    try:
        s = distcp_items.read_item_pickles(pickles)
    except Exception as exc:  # noqa: BLE001 - a reader bug on odd input must become a finding, not a crash
        return (finding("distcp-item-invalid", path, f"{type(exc).__name__}: {exc}"),)
    return file_rules.structure_findings(path, problems=s.problems, unsafe_globals=s.unsafe_globals)


def _has_dcp_facts(kind: FileKind, prev: FileFacts) -> bool:
    """A DCP .metadata is reused only with its parsed facts (a row from before m006 has none: it is read again)."""
    if kind is not FileKind.DCP_METADATA or prev.dcp is not None:
        return True
    return any(f.code == "dcp-metadata-invalid" for f in prev.findings)  # unparseable: nothing to re-learn


def _dcp_facts(path: str) -> tuple[DcpFacts | None, tuple[Finding, ...]]:
    """A DCP `.metadata`'s byte ranges and keys: the scan checks its data files against them (layouts.dcp)."""
    from ckpt_audit.readers import dcp_metadata  # on the first .metadata: it loads the unpickler, off start-up

    try:
        return dcp_metadata.read_facts(path), ()
    except OSError as exc:
        return None, (finding("unreadable", path, f"cannot read .metadata: {exc.strerror or exc}"),)
    except Exception as exc:  # noqa: BLE001 - a reader bug on odd input must become a finding, not a crash
        return None, (finding("dcp-metadata-invalid", path, f".metadata {exc}"),)


def _prod(shape: tuple[int, ...] | None) -> int:
    n = 1
    for x in shape or (0,):
        n *= x
    return n


# -- the walk -------------------------------------------------------------------------------------------------


def walk(root: str) -> tuple[Tree, dict[str, os.stat_result], list[Finding]]:
    """List `root` without following links out of it. Regular files only (a FIFO would block a reader)."""
    dirs: dict[str, tuple[str, ...]] = {}
    files: dict[str, tuple[str, ...]] = {}
    stats: dict[str, os.stat_result] = {}
    dir_mtimes: dict[str, int] = {}
    links: dict[str, str] = {}
    found: list[Finding] = []
    seen: set[tuple[int, int]] = set()
    inside = root.rstrip("/") + "/"
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            dst = os.stat(d)
        except OSError as exc:
            found.append(_os_finding(d, exc))
            continue
        if (dst.st_dev, dst.st_ino) in seen:  # a bind mount or hard-linked directory loop
            found.append(finding("symlink-loop", d, "directory already walked under another path"))
            continue
        seen.add((dst.st_dev, dst.st_ino))
        dir_mtimes[d] = dst.st_mtime_ns
        subdirs: list[str] = []
        names: list[str] = []
        ascii_dir = d.isascii()  # an ASCII path always encodes: the UTF-8 check below is for the rest
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError as exc:
            found.append(_os_finding(d, exc))
            dirs[d], files[d] = (), ()
            continue
        for e in entries:
            path = f"{d}/{e.name}"
            if not (ascii_dir and e.name.isascii()):
                try:
                    path.encode("utf-8")
                except UnicodeEncodeError:
                    shown = os.fsencode(path).decode("utf-8", "backslashreplace")
                    found.append(finding("non-utf8-name", shown, "name is not valid UTF-8; skipped"))
                    continue
            try:  # regular files first: nearly every entry is one (a link is neither file nor dir unfollowed)
                if e.is_file(follow_symlinks=False):
                    stats[path] = e.stat(follow_symlinks=False)
                    names.append(e.name)
                elif e.is_dir(follow_symlinks=False):
                    subdirs.append(e.name)
                elif e.is_symlink():
                    links[path] = os.readlink(path)
                    kind = _follow_link(path, d, root, inside, found)
                    if kind is not None:
                        names.append(e.name)
                        stats[path] = kind
            except FileNotFoundError:
                found.append(finding("file-vanished", path, "listed, then gone before it could be examined"))
            except OSError as exc:
                found.append(_os_finding(path, exc))
        subdirs.sort()
        names.sort()
        dirs[d] = tuple(subdirs)
        files[d] = tuple(names)
        stack.extend(f"{d}/{s}" for s in reversed(subdirs))
    return Tree(dirs=dirs, files=files, dir_mtime_ns=dir_mtimes, links=links), stats, found


def _follow_link(path: str, parent: str, root: str, inside: str, found: list[Finding]) -> os.stat_result | None:
    """The target's stat when `path` is a link to a regular file inside the root; else a finding and None.

    Directory links inside the root are not walked: their targets are walked under their real paths anyway.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        found.append(finding("broken-symlink", path, f"points to missing {os.readlink(path)!r}"))
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            found.append(finding("symlink-loop", path, "link resolves to itself (ELOOP)"))
        else:
            found.append(_os_finding(path, exc))
        return None
    target = os.path.realpath(path)
    if target != root and not target.startswith(inside):
        found.append(finding("symlink-outside-root", path, f"points outside the root to {target}; not followed"))
        return None
    if statmod.S_ISDIR(st.st_mode):
        if parent == target or parent.startswith(target.rstrip("/") + "/"):
            found.append(finding("symlink-loop", path, f"points back to its ancestor {target}; not followed"))
        return None
    return st if statmod.S_ISREG(st.st_mode) else None


def _os_finding(path: str, exc: OSError) -> Finding:
    return finding("unreadable", path, f"cannot read: {exc.strerror or type(exc).__name__}")


# -- reduce ---------------------------------------------------------------------------------------------------


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


def reduce(partials: Sequence[Partial], *, ctx: ScanContext, layouts: Sequence[Layout] | None = None) -> ScanResult:
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
    runs = tuple(reused[d][1] if d in reused else owner[d].build_run(d, tree, facts, ctx) for d in sorted(owner))
    judged = [r for r in runs if r.path not in reused]
    keys = {d: key for d, (key, _run) in reused.items()} | _verdict_keys(
        partials, judged, tree, facts, ctx, layouts, owner
    )
    # a walk finding inside a checkpoint (or on a run's tracker) now belongs to it: report it once
    attached = {f for run in runs for f in (*run.findings, *(x for c in run.checkpoints for x in c.findings))}
    from ckpt_audit.models import ScanResult  # made on first use: off start-up

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
        file_facts=verdict_cache.WithRows(facts, rows) if (rows := _reused_rows(partials)) else facts,
        run_keys=keys,
        runs_reused=frozenset(reused),
    )


def _reused_rows(partials: Sequence[Partial]) -> Mapping[str, tuple]:
    """The reused runs' catalog rows of every partial, still unread (verdict_cache.LaterRows)."""
    rows = [part.reused_rows for part in partials if part.reused_rows]
    return rows[0] if len(rows) == 1 else ChainMap(*rows)


def _verdict_keys(partials, runs, tree, facts, ctx, layouts, owner) -> dict[str, str]:
    """run -> its verdict cache key, for the settled runs whose every file was read (or reused) cleanly: the
    catalog keeps these verdicts. A file of the run's checkpoints has a catalog row; the rest enter by their facts."""
    digests = {d: g for part in partials for d, g in part.run_digests.items()}
    names = [layout.name for layout in layouts]
    stamps = verdict_cache.deep_stamps(ctx.deep) if ctx.deep else {}
    keys: dict[str, str] = {}
    for run in runs:
        if run.path not in digests:
            continue
        files = list(tree.files_below(run.path))
        if not all(p in facts and verdict_cache.clean(facts[p]) for p in files):
            continue
        rowed = {f.path for c in run.checkpoints for f in c.all_files}
        keys[run.path] = verdict_cache.run_key(
            run.path,
            digests[run.path],
            layout=owner[run.path].name,
            layouts=names,
            window_ns=ctx.in_progress_window_ns,
            unrowed={p: facts[p] for p in files if p not in rowed},
            deep=stamps.get(run.path, ""),
        )
    return keys
