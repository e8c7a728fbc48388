"""What an export reads, and how it is planned: the seam between a trainer's layout and the engines.

`export_input` walks the checkpoint's run as the scan walks it (scan.walk: no link out of the run is followed) and
takes from that walk, through the layouts' own names, an `ExportInput`: which files are the model's weights (for
verl's FSDP shards, those of the component the scan builds: layouts.verl_fsdp.model_weights), its config and
tokenizer, and a DeepSpeed tag's states (named as rules.deepspeed names them). Nothing below lists a directory of
the checkpoint itself. `plan_source` turns any input into a stream_plan.Plan; `files_to_read` is what export.guard
re-reads, by content, at the moment the export acts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_audit.export.guard import ExportError, ExportRefused
from ckpt_audit.layouts import enclosing_step_dir, hf_trainer, megatron_v2, verl_fsdp
from ckpt_audit.models import FileKind, Finding
from ckpt_audit.readers import bounded_json
from ckpt_audit.rules.shards import shard_name
from ckpt_audit.rules.status import ScanContext
from ckpt_audit.scan.read import stat_facts
from ckpt_audit.scan.walk import walk
from ckpt_audit.tree import Tree

if TYPE_CHECKING:
    from ckpt_audit.export.zero import ZeroFiles

WEIGHT_FILE_RE = re.compile(r"(\.safetensors|\.bin)$|^(model\.safetensors|pytorch_model\.bin)\.index\.json$")


NO_WEIGHTS = (
    "{role_dir}: no model weights: no FSDP shards (model_world_size_W_rank_R.pt), no Megatron dist_ckpt"
    " (model/dist_ckpt/.metadata, or dist_ckpt/.metadata in the pre-v2 layout) and no HF weights in {hf_dir}"
)
# a Megatron dist_ckpt saved without the HF config (verl without a bridge): the config is the model verl started from
NEEDS_CONFIG = (
    "{hf_dir} has no config.json: name the HF model the run started from (verl's model.path) with --hf-config DIR"
)


FSDP = "fsdp-shards"
MEGATRON = "megatron-dist-ckpt"
HF = "hf-weights"
DEEPSPEED = "deepspeed-zero"  # a tag dir export.zero plans


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportInput:
    """What one export reads, as the scan's walk and the layouts name it; made before anything is written."""

    src: Path  # the checkpoint exported and looked up in the catalog (a DeepSpeed tag, or the checkpoint-N holding it)
    kind: str  # FSDP | MEGATRON | HF | DEEPSPEED; "" none (source_kind says why)
    role_dir: Path  # where the weights are: the role dir, or the DeepSpeed tag
    hf_dir: Path  # where the HF files (config, tokenizer) sit
    hf_files: tuple[Path, ...] = ()  # hf_dir's files that are the model's but no weights (export.sources.model_file)
    hf_weights: tuple[Path, ...] = ()  # hf_dir's *.safetensors (beside a dist_ckpt: verl's bridge)
    lora_config: Path | None = None  # verl's lora_adapter/adapter_config.json beside the role
    world_size: int | None = None  # FSDP: the shard set the scan judges
    shards: tuple[tuple[int, Path], ...] = ()  # FSDP: (rank, model shard) of that set, in rank order
    dist_ckpt: Path | None = None  # MEGATRON: the dist_checkpointing directory
    dist_files: tuple[Path, ...] = ()  # MEGATRON: its files
    zero: ZeroFiles | None = None  # DEEPSPEED: the tag's states
    problem: str = ""  # why the weights cannot be told apart (source_kind raises it)
    unwalked: tuple[Finding, ...] = ()  # what the walk did not follow or read (a link out of the run...)
    # path -> (size, mtime_ns, inode) as the walk listed each file: the guard's re-read must find the same file
    listed: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Walked:
    """The scan's walk of the run holding the checkpoint (scan.walk.walk)."""

    tree: Tree
    stats: dict[str, os.stat_result]
    findings: tuple[Finding, ...]

    def names(self, d: Path) -> tuple[str, ...]:
        return self.tree.file_names(str(d))

    def is_dir(self, d: Path) -> bool:
        return self.tree.has_dir(str(d))

    def hf_trainer(self, d: Path) -> bool:
        return hf_trainer.is_checkpoint(self.names(d))

    def hf_weights(self, hf: Path) -> tuple[Path, ...]:
        return tuple(hf / n for n in self.names(hf) if n.endswith(".safetensors"))

    def model_files(self, hf: Path) -> tuple[Path, ...]:
        return tuple(hf / n for n in self.names(hf) if model_file(n))


