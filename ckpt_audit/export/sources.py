"""Where a checkpoint's weights are and how they are planned: the seam between a trainer's layout and the engines.

`source_kind` tells FSDP shards, a Megatron dist_ckpt and HF weights apart (a DeepSpeed tag is found first, by
`zero_source`); `plan_source` turns any of them into an stream_plan.Plan; `files_to_read` lists what the export
reads or copies (what export.guard re-reads). The directory lookups here are the verl, HF Trainer and DeepSpeed
layouts' (docs/layouts.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_audit.export.guard import ExportError, ExportRefused
from ckpt_audit.layouts import hf_trainer
from ckpt_audit.layouts.verl_fsdp import classify
from ckpt_audit.models import FileKind
from ckpt_audit.readers import bounded_json
from ckpt_audit.rules.shards import current_world_size, parse_fsdp_config

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


MEGATRON = "megatron-dist-ckpt"
DEEPSPEED = "deepspeed-zero"  # a tag dir export.zero plans (found by zero_source, before source_kind)


def locate(src: Path, role: str, weights: str | None, engine: str) -> tuple[Path, Path, ZeroFiles | None]:
    """(role_dir, hf_dir, zero) of the checkpoint at `src`: where its weights are, where its HF files sit, and the
    DeepSpeed tag's files when it is one (weights in the tag, config and tokenizer in the tag's parent, never the
    tag: its files are all states)."""
    zero = zero_source(src, weights, engine)
    if zero is not None:
        return zero.tag_dir, zero.tag_dir.parent, zero
    role_dir = role_dir_of(src, role)
    return role_dir, hf_dir_of(role_dir), None


def role_dir_of(src: Path, role: str) -> Path:
    """The directory `role`'s weights are in: `src/role`, else `src` itself (SFT, a role dir, HF Trainer)."""
    if not src.is_dir():
        raise ExportError(f"{src}: not a directory")
    if (src / role).is_dir():
        return src / role
    if model_shards(src) or (src / "huggingface").is_dir() or hf_trainer_dir(src):  # SFT, role dir, HF Trainer
        return src
    if (src / ".metadata").is_file():  # torchtitan's step-N, or plain DCP (docs/layouts.md#torchtitan-step-n)
        raise ExportError(
            f"{src}: a DCP checkpoint (torchtitan step-N, plain DCP) is not supported: its weights are DCP chunks "
            "in the trainer's own names; convert it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save, "
            "or have torchtitan save HF safetensors (checkpoint.last_save_in_hf)"
        )
    raise ExportError(f"{src}: no {role}/ directory and no model shards")


def zero_source(src: Path, weights: str | None, engine: str) -> ZeroFiles | None:
    """The DeepSpeed tag files `src` exports (export.zero.ZeroFiles), or None for every other source. An HF Trainer
    checkpoint that holds HF weights exports those unless --weights asks for DeepSpeed's."""
    from ckpt_audit.export import zero
    from ckpt_audit.export.stream_plan import StreamError, StreamUnsupported

    if weights is not None and weights not in zero.WEIGHTS:
        raise ExportError(f"unknown weights {weights!r} (use {' or '.join(zero.WEIGHTS)})")
    try:
        tag = zero.tag_dir(src) if src.is_dir() else None
        if tag is None or (weights is None and hf_trainer_dir(src) and hf_weights(src)):
            if weights is not None:
                raise ExportError(
                    f"{src}: --weights applies to DeepSpeed checkpoints (a tag dir, or a dir whose "
                    "latest names one); this is not one"
                )
            return None
        if engine == "torch":
            raise ExportError(f"{tag}: a DeepSpeed checkpoint exports with the stream engine only (--engine auto)")
        return zero.zero_files(tag)
    except (StreamError, StreamUnsupported) as exc:
        raise ExportError(str(exc)) from None


def zero_files_to_read(zero: ZeroFiles, weights: str | None, hf_dir: Path) -> list[tuple[str, bool]]:
    """files_to_read for a DeepSpeed tag: the states the export of `weights` reads, and the HF files it copies."""
    out = [(str(p), True) for p in zero.read(weights or "fp32")]
    try:
        beside = sorted(hf_dir.iterdir())
    except OSError as exc:
        raise ExportError(f"{hf_dir}: cannot list ({exc.strerror or exc})") from None
    return out + [(str(p), False) for p in beside if p.is_file() and model_file(p.name)]


