"""The run verdict cache: a re-scan reuses a run's judged model when nothing the judgement read has changed.

A run's verdict (`layouts.build_run`) is a function of its subtree (directory and file names, directory mtimes),
the facts of its files, and the scan's clock against the in-progress window. The key hashes all of it:

    the tool's version, VERDICT_FORMAT, the readers' RULES and the judging code's files (size and mtime of
        models.py and every module of codes/, scan/, rules/, layouts/ and readers/: an edited checkout judges
        afresh), the run's layout and those loaded, the in-progress window;
    every directory under the run: its path and mtime;
    every file under the run: its path, size, mtime, inode and ctime (the stat cache's own key, plus ctime: a
        chmod or a rewrite with the mtime put back moves it), and, for a file the catalog keeps no row for (the
        tracker, run-level files), its facts as read this scan, text included;
    the deep verdicts the catalog keeps for the run's checkpoints (rules.deep_verdict: which, and when judged), so a
        verdict cached before verify recorded one is not reused after.

Files the catalog does keep rows for contribute their stat alone (the configs the rules read as text too: same
stat and ctime, same bytes, and bit rot under a kept stat is the scrub's to find, as for every shard): their rows
are the facts the verdict was judged from, and anything that rewrites a row (a prune survivor check, a verify)
deletes the run's verdict by a trigger (catalog migration m007). So a key that matches means the judgement would
read the same inputs again.

What is never cached: a run whose walk found something unreadable, a link out of the root or prune's trash inside
it; a run with anything touched within the in-progress window (time alone changes that verdict); a run holding a
file not read cleanly; a run nested in another. `--rehash`, a checkpoint asked for alone, verify and `--ray`'s
node-local scans judge afresh. The scrub still re-reads its share of every run's files: a file that reads back
different makes its run judged afresh.
"""

from __future__ import annotations

import array
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple, Protocol

import xxhash  # already loaded by the readers; hashlib's OpenSSL start-up costs ~4 ms

from ckpt_audit import __version__
from ckpt_audit.models import FileFacts, Finding, Run, RunSummary, from_slots
from ckpt_audit.readers import RULES
from ckpt_audit.scan.walk import files_under
from ckpt_audit.tree import Tree

if TYPE_CHECKING:
    from ckpt_audit.rules.deep_verdict import DeepVerdict

# bump when a rule or layout change would judge the same inputs differently (a new release changes the key anyway,
# and so does any edit to the judging code's files: code_stamp)
VERDICT_FORMAT = 1
_STAMP: list[str] = []
_JUDGING = ("models.py",)  # the top-level modules a verdict depends on
_JUDGING_PACKAGES = ("codes", "scan", "rules", "layouts", "readers")