def export_input(src: Path, role: str, weights: str | None, engine: str) -> ExportInput:
    """What exporting `src` (resolved) reads. The walk covers the run holding it (the checkpoint's parent; `src`
    itself when no layout names a step directory at or above it), with the scan's link rules: a file linked from
    outside it is not the checkpoint's, as it is not to the scan. Raises ExportError (one line)."""
    if not src.is_dir():
        raise ExportError(f"{src}: not a directory")
    ckpt = enclosing_step_dir(str(src))
    tree, stats, found = walk(os.path.dirname(ckpt) if ckpt else str(src))
    walked = _Walked(tree, stats, tuple(found))
    listed = {p: (st.st_size, st.st_mtime_ns, st.st_ino) for p, st in stats.items()}
    zero = zero_source(src, weights, engine, walked)
    if zero is not None:
        tag = zero.tag_dir
        # the checkpoint is the tag, or the HF Trainer checkpoint-N holding it; its HF files sit in the tag's
        # parent, never the tag (its files are all states)
        return ExportInput(
            src=src if walked.hf_trainer(src) else tag,
            kind=DEEPSPEED,
            role_dir=tag,
            hf_dir=tag.parent,
            hf_files=walked.model_files(tag.parent),
            zero=zero,
            listed=listed,
        )
    role_dir = role_dir_of(src, role, walked)
    hf_dir = hf_dir_of(role_dir, walked)
    lora = hf_dir.parent / "lora_adapter"
    base = ExportInput(
        src=src,
        kind="",
        role_dir=role_dir,
        hf_dir=hf_dir,
        hf_files=walked.model_files(hf_dir),
        hf_weights=walked.hf_weights(hf_dir),
        lora_config=lora / "adapter_config.json" if "adapter_config.json" in walked.names(lora) else None,
        unwalked=walked.findings,
        listed=listed,
    )
    if fsdp := _fsdp_shards(role_dir, walked):
        return replace(base, kind=FSDP, **fsdp)
    if (dist := megatron_v2.model_dirs(str(role_dir), walked.tree)[0]) is not None:
        files = tuple(Path(dist, n) for n in walked.tree.file_names(dist))
        return replace(base, kind=MEGATRON, dist_ckpt=Path(dist), dist_files=files)
    return replace(base, kind=HF if base.hf_weights else "")


def _fsdp_shards(role_dir: Path, walked: _Walked) -> dict:
    """The FSDP model shards of the component the scan builds of `role_dir` (layouts.verl_fsdp), as ExportInput
    fields; {} when it holds no model shards named with their world size."""
    top = str(role_dir)
    facts = {p: stat_facts(p, walked.stats[p]) for p in walked.tree.files_below(top) if p in walked.stats}
    sft = verl_fsdp.step_of(role_dir.name)[0] is not None  # SFT: the step directory is the component, role ""
    name = "" if sft else role_dir.name
    ctx = ScanContext(now_ns=time.time_ns())
    comp = verl_fsdp.LAYOUT.build_component(name, top, walked.tree, facts, ctx)
    if comp is None:
        return {}
    named = [f for f in comp.files if f.kind is FileKind.MODEL and f.world_size is not None]
    if not named:
        return {}
    by_rank = verl_fsdp.model_weights(comp)
    problem = ""
    if not by_rank:
        stale = ", ".join(map(str, sorted({f.world_size for f in named if f.world_size is not None})))
        problem = (
            f"{role_dir}: no model shards for world size {comp.world_size}, the shard set the checkpoint is judged by "
            f"(the one fsdp_config.json names, else the newest); the model shards for world size {stale} beside it "
            "are stale: if they are the checkpoint, name their world size in fsdp_config.json"
        )
    shards = tuple(sorted((r, Path(f.path)) for r, f in by_rank.items()))
    return dict(world_size=comp.world_size, shards=shards, problem=problem)


def role_dir_of(src: Path, role: str, walked: _Walked) -> Path:
    """The directory `role`'s weights are in: `src/role`, else `src` itself (SFT, a role dir, HF Trainer)."""
    if walked.is_dir(src / role):
        return src / role
    names = walked.names(src)
    if any(_model_shard(n) for n in names) or walked.is_dir(src / "huggingface") or walked.hf_trainer(src):
        return src
    if ".metadata" in names:  # torchtitan's step-N, or plain DCP (docs/layouts.md#torchtitan-step-n)
        raise ExportError(
            f"{src}: a DCP checkpoint (torchtitan step-N, plain DCP) is not supported: its weights are DCP chunks "
            "in the trainer's own names; convert it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save, "
            "or have torchtitan save HF safetensors (checkpoint.last_save_in_hf)"
        )
    raise ExportError(f"{src}: no {role}/ directory and no model shards")


