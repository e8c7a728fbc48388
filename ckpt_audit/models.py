"""The scanner's model of checkpoints on disk: frozen, plain, serialisable data.

Run ─< Checkpoint ─< Component ─< ShardFile, with Findings attached at every level. Every other part of
ckpt-audit (catalog, rules, prune, export, TUI) speaks in these nouns; only `layouts/` knows file names.
Paths are absolute strings, so results serialise to JSON and SQLite as they are.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from itertools import chain, starmap
from typing import Any, TypeVar, cast

# the one size formatter lives with the other units; models.format_size stays importable for its many callers
from ckpt_audit.units import format_size

MAX_STEP = 2**63 - 1  # the largest step SQLite's INTEGER holds: a larger "step" is a finding, not a checkpoint


_T = TypeVar("_T")


def from_slots(cls: type[_T], values: Sequence[object]) -> _T:
    """An instance of the frozen slotted dataclass `cls` from its field values in slot order, without its
    `__init__`: for what the scan rebuilds by the thousand (catalog rows, cached run verdicts, a Ray node's answers).
    Only those row builders use it (layouts.shard_file, catalog.manifest.facts_of_rows, catalog.verdicts,
    scan.verdicts.light_facts, reduce_as_tuple); tests/test_slot_builders.py fails when a field order they rely on
    changes. Anywhere else, call the class.

    The frozen `__init__` sets each field through object.__setattr__, ~9 us an object on this VM; here an unfrozen
    twin with the same slots, in the same order, takes the values positionally (~1 us) and the object is then
    given its real class (same layout, so CPython allows it). Equality, hash and immutability are `cls`'s own."""
    twin = _TWINS.get(cls) or _make_twin(cls)
    obj = twin(*values)
    obj.__class__ = cls
    return cast(_T, obj)


def many_from_slots(cls: type[_T], rows: Iterable[Sequence[object]]) -> tuple[_T, ...]:
    """from_slots for many rows at once (the twin's calls made from C: ~20 % less per object)."""
    twin = _TWINS.get(cls) or _make_twin(cls)
    out = tuple(starmap(twin, rows))
    for obj in out:
        obj.__class__ = cls
    return cast(tuple[_T, ...], out)


_TWINS: dict[type, type] = {}


def _make_twin(cls: type) -> type:
    # a plain class with one generated __init__: make_dataclass costs ~2.5 ms a class at start-up, this ~0.1 ms
    names: tuple[str, ...] = getattr(cls, "__slots__", ())
    if cls.__base__ is not object or not names or not all(n.isidentifier() and not n.startswith("_") for n in names):
        raise TypeError(f"{cls.__name__} cannot be rebuilt from its slots")
    namespace: dict[str, object] = {}
    exec(f"def __init__(self, {', '.join(names)}):\n" + "".join(f"    self.{n} = {n}\n" for n in names), namespace)
    twin = type(f"_{cls.__name__}Slots", (), {"__slots__": names, "__init__": namespace["__init__"]})
    _TWINS[cls] = twin
    return twin


@contextmanager
def many_objects() -> Iterator[None]:
    """Pause the cyclic GC while a scan builds objects by the hundred thousand (stats, facts, a cached run model):
    none of them is in a cycle, and each collection would walk the whole growing heap again (at 1M files a third
    of the re-scan's CPU: bench/README.md). Restored as it was, so nesting and a caller's own setting hold."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def reduce_as_tuple(obj: object) -> tuple:
    """`__reduce__` for the frozen slotted dataclasses a Ray node sends back: pickle as (class, field values).
    The standard library's slotted-dataclass `__setstate__` calls `fields()` per object on load (bench/README, the
    Ray section, for what this saves); equality, hash and immutability are the dataclass's own, unchanged."""
    cls: Any = type(obj)  # a slotted dataclass (its __slots__ are its fields, in order)
    return from_slots, (cls, tuple(getattr(obj, name) for name in cls.__slots__))