def code_stamp() -> str:
    """The judging code as installed: name, size and mtime of _JUDGING and of every module under codes/, scan/,
    rules/, layouts/ and readers/, their subpackages included (readers/pt/: a reader that finds more in the same bytes
    judges the same inputs differently)."""
    if not _STAMP:
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        h = xxhash.xxh3_128()
        for name in _JUDGING:
            st = os.stat(os.path.join(package, name))
            h.update(f"/{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        for sub in _JUDGING_PACKAGES:
            for d, dirs, files in os.walk(os.path.join(package, sub)):
                dirs.sort()
                for f in sorted(files):
                    if f.endswith(".py"):
                        st = os.stat(os.path.join(d, f))
                        h.update(f"{d[len(package) :]}/{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        _STAMP.append(h.hexdigest())
    return _STAMP[0]


# a files row as the verdict cache reads it: (size_bytes, mtime_ns, inode, hash, crc_ok 0/1/None, verified_ns); a tuple
# because a re-scan reads one per catalogued file
Row = tuple[int, int, int, str | None, int | None, int | None]


def light_facts(path: str, row: Row) -> FileFacts:
    """What a reused run's file stands for in a ScanResult (stat, hash, CRC verdict, verified_ns: what reports
    read); no rule ever sees these. Slot order as FileFacts (models.from_slots)."""
    size, mtime, inode, digest, crc, verified = row
    crc_ok = None if crc is None else bool(crc)
    return from_slots(
        FileFacts, (path, size, mtime, inode, digest, crc_ok, None, None, (), True, verified, None, None, ())
    )


class LaterRows(Mapping):
    """path -> Row for the files of `runs` (each: its files, and those of them read now, left out), read from the
    catalog on first use: a cron re-scan that prints a summary never asks for them (a row per file cost ~4 us to
    load; ~0.4 s at 100k files), nor for the set of their paths (~0.35 s at 1M)."""

    def __init__(self, source: Source, root: str, runs: Sequence[tuple[Sequence[str], AbstractSet[str]]]) -> None:
        self.source, self.root, self.runs = source, root, runs
        self._paths: frozenset[str] | None = None
        self._rows: dict[str, Row] | None = None

    @property
    def paths(self) -> frozenset[str]:
        if self._paths is None:
            self._paths = frozenset(p for files, read in self.runs for p in files if p not in read)
        return self._paths

    def _loaded(self) -> dict[str, Row]:
        if self._rows is None:
            every = self.source.rows(self.root)
            self._rows = {p: every[p] for p in self.paths if p in every}
        return self._rows

    def __getitem__(self, path: str) -> Row:
        return self._loaded()[path]

    def __contains__(self, path: object) -> bool:
        return path in self.paths

    def __bool__(self) -> bool:  # not by len(): that would read the rows
        return any(len(files) > len(read) for files, read in self.runs)

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())


class WithRows(Mapping):
    """A scan's file facts: what was read or reused by stat, then the reused runs' files as their rows say (their
    FileFacts are made when asked for: most re-scans print a summary and never ask)."""

    def __init__(self, facts: Mapping[str, FileFacts], rows: Mapping[str, Row]) -> None:
        self.facts, self.rows = facts, rows

    def __getitem__(self, path: str) -> FileFacts:
        if path in self.facts:
            return self.facts[path]
        return light_facts(path, self.rows[path])

    def __contains__(self, path: object) -> bool:
        return path in self.facts or path in self.rows

    def __iter__(self) -> Iterator[str]:
        yield from self.facts
        yield from (p for p in self.rows if p not in self.facts)

    def __len__(self) -> int:
        return len(self.facts) + sum(1 for p in self.rows if p not in self.facts)


class Stored(NamedTuple):
    """A run's cached verdict as a re-scan reads it: its key, its summary (what `scan -q`, the exit code and the
    record step need of it) and its files the catalog keeps no row for (read every scan, keyed by their facts). The
    model itself is decoded only when someone asks for it (models.LazyRuns)."""

    key: str
    summary: RunSummary
    unrowed: tuple[str, ...]


class Source(Protocol):
    """Where the scanner finds cached verdicts (the catalog implements it: catalog.verdicts.CatalogVerdicts)."""

    def stored(self) -> Mapping[str, Stored]:
        """run path -> its cached verdict (a damaged one left out)."""
        ...

    def rows(self, root: str) -> Mapping[str, Row]:
        """path -> files row, for the present files at or under `root`."""
        ...

    def verified_order(self, runs: Iterable[str], *, newest_first: bool = False) -> Iterator[tuple[str, int, int]]:
        """(path, verified_ns, size_bytes) of the present files of `runs` read cleanly under today's readers, oldest
        verified first (ties by path; `newest_first`: the other way), read only as far as iterated."""
        ...

    def facts(self, paths: Iterable[str]) -> dict[str, FileFacts]:
        """The full catalogued facts of these files (what a plain re-scan reuses by stat)."""
        ...

    def runs(self, keys: Mapping[str, str]) -> dict[str, Run]:
        """run path -> its kept model, for the runs of `keys` (run path -> key) whose stored verdict is still under
        that key; a run left out (no longer stored, or not readable back) is judged afresh."""
        ...


class Settled(NamedTuple):
    """A run whose verdict may be cached: its files (sorted), the digest of its subtree as the walk saw it, and its
    files' bytes (the scrub's share counts them without a lookup per file)."""

    files: list[str]
    digest: str
    bytes: int


def settled_runs(
    run_files: Mapping[str, list[str]],
    tree: Tree,
    stats: Mapping[str, os.stat_result],
    walk_findings: Sequence[Finding],
    *,
    now_ns: int,
    window_ns: int,
) -> dict[str, Settled]:
    """Of the runs (run dir -> its files, sorted), those whose verdict may be cached: nothing unread or trashed
    inside, not nested in another run, nothing touched within the in-progress window (nor in the future). One pass
    over each run's directories and files both checks that and makes the digest (run_key)."""
    runs = sorted(run_files)
    inside = nested(runs)
    tainted = {d for f in walk_findings for d in (f.path, *ancestors(f.path))}  # each finding and what holds it
    young = now_ns - window_ns  # the status rules' "recent": now - mtime < window (a future mtime is recent too)
    dir_mtimes = tree.dir_mtime_ns
    below = files_under(runs, tree.dirs)  # the directories as the files: sorted once, sliced per run
    out: dict[str, Settled] = {}
    for run in runs:
        if run in inside or run in tainted:
            continue
        dirs = [run, *below[run]]
        mtimes = [m for d in dirs if (m := dir_mtimes.get(d)) is not None]
        if len(mtimes) < len(dirs) or any(m > young for m in mtimes):
            continue
        files = run_files[run]
        try:  # in C: a run may hold a hundred thousand files
            numbers = [*mtimes, *chain.from_iterable(map(_KEYED, map(stats.__getitem__, files)))]
        except KeyError:
            continue
        n = len(mtimes)
        if files and max(numbers[n + 1 :: 4]) > young:  # each file's (size, mtime, inode, ctime) after the dirs'
            continue
        out[run] = Settled(files, _digest(dirs, files, numbers), sum(numbers[n::4]))
    return out


_KEYED = attrgetter("st_size", "st_mtime_ns", "st_ino", "st_ctime_ns")  # a file's part of the digest


def _digest(dirs: list[str], files: list[str], numbers: list[int]) -> str:
    """The run's subtree as the walk saw it: each directory with its mtime, each file with its size, mtime, inode
    and ctime (a chmod, or a rewrite with the mtime put back, moves the ctime). Two parts, each unambiguous: the
    paths joined by NUL (which no name holds; whole, as the walk made them: the key names the run anyway), then the
    numbers in the paths' order."""
    h = xxhash.xxh3_128(b"%d %d\0" % (len(dirs), len(files)))
    h.update("\0".join(dirs + files).encode("utf-8", "surrogateescape"))
    try:
        packed = b"B" + array.array("q", numbers).tobytes()  # 8 bytes a number
    except OverflowError:  # an inode past 2**63, or a ctime past 2262: the numbers as text, tagged apart
        packed = b"T" + repr(numbers).encode()
    h.update(b"\0" + packed)
    return h.hexdigest()


def nested(dirs: Sequence[str]) -> set[str]:
    """The directories inside another of `dirs`, and those holding one: each one's ancestors looked up, not every
    pair (a store may hold thousands of runs)."""
    known = set(dirs)
    out: set[str] = set()
    for d in dirs:
        for parent in ancestors(d):
            if parent in known:
                out.update((d, parent))
    return out


def ancestors(path: str) -> Iterator[str]:
    """Every directory above `path`, up to "/" (which is its own parent)."""
    child, parent = path, os.path.dirname(path)
    while parent != child:
        yield parent
        child, parent = parent, os.path.dirname(parent)


def run_key(
    run: str,
    digest: str,
    *,
    layout: str,
    layouts: Sequence[str],
    window_ns: int,
    unrowed: Mapping[str, FileFacts],
    deep: str = "",
) -> str:
    """The verdict cache key: the stat digest, what the verdict's rules are, the facts of the files the catalog
    keeps no row for (`unrowed`: read every scan, so their facts are part of what the verdict read) and the deep
    verdicts recorded for the run's checkpoints (`deep`: deep_stamps; one recorded or dropped later changes it)."""
    h = xxhash.xxh3_128()
    h.update(
        f"{__version__}\0{VERDICT_FORMAT}\0{RULES}\0{code_stamp()}\0{layout}\0{','.join(layouts)}\0{window_ns}\0{run}\0{digest}\0{deep}\n".encode(
            "utf-8", "surrogateescape"
        )
    )
    cut = len(run)
    for p in sorted(unrowed):
        h.update(f"{p[cut:]}\0{content(unrowed[p])}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def deep_stamps(deep: Mapping[str, DeepVerdict]) -> dict[str, str]:
    """run path -> which deep verdicts the catalog holds for its checkpoints (rules.deep_verdict), as run_key's
    `deep`: a verdict judged before one was recorded (or after one was dropped) is not reused."""
    out: dict[str, list[str]] = {}
    for path, v in sorted(deep.items()):
        out.setdefault(v.run_path, []).append(f"{path}\0{v.judged_ns}")
    return {run: "\0".join(parts) for run, parts in out.items()}


def content(f: FileFacts) -> str:
    """What a read said of a file, apart from when: the part of its facts a verdict can depend on."""
    return repr((f.size_bytes, f.mtime_ns, f.inode, f.hash, f.crc_ok, f.pt, f.text, f.findings, f.dcp))


def same_content(a: FileFacts, b: FileFacts) -> bool:
    """A scrub re-read that found what the catalog holds (text aside: it is re-read every scan and keyed)."""
    return (a.hash, a.crc_ok, a.pt, a.findings, a.dcp) == (b.hash, b.crc_ok, b.pt, b.findings, b.dcp)


def clean(f: FileFacts) -> bool:
    """Read (or reused) cleanly: a verdict over a file that was not is not kept."""
    return f.hash is not None and f.verified_ns is not None