def files_to_read(role_dir: Path, hf_dir: Path, cfg_dir: Path) -> list[tuple[str, bool]]:
    """(path, holds weights) for every file the export reads or copies: what check_source re-reads first."""
    out: list[tuple[str, bool]] = []
    if by_w := model_shards(role_dir):
        out += [(str(p), True) for _r, p in sorted(by_w[world_size_of(role_dir, by_w)].items())]
    elif dist := megatron_dist(role_dir):
        names = sorted(os.listdir(dist))
        out += [(str(dist / n), n.endswith(".distcp")) for n in names if (dist / n).is_file()]
        out += [(str(p), True) for p in hf_weights(hf_dir)]  # bridge mode: checked against the dist_ckpt too
    else:
        out += [(str(p), True) for p in hf_weights(hf_dir)]
    if cfg_dir.is_dir():
        out += [(str(p), False) for p in sorted(cfg_dir.iterdir()) if p.is_file() and model_file(p.name)]
    if (adapter := hf_dir.parent / "lora_adapter" / "adapter_config.json").is_file():
        out.append((str(adapter), False))
    return out


def source_kind(role_dir: Path, hf_dir: Path) -> str:
    """Where the model's weights are: "fsdp-shards", MEGATRON (also when verl's bridge saved HF weights beside it:
    those are then checked against it) or "hf-weights". Raises ExportError when there are none."""
    if model_shards(role_dir):
        return "fsdp-shards"
    if megatron_dist(role_dir) is not None:
        return MEGATRON
    if hf_weights(hf_dir):
        return "hf-weights"
    raise ExportError(NO_WEIGHTS.format(role_dir=role_dir, hf_dir=hf_dir))


def plan_source(role_dir: Path, hf_dir: Path, config: dict, *, weights: str | None = None):
    """The seam between a source and the stream engine: an stream_plan.Plan of the model's tensors, whatever the
    trainer's layout. `weights`: `role_dir` is a DeepSpeed tag, planned by export.zero. Raises ExportError, or
    stream_plan.StreamError / StreamUnsupported."""
    from ckpt_audit.export.fsdp_shards import plan_shards
    from ckpt_audit.export.stream_plan import StreamError, StreamUnsupported, plan_hf

    if weights is not None:
        from ckpt_audit.export.zero import plan_zero

        try:
            return plan_zero(role_dir, weights)
        except StreamUnsupported as exc:  # no torch engine to fall back to
            raise StreamError(str(exc)) from None
    kind = source_kind(role_dir, hf_dir)
    if kind == "fsdp-shards":
        world, files = shard_set(role_dir)
        return plan_shards(files, world, role_dir)
    if kind == MEGATRON:
        from ckpt_audit.export.megatron_dist import plan_dist_ckpt
        from ckpt_audit.export.megatron_names import NameMapError, arch_of

        if not config:
            raise ExportError(NEEDS_CONFIG.format(hf_dir=hf_dir))
        try:
            arch_of(config)
        except NameMapError as exc:
            if bridge := hf_weights(hf_dir):  # an architecture the planner does not map: the bridge's weights as is
                why = f"exported from {hf_dir} as saved, not checked against the dist_ckpt: {exc}"
                return replace(plan_hf(bridge), warnings=(why,))
        return plan_dist_ckpt(megatron_dist(role_dir), config)  # type: ignore[arg-type]  # not None: kind
    return plan_hf(hf_weights(hf_dir))


def megatron_dist(role_dir: Path) -> Path | None:
    """The model's dist_checkpointing directory: model/dist_ckpt (verl's layout v2), else dist_ckpt/ (pre-v2)."""
    for d in (role_dir / "model" / "dist_ckpt", role_dir / "dist_ckpt"):
        if (d / ".metadata").is_file():
            return d
    return None


def hf_dir_of(role_dir: Path) -> Path:
    """Where HF files sit: the role dir itself (HF Trainer's checkpoint-N), model/huggingface (verl's Megatron v2),
    else huggingface/."""
    if hf_trainer_dir(role_dir):
        return role_dir
    if (role_dir / "model" / "huggingface").is_dir() or (role_dir / "model" / "dist_ckpt").is_dir():
        return role_dir / "model" / "huggingface"
    return role_dir / "huggingface"


