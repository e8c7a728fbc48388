"""transformers' Trainer output directories: `<output_dir>/checkpoint-N/`, recognised with no configuration.

<output_dir>/checkpoint-N/model.safetensors          or model-0000i-of-0000n.safetensors + model.safetensors.index.json
                          (pytorch_model*.bin, adapter_model.*, config.json, generation_config.json, tokenizer files)
                          optimizer.pt, scheduler.pt, scaler.pt (fp16), rng_state.pth or rng_state_R.pth per rank
                          training_args.bin                     a pickled TrainingArguments, never loaded on resume
                          trainer_state.json                    written last: it commits the save

The output directory is the run, N the step; one component ("") holds every file. There is no tracker:
`resume_from_checkpoint=True` loads the highest N whatever it holds (transformers' get_last_checkpoint), so the run
says so when that one is not complete (`ckpt-audit latest` names the newest complete one). The rules are in
`ckpt_audit.rules.hf_trainer`; the pickles go through the scan's restricted reader like verl's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace

from ckpt_audit import models
from ckpt_audit.codes import finding
from ckpt_audit.layouts import DeepChecks, TextRead, deepspeed, one_component_checkpoint, shard_file
from ckpt_audit.layouts.verl_fsdp import STEP_TRACKER
from ckpt_audit.models import MAX_STEP, Checkpoint, Component, FileKind, Finding, Run, Status
from ckpt_audit.rules import hf_trainer as rules
from ckpt_audit.rules import status
from ckpt_audit.rules.status import ScanContext
from ckpt_audit.tree import FileFacts, Tree

NAME = "hf-trainer"
CHECKPOINT_RE = re.compile(r"checkpoint-(\d{1,19})")  # transformers' _re_checkpoint, with a bound on the digits
# names only Trainer writes together: one of them in a checkpoint-N/ makes its parent an HF output directory
SIGNS = frozenset({rules.TRAINER_STATE, rules.TRAINING_ARGS, rules.SCHEDULER, "rng_state.pth", *rules.OPTIMIZER_FILES})
ADAPTER_NAMES = frozenset({"adapter_model.safetensors", "adapter_model.bin"})
# what DeepSpeed's save_checkpoint puts beside its global_stepK/: the tag pointer and converters of that state
DEEPSPEED_FILES = frozenset({"latest", "zero_to_fp32.py", "zero_to_torch.py"})


def step_of(name: str) -> int | None:
    m = CHECKPOINT_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def classify(name: str) -> tuple[FileKind, int | None]:
    """(kind, rank) of a file directly in checkpoint-N/ (rank: the R of rng_state_R.pth)."""
    if name in rules.WEIGHT_FILES or rules.WEIGHT_SHARD_RE.fullmatch(name) or name.startswith(rules.FSDP_MODEL_PREFIX):
        return FileKind.MODEL, None
    if name in rules.OPTIMIZER_FILES:
        return FileKind.OPTIM, None
    if m := rules.RNG_RE.fullmatch(name):
        return FileKind.EXTRA_STATE, int(m.group(1)) if m.group(1) is not None else None
    if name in (rules.SCHEDULER, "scaler.pt"):
        return FileKind.EXTRA_STATE, None
    return FileKind.OTHER, None


def is_checkpoint(names: Iterable[str]) -> bool:
    """Whether a directory holding files `names` is a Trainer checkpoint (by names only Trainer writes)."""
    return any(n in SIGNS or rules.RNG_RE.fullmatch(n) for n in names)


def is_resume_state(name: str) -> bool:
    """A file Trainer writes only to resume (optimizer, scheduler, scaler, RNG, trainer state, its arguments): not
    part of the model, so an export leaves it out."""
    return classify(name)[0] in (FileKind.OPTIM, FileKind.EXTRA_STATE) or name in (
        rules.TRAINER_STATE,
        rules.TRAINING_ARGS,
        *DEEPSPEED_FILES,
    )


def _is_hf_checkpoint(d: str, tree: Tree) -> bool:
    return is_checkpoint(tree.file_names(d))


class HfTrainer:
    name = NAME
    # the Trainer's JSON grows with the run (log_history, weight_map): the rules read what they need from a prefix
    # (trainer_state.json is dumped with sorted keys: global_step comes first); a weights index is read whole up to
    # INDEX_TEXT_LIMIT (its weight_map is checked against the shards' headers)
    text_files = {
        "trainer_state.json": TextRead(rules.TEXT_LIMIT, prefix=True),
        **{n: TextRead(rules.INDEX_TEXT_LIMIT, prefix=True) for n in rules.INDEX_FILES},
    }
    # its resume pickles, and DeepSpeed's tags inside a checkpoint-N as a bare engine tree's
    deep_checks = DeepChecks(
        components={NAME: ("ckpt_audit.deep.hf_check:check", "ckpt_audit.deep.deepspeed_check:check")}
    )

    # Trainer reads no tracker: one written there would only mislead
    tracker = replace(
        STEP_TRACKER,
        refusal="an HF Trainer run has no tracker (resume_from_checkpoint=True loads the highest checkpoint-N): "
        "pass `ckpt-audit latest` to resume_from_checkpoint instead",
    )

    def is_step_dir(self, name: str) -> bool:
        return CHECKPOINT_RE.fullmatch(name) is not None

    def find_runs(self, tree: Tree) -> Iterable[str]:
        steps = {s for s in tree.distinct_dir_names() if step_of(s) is not None}
        if not steps:
            return
        for d, subdirs in tree.dirs.items():
            if steps.isdisjoint(subdirs) or step_of(d.rsplit("/", 1)[-1]) is not None:
                continue  # a checkpoint is never itself a run (nested output dirs are not Trainer's)
            if any(s in steps and _is_hf_checkpoint(f"{d}/{s}", tree) for s in subdirs):
                yield d

    def file_kind(self, path: str) -> FileKind | None:
        parent, _, name = path.rpartition("/")
        if step_of(parent.rsplit("/", 1)[-1]) is None:
            return None
        kind = classify(name)[0]
        return None if kind is FileKind.OTHER else kind

    def build_component(
        self, role: str, role_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext
    ) -> Component | None:
        return None  # Trainer checkpoints are runs of their own, never a role inside another layout's step

    def build_run(self, run_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext) -> Run:
        checkpoints: list[Checkpoint] = []
        found: list[Finding] = []
        for sub in tree.subdirs(run_dir):
            step = step_of(sub)
            if step is None:
                continue
            d = f"{run_dir}/{sub}"
            if step > MAX_STEP:
                found.append(finding("step-out-of-range", d, f"step {step} is past 2^63-1; not a checkpoint"))
                continue
            ckpt = self._checkpoint(run_dir, d, step, tree, facts)
            # Trainer writes trainer_state.json last: its presence commits the save, as verl's tracker does
            committed = step if rules.TRAINER_STATE in tree.file_names(d) else None
            checkpoints.append(status.judge(ckpt, tracker_step=committed, ctx=ctx))
        checkpoints.sort(key=lambda c: (c.step, c.path))
        checkpoints = fewer_ranks(checkpoints)
        found.extend(last_checkpoint(run_dir, checkpoints))
        return models.Run(path=run_dir, layout=NAME, checkpoints=tuple(checkpoints), findings=tuple(found))

    def _checkpoint(
        self, run_dir: str, step_dir: str, step: int, tree: Tree, facts: Mapping[str, FileFacts]
    ) -> Checkpoint:
        files = []
        file_findings: list[Finding] = []
        for path in tree.files_below(step_dir):
            fact = facts.get(path)
            if fact is None:
                continue  # not read: a focused scan of a neighbour
            rel = path[len(step_dir) + 1 :]
            kind, rank = classify(rel) if "/" not in rel else (FileKind.OTHER, None)
            files.append(shard_file(fact, kind, rank))
            file_findings.extend(fact.findings)
        names = frozenset(tree.file_names(step_dir))
        subdirs = frozenset(tree.subdirs(step_dir))
        texts = {
            n: (fact.text, fact.size_bytes <= (rules.INDEX_TEXT_LIMIT if n in rules.INDEX_FILES else rules.TEXT_LIMIT))
            for n in names & {rules.TRAINER_STATE, *rules.INDEX_FILES}
            if (fact := facts.get(f"{step_dir}/{n}")) is not None
        }
        headers = {
            n: fact.tensors
            for n in names
            if n.endswith(".safetensors") and n not in ADAPTER_NAMES and (fact := facts.get(f"{step_dir}/{n}"))
        }
        below = any(
            s.startswith((rules.FSDP_MODEL_PREFIX, rules.FSDP_OPTIM_PREFIX))
            or rules.DEEPSPEED_STEP_RE.fullmatch(s)
            or ADAPTER_NAMES & set(tree.file_names(f"{step_dir}/{s}"))
            for s in subdirs
        )
        return one_component_checkpoint(
            run_dir,
            step,
            step_dir,
            layout=NAME,
            world_size=rules.world_size(names),
            files=files,
            file_findings=file_findings,
            findings=rules.check_checkpoint(step_dir, step, names, subdirs, texts, weights_below=below, headers=headers)
            + deepspeed.trainer_state_findings(step_dir, tree, facts),
            tree=tree,
        )


def fewer_ranks(checkpoints: list[Checkpoint]) -> list[Checkpoint]:
    """Each checkpoint (by step) with RNG states for fewer ranks than the one before gets a warning: the names
    alone cannot tell the highest ranks' missing files from a resume on fewer processes, so it stays a warning."""
    out: list[Checkpoint] = []
    before: Checkpoint | None = None
    for c in checkpoints:
        ws, prev = c.world_size, before.world_size if before is not None else None
        if (
            before is not None
            and ws is not None
            and prev is not None
            and ws < prev
            and c.status is not Status.IN_PROGRESS
        ):
            note = finding(
                "hf-fewer-ranks",
                f"{c.path}/rng_state_{ws}.pth",
                f"RNG states of {ws} rank(s), checkpoint-{before.step} has {prev}: rank {ws} and up are missing, "
                "or the run resumed on fewer processes",
                rank=ws,
            )
            c = replace(c, findings=c.findings + (note,))
        out.append(c)
        before = c if c.world_size is not None else before
    return out


def last_checkpoint(run_dir: str, checkpoints: list[Checkpoint]) -> tuple[Finding, ...]:
    """What `resume_from_checkpoint=True` would load (the highest N), when that is not a complete checkpoint."""
    if not checkpoints:
        return ()
    last = checkpoints[-1]
    if last.status in (Status.COMPLETE, Status.IN_PROGRESS):
        return ()
    good = [c for c in checkpoints if c.status is Status.COMPLETE]
    instead = f"the newest complete one is {good[-1].path}" if good else "no checkpoint here is complete"
    return (
        finding(
            "hf-last-checkpoint-unusable",
            last.path,
            f"resume_from_checkpoint=True loads checkpoint-{last.step}, which is {last.status.value}; {instead}",
        ),
    )


LAYOUT = HfTrainer()
