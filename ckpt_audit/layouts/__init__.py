"""Layout plug-ins: the only code that knows checkpoint file names.

A layout is a module exposing `LAYOUT`, an object with the `Layout` protocol below. To add one (Megatron
`dist_ckpt`, plain DCP, HF Trainer, ...), write `ckpt_audit/layouts/<name>.py` and add one line to `LAYOUTS`.

The scanner asks every layout, in order, which directories of the walked `Tree` are runs (`find_runs`); the first
layout to claim a directory builds it (`build_run`). Run layouts that contain per-role directories (verl PPO's
`actor/`, `critic/`) first offer each role directory to every layout's `build_component`, so a component format
(e.g. Megatron `dist_ckpt/` under a verl step) plugs into the verl run structure without knowing about it.

Layouts must stay torch-free and do no IO: everything they need is in the `Tree` and the `FileFacts`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from typing import Protocol

from ckpt_audit.models import Component, FileKind, Run, ShardFile, from_slots
from ckpt_audit.rules.status import ScanContext
from ckpt_audit.tree import FileFacts, Tree

# module path of each layout plug-in, in priority order (first claim wins).
LAYOUTS: tuple[str, ...] = (
    "ckpt_audit.layouts.deepspeed",  # before verl: DeepSpeed's global_stepN tags read like misnamed verl steps
    "ckpt_audit.layouts.verl_fsdp",
    "ckpt_audit.layouts.torchtitan",  # before dcp: its step-N folders are DCP directories too
    "ckpt_audit.layouts.megatron_v2",  # before dcp: a migrated v2 role directory still holds the old dist_ckpt/
    "ckpt_audit.layouts.dcp",
    "ckpt_audit.layouts.hf_trainer",  # transformers Trainer output dirs (checkpoint-N/)
)


class Layout(Protocol):
    name: str  # e.g. "verl-fsdp"; stored as Run.layout / Component.layout

    def find_runs(self, tree: Tree) -> Iterable[str]:
        """Directories of `tree` that are runs in this layout (absolute paths)."""
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


def shard_file(facts: FileFacts, kind: FileKind, rank: int | None, world_size: int | None = None) -> ShardFile:
    """The one way a layout turns a walked file into a ShardFile (rank and world size from its name, if any).
    One per file per judgement: built in slot order without the frozen __init__ (models.from_slots)."""
    f = facts
    return from_slots(ShardFile, (f.path, kind, f.size_bytes, f.mtime_ns, f.inode, rank, world_size, f.hash, f.crc_ok))