def config_dir_of(hf_dir: Path, hf_config: str | Path | None) -> Path:
    """The directory whose config.json describes the model: the checkpoint's, else --hf-config (a dir or its file)."""
    if (hf_dir / "config.json").is_file() or hf_config is None:
        return hf_dir
    p = Path(hf_config).resolve()
    return p.parent if p.name == "config.json" else p


def check_bridge_weights(plan, bridge: Path, config: dict, role_dir: Path) -> None:
    """verl's bridge mode saves HF weights beside the dist_ckpt: they must be the same model, or the export (made
    from the dist_ckpt, the state verl resumes from) would hide that what users load from huggingface/ differs."""
    from ckpt_audit.export.check import CheckError, compare

    try:
        report = compare(plan, bridge, config, source=str(role_dir))
    except CheckError as exc:
        raise ExportRefused(f"{bridge}: {exc}", about="source") from None
    if not report.same:
        more = f" (+{len(report.differences) - 1} more)" if len(report.differences) > 1 else ""
        raise ExportRefused(
            f"{bridge} is not the model in {megatron_dist(role_dir)}: {report.differences[0]}{more}", about="source"
        )


def hf_trainer_dir(d: Path) -> bool:
    try:
        return hf_trainer.is_checkpoint(os.listdir(d))
    except OSError:
        return False


def model_shards(d: Path) -> dict[int, dict[int, Path]]:
    """world size -> rank -> model shard, named as the verl layout reads them (with the world size in the name)."""
    by_w: dict[int, dict[int, Path]] = {}
    try:
        names = os.listdir(d)
    except OSError:
        return {}
    for name in names:
        kind, rank, ws = classify(name, ())
        if kind is FileKind.MODEL and rank is not None and ws is not None:
            by_w.setdefault(ws, {})[rank] = d / name
    return by_w


def hf_weights(hf: Path) -> list[Path]:
    return sorted(hf.glob("*.safetensors")) if hf.is_dir() else []


def shard_set(role_dir: Path) -> tuple[int, dict[int, Path]]:
    """(world size, rank -> file) of the model shard set the export reads, every rank present, else ExportError."""
    by_w = model_shards(role_dir)
    world = world_size_of(role_dir, by_w)
    files = by_w[world]
    if missing := sorted(set(range(world)) - set(files)):
        raise ExportError(f"{role_dir}: missing model shard(s) for rank {', '.join(map(str, missing))} of {world}")
    return world, files


def world_size_of(role_dir: Path, by_w: dict[int, dict[int, Path]]) -> int:
    """The shard set the scan judged (one policy: `rules.shards.current_world_size`)."""
    config = role_dir / "fsdp_config.json"
    try:
        text: str | None = config.read_text()
    except (OSError, ValueError):
        text = None
    config_ws, _ = parse_fsdp_config(str(config), text)
    newest: dict[int | None, int] = {w: max(_mtime_ns(p) for p in files.values()) for w, files in by_w.items()}
    return current_world_size(newest, config_ws)  # type: ignore[return-value]  # by_w has no None key


def _mtime_ns(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def read_config(hf: Path) -> dict:
    """config.json as a dict; {} when it cannot be read or is no JSON object (the model check names it)."""
    try:
        config = bounded_json.load_file(str(hf / "config.json"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def copy_hf_files(hf: Path, tmp: Path, out_dtype) -> None:
    """config, generation config, tokenizer and custom code; never the weights (we just wrote those)."""
    if not hf.is_dir():
        return
    for p in sorted(hf.iterdir()):
        if p.is_file() and model_file(p.name):
            shutil.copy2(p, tmp / p.name)
    cfg = tmp / "config.json"
    if cfg.is_file() and (data := read_config(tmp)):  # one that is not a JSON object is copied as is, and refused
        name = str(out_dtype).removeprefix("torch.")
        data["torch_dtype" if "torch_dtype" in data and "dtype" not in data else "dtype"] = name
        cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def model_file(name: str) -> bool:
    """A non-weight file of the model (config, tokenizer, code): never the weights, nor HF Trainer's resume state."""
    return not WEIGHT_FILE_RE.search(name) and not hf_trainer.is_resume_state(name)
