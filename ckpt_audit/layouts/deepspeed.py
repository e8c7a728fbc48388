"""DeepSpeed engine trees (`engine.save_checkpoint(save_dir)`), recognised with no configuration.

<save_dir>/latest                                   the tag load_checkpoint(tag=None) resumes, written after the save
<save_dir>/<tag>/mp_rank_MM_model_states.pt         ZeRO 0-2: module weights and engine state, one per mp rank
                 zero_pp_rank_D_mp_rank_MM_model_states.pt      ZeRO-3: one per dp rank too
                 [bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt  ZeRO >= 1: one optimizer partition per dp rank
                 layer_L_expert_E_mp_rank_MM_model_states.pt  MoE: one per expert of each MoE layer
                 expp_rank_R_mp_rank_MM_optim_states.pt      MoE at ZeRO-0: the optimizer per expert-parallel rank
                 layer_XX[-model_YY]-model_states.pt         PipelineModule: one layer's weights per tensor slice
<save_dir>/zero_to_fp32.py                          DeepSpeed's converter, copied next to the tags
<save_dir>/latest_universal, <tag>/zero/            a universal checkpoint (ds_to_universal) and the tag naming it

The save directory is the run; each directory holding DeepSpeed shards is a checkpoint (tag `global_stepN`,
`best_global_stepN` or any custom name; a custom tag's step is what its model states record). The degrees and the
rank grid come from what the files record (rules/deepspeed.py); tags newer than `latest` are uncommitted. OpenRLHF's
`_actor/` and `_critic/` save directories are also held to each other (openrlhf_findings).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from ckpt_audit import models
from ckpt_audit.codes import finding
from ckpt_audit.layouts import DeepChecks, TextRead, one_component_checkpoint, shard_file
from ckpt_audit.layouts.tracker import Tracker
from ckpt_audit.models import MAX_STEP, Checkpoint, Component, FileKind, Finding, Run, ShardFile, Status
from ckpt_audit.rules import deepspeed as rules
from ckpt_audit.rules import hf_trainer as hf_rules
from ckpt_audit.rules import status, tracker
from ckpt_audit.rules.status import ScanContext
from ckpt_audit.tree import FileFacts, Tree

NAME = "deepspeed"


def is_tag(d: str, tree: Tree) -> bool:
    """A directory holding DeepSpeed shard files."""
    return any(map(rules.SHARD_RE.fullmatch, tree.file_names(d)))


def classify(name: str) -> FileKind:
    if rules.OPTIM_RE.fullmatch(name) or rules.EXPP_RE.fullmatch(name):
        return FileKind.OPTIM
    if any(r.fullmatch(name) for r in (rules.MODEL_RE, rules.ZERO3_MODEL_RE, rules.EXPERT_RE, rules.PIPE_LAYER_RE)):
        return FileKind.MODEL
    return FileKind.OTHER


def _opens(name: str, step: int) -> bool:
    """load_checkpoint(tag=None) opens `<save_dir>/<latest read as UTF-8 text, stripped>`: a tag whose name has
    surrounding whitespace, an unprintable character or an undecodable byte cannot be named by `latest`."""
    return name == name.strip() and name.isprintable() and _utf8(name)


def _utf8(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:  # an undecodable byte in the directory's name (surrogateescape)
        return False
    return True


class DeepSpeed:
    name = NAME
    text_files = {"latest": TextRead(), "latest_universal": TextRead()}
    deep_checks = DeepChecks(components={NAME: ("ckpt_audit.deep.deepspeed_check:check",)})
    # `<save_dir>/latest` names the tag directory load_checkpoint(tag=None) resumes; a tag is any directory of shards
    tracker = Tracker(file=rules.LATEST, takes_tag=True, resolves=_opens, step_entry=rules.is_shard)

    def is_step_dir(self, name: str) -> bool:
        return rules.STEP_TAG_RE.fullmatch(name) is not None  # a custom tag has no telling name

    def find_runs(self, tree: Tree) -> Iterable[str]:
        if not any(map(rules.is_shard, tree.distinct_file_names())):
            return  # no shard anywhere, so no tag
        tags = {d for d in tree.dirs if is_tag(d, tree)}  # each directory tested once: this runs on every scan
        for d, subdirs in tree.dirs.items():
            names = tree.file_names(d)
            if d in tags or hf_rules.TRAINER_STATE in names or hf_rules.TRAINING_ARGS in names:
                continue  # a tag is never a run; Trainer's checkpoint-N/global_stepN is Trainer's (layouts.hf_trainer)
            if any(f"{d}/{s}" in tags for s in subdirs):
                yield d

    def file_kind(self, path: str) -> FileKind | None:
        kind = classify(path.rsplit("/", 1)[-1])
        return None if kind is FileKind.OTHER else kind

    def build_component(
        self, role: str, role_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext
    ) -> Component | None:
        return None  # a DeepSpeed save directory is a run of its own

    def build_run(self, run_dir: str, tree: Tree, facts: Mapping[str, FileFacts], ctx: ScanContext) -> Run:
        latest_path = f"{run_dir}/{rules.LATEST}"
        latest_fact = facts.get(latest_path)
        latest_tag = rules.read_latest(latest_fact.text if latest_fact else None)
        found: list[Finding] = list(latest_fact.findings) if latest_fact else []
        # present but not read (permission, I/O, a link out of the root): which tag resumes is unknown, and prune
        # keeps every tag (retention reads tracker-unread for any layout)
        walked = tuple(f for f in ctx.unread if f.path == latest_path)
        unread = tracker.unread_tracker(
            latest_path,
            text=latest_fact.text if latest_fact else None,
            present=latest_fact is not None,
            read=latest_fact.findings if latest_fact else (),
            walked=walked,
        )
        found += unread
        checkpoints: list[Checkpoint] = []
        for sub in tree.subdirs(run_dir):
            d = f"{run_dir}/{sub}"
            if not is_tag(d, tree):
                continue
            ckpt = tag_checkpoint(run_dir, d, tree, facts)
            if ckpt is None:
                found.append(
                    finding(
                        "ds-tag-unplaced",
                        d,
                        f"tag {sub!r}: no step (within 2^63-1) in its name or its files; not judged",
                    )
                )
                continue
            checkpoints.append(ckpt)
        pair_run, pair_ckpt = openrlhf_findings(run_dir, tree, facts, checkpoints)
        found += pair_run
        checkpoints = [
            replace(c, findings=c.findings + pair_ckpt[c.path]) if c.path in pair_ckpt else c for c in checkpoints
        ]
        by_tag = {c.path.rsplit("/", 1)[-1]: c for c in checkpoints}
        committed = by_tag[latest_tag].step if latest_tag in by_tag else None
        judged = sorted(
            (status.judge(c, tracker_step=committed, ctx=ctx) for c in checkpoints), key=lambda c: (c.step, c.path)
        )
        if not unread:
            found += check_latest(run_dir, latest_fact is not None, latest_fact.text if latest_fact else None, judged)
        if (universal := facts.get(f"{run_dir}/{rules.LATEST_UNIVERSAL}")) is not None and universal.text is not None:
            judged, dangling = check_latest_universal(run_dir, universal.text, judged)
            found += dangling
        return models.Run(
            path=run_dir, layout=NAME, tracker_step=committed, checkpoints=tuple(judged), findings=tuple(found)
        )


def tag_files(
    tag_dir: str, tree: Tree, facts: Mapping[str, FileFacts]
) -> tuple[list[ShardFile], list[Finding], dict[str, Mapping[str, int | str] | None]]:
    """A tag directory's files as ShardFiles, their readers' findings, and what each DeepSpeed shard records."""
    files = []
    file_findings: list[Finding] = []
    metas: dict[str, Mapping[str, int | str] | None] = {}
    for path in tree.files_below(tag_dir):
        fact = facts.get(path)
        if fact is None:
            continue  # not read: a focused scan of a neighbour
        name = path[len(tag_dir) + 1 :]
        kind = classify(name) if "/" not in name else FileKind.OTHER
        files.append(shard_file(fact, kind, rules.rank_of(name) if kind is not FileKind.OTHER else None))
        file_findings.extend(fact.findings)
        if kind is not FileKind.OTHER:
            # None: the pickle was not read (its own findings say why); {}: read, and it records none of the keys
            metas[name] = dict(fact.pt.meta) if fact.pt is not None else None
    return files, file_findings, metas


def tag_checkpoint(run_dir: str, tag_dir: str, tree: Tree, facts: Mapping[str, FileFacts]) -> Checkpoint | None:
    """One tag directory as a Checkpoint with the tag rules' findings (None: no step to file it under)."""
    files, file_findings, metas = tag_files(tag_dir, tree, facts)
    step = rules.tag_step(tag_dir.rsplit("/", 1)[-1])
    universal = rules.UNIVERSAL_DIR in tree.subdirs(tag_dir)
    degrees, found = rules.check_tag(tag_dir, step, metas, universal=universal)
    if universal:
        zero = f"{tag_dir}/{rules.UNIVERSAL_DIR}"
        params = {p: frozenset(tree.file_names(f"{zero}/{p}")) for p in tree.subdirs(zero)}
        found += tuple(rules.universal_findings(tag_dir, params, frozenset(tree.file_names(zero))))
        found += (
            finding(
                "ds-universal",
                tag_dir,
                "a universal checkpoint: only an engine with checkpoint.load_universal loads it (through "
                "`latest_universal`); never the answer for `latest` or what fix-tracker writes",
            ),
        )
    if step is None:  # a custom tag: filed under the step its own files record
        steps = {v for m in metas.values() if m and isinstance(v := m.get("global_steps"), int)}
        step = steps.pop() if len(steps) == 1 else None
    if step is None or step > MAX_STEP:
        return None
    return one_component_checkpoint(
        run_dir,
        step,
        tag_dir,
        layout=NAME,
        world_size=degrees.dp * degrees.mp if degrees else None,
        files=files,
        file_findings=file_findings,
        findings=found,
        tree=tree,
    )


