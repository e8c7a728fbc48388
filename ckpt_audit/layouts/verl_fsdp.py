"""verl's FSDP checkpoint trees (docs/verl-format.md §1): PPO/GRPO, SFT and the older names.

<run>/latest_checkpointed_iteration.txt
<run>/global_step_N/{actor,critic}/model_world_size_W_rank_R.pt (+ optim_, extra_state_, fsdp_config.json,
                                   huggingface/, lora_adapter/)
<run>/global_step_N/data.pt                      PPO: dataloader state, written after every role
<run>/global_step_N/model_world_size_W_rank_R.pt SFT: shards directly in the step directory (data_{dp}.pt too)
.../model_rank_R.pt                              v0.2-era names without the world size
<run>/global_steps_N/                            the docs' typo, never read by verl: flagged misnamed-step
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace

from ckpt_audit import models
from ckpt_audit.codes import finding
from ckpt_audit.layouts import DeepChecks, TextRead, component_for, shard_file
from ckpt_audit.layouts.tracker import TRACKER, Tracker, read_tracker, tracker_path
from ckpt_audit.models import MAX_STEP, Checkpoint, Component, FileKind, Finding, Run, ShardFile, Status
from ckpt_audit.readers import bounded_json
from ckpt_audit.rules import megatron_v2, save_order, shards, status, tracker
from ckpt_audit.rules.status import ScanContext
from ckpt_audit.tree import FileFacts, Tree

NAME = "verl-fsdp"
STEP_RE = re.compile(r"global_step_(\d+)")
MISNAMED_STEP_RE = re.compile(r"(?:global[_-]?steps?[_-]?|global_steps_)(\d+)", re.IGNORECASE)
SHARD_RE = re.compile(r"(model|optim|extra_state)_(?:world_size_(\d+)_)?rank_(\d+)\.pt")
DATA_RE = re.compile(r"data(?:_\d+)?\.pt")
HF_CONFIG = "huggingface/config.json"  # the model config verl saves beside a role's shards
ROLE_NAMES = frozenset({"actor", "critic", "ref", "reward", "rm"})
_KINDS = {"model": FileKind.MODEL, "optim": FileKind.OPTIM, "extra_state": FileKind.EXTRA_STATE}


@functools.lru_cache(maxsize=8192)  # pure; a tree repeats the same few names in every step (re-scan: 2 calls a file)
def classify(name: str, rel_parts: tuple[str, ...]) -> tuple[FileKind, int | None, int | None]:
    """(kind, rank, world_size) of a file inside a component, from its name and its path below the component."""
    if rel_parts and rel_parts[0] == "huggingface":
        return FileKind.HF, None, None
    if rel_parts and rel_parts[0] == "lora_adapter":
        return FileKind.LORA, None, None
    if rel_parts:
        return FileKind.OTHER, None, None
    if (m := SHARD_RE.fullmatch(name)) and max(len(m.group(2) or ""), len(m.group(3))) < 10:
        # (a rank or world size of ten digits or more is no shard name: SQLite could not even record it)
        return _KINDS[m.group(1)], int(m.group(3)), int(m.group(2)) if m.group(2) else None
    if name == "fsdp_config.json":
        return FileKind.FSDP_CONFIG, None, None
    if DATA_RE.fullmatch(name):
        return FileKind.DATA, None, None
    return FileKind.OTHER, None, None


def step_dir_name(step: int) -> str:
    """The directory verl saves (and resumes) step `step` in."""
    return f"global_step_{step}"


def step_of(name: str) -> tuple[int | None, bool]:
    """(step, misnamed) for a directory name; (None, False) when it is not a step directory at all."""
    if m := STEP_RE.fullmatch(name):
        return int(m.group(1)), False
    if m := MISNAMED_STEP_RE.fullmatch(name):
        return int(m.group(1)), True
    return None, False


def _opens(name: str, step: int) -> bool:
    """verl resumes from exactly `<run>/global_step_<N>`: a `global_step_06` is never what a tracker saying 6 loads."""
    return name == step_dir_name(step)


def _numbered(name: str) -> bool:
    """A step directory (global_step_N, or misnamed) with N within 0..2^63-1, as the scan counts them:
    fix-tracker's re-check of the run compares this listing with the scanned checkpoints."""
    step = step_of(name)[0]
    return step is not None and step <= MAX_STEP


# a tracker naming a step by number, written as verl writes it: any directory of that step is what it names
STEP_TRACKER = Tracker(file=TRACKER, step_entry=_numbered)

HF_CHECKPOINT_RE = re.compile(r"checkpoint-\d+")  # HF Trainer's checkpoint-N (layouts.hf_trainer): not a verl run