class Severity(IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class Status(StrEnum):
    COMPLETE = "complete"
    INCOMPLETE = "incomplete"
    CORRUPT = "corrupt"
    UNCOMMITTED = "uncommitted"  # newer than the tracker
    HUSK = "husk"  # only data.pt (or nothing resumable) left after retention
    IN_PROGRESS = "in-progress"  # being written now: never called corrupt
    UNSAFE = "unsafe"  # a pickle in it reaches globals outside the allowlist: resuming would run code
    UNKNOWN = "unknown"  # something inside could not be read (permissions, I/O, a link out of the root): protected


# An uncommitted checkpoint (or a tracker) touched within this many seconds is being written: IN_PROGRESS, not broken.
# The one default of every --in-progress-window and of the core's in_progress_window_s (docs/scan.md: 300 s).
IN_PROGRESS_WINDOW_S = 300.0


class FileKind(StrEnum):
    MODEL = "model"
    OPTIM = "optim"
    EXTRA_STATE = "extra_state"
    FSDP_CONFIG = "fsdp_config"
    DATA = "data"  # global_step_N/data.pt (or data_{dp}.pt)
    HF = "huggingface"  # anything under huggingface/
    LORA = "lora_adapter"
    TRACKER = "tracker"
    DCP_METADATA = "dcp_metadata"  # DCP/Megatron .metadata
    DISTCP = "distcp"  # __R_k.distcp
    COMMON = "common"  # Megatron common.pt
    MEGATRON_METADATA = "megatron_metadata"  # dist_ckpt/metadata.json
    OTHER = "other"


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One defect found: a registered code (ckpt_audit.codes) with its severity, where, and a one-line message."""

    severity: Severity
    code: str  # stable slug, e.g. "missing-rank"; registered in ckpt_audit/codes/, documented in docs/codes.md
    path: str
    message: str
    rank: int | None = None
    tensor: str | None = None

    __reduce__ = reduce_as_tuple

    def to_dict(self) -> dict:
        return {
            "severity": self.severity.label,
            "code": self.code,
            "path": self.path,
            "message": self.message,
            "rank": self.rank,
            "tensor": self.tensor,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class PtFacts:
    """What the zip directory and the restricted unpickler showed of one torch `.pt` file."""

    prefix: str | None  # top-level folder inside the zip (torch: the file stem at save time)
    n_tensors: int = 0
    n_dtensors: int = 0
    mesh_sizes: tuple[int, ...] = ()  # distinct DeviceMesh sizes seen on DTensors
    top_keys: tuple[str, ...] = ()  # top-level dict keys, when the pickle is a dict
    meta: tuple[tuple[str, int | str], ...] = ()  # what a framework's file says of itself (readers.deepspeed_meta)

    __reduce__ = reduce_as_tuple


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpFacts:
    """What a DCP `.metadata` says of its directory (readers.dcp_metadata), all the shallow scan needs of it."""

    file_ends: tuple[tuple[str, int], ...] = ()  # (data file relative to the directory, bytes it must hold at least)
    key_roots: tuple[str, ...] = ()  # distinct first segments of the saved keys ("optimizer", "layers", ...)

    __reduce__ = reduce_as_tuple


@dataclass(frozen=True, slots=True, kw_only=True)
class FileFacts:
    """What the scan knows of one file: its stat, hash and what the readers found (or the catalog's, if reused)."""

    path: str
    size_bytes: int
    mtime_ns: int
    inode: int
    hash: str | None = None  # xxh3-128 hex; None when the file could not be read
    crc_ok: bool | None = None  # None: not a zip, or CRCs disabled at save
    pt: PtFacts | None = None
    text: str | None = None  # content of small JSON/tracker files the rules need
    findings: tuple[Finding, ...] = ()  # per-file findings (truncated, crc-mismatch, unreadable, ...)
    reused: bool = False  # hash (and structure) taken from the previous scan because the stat matched
    verified_ns: int | None = None  # when the content was last read in full (hash + CRC); None: never, or not cleanly
    dcp: DcpFacts | None = None  # a DCP .metadata's parsed facts (the catalog keeps them: files.dcp_facts)
    # a .safetensors file's tensor names, from its header (None: not read, or unusable); not catalogued: a reused
    # row's header is read and checked again (scanner._header_again), and a weights index is checked against them
    tensors: tuple[str, ...] | None = None
    # the whole file's checksums as object stores record them (readers.hashing.StoreSums: scan --store-checksums),
    # e.g. (("crc32c", "bIkWNQ=="), ...); a remote scan compares a bucket's copy against them (ckpt_audit.remote)
    checksums: tuple[tuple[str, str], ...] = ()

    __reduce__ = reduce_as_tuple


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardFile:
    """One file of a checkpoint, as its layout names it, with the stat and hash the scan recorded."""

    path: str
    kind: FileKind
    size_bytes: int
    mtime_ns: int
    inode: int
    rank: int | None = None
    world_size: int | None = None  # from the file name, when it carries one
    hash: str | None = None  # xxh3-128 hex; None when unreadable
    crc_ok: bool | None = None  # None: not a zip, or CRCs disabled at save (all zero)

    @property
    def size_str(self) -> str:
        return format_size(self.size_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Component:
    """One role of a checkpoint (actor, critic; "" for SFT shards directly in global_step_N)."""

    role: str
    path: str
    layout: str  # "verl-fsdp", "verl-megatron", "dcp", ...
    world_size: int | None
    files: tuple[ShardFile, ...] = ()
    findings: tuple[Finding, ...] = ()

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """One saved step of a run (global_step_N, checkpoint-N, step-N, ...) with its status."""

    run_path: str
    step: int
    path: str
    status: Status
    components: tuple[Component, ...] = ()
    files: tuple[ShardFile, ...] = ()  # step-level files such as data.pt
    findings: tuple[Finding, ...] = ()
    mtime_ns: int = 0  # newest mtime of anything inside

    # chain and map: these run per checkpoint per report and record, over every file (issue 16)
    @property
    def all_files(self) -> tuple[ShardFile, ...]:
        return self.files + tuple(chain.from_iterable(c.files for c in self.components))

    @property
    def all_findings(self) -> tuple[Finding, ...]:
        return self.findings + tuple(chain.from_iterable(c.findings for c in self.components))

    @property
    def size_bytes(self) -> int:
        # a file hardlinked several times inside (verl's Megatron migration mirrors dist_ckpt/ three times)
        # takes its bytes once: the same inode, size and mtime is the same file
        return sum(
            {(f.inode, f.size_bytes, f.mtime_ns) if f.inode else f.path: f.size_bytes for f in self.all_files}.values()
        )

    @property
    def size_str(self) -> str:
        return format_size(self.size_bytes)

    @property
    def world_size(self) -> int | None:
        sizes = {c.world_size for c in self.components if c.world_size is not None}
        return sizes.pop() if len(sizes) == 1 else None


def run_name(path: str) -> str:
    """A run's `project/experiment` name: the last two parts of its path."""
    return "/".join(path.rstrip("/").split("/")[-2:])


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """A `<project>/<experiment>` directory holding global_step_N directories and (usually) a tracker."""

    path: str
    layout: str
    tracker_step: int | None = None
    checkpoints: tuple[Checkpoint, ...] = ()
    findings: tuple[Finding, ...] = ()
    metrics_path: str | None = None  # the run's metrics JSONL, when one sits beside it

    @property
    def name(self) -> str:
        return run_name(self.path)

    @property
    def latest_complete(self) -> Checkpoint | None:
        done = [c for c in self.checkpoints if c.status is Status.COMPLETE]
        return max(done, key=lambda c: c.step) if done else None

    @property
    def size_bytes(self) -> int:
        return sum(c.size_bytes for c in self.checkpoints)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    """What a scan's light consumers read of a run (the exit code, `scan -q`, the summary line, the record step).
    A run whose cached verdict stood is this, stored with its verdict, until someone asks for its model (LazyRuns)."""

    path: str
    layout: str
    tracker_step: int | None
    metrics_path: str | None
    size_bytes: int
    checkpoints: tuple[tuple[str, int, Status], ...]  # (path, step, status), in the run's order
    # (checkpoint path, or None for the run's own, finding), in ScanResult.all_findings' order
    findings: tuple[tuple[str | None, Finding], ...]

    @classmethod
    def of(cls, run: Run) -> RunSummary:
        found: list[tuple[str | None, Finding]] = [(None, f) for f in run.findings]
        found += [(c.path, f) for c in run.checkpoints for f in c.all_findings]
        return cls(
            path=run.path,
            layout=run.layout,
            tracker_step=run.tracker_step,
            metrics_path=run.metrics_path,
            size_bytes=run.size_bytes,
            checkpoints=tuple((c.path, c.step, c.status) for c in run.checkpoints),
            findings=tuple(found),
        )

    @property
    def latest_complete_step(self) -> int | None:
        return max((step for _p, step, st in self.checkpoints if st is Status.COMPLETE), default=None)


class LazyRuns(Sequence[Run]):
    """A scan's runs, sorted by path: those judged now, and those whose cached verdict stood (`kept`: run -> (key,
    summary)), whose models `load` decodes from the catalog on first use, all at once (run -> key in, run ->
    model out). Light consumers ask `summaries()` and decode nothing (a million files' models cost ~2 s)."""

    def __init__(
        self,
        judged: Iterable[Run],
        kept: Mapping[str, tuple[str, RunSummary]],
        load: Callable[[Mapping[str, str]], Mapping[str, Run]],
    ) -> None:
        self.judged = {r.path: r for r in judged}
        self.kept, self.load = kept, load
        self.order = sorted({*self.judged, *kept})
        self._models: tuple[Run, ...] | None = None

    def summaries(self) -> Iterator[RunSummary]:
        for path in self.order:
            yield self.kept[path][1] if path in self.kept else RunSummary.of(self.judged[path])

    def models(self) -> tuple[Run, ...]:
        if self._models is None:
            loaded = self.load({p: key for p, (key, _s) in self.kept.items()}) if self.kept else {}
            for path, (_key, stored) in self.kept.items():
                if path not in loaded or RunSummary.of(loaded[path]) != stored:
                    raise KeptVerdictError(path)
            self._models = tuple(self.judged[p] if p in self.judged else loaded[p] for p in self.order)
        return self._models

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i):  # an int or a slice, as a tuple's
        return self.models()[i]

    def __iter__(self) -> Iterator[Run]:
        return iter(self.models())

    def __eq__(self, other: object) -> bool:  # as the tuple of its models
        return isinstance(other, Sequence) and not isinstance(other, str) and self.models() == tuple(other)

    __hash__ = None  # type: ignore[assignment]  # mutable cache inside: not hashable, as a list


class KeptVerdictError(Exception):
    """A kept run's stored model is gone, unreadable or disagrees with its stored summary (asked for after the scan
    answered from the summary): a one-line error; `scan --rehash` judges it afresh."""

    def __init__(self, run: str) -> None:
        super().__init__(
            f"the catalog's kept verdict of {run} is gone or does not match its summary (the catalog changed "
            "under this scan, or was edited): run `ckpt-audit scan --rehash` on it"
        )


def run_summaries(runs: Sequence[Run]) -> Iterator[RunSummary]:
    """Each run's summary, decoding no kept run (LazyRuns)."""
    return runs.summaries() if isinstance(runs, LazyRuns) else map(RunSummary.of, runs)


def judged_runs(runs: Sequence[Run], kept: AbstractSet[str]) -> Iterator[Run]:
    """The runs judged now (not in `kept`), decoding no kept run (LazyRuns)."""
    if isinstance(runs, LazyRuns):
        return iter(runs.judged.values())
    return (r for r in runs if r.path not in kept)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCopy:
    """One node's copy of a file, as a `scan --ray` saw it (the stat is that node's own; the path is logical)."""

    node_id: str
    size_bytes: int
    mtime_ns: int
    inode: int
    hash: str | None = None
    verified_ns: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterView:
    """Which node holds what, for a scan made on a Ray cluster (`scan --ray`): what the catalog records per node."""

    answered: tuple[str, ...] = ()  # nodes whose scan came back
    silent: tuple[str, ...] = ()  # nodes that did not answer (or that held files before and are gone now)
    copies: Mapping[str, tuple[NodeCopy, ...]] = field(default_factory=dict)  # logical path -> copy per node


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanResult:
    """What one scan found: the runs judged, findings outside any run, what was read and what reused."""

    roots: tuple[str, ...]
    runs: Sequence[Run] = ()  # a re-scan's are LazyRuns: the kept runs' models are decoded when first asked for
    findings: tuple[Finding, ...] = ()  # not attached to any run (e.g. a broken link under a root)
    started_ns: int = 0
    finished_ns: int = 0
    files_hashed: int = 0  # files actually read this scan
    files_reused: int = 0  # files whose recorded hash was reused by stat
    bytes_hashed: int = 0
    deep: bool = False
    reused_paths: frozenset[str] = frozenset()  # files whose hash and per-file findings came from the catalog
    files_scrubbed: int = 0  # reusable files re-read by content on purpose (scrub); part of files_hashed
    bytes_scrubbed: int = 0
    # path -> what the readers (or the catalog, for reused files) said of each file: the catalog records it whole,
    # so a re-scan that reuses a file reuses every fact a verdict depends on. A run whose cached verdict stood
    # (runs_reused) has only its files' stat, hash, CRC verdict and verified_ns here: nothing judges them again
    file_facts: Mapping[str, FileFacts] = field(default_factory=dict)
    cluster: ClusterView | None = None  # scan --ray: the nodes and each file's copies; None for a local scan
    run_keys: Mapping[str, str] = field(default_factory=dict)  # run -> verdict cache key, for the runs to cache
    # run -> its files the catalog keeps no row for, for the runs judged now with a key (kept with the verdict)
    run_unrowed: Mapping[str, Sequence[str]] = field(default_factory=dict)
    runs_reused: frozenset[str] = frozenset()  # runs whose verdict the catalog's verdict cache gave (nothing moved)
    kept_reread: frozenset[str] = frozenset()  # their catalogued files the scrub read again (same content)
    # verify: checkpoint path -> the findings the deep checks added to the scan's (() for none), for each
    # checkpoint deepened and not being written; the catalog keeps them (catalog.deep_verdicts)
    deep_found: Mapping[str, tuple[Finding, ...]] = field(default_factory=dict)

    @property
    def all_findings(self) -> tuple[Finding, ...]:
        out = list(self.findings)
        for s in run_summaries(self.runs):
            out.extend(f for _ckpt, f in s.findings)
        return tuple(out)
