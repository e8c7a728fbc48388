"""torchtitan's checkpoint folder: `<dump_folder>/<checkpoint.folder>/step-N/`, one DCP save per step (docs/scan.md).

    <dump>/checkpoint/step-N/{.metadata, __R_0.distcp}   CheckpointManager via dcp.save / dcp.async_save
    <dump>/checkpoint/step-N/.metadata.tmp                DCP's commit under way (renamed to .metadata last)
    <dump>/checkpoint/step-0/                             the seed checkpoint: model only
    <dump>/checkpoint/step-N/                             the last step: model only by default (last_save_model_only)
    <dump>/checkpoint/step-N/{model.safetensors.index.json, *.safetensors, sharded/}   last_save_in_hf export

torchtitan resumes from the highest `step-N` holding a `.metadata` or a safetensors index, whatever else the folder
holds, and its keep_latest_k purge deletes the oldest `step-N` folders in the background. So the scan judges each
step folder as DCP wrote it: `.metadata` is the commit (a folder without it is being written, or its writer died),
every data file `.metadata` points into must exist and hold its byte ranges, and a save with no optimizer state is
model only (torchtitan resumes training from it only at step 0, as a seed).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace

from ckpt_audit import models
from ckpt_audit.codes import finding
from ckpt_audit.layouts import DeepChecks, TextRead, one_component_checkpoint, shard_file
from ckpt_audit.layouts.dcp import DISTCP_RE, METADATA, check_byte_ranges, check_dcp_dir, check_model_keys
from ckpt_audit.layouts.verl_fsdp import STEP_TRACKER
from ckpt_audit.models import MAX_STEP, Checkpoint, Component, FileKind, Finding, Run, ShardFile, Status
from ckpt_audit.rules import status
from ckpt_audit.rules.status import ScanContext
from ckpt_audit.tree import FileFacts, Tree

NAME = "torchtitan"
STEP_DIR_RE = re.compile(r"step-(\d+)")
STEP_SEARCH_RE = re.compile(r"step-(\d+)")  # torchtitan's own test: re.search, so "step-5.bak" is step 5 to it
METADATA_TMP = f"{METADATA}.tmp"
HF_INDEX = "model.safetensors.index.json"
OPTIMIZER = "optimizer"  # torchtitan's state-dict key for the optimizers (components/checkpointer/base.py)


def _markers(names: tuple[str, ...]) -> bool:
    """A folder name torchtitan's save leaves behind (DCP's files, or the HF export's index and weights)."""
    return any(n in (METADATA, METADATA_TMP, HF_INDEX) or DISTCP_RE.fullmatch(n) for n in names)


def step_of(name: str) -> int | None:
    m = STEP_DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def classify(rel_parts: tuple[str, ...]) -> tuple[FileKind, int | None]:
    """(kind, rank) of a file below a step folder, from its path there."""
    name = rel_parts[-1]
    if len(rel_parts) == 1 and (m := DISTCP_RE.fullmatch(name)):
        return FileKind.DISTCP, int(m.group(1))
    if len(rel_parts) == 1 and name == METADATA:
        return FileKind.DCP_METADATA, None
    if name == HF_INDEX or name.endswith(".safetensors"):
        return FileKind.HF, None
    return FileKind.OTHER, None