class VerlFsdp:
    name = NAME
    # the tracker, each role's FSDP config, and the run's Hydra config (rules.save_order)
    text_files = {TRACKER: TextRead(), "fsdp_config.json": TextRead(), "config.yaml": TextRead()}
    deep_checks = DeepChecks(
        components={NAME: ("ckpt_audit.deep.verl_fsdp:check",)}, step=("ckpt_audit.deep.verl_fsdp:check_step",)
    )
    tracker = replace(STEP_TRACKER, resolves=_opens)

    def is_step_dir(self, name: str) -> bool:
        return step_of(name)[0] is not None  # global_step_N, or misnamed

    def find_runs(self, tree: Tree) -> Iterable[str]:
        steps = {s for s in tree.distinct_dir_names() if step_of(s)[0] is not None}
        for d, subdirs in tree.dirs.items():
            if TRACKER in tree.file_names(d) or not steps.isdisjoint(subdirs):
                # a step directory is never itself a run (verl's SFT nests nothing below it)
                if step_of(d.rsplit("/", 1)[-1])[0] is None and not _hf_checkpoint(d, tree):
                    yield d

    def file_kind(self, path: str) -> FileKind | None:
        kind = classify(path.rsplit("/", 1)[-1], ())[0]
        return None if kind is FileKind.OTHER else kind

    def build_component(
        self, role: str, role_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext
    ) -> Component | None:
        if not any(SHARD_RE.fullmatch(n) for n in tree.file_names(role_dir)):
            return None
        return self._component(role, role_dir, tree, facts)

    def _component(self, role: str, role_dir: str, tree: Tree, facts: Mapping[str, FileFacts]) -> Component:
        files: list[ShardFile] = []
        file_findings: list[Finding] = []
        cut = len(role_dir) + 1
        stop = frozenset(
            f"{role_dir}/{s}" for s in tree.subdirs(role_dir) if role == "" and _is_role(s, tree, role_dir)
        )
        for path in tree.files_below(role_dir, stop=stop):
            fact = facts.get(path)
            if fact is None:
                continue
            parts = tuple(path[cut:].split("/"))
            kind, rank, ws = classify(parts[-1], parts[:-1])
            if role == "" and kind is FileKind.DATA:
                continue  # SFT: the step's data_{dp}.pt belongs to the checkpoint, not the component
            files.append(shard_file(fact, kind, rank, ws))
            file_findings.extend(fact.findings)
        config_fact = facts.get(f"{role_dir}/fsdp_config.json")
        comp = models.Component(role=role, path=role_dir, layout=NAME, world_size=None, files=tuple(files))
        ws, found = shards.check_fsdp_shards(comp, config_text=config_fact.text if config_fact else None)
        meshes = {f.path: pt.mesh_sizes for f in files if (pt := facts[f.path].pt) is not None}
        found += shards.check_meshes(comp, ws, meshes)
        if "huggingface" not in tree.subdirs(role_dir) and "huggingface" in tree.subdirs(f"{role_dir}/model"):
            found += (megatron_v2.huggingface_moved(role_dir),)
        return replace(comp, world_size=ws, findings=tuple(file_findings) + found)

    def build_run(self, run_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext) -> Run:
        tracker_file = tracker_path(run_dir)
        tracker_fact = facts.get(tracker_file)
        tracker_step, run_findings = read_tracker(
            tracker_file, tracker_fact.text if tracker_fact else None, present=tracker_fact is not None
        )
        if tracker_fact is not None:
            run_findings = tuple(tracker_fact.findings) + run_findings
        walked = tuple(f for f in ctx.unread if f.path == tracker_file)  # e.g. a link out of the root
        run_findings += tracker.unread_tracker(
            tracker_file,
            text=tracker_fact.text if tracker_fact else None,
            present=tracker_fact is not None,
            walked=walked,
            read=tracker_fact.findings if tracker_fact else (),
        )
        checkpoints = []
        for sub in tree.subdirs(run_dir):
            step, misnamed = step_of(sub)
            if step is None:
                continue
            if step > MAX_STEP:  # one absurd name must not stop the catalog from recording the rest
                run_findings += (
                    finding("step-out-of-range", f"{run_dir}/{sub}", f"step {step} is past 2^63-1; not a checkpoint"),
                )
                continue
            ckpt = self._checkpoint(run_dir, f"{run_dir}/{sub}", step, tree, facts, ctx)
            if misnamed:
                ckpt = replace(
                    ckpt,
                    findings=ckpt.findings
                    + (
                        finding(
                            "misnamed-step", ckpt.path, f"{sub!r} is not named global_step_{step}; verl never reads it"
                        ),
                    ),
                )
            checkpoints.append(ckpt)
        checkpoints.sort(key=lambda c: (c.step, c.path))
        judged = tuple(status.judge(c, tracker_step=tracker_step, ctx=ctx) for c in checkpoints)
        known = tracker_fact is not None or bool(walked)
        run_findings += tracker.check_run(
            run_dir,
            tracker_step,
            judged,
            tracker_known=known,
            tracker_path=tracker_file,
            target_path=None if tracker_step is None else f"{run_dir}/{step_dir_name(tracker_step)}",
        )
        run_findings += save_order.check_run(
            run_dir,
            tracker_path=tracker_file,
            tracker_step=tracker_step,
            tracker_mtime_ns=tracker_fact.mtime_ns if tracker_fact else None,
            tracker_known=known,
            checkpoints=judged,
            changed_paths=ctx.changed_paths,
            now_ns=ctx.now_ns,
            in_progress_window_ns=ctx.in_progress_window_ns,
            configs={
                p: text
                for p in (f"{run_dir}/{n}" for n in save_order.CONFIG_NAMES)
                if p in facts and (text := facts[p].text)
            },
        )
        metrics = f"{run_dir}/metrics.jsonl"
        return models.Run(
            path=run_dir,
            layout=NAME,
            tracker_step=tracker_step,
            checkpoints=judged,
            findings=run_findings,
            metrics_path=metrics if metrics in facts else None,
        )

    def _checkpoint(
        self, run_dir: str, step_dir: str, step: int, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext
    ) -> Checkpoint:
        components: list[Component] = []
        claimed: set[str] = set()
        for sub in tree.subdirs(step_dir):
            role_dir = f"{step_dir}/{sub}"
            if not _is_role(sub, tree, step_dir):
                continue
            comp = component_for(sub, role_dir, tree, facts, ctx) or self._component(sub, role_dir, tree, facts)
            components.append(comp)
            claimed.add(role_dir)
        sft = any(SHARD_RE.fullmatch(n) for n in tree.file_names(step_dir))
        if sft:
            components.insert(0, self._component("", step_dir, tree, facts))
        step_files: list[ShardFile] = []
        step_findings: list[Finding] = []
        in_components = {f.path for c in components for f in c.files}
        for path in tree.files_below(step_dir, stop=frozenset(claimed)):
            fact = facts.get(path)
            if fact is None or path in in_components:
                continue
            rel = tuple(path[len(step_dir) + 1 :].split("/"))
            kind = FileKind.DATA if len(rel) == 1 and DATA_RE.fullmatch(rel[0]) else FileKind.OTHER
            step_files.append(shard_file(fact, kind, None, None))
            step_findings.extend(fact.findings)
        # its age is its newest entry's, directories included: an empty global_step_N/ made a second ago is young
        mtime = max(
            [
                tree.newest_dir_mtime_ns(step_dir),
                *(f.mtime_ns for f in step_files),
                *(f.mtime_ns for c in components for f in c.files),
            ]
        )
        ckpt = models.Checkpoint(
            run_path=run_dir,
            step=step,
            path=step_dir,
            status=Status.INCOMPLETE,  # placeholder; status.judge decides
            components=tuple(components),
            files=tuple(step_files),
            findings=tuple(step_findings),
            mtime_ns=mtime,
        )
        return replace(ckpt, findings=ckpt.findings + shards.check_step(ckpt, sft=sft))