def _model_shard(name: str) -> bool:
    kind, rank, ws = verl_fsdp.classify(name, ())
    return kind is FileKind.MODEL and rank is not None and ws is not None


def zero_source(src: Path, weights: str | None, engine: str, walked: _Walked) -> ZeroFiles | None:
    """The DeepSpeed tag files `src` exports (export.zero.ZeroFiles), or None for every other source. An HF Trainer
    checkpoint that holds HF weights exports those unless --weights asks for DeepSpeed's."""
    from ckpt_audit.export import zero
    from ckpt_audit.export.stream_plan import StreamError, StreamUnsupported

    if weights is not None and weights not in zero.WEIGHTS:
        raise ExportError(f"unknown weights {weights!r} (use {' or '.join(zero.WEIGHTS)})")
    try:
        tag = zero.tag_dir(src, walked.names)
        if tag is None or (weights is None and walked.hf_trainer(src) and walked.hf_weights(src)):
            if weights is not None:
                raise ExportError(
                    f"{src}: --weights applies to DeepSpeed checkpoints (a tag dir, or a dir whose "
                    "latest names one); this is not one"
                )
            return None
        if engine == "torch":
            raise ExportError(f"{tag}: a DeepSpeed checkpoint exports with the stream engine only (--engine auto)")
        return zero.zero_files(tag, walked.names(tag))
    except (StreamError, StreamUnsupported) as exc:
        raise ExportError(str(exc)) from None


def files_to_read(inp: ExportInput, cfg_dir: Path, weights: str | None = None) -> list[tuple[str, bool]]:
    """(path, holds weights) for every file the export reads or copies: what check_source re-reads first."""
    out: list[tuple[str, bool]] = []
    if inp.zero is not None:
        out += [(str(p), True) for p in inp.zero.read(weights or "fp32")]
    elif inp.kind == FSDP:
        out += [(str(p), True) for _r, p in inp.shards]
    elif inp.kind == MEGATRON:
        out += [(str(p), p.name.endswith(".distcp")) for p in inp.dist_files]
        out += [(str(p), True) for p in inp.hf_weights]  # bridge mode: checked against the dist_ckpt too
    else:
        out += [(str(p), True) for p in inp.hf_weights]
    out += [(str(p), False) for p in config_files(inp, cfg_dir)]
    if inp.lora_config is not None:
        out.append((str(inp.lora_config), False))
    return out


def source_kind(inp: ExportInput) -> str:
    """Where the model's weights are: FSDP, MEGATRON (also when verl's bridge saved HF weights beside it: those are
    then checked against it), HF or DEEPSPEED. Raises ExportError when there are none, or they cannot be told."""
    if inp.problem:
        raise ExportError(inp.problem)
    if not inp.kind:
        inside = f"{inp.role_dir}/"
        unread = [f for f in inp.unwalked if f.path == str(inp.role_dir) or f.path.startswith(inside)]
        why = f"; {unread[0].path}: {unread[0].code}: {unread[0].message}" if unread else ""
        raise ExportError(NO_WEIGHTS.format(role_dir=inp.role_dir, hf_dir=inp.hf_dir) + why)
    return inp.kind


def plan_source(inp: ExportInput, config: dict, *, weights: str | None = None):
    """The seam between a source and the stream engine: an stream_plan.Plan of the model's tensors, whatever the
    trainer's layout. `weights`: a DeepSpeed tag's, planned by export.zero. Raises ExportError, or
    stream_plan.StreamError / StreamUnsupported."""
    from ckpt_audit.export.fsdp_shards import plan_shards
    from ckpt_audit.export.stream_plan import StreamError, StreamUnsupported, plan_hf

    kind = source_kind(inp)
    if kind == DEEPSPEED:
        from ckpt_audit.export.zero import plan_zero

        try:
            return plan_zero(inp.zero, weights or "fp32")  # type: ignore[arg-type]  # not None: kind
        except StreamUnsupported as exc:  # no torch engine to fall back to
            raise StreamError(str(exc)) from None
    if kind == FSDP:
        world, files = shard_set(inp)
        return plan_shards(files, world, inp.role_dir)
    if kind == MEGATRON:
        from ckpt_audit.export.megatron_dist import plan_dist_ckpt
        from ckpt_audit.export.megatron_names import NameMapError, arch_of

        if not config:
            raise ExportError(NEEDS_CONFIG.format(hf_dir=inp.hf_dir))
        try:
            arch_of(config)
        except NameMapError as exc:
            if inp.hf_weights:  # an architecture the planner does not map: the bridge's weights as is
                why = f"exported from {inp.hf_dir} as saved, not checked against the dist_ckpt: {exc}"
                return replace(plan_hf(list(inp.hf_weights)), warnings=(why,))
        return plan_dist_ckpt(inp.dist_ckpt, config)  # type: ignore[arg-type]  # not None: kind
    return plan_hf(list(inp.hf_weights))