def trainer_state_findings(ckpt_dir: str, tree: Tree, facts: Mapping[str, FileFacts]) -> tuple[Finding, ...]:
    """DeepSpeed's state inside an HF Trainer `checkpoint-N/` (layouts.hf_trainer): Trainer resumes it with
    `engine.load_checkpoint(checkpoint-N)`, tag=None, so `checkpoint-N/latest` must name a tag there, and each tag is
    held to the same rules as a bare engine tree's."""
    tags = sorted(s for s in tree.subdirs(ckpt_dir) if is_tag(f"{ckpt_dir}/{s}", tree))
    if not tags:
        return ()
    path = f"{ckpt_dir}/{rules.LATEST}"
    out: list[Finding] = []
    if rules.LATEST not in tree.file_names(ckpt_dir):
        out.append(
            finding("hf-deepspeed-latest", path, "no `latest`: Trainer's resume raises ValueError (failed to resume)")
        )
    elif (fact := facts.get(path)) is not None and fact.text is not None:
        tag = rules.read_latest(fact.text)
        if tag not in tags:
            out.append(
                finding("hf-deepspeed-latest", path, f"`latest` names {tag!r}, not a tag here ({', '.join(tags)})")
            )
    worlds = set()
    for t in tags:
        tag_dir = f"{ckpt_dir}/{t}"
        degrees, found = rules.check_tag(tag_dir, rules.tag_step(t), tag_files(tag_dir, tree, facts)[2])
        out += found
        if degrees:
            worlds.add(degrees.dp * degrees.mp)
    names = frozenset(tree.file_names(ckpt_dir))
    if not names & hf_rules.WEIGHT_FILES and not names & hf_rules.INDEX_FILES:
        # ZeRO-3 without stage3_gather_16bit_weights_on_model_save: Trainer removes the empty weights it wrote
        out.append(
            finding(
                "hf-deepspeed-no-weights",
                ckpt_dir,
                "no HF weights beside DeepSpeed's state (ZeRO-3 saved without "
                "stage3_gather_16bit_weights_on_model_save): Trainer resumes it, from_pretrained cannot load it; "
                "the weights are in the ZeRO partitions",
            )
        )
    ranks = hf_rules.rng_ranks(names)[1]
    if ranks and len(worlds) == 1 and (world := worlds.pop()) > max(ranks) + 1:
        # one rng_state_R.pth per process: the DeepSpeed state says how many processes saved
        out += [
            finding(
                "hf-missing-rng-state",
                f"{ckpt_dir}/rng_state_{r}.pth",
                f"rank {r}'s RNG state is absent: DeepSpeed's state records {world} processes",
                rank=r,
            )
            for r in range(max(ranks) + 1, world)
        ]
    return tuple(out)