def model_weights(comp: Component) -> dict[int, ShardFile]:
    """The checkpoint's model weights in a component this layout built, by rank: the model shards named for the
    world size the scan judged it at (Component.world_size, rules.shards.current_world_size: the one fsdp_config.json
    names, else the newest set of any kind). The one rule: the scan judges these and export reads them."""
    ws = comp.world_size
    return {
        f.rank: f
        for f in comp.files
        if f.kind is FileKind.MODEL and f.rank is not None and f.world_size is not None and f.world_size == ws
    }


def config_world_size(role_dir: str) -> int | None:
    """The world_size a component's fsdp_config.json names, read now and parsed as the scan parses it
    (rules.shards.parse_fsdp_config; verify's mesh check): None when absent, unreadable or unusable (the scan
    says why)."""
    path = f"{role_dir}/fsdp_config.json"
    try:
        with open(path, "rb") as f:
            text = f.read(bounded_json.MAX_FILE + 1).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return shards.parse_fsdp_config(path, text)[0]


def _hf_checkpoint(d: str, tree: Tree) -> bool:
    """An HF Trainer checkpoint-N (layouts.hf_trainer): under DeepSpeed it holds a global_stepK/ of DeepSpeed's, which
    reads like a misnamed verl step, but it is no verl run."""
    names = tree.file_names(d)
    return (
        bool(HF_CHECKPOINT_RE.fullmatch(d.rsplit("/", 1)[-1]))
        and TRACKER not in names
        # trainer_state.json comes last; training_args.bin with the weights, before DeepSpeed's global_stepK/
        and ("trainer_state.json" in names or "training_args.bin" in names)
    )


def _is_role(name: str, tree: Tree, parent: str) -> bool:
    """A role directory: verl's role names, or any sub-directory holding shard files or a dist_ckpt/."""
    if name in ("huggingface", "lora_adapter"):
        return False
    if name in ROLE_NAMES:
        return True
    d = f"{parent}/{name}"
    names = tree.file_names(d)
    # a dist_ckpt/ (Megatron, old layout) or ckpt_contents.json (Megatron layout v2) makes any name a role
    return any(SHARD_RE.fullmatch(n) for n in names) or "dist_ckpt" in tree.subdirs(d) or "ckpt_contents.json" in names


LAYOUT = VerlFsdp()