def hf_dir_of(role_dir: Path, walked: _Walked) -> Path:
    """Where HF files sit: the role dir itself (HF Trainer's checkpoint-N), else where verl saves them
    (layouts.megatron_v2.model_dirs)."""
    if walked.hf_trainer(role_dir):
        return role_dir
    return Path(megatron_v2.model_dirs(str(role_dir), walked.tree)[1])


def config_dir_of(inp: ExportInput, hf_config: str | Path | None) -> Path:
    """The directory whose config.json describes the model: the checkpoint's, else --hf-config (a dir or its file)."""
    if inp.hf_dir / "config.json" in inp.hf_files or hf_config is None:
        return inp.hf_dir
    p = Path(hf_config).resolve()
    return p.parent if p.name == "config.json" else p


def check_bridge_weights(plan, inp: ExportInput, config: dict) -> None:
    """verl's bridge mode saves HF weights beside the dist_ckpt: they must be the same model, or the export (made
    from the dist_ckpt, the state verl resumes from) would hide that what users load from huggingface/ differs."""
    from ckpt_audit.export.check import CheckError, compare

    bridge = inp.hf_dir
    try:
        report = compare(plan, bridge, config, source=str(inp.role_dir))
    except CheckError as exc:
        raise ExportRefused(f"{bridge}: {exc}", about="source") from None
    if not report.same:
        more = f" (+{len(report.differences) - 1} more)" if len(report.differences) > 1 else ""
        raise ExportRefused(
            f"{bridge} is not the model in {inp.dist_ckpt}: {report.differences[0]}{more}", about="source"
        )


def shard_set(inp: ExportInput) -> tuple[int, dict[int, Path]]:
    """(world size, rank -> file) of the model shard set the export reads, every rank present, else ExportError
    (naming what the walk did not follow at a missing shard's path: a link out of the run, say)."""
    world, files = inp.world_size or 0, dict(inp.shards)
    if missing := sorted(set(range(world)) - set(files)):
        why = {f.path: f"{f.code}: {f.message}" for f in inp.unwalked}
        at = [str(inp.role_dir / shard_name(FileKind.MODEL, r, world)) for r in missing]
        seen = "".join(f"; {p}: {why[p]}" for p in at if p in why)
        raise ExportError(
            f"{inp.role_dir}: missing model shard(s) for rank {', '.join(map(str, missing))} of {world}{seen}"
        )
    return world, files


def read_config(hf: Path, *, source: bool = False) -> dict:
    """config.json as a dict; {} when it is not there, cannot be read or is no JSON object (the model check names
    it). `source`: the checkpoint's own (or --hf-config's), where one that is there but cannot be opened raises its
    OSError (the session names the file): `export --check` would otherwise judge by the config of the export."""
    try:
        config = bounded_json.load_file(str(hf / "config.json"))
    except FileNotFoundError:
        return {}
    except OSError:
        if source:
            raise
        return {}
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def config_files(inp: ExportInput, cfg_dir: Path) -> tuple[Path, ...]:
    """The model's files that are no weights (config, generation config, tokenizer, custom code): the checkpoint's
    as the walk listed them, or those of --hf-config's directory (the model the run started from, no checkpoint)."""
    if cfg_dir == inp.hf_dir:
        return inp.hf_files
    if not cfg_dir.is_dir():
        return ()
    return tuple(p for p in sorted(cfg_dir.iterdir()) if p.is_file() and model_file(p.name))


def copy_hf_files(inp: ExportInput, cfg_dir: Path, tmp: Path, out_dtype) -> None:
    """config_files, the ones the source check read; never the weights (we just wrote those)."""
    for p in config_files(inp, cfg_dir):
        shutil.copy2(p, tmp / p.name)
    cfg = tmp / "config.json"
    if cfg.is_file() and (data := read_config(tmp)):  # one that is not a JSON object is copied as is, and refused
        name = str(out_dtype).removeprefix("torch.")
        data["torch_dtype" if "torch_dtype" in data and "dtype" not in data else "dtype"] = name
        cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def model_file(name: str) -> bool:
    """A non-weight file of the model (config, tokenizer, code): never the weights, nor HF Trainer's resume state."""
    return not WEIGHT_FILE_RE.search(name) and not hf_trainer.is_resume_state(name)