def openrlhf_findings(
    run_dir: str, tree: Tree, facts: Mapping[str, FileFacts], checkpoints: list[Checkpoint]
) -> tuple[list[Finding], dict[str, tuple[Finding, ...]]]:
    """(run findings, checkpoint path -> findings) of an OpenRLHF save directory (`_actor`, `_critic`).

    OpenRLHF resumes each of the pair with load_checkpoint(dir) and no tag, so the two `latest` must name one tag,
    and a tag only one of them holds resumes half of the pair at another step. metric.json is written by OpenRLHF
    after DeepSpeed's save (and `latest`): a tag without it was cut in between (still loadable), and OpenRLHF's own
    rotation evicts it first. `<tag>_hf/` beside the pair is the actor's HF export of that tag."""
    parent, _, name = run_dir.rpartition("/")
    if name not in rules.OPENRLHF_PAIR:
        return [], {}
    run_out: list[Finding] = []
    ckpt_out: dict[str, list[Finding]] = {}
    tags = {c.path.rsplit("/", 1)[-1]: c for c in checkpoints}
    for c in tags.values():
        if rules.METRIC_JSON not in tree.file_names(c.path):
            ckpt_out.setdefault(c.path, []).append(
                finding(
                    "openrlhf-metric-missing",
                    f"{c.path}/{rules.METRIC_JSON}",
                    "no metric.json: OpenRLHF's save was cut after DeepSpeed's (the tag loads), or an older "
                    "OpenRLHF; its rotation deletes this tag first",
                )
            )
    exports = sorted(
        d for d in tree.subdirs(parent) if d.endswith(rules.HF_EXPORT_SUFFIX) and d[: -len(rules.HF_EXPORT_SUFFIX)]
    )
    if name == "_actor" and exports:
        run_out.append(
            finding(
                "openrlhf-hf-export",
                parent,
                f"{', '.join(f'{d}/' for d in exports)}: the actor's HF weights OpenRLHF exported (--ckpt.save_hf); "
                "exports, not resume points: never judged or pruned as checkpoints",
            )
        )
    other = f"{parent}/{rules.OPENRLHF_PAIR[name]}"  # not walked (a scan of this directory alone): not compared
    theirs = {s for s in tree.subdirs(other) if is_tag(f"{other}/{s}", tree)} if other in tree.dirs else None
    for tag, c in tags.items():
        if theirs is not None and tag not in theirs:
            ckpt_out.setdefault(c.path, []).append(
                finding(
                    "openrlhf-pair-missing",
                    c.path,
                    f"{rules.OPENRLHF_PAIR[name].lstrip('_')} has no tag {tag}: resuming here loads one of OpenRLHF's "
                    "actor/critic pair from another step",
                )
            )
    mine, their = (facts.get(f"{d}/{rules.LATEST}") for d in (run_dir, other))
    if theirs is not None and mine and their and mine.text is not None and their.text is not None:
        a, b = rules.read_latest(mine.text), rules.read_latest(their.text)
        if a != b:
            run_out.append(
                finding(
                    "openrlhf-latest-differs",
                    f"{run_dir}/{rules.LATEST}",
                    f"`latest` names {a!r} here, {b!r} in {rules.OPENRLHF_PAIR[name]}: OpenRLHF resumes the actor and "
                    "the critic from different tags",
                )
            )
    return run_out, {p: tuple(f) for p, f in ckpt_out.items()}


