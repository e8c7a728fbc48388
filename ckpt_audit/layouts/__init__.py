"""Layout plug-ins: the only code that knows checkpoint file names.

A layout is a module exposing `LAYOUT`, an object with the `Layout` protocol below. To add one (Megatron
`dist_ckpt`, plain DCP, HF Trainer, ...), write `ckpt_audit/layouts/<name>.py` and add one line to `LAYOUTS`; the
whole checklist (rules, deep checks, codes, tests, docs) is in docs/design.md, "A new layout".

The scanner asks every layout, in order, which directories of the walked `Tree` are runs (`find_runs`); the first
layout to claim a directory builds it (`build_run`). Run layouts that contain per-role directories (verl PPO's
`actor/`, `critic/`) first offer each role directory to every layout's `build_component`, so a component format
(e.g. Megatron `dist_ckpt/` under a verl step) plugs into the verl run structure without knowing about it.

Layouts must stay torch-free and do no IO: everything they need is in the `Tree` and the `FileFacts`. What `verify`
checks beyond that (the torch side) a layout names in `deep_checks`: functions of `ckpt_audit.deep`, by name only.
What its runs' resume reads to find a checkpoint (fix-tracker, `latest --print tag`, the cluster) is its `tracker`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ckpt_audit.models import Checkpoint, Component, FileKind, Finding, Run, ShardFile, Status, from_slots
from ckpt_audit.rules.status import ScanContext
from ckpt_audit.tree import FileFacts, Tree

if TYPE_CHECKING:
    from ckpt_audit.layouts.tracker import Tracker

# module path of each layout plug-in, in priority order (first claim wins).
LAYOUTS: tuple[str, ...] = (
    "ckpt_audit.layouts.deepspeed",  # before verl: DeepSpeed's global_stepN tags read like misnamed verl steps
    "ckpt_audit.layouts.verl_fsdp",
    "ckpt_audit.layouts.torchtitan",  # before dcp: its step-N folders are DCP directories too
    "ckpt_audit.layouts.megatron_v2",  # before dcp: a migrated v2 role directory still holds the old dist_ckpt/
    "ckpt_audit.layouts.dcp",
    "ckpt_audit.layouts.hf_trainer",  # transformers Trainer output dirs (checkpoint-N/)
)


TEXT_LIMIT = 64 * 1024  # a small file the rules read as text: read whole up to this (HF's JSON: this much of it)


class TextRead(NamedTuple):
    """How much of a file the rules read as text the scan reads: up to `limit` bytes; a longer file is read as its
    first `limit` bytes when `prefix` (the rules read what they need from a prefix), else not at all (text None)."""

    limit: int = TEXT_LIMIT
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class DeepChecks:
    """What `verify` runs on a layout's checkpoints: functions of `ckpt_audit.deep`, named "module:function" (the
    signatures are deep.check's). Named, never imported, here: they load torch, and deep sits above the layouts."""

    # Component.layout of each kind of component this layout builds -> the checks of such a component
    components: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # checks of the files a checkpoint of this layout's runs holds itself, outside its components
    step: tuple[str, ...] = ()


class Layout(Protocol):
    name: str  # e.g. "verl-fsdp"; stored as Run.layout / Component.layout

    @property
    def text_files(self) -> Mapping[str, TextRead]:
        """File name -> how much of it the scan reads as text (FileFacts.text), for this layout's rules."""
        ...

    @property
    def deep_checks(self) -> DeepChecks:
        """What verify checks beyond the scan, on this layout's components and checkpoints."""
        ...

    @property
    def tracker(self) -> Tracker | None:
        """What this layout's runs' resume reads to find its checkpoint (None: a component format, no runs)."""
        ...

    def is_step_dir(self, name: str) -> bool:
        """A directory by this name is one checkpoint (a step) in this layout: a path inside it scans it alone."""
        ...

    def find_runs(self, tree: Tree) -> Iterable[str]:
        """Directories of `tree` that are runs in this layout (absolute paths). Asked on every scan of every directory
        of the store: test each distinct name once (`Tree.distinct_file_names`, `distinct_dir_names`) and look only
        where the names taken are, not every file of every directory."""
        ...

    def file_kind(self, path: str) -> FileKind | None:
        """What the file at `path` is when its name alone says so in this layout, else None."""
        ...

    def build_run(self, run_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext) -> Run:
        """The model of one run, findings and statuses included (via `ckpt_audit.rules`)."""
        ...

    def build_component(
        self, role: str, role_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext
    ) -> Component | None:
        """A role directory in this layout's format as a Component with its findings, or None if not ours."""
        ...