class Torchtitan:
    name = NAME
    text_files: Mapping[str, TextRead] = {}
    deep_checks = DeepChecks(components={NAME: ("ckpt_audit.deep.dcp_check:check",)})  # a torchtitan step is DCP
    # torchtitan resumes from the highest step-N with a .metadata, whatever is there
    tracker = replace(
        STEP_TRACKER,
        refusal="a torchtitan run has no tracker (it resumes from the highest step-N holding a .metadata): "
        "move a broken newest step-N aside, or set checkpoint.load_step",
    )

    def is_step_dir(self, name: str) -> bool:
        return STEP_DIR_RE.fullmatch(name) is not None

    def find_runs(self, tree: Tree) -> Iterable[str]:
        steps = {s for s in tree.distinct_dir_names() if step_of(s) is not None}
        if not steps:
            return
        for d, subdirs in tree.dirs.items():
            if steps.isdisjoint(subdirs) or step_of(d.rsplit("/", 1)[-1]) is not None:
                continue  # a step folder is never itself a run
            if any(s in steps and _markers(tree.file_names(f"{d}/{s}")) for s in subdirs):
                yield d

    def file_kind(self, path: str) -> FileKind | None:
        parts = path.rsplit("/", 2)
        if len(parts) == 3 and step_of(parts[1]) is not None:
            kind = classify((parts[2],))[0]
            return None if kind is FileKind.OTHER else kind
        return None

    def build_component(
        self, role: str, role_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext
    ) -> Component | None:
        return None  # torchtitan folders are runs of their own, never a role inside another layout's step

    def build_run(self, run_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext) -> Run:
        found: list[Finding] = []
        checkpoints = []
        for sub in tree.subdirs(run_dir):
            step = step_of(sub)
            if step is None:
                found.extend(_stray(run_dir, sub, tree))
                continue
            if step > MAX_STEP:
                found.append(finding("step-out-of-range", f"{run_dir}/{sub}", f"step {step} is past 2^63-1"))
                continue
            checkpoints.append(self._checkpoint(run_dir, f"{run_dir}/{sub}", step, tree, facts, ctx))
        checkpoints.sort(key=lambda c: (c.step, c.path))
        # what torchtitan's auto-resume loads: the highest step folder with a .metadata or an HF index
        target = max((c for c in checkpoints if _committed(c.path, tree)), key=lambda c: c.step, default=None)
        if target is not None and target.status not in (Status.COMPLETE, Status.IN_PROGRESS):
            found.append(
                finding(
                    "torchtitan-resume-broken",
                    target.path,
                    f"torchtitan's auto-resume picks step {target.step} (the highest step-N with {METADATA}), "
                    f"which is {target.status}: the restart fails or loads damaged state; move it out of {run_dir}",
                )
            )
        return models.Run(
            path=run_dir,
            layout=NAME,
            tracker_step=target.step if target is not None else None,
            checkpoints=tuple(checkpoints),
            findings=tuple(found),
        )

    def _checkpoint(
        self, run_dir: str, step_dir: str, step: int, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext
    ) -> Checkpoint:
        files: list[ShardFile] = []
        found: list[Finding] = []
        cut = len(step_dir) + 1
        for path in tree.files_below(step_dir):
            fact = facts.get(path)
            if fact is None:
                continue
            kind, rank = classify(tuple(path[cut:].split("/")))
            files.append(shard_file(fact, kind, rank))
            found.extend(fact.findings)
        names = tree.file_names(step_dir)
        hf_only = HF_INDEX in names and METADATA not in names and not any(DISTCP_RE.fullmatch(n) for n in names)
        ws = None
        if not hf_only:
            ws, more = check_dcp_dir(step_dir, tree)
            found.extend(_with_tmp_note(more, names))
            found.extend(check_byte_ranges(step_dir, tree, facts))
            found.extend(check_model_keys(step_dir, facts))
        found.extend(_model_only(step_dir, step, facts, hf_only=hf_only))
        ckpt = one_component_checkpoint(
            run_dir,
            step,
            step_dir,
            layout=NAME,
            world_size=ws,
            files=files,
            file_findings=found,
            findings=(),
            tree=tree,
        )
        # DCP renames .metadata into place last: until then the folder is uncommitted (in progress while young)
        return status.judge(ckpt, tracker_step=step if _committed(step_dir, tree) else None, ctx=ctx)


def _stray(run_dir: str, name: str, tree: Tree) -> tuple[Finding, ...]:
    """A folder torchtitan takes for a step although it is not named step-N (a copy set aside as step-5.bak): its
    resume may pick that number and its keep_latest_k purge counts and deletes it."""
    m = STEP_SEARCH_RE.search(name)
    if m is None or not _committed(f"{run_dir}/{name}", tree):
        return ()
    return (
        finding(
            "torchtitan-stray-step",
            f"{run_dir}/{name}",
            f"torchtitan reads {name!r} as step {m.group(1)} (it searches folder names for step-N): its resume may "
            f"pick step {m.group(1)} and load step-{m.group(1)}, and its purge deletes this folder; move it out of "
            f"{run_dir}",
        ),
    )


def _committed(step_dir: str, tree: Tree) -> bool:
    names = tree.file_names(step_dir)
    return METADATA in names or HF_INDEX in names


def _with_tmp_note(found: tuple[Finding, ...], names: tuple[str, ...]) -> tuple[Finding, ...]:
    """dcp-metadata-missing says why when DCP's commit was cut between writing .metadata.tmp and renaming it."""
    if METADATA_TMP not in names:
        return found
    return tuple(
        finding(
            f.code,
            f.path,
            f"no .metadata but a {METADATA_TMP}: the save died while committing; torchtitan skips this step",
        )
        if f.code == "dcp-metadata-missing"
        else f
        for f in found
    )


def _model_only(step_dir: str, step: int, facts: Mapping[str, FileFacts], *, hf_only: bool) -> tuple[Finding, ...]:
    """A save without optimizer state: a seed at step 0 (what torchtitan loads it as), else not resumable."""
    meta = facts.get(f"{step_dir}/{METADATA}")
    keys = meta.dcp.key_roots if meta is not None and meta.dcp is not None else None
    if not hf_only and (keys is None or OPTIMIZER in keys):
        return ()
    what = "HF safetensors export" if hf_only else "DCP save"
    if step == 0:
        return (
            finding(
                "torchtitan-seed",
                step_dir,
                f"model-only {what} at step 0: the seed checkpoint torchtitan starts training from",
            ),
        )
    return (
        finding(
            "torchtitan-model-only",
            step_dir,
            f"model-only {what} (no optimizer, lr_scheduler, dataloader or train_state; torchtitan's "
            "last_save_model_only): weights for export or eval; a torchtitan resume from it fails loading the rest",
        ),
    )


LAYOUT = Torchtitan()