def check_latest_universal(
    run_dir: str, text: str, checkpoints: list[Checkpoint]
) -> tuple[list[Checkpoint], tuple[Finding, ...]]:
    """`latest_universal`, which an engine with checkpoint.load_universal reads instead of `latest`: (the checkpoints,
    the one it names marked as its target so prune keeps it; the run's finding when it names no whole tag here)."""
    tag = rules.read_latest(text)
    path = f"{run_dir}/{rules.LATEST_UNIVERSAL}"
    target = next((c for c in checkpoints if c.path == f"{run_dir}/{tag}"), None)
    if target is None or target.status not in (Status.COMPLETE, Status.IN_PROGRESS):
        why = "which is no tag here" if target is None else f"which is {target.status.value}"
        return checkpoints, (finding("ds-latest-dangling", path, f"`latest_universal` names {tag!r}, {why}"),)
    named = finding(
        "ds-latest-universal-target", target.path, "`latest_universal` names it: a universal resume loads it"
    )
    return [replace(c, findings=(*c.findings, named)) if c is target else c for c in checkpoints], ()


def check_latest(run_dir: str, present: bool, text: str | None, checkpoints: list[Checkpoint]) -> tuple[Finding, ...]:
    """What load_checkpoint(tag=None) makes of `latest` (read as `text`): missing, naming no usable tag (an empty
    one makes it look in the save directory itself), or behind whole tags."""
    path = f"{run_dir}/{rules.LATEST}"
    if not checkpoints:
        return ()
    if not present:
        return (finding("ds-latest-missing", path, "no `latest`: load_checkpoint(tag=None) trains from scratch"),)
    tag = (text or "").strip()
    out: list[Finding] = []
    target = [c for c in checkpoints if c.path == f"{run_dir}/{tag}"]
    if not target:
        out.append(finding("ds-latest-dangling", path, f"`latest` names {tag!r}, which is no tag here"))
    elif target[0].status not in (Status.COMPLETE, Status.IN_PROGRESS):
        out.append(finding("ds-latest-dangling", path, f"`latest` names {tag}, which is {target[0].status.value}"))
    if whole := tracker.ahead_of_tracker(checkpoints):
        names = ", ".join(c.path.rsplit("/", 1)[-1] for c in whole)
        out.append(
            finding(
                "ds-latest-behind",
                path,
                f"`latest` names {tag} but {names} look whole: load_checkpoint(tag=None) resumes the older one",
            )
        )
    if not any(c.status in (Status.COMPLETE, Status.IN_PROGRESS) for c in checkpoints):
        out.append(finding("no-complete-checkpoint", run_dir, f"none of {len(checkpoints)} checkpoint(s) is complete"))
    return tuple(out)


LAYOUT = DeepSpeed()