@cache
def load_layouts() -> tuple[Layout, ...]:
    return tuple(importlib.import_module(name).LAYOUT for name in LAYOUTS)


@cache
def text_files() -> Mapping[str, TextRead]:
    """Every layout's text files, by name (a name two layouts read is read the way the first one says)."""
    out: dict[str, TextRead] = {}
    for layout in reversed(load_layouts()):
        out.update(layout.text_files)
    return out


def deep_checks(layout: str) -> tuple[str, ...]:
    """The deep checks of a component whose `Component.layout` is `layout`, as the layout that builds it names them."""
    for each in load_layouts():
        if layout in each.deep_checks.components:
            return each.deep_checks.components[layout]
    return ()


def layout_named(name: str) -> Layout | None:
    """The layout whose name is `name` (a Run.layout), or None."""
    return next((each for each in load_layouts() if each.name == name), None)


def deep_step_checks(layout: str) -> tuple[str, ...]:
    """The deep checks of the files a checkpoint of a run whose `Run.layout` is `layout` holds itself."""
    found = layout_named(layout)
    return () if found is None else found.deep_checks.step


def run_tracker(layout: str) -> Tracker:
    """The tracker of a run whose `Run.layout` is `layout`. Raises LookupError for a name no run layout has."""
    found = layout_named(layout)
    if found is None or found.tracker is None:
        raise LookupError(f"no layout builds runs named {layout!r}")
    return found.tracker


def tracker_by_file(name: str) -> Tracker | None:
    """The tracker a file by this name is, as a fix writes it: the first layout's whose resume reads it."""
    return next((t for each in load_layouts() if (t := each.tracker) and t.file == name and not t.refusal), None)


def enclosing_step_dir(path: str) -> str | None:
    """`path` itself or its nearest ancestor that some layout calls a step directory (Layout.is_step_dir), else
    None (a custom DeepSpeed tag has no telling name)."""
    layouts = load_layouts()
    p = path.rstrip("/")
    while p and p != "/":
        name = p.rsplit("/", 1)[-1]
        if any(layout.is_step_dir(name) for layout in layouts):
            return p
        p = p.rsplit("/", 1)[0]
    return None


def file_kind(path: str, layouts: Sequence[Layout] | None = None) -> FileKind:
    """What a file is by its name, as the first layout that knows the name says (OTHER when none does). The scanner
    asks before the file rules run, so a rule applies to what the file is meant to be (a .distcp is no zip)."""
    for layout in layouts if layouts is not None else load_layouts():
        kind = layout.file_kind(path)
        if kind is not None:
            return kind
    return FileKind.OTHER


def component_for(
    role: str, role_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext
) -> Component | None:
    """The first layout that recognises `role_dir` builds its component."""
    for layout in load_layouts():
        comp = layout.build_component(role, role_dir, tree, facts, ctx)
        if comp is not None:
            return comp
    return None


def one_component_checkpoint(
    run_dir: str,
    step: int,
    step_dir: str,
    *,
    layout: str,
    world_size: int | None,
    files: Sequence[ShardFile],
    file_findings: Sequence[Finding],
    findings: Sequence[Finding],
    tree: Tree,
) -> Checkpoint:
    """A checkpoint whose step directory is its one component (a DeepSpeed tag, HF Trainer's checkpoint-N,
    torchtitan's step-N), to be judged by rules.status.judge. Its age is its newest entry's, directories included:
    an empty step folder made a second ago is young."""
    comp = Component(
        role="", path=step_dir, layout=layout, world_size=world_size, files=tuple(files), findings=tuple(file_findings)
    )
    return Checkpoint(
        run_path=run_dir,
        step=step,
        path=step_dir,
        status=Status.INCOMPLETE,  # placeholder; status.judge decides
        components=(comp,),
        findings=tuple(findings),
        mtime_ns=max([tree.newest_dir_mtime_ns(step_dir), *(f.mtime_ns for f in files)]),
    )


def shard_file(facts: FileFacts, kind: FileKind, rank: int | None, world_size: int | None = None) -> ShardFile:
    """The one way a layout turns a walked file into a ShardFile (rank and world size from its name, if any).
    One per file per judgement: built in slot order without the frozen __init__ (models.from_slots)."""
    f = facts
    return from_slots(ShardFile, (f.path, kind, f.size_bytes, f.mtime_ns, f.inode, rank, world_size, f.hash, f.crc_ok))
