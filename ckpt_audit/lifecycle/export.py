"""Export a checkpoint to a HuggingFace model directory by streaming its shards.

Two engines. The default ("stream", export_stream.py) needs no torch: tensor bytes are copied from the shards'
stored zip entries in fixed-size blocks, cast by numpy, CRC-checked and hashed in the same pass; peak memory is a
block budget whatever the model's size. The torch engine below ("torch") is the oracle it is tested against
byte for byte, and the fallback for what streaming cannot do exactly. The rest of this docstring is the torch
engine's story; the guards, marker, swap and kill points are the same for both.

verl's merger loads every rank's shard fully, concatenates everything in memory and only then saves: peak
memory is about twice the model. Here each rank file is opened once with
`torch.load(weights_only=True, mmap=True, map_location="cpu")`, so tensors are views into the files, and
the output safetensors are written one tensor at a time: a dim-0 shard is cast and written piece by piece, a
Shard(d>0) tensor is assembled into one buffer of its final size. After each tensor its source pages are
dropped from this process (madvise), so peak memory stays near the largest tensor, not the model.

Handled shapes: FSDP1/FSDP2 DTensors with Shard(0) or Shard(1), uneven and empty trailing shards, HSDP
(`(Replicate(), Shard(d))`: only the first replica is read), world size 1 plain tensors, tied embeddings
(lm_head dropped when the config ties it and the two are equal), LoRA keys (base exported, adapter beside
it, not fused), Megatron checkpoints with HF weights in `huggingface/`.

What was written is then checked against an independent computation: every tensor read back with the
safetensors library must equal `torch.cat` of its shards, bit for bit after the cast. The shards themselves are
re-read in full while they are copied (export_guard.check_source on its own thread: CRCs, and each file's hash
against the catalog's manifest; before the copy when the catalog already refuses the checkpoint or with
--allow-corrupt), and the export is put in place only once that check passed, so "verified" means equal to content
that was checked, not only to itself. A failed check, or a failed copy, removes the hidden directory.

Nothing is written before export_guard says `--to` is clear of every checkpoint, run and scanned root. The export is
built in a hidden sibling directory, every file fsynced once after the read-back, marked as an export (MARKER, with
its file hashes), and only then put in place by one rename (an atomic exchange when it replaces an earlier export),
so `--to` is at every moment absent, the earlier export, or the complete new one. Kill points for the crash test
(the killpoints seam, CKPT_AUDIT_TEST_KILL_AFTER_OPS), in order: one per tensor written, one per tensor read back,
the marker written, the rename into place, the earlier export removed (only when there was one), then inside the
catalog transaction. torch is imported lazily: `ckpt-audit scan` must never pay for it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpt_audit.durable import fsync_dir
from ckpt_audit.export.guard import (
    MARKER,
    REFUSED_STATUSES,
    BackgroundCheck,
    Destination,
    ExportError,
    ExportRefused,
    SourceCheck,
    changed_since,
    check_destination,
    check_source,
    first_of,
    marker_document,
    refusal,
    step_and_run,
)
from ckpt_audit.export.model import Load, check_config, load_with_transformers, source_config_problem
from ckpt_audit.killpoints import OpCounter
from ckpt_audit.layouts import hf_trainer
from ckpt_audit.layouts.verl_fsdp import classify
from ckpt_audit.lifecycle.export_stream import SAFETENSORS_DTYPE, StreamUnsupported, output_shards
from ckpt_audit.models import FileKind, Finding
from ckpt_audit.readers import bounded_json
from ckpt_audit.rules.hf_trainer import TIED_EMBEDDINGS
from ckpt_audit.rules.shards import current_world_size, parse_fsdp_config

__all__ = ["ExportError", "ExportRefused", "ExportResult", "ExportedFile", "export_checkpoint"]

WEIGHT_FILE_RE = re.compile(r"(\.safetensors|\.bin)$|^(model\.safetensors|pytorch_model\.bin)\.index\.json$")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_MAX_SHARD = 5 * 10**9
DEFAULT_MAX_LOAD = 16 * 10**9  # tensor bytes up to which transformers' load (all in memory) is part of "verified"
ENGINES = ("auto", "stream", "torch")
TORCH_EXTRA = "pip install 'ckpt-audit[torch]'"
LEFTOVER_RE = r"\.{name}\.ckpt-audit-(?:tmp|old)-(\d+)-[0-9a-f]{{8}}"  # a killed export's work dirs beside --to


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportedFile:
    path: str  # absolute, in the final directory
    size_bytes: int
    hash: str  # xxh3-128 hex


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportResult:
    source: str  # the step (or role) directory asked for
    role_dir: str  # where the weights came from
    out_dir: str
    source_kind: str  # "fsdp-shards" | "megatron-dist-ckpt" | "hf-weights"
    world_size: int | None
    dtype: str  # torch dtype name of floating tensors in the export, e.g. "float32"
    tensors: int
    total_bytes: int  # tensor bytes in the export
    files: tuple[ExportedFile, ...] = ()
    lora_dir: str | None = None
    warnings: tuple[str, ...] = ()
    read_back: bool = False  # every tensor read back equals the concatenation of its shards
    source_check: str = "none"  # how the source's weights were re-read: "manifest" | "crc-only" | "none"
    source_files: tuple[tuple[str, str], ...] = ()  # (path, xxh3-128) of every source file, as re-read
    override: str = ""  # "allow-corrupt": exported although the source failed its check
    source_findings: tuple[Finding, ...] = ()  # what the source check found (overridden when exported)
    replaced: str = ""  # what --to held before: "" nothing | "empty-dir" | "export"
    export_id: int | None = None  # the catalog's exports.id
    # is it a model transformers loads as written (export_model)? "transformers": config.json agrees with the tensors
    # and transformers' own load gave them back; "config": it agrees, the load did not run (model_load says why);
    # "failed": it does not, exported with --allow-unverified; "none": not asked yet
    model_check: str = "none"
    model_findings: tuple[Finding, ...] = ()
    model_load: str = ""  # one line: what transformers loaded, or why the load did not run

    @property
    def verified(self) -> bool:
        """Read back equal to a source whose content was checked (manifest or CRCs) and passed, and a model that
        config.json describes (and transformers loads, where it is installed)."""
        return (
            self.read_back
            and self.source_check != "none"
            and not self.override
            and self.model_check in ("transformers", "config")
        )

    @property
    def source_verified(self) -> bool:
        return self.source_check == "manifest" and not self.override

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "role_dir": self.role_dir,
            "out_dir": self.out_dir,
            "source_kind": self.source_kind,
            "world_size": self.world_size,
            "dtype": self.dtype,
            "tensors": self.tensors,
            "total_bytes": self.total_bytes,
            "verified": self.verified,
            "read_back": self.read_back,
            "source_check": self.source_check,
            "source_verified": self.source_verified,
            "override": self.override,
            "source_findings": [f.to_dict() for f in self.source_findings],
            "replaced": self.replaced,
            "model_check": self.model_check,
            "model_findings": [f.to_dict() for f in self.model_findings],
            "model_load": self.model_load,
            "lora_dir": self.lora_dir,
            "warnings": list(self.warnings),
            "files": [{"path": f.path, "size_bytes": f.size_bytes, "hash": f.hash} for f in self.files],
        }


NO_WEIGHTS = (
    "{role_dir}: no model weights: no FSDP shards (model_world_size_W_rank_R.pt), no Megatron dist_ckpt"
    " (model/dist_ckpt/.metadata, or dist_ckpt/.metadata in the pre-v2 layout) and no HF weights in {hf_dir}"
)
# a Megatron dist_ckpt saved without the HF config (verl without a bridge): the config is the model verl started from
NEEDS_CONFIG = (
    "{hf_dir} has no config.json: name the HF model the run started from (verl's model.path) with --hf-config DIR"
)


def export_checkpoint(
    step_dir: str | Path,
    to: str | Path,
    *,
    dtype: str | None = None,
    force: bool = False,
    role: str = "actor",
    max_shard_size: int = DEFAULT_MAX_SHARD,
    verify: bool = True,
    catalog=None,
    allow_corrupt: bool = False,
    allow_unverified: bool = False,
    max_load_size: int = DEFAULT_MAX_LOAD,
    protected_roots: Iterable[str] = (),
    progress: Callable[[int, int, str], None] | None = None,
    engine: str = "auto",
    weights: str | None = None,
    hf_config: str | Path | None = None,
    jobs: int = 1,
) -> ExportResult:
    """Merge `step_dir`'s `role` into a HuggingFace directory at `to`. Raises ExportError with a one-line reason,
    ExportRefused (nothing touched) when `to` or the source fails a safety check.

    `dtype`: "bf16" | "fp16" | "fp32" (floating tensors only), default the checkpoint's own. `force`: replace an
    earlier export or an empty directory, nothing else. `catalog` (a LifecycleLog): what it knows is protected
    from `to`, its manifest is what the source is checked against, and the export is recorded in it.
    `protected_roots`: further roots the caller scanned. `allow_corrupt`: export a source that failed its check,
    recorded as an override. The directory appears at `to` only when complete.

    The export must be a model: config.json present and agreeing with the tensors, and, where transformers is
    installed and the tensors are at most `max_load_size` bytes, transformers' own load giving them back
    (export_model). Otherwise ExportRefused (about "model"), unless `allow_unverified`: then it is written, not
    verified, and the findings are in the result and its marker.

    `engine`: "stream" copies tensor bytes without torch (export_stream); "torch" loads the shards with torch (the
    oracle); "auto" streams and falls back to torch only for what streaming cannot do exactly. A Megatron dist_ckpt
    is streamed only (export_megatron). `hf_config`: the HF model directory whose config.json (and tokenizer) the
    export takes when the checkpoint holds none (verl's Megatron saves without a bridge).

    `weights` ("fp32" | "module"): a DeepSpeed ZeRO checkpoint (a tag dir, or a dir whose `latest` names one) exports
    its fp32 master weights (the default) or the module's own weights (export_zero); an HF Trainer checkpoint with
    HF weights exports those unless `weights` is given.

    `jobs`: the stream engine writes and reads back that many output files at once, one worker process each
    (export_stream._in_workers); the files are the same bytes as with 1.
    """
    if engine not in ENGINES:
        raise ExportError(f"unknown engine {engine!r} (use {', '.join(ENGINES)})")
    if dtype and dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r} (use bf16, fp16 or fp32)")
    src = Path(step_dir).resolve()
    zero = _zero_source(src, weights, engine)  # a DeepSpeed tag to export from (export_zero), or None
    if zero is not None:
        # the checkpoint exported (and looked up in the catalog) is the tag, or the HF Trainer checkpoint-N holding
        # it; config and tokenizer come from the tag's parent, never the tag (its files are all states)
        if not _hf_trainer_dir(src):
            src = zero.tag_dir
        role_dir, hf_dir = zero.tag_dir, zero.tag_dir.parent
    else:
        role_dir = _role_dir(src, role)
        hf_dir = _hf_dir_of(role_dir)
    cfg_dir = _config_dir(hf_dir, hf_config)
    ckpt, run = step_and_run(str(src))
    places = [("checkpoint", ckpt), ("run", run), *(("scanned root", r) for r in protected_roots)]
    if catalog is not None:
        places += catalog.known_places()
    dest = check_destination(to, protected=places, force=force)
    kind = DEEPSPEED if zero is not None else source_kind(role_dir, hf_dir)
    if kind == MEGATRON and not (cfg_dir / "config.json").is_file():  # the names and the split need it
        raise ExportError(NEEDS_CONFIG.format(hf_dir=cfg_dir))
    if kind == MEGATRON and engine == "torch" and not _hf_weights(hf_dir):
        raise ExportError(f"{role_dir}: the torch engine does not read a Megatron dist_ckpt (use --engine stream)")
    if not allow_unverified and (no_config := source_config_problem(cfg_dir)) is not None:
        raise ExportRefused(_MODEL_REFUSAL.format(head=no_config), about="model")
    status, manifest, status_findings = catalog.export_source(str(src)) if catalog is not None else (None, {}, ())
    reading = _files_to_read(role_dir, hf_dir, cfg_dir) if zero is None else _zero_files_to_read(zero, weights, hf_dir)
    source = dict(manifest=manifest, status=status, status_findings=status_findings)
    background = None
    refused = None
    if allow_corrupt or status in REFUSED_STATUSES:
        # checked before anything is written: a source the catalog refuses is refused as it is, and with
        # --allow-corrupt the copy must know whether the CRCs already failed
        check = check_source(reading, **source)
        refused = refusal(check)
        if refused is not None and not allow_corrupt:
            raise refused
    else:
        # the source is re-read while the copy pass writes (same checks, the copy's time instead of its own); it
        # is joined before anything is put in place, and a failed check discards the hidden work directory
        background = BackgroundCheck(reading, **source)

    out = Path(dest.path)  # not resolved: --force must replace a link, never the dir it points to
    ops = OpCounter.from_env()
    made = _missing_dirs(out.parent)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _reclaim_leftovers(out)
        tmp = out.parent / f".{out.name}.ckpt-audit-tmp-{os.getpid()}-{os.urandom(4).hex()}"
        tmp.mkdir()
        args: dict[str, Any] = dict(
            max_shard_size=max_shard_size, verify=verify, progress=progress, hf_dir=cfg_dir, ops=ops
        )
        fallback = ""
        result = None
        if zero is not None:  # streamed only: the torch engine has no DeepSpeed source
            crc = refused is None
            result = _export_streamed(
                role_dir, src, tmp, out, dtype=dtype, check_crc=crc, jobs=jobs, **args, weights=weights or "fp32"
            )
        elif engine != "torch":
            try:
                # --allow-corrupt: the CRCs already failed and the user took the bytes as they are
                crc = refused is None
                result = _export_streamed(role_dir, src, tmp, out, dtype=dtype, check_crc=crc, jobs=jobs, **args)
            except StreamUnsupported as why:
                if kind == MEGATRON:
                    raise ExportError(f"{why}: not supported (the torch engine reads no dist_ckpt either)") from None
                if engine == "stream" or not _torch_available():
                    raise ExportError(f"{why}: this checkpoint needs the torch engine ({TORCH_EXTRA})") from None
                fallback = f"exported with torch: {why}"
                _remove(tmp)
                tmp.mkdir()
        if result is None:
            result = _export_torch(role_dir, src, tmp, out, dtype=dtype, **args)
            if fallback:
                result = replace(result, warnings=(*result.warnings, fallback))
        if background is not None:
            check = background.result()
            if (refused := refusal(check)) is not None:
                raise refused
        result = _with_source(result, check, dest, override="allow-corrupt" if refused is not None else "")
        result = _with_model(result, tmp, out, verify=verify, max_load_size=max_load_size)
        if result.model_findings and not allow_unverified:
            head = first_of(result.model_findings)
            raise ExportRefused(_MODEL_REFUSAL.format(head=head), about="model", findings=result.model_findings)
        _sync_tree(tmp)
        _write_marker(tmp, result)
        ops.tick()  # complete and marked: right before the rename
        if (moved := changed_since(check)) is not None:
            raise ExportError(f"{moved} changed while it was exported; nothing was replaced (export again)")
        # what --to holds may have changed during a long export (a file added to the earlier one, a directory
        # made there): judge it again, as it is now, right before it is replaced
        if check_destination(to, protected=places, force=force) != dest:
            raise ExportError(f"{out} changed while the export was written; nothing was replaced (export again)")
        _swap_into_place(tmp, out, ops)
    except BaseException as exc:
        if tmp is not None and os.path.lexists(tmp):
            _remove(tmp)
        _remove_empty(made)
        if background is not None:
            if not isinstance(exc, Exception):  # interrupted: stop reading, do not wait for the whole check
                background.cancel()
            elif not isinstance(exc, ExportRefused) and (source_refused := refusal(background.result())) is not None:
                # the copy failed and the source failed its check: the check says why (a flipped byte fails both)
                raise source_refused from None
        if isinstance(exc, OSError):  # a full disk, a file-size limit, a source gone: one line, nothing in place
            where = f": {exc.filename}" if exc.filename else ""
            raise ExportError(f"export to {out} failed ({exc.strerror or exc}{where}); nothing was put there") from None
        raise
    if catalog is not None:
        result = replace(result, export_id=catalog.record_export(result, tick=ops.tick))
    return result


_MODEL_REFUSAL = (
    "refusing to export what transformers cannot load as written: {head}; pass --allow-unverified to write it "
    "anyway (marked unverified)"
)


def _with_model(result: ExportResult, tmp: Path, out: Path, *, verify: bool, max_load_size: int) -> ExportResult:
    """The model check (export_model) of the finished work directory: config.json first, then transformers' load."""
    checked = check_config(tmp, out)
    warnings = [*result.warnings, *checked.notes]
    if checked.findings:
        load = Load(ran=False, note="transformers load not run: config.json disagrees with the tensors")
    elif not verify:
        load = Load(ran=False, note="transformers load not run (--no-verify)")
    else:
        load = load_with_transformers(tmp, out, total_bytes=result.total_bytes, max_size=max_load_size)
    found = (*checked.findings, *load.findings)
    if found:
        warnings += [f"--allow-unverified: exported although {f.path}: {f.code}: {f.message}" for f in found]
    mode = "failed" if found else ("transformers" if load.ran else "config")
    return replace(result, model_check=mode, model_findings=found, model_load=load.note, warnings=tuple(warnings))


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first: what mkdir(parents=True) will create."""
    out = []
    while not os.path.lexists(path) and path.parent != path:
        out.append(path)
        path = path.parent
    return out


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the directories this export created for --to, deepest first, as long as they are still empty."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            return


def _torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _export_torch(role_dir: Path, src: Path, tmp: Path, out: Path, *, dtype: str | None, **args) -> ExportResult:
    """The torch engine: every rank file loaded with torch (mmap), tensors joined by torch, read back by safetensors."""
    try:
        import torch  # lazy: see module docstring
    except ImportError:
        raise ExportError(f"the torch engine needs torch ({TORCH_EXTRA})") from None
    source = _ShardSource(role_dir) if _model_shards(role_dir) else _HfSource(_hf_dir_of(role_dir))
    target = getattr(torch, DTYPES[dtype]) if dtype else None
    return _export(source, src, tmp, out, target=target, torch=torch, **args)


def _export_streamed(
    role_dir: Path,
    src: Path,
    tmp: Path,
    out: Path,
    *,
    dtype,
    check_crc,
    max_shard_size,
    verify,
    progress,
    hf_dir,
    ops,
    jobs: int = 1,
    weights: str | None = None,
) -> ExportResult:
    """The stream engine (export_stream): tensor bytes copied from the shards in blocks, no torch. `weights`: the
    DeepSpeed tag `role_dir`'s weights to plan (export_zero)."""
    from ckpt_audit.lifecycle import export_stream as es
    from ckpt_audit.readers.hashing import digest_file

    try:
        config = _read_config(hf_dir)
        plan = plan_source(role_dir, _hf_dir_of(role_dir), config, weights=weights)
        if plan.kind == MEGATRON and (bridge := _hf_weights(_hf_dir_of(role_dir))):
            _check_bridge_weights(plan, bridge[0].parent, config, role_dir)
        total = len(plan.tensors)  # minus a dropped tied head, corrected as the ticks come
        counter = [0]

        def tick(name: str) -> None:
            ops.tick()  # one tensor written
            counter[0] += 1
            if progress is not None:
                progress(counter[0], max(total, counter[0]), name)

        outcome = es.export_tensors(
            plan,
            tmp,
            target=DTYPES[dtype] if dtype else None,
            max_shard_size=max_shard_size,
            verify=verify,
            tie=bool(config.get("tie_word_embeddings")) and plan.kind != MEGATRON,  # the planner already decided
            check_crc=check_crc,
            tick=tick,
            read_tick=ops.tick,  # one tensor read back
            jobs=jobs,
        )
    except es.StreamError as exc:
        raise ExportError(str(exc)) from None
    lora_dir = None
    if outcome.lora:
        adapter_cfg = _hf_dir_of(role_dir).parent / "lora_adapter" / "adapter_config.json"  # beside actor/
        if adapter_cfg.is_file():
            shutil.copy2(adapter_cfg, tmp / "lora_adapter" / "adapter_config.json")
        lora_dir = str(out / "lora_adapter")
    _copy_hf_files(hf_dir, tmp, outcome.dtype, None)
    exported: list[ExportedFile] = []
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(tmp))
            size, digest = outcome.hashes[rel] if rel in outcome.hashes else _digest(digest_file, p)
            exported.append(ExportedFile(path=str(out / rel), size_bytes=size, hash=digest))
    return ExportResult(
        source=str(src),
        role_dir=str(role_dir),
        out_dir=str(out),
        source_kind=plan.kind,
        world_size=plan.world_size,
        dtype=outcome.dtype,
        tensors=outcome.tensors,
        total_bytes=outcome.total_bytes,
        files=tuple(exported),
        lora_dir=lora_dir,
        warnings=outcome.warnings,
        read_back=outcome.read_back,
    )


def _digest(digest_file, p: Path) -> tuple[int, str]:
    d = digest_file(str(p))
    return d.size_bytes, d.hash


def _files_to_read(role_dir: Path, hf_dir: Path, cfg_dir: Path) -> list[tuple[str, bool]]:
    """(path, holds weights) for every file the export reads or copies: what check_source re-reads first."""
    out: list[tuple[str, bool]] = []
    if by_w := _model_shards(role_dir):
        out += [(str(p), True) for _r, p in sorted(by_w[_world_size(role_dir, by_w)].items())]
    elif dist := _megatron_dist(role_dir):
        names = sorted(os.listdir(dist))
        out += [(str(dist / n), n.endswith(".distcp")) for n in names if (dist / n).is_file()]
        out += [(str(p), True) for p in _hf_weights(hf_dir)]  # bridge mode: checked against the dist_ckpt too
    else:
        out += [(str(p), True) for p in _hf_weights(hf_dir)]
    if cfg_dir.is_dir():
        out += [(str(p), False) for p in sorted(cfg_dir.iterdir()) if p.is_file() and _model_file(p.name)]
    if (adapter := hf_dir.parent / "lora_adapter" / "adapter_config.json").is_file():
        out.append((str(adapter), False))
    return out


def _with_source(result: ExportResult, check: SourceCheck, dest: Destination, *, override: str) -> ExportResult:
    warnings = [*result.warnings, *check.notes]
    if override:
        warnings += [f"--allow-corrupt: exported although {f.path}: {f.code}: {f.message}" for f in check.findings]
    return replace(
        result,
        source_check=check.mode,
        source_files=tuple((f.path, f.hash) for f in check.files),
        override=override,
        source_findings=check.findings,
        replaced=dest.replaces,
        warnings=tuple(warnings),
    )


# ---------------------------------------------------------------------------------------------------- sources


@dataclass(slots=True, kw_only=True)
class _Tensor:
    """One output tensor: where its pieces are and how they join."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype of the source
    pieces: list = field(default_factory=list)  # torch tensors (mmap-backed views), in join order
    dim: int | None = None  # concatenation dim; None: a single piece


def _role_dir(src: Path, role: str) -> Path:
    if not src.is_dir():
        raise ExportError(f"{src}: not a directory")
    if (src / role).is_dir():
        return src / role
    if _model_shards(src) or (src / "huggingface").is_dir() or _hf_trainer_dir(src):  # SFT, role dir, HF Trainer
        return src
    if (src / ".metadata").is_file():  # torchtitan's step-N, or plain DCP (docs/layouts.md#torchtitan-step-n)
        raise ExportError(
            f"{src}: a DCP checkpoint (torchtitan step-N, plain DCP) is not supported: its weights are DCP chunks "
            "in the trainer's own names; convert it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save, "
            "or have torchtitan save HF safetensors (checkpoint.last_save_in_hf)"
        )
    raise ExportError(f"{src}: no {role}/ directory and no model shards")


def _zero_source(src: Path, weights: str | None, engine: str):
    """The DeepSpeed tag files `src` exports (export_zero.ZeroFiles), or None for every other source. An HF Trainer
    checkpoint that holds HF weights exports those unless --weights asks for DeepSpeed's."""
    from ckpt_audit.export import zero as export_zero
    from ckpt_audit.lifecycle import export_stream as es

    if weights is not None and weights not in export_zero.WEIGHTS:
        raise ExportError(f"unknown weights {weights!r} (use {' or '.join(export_zero.WEIGHTS)})")
    try:
        tag = export_zero.tag_dir(src) if src.is_dir() else None
        if tag is None or (weights is None and _hf_trainer_dir(src) and _hf_weights(src)):
            if weights is not None:
                raise ExportError(
                    f"{src}: --weights applies to DeepSpeed checkpoints (a tag dir, or a dir whose "
                    "latest names one); this is not one"
                )
            return None
        if engine == "torch":
            raise ExportError(f"{tag}: a DeepSpeed checkpoint exports with the stream engine only (--engine auto)")
        return export_zero.zero_files(tag)
    except (es.StreamError, es.StreamUnsupported) as exc:
        raise ExportError(str(exc)) from None


def _zero_files_to_read(zero, weights: str | None, hf_dir: Path) -> list[tuple[str, bool]]:
    """_files_to_read for a DeepSpeed tag: the states the export of `weights` reads, and the HF files it copies."""
    out = [(str(p), True) for p in zero.read(weights or "fp32")]
    try:
        beside = sorted(hf_dir.iterdir())
    except OSError as exc:
        raise ExportError(f"{hf_dir}: cannot list ({exc.strerror or exc})") from None
    return out + [(str(p), False) for p in beside if p.is_file() and _model_file(p.name)]


MEGATRON = "megatron-dist-ckpt"
DEEPSPEED = "deepspeed-zero"  # a tag dir export_zero plans (found by _zero_source, before source_kind)


def source_kind(role_dir: Path, hf_dir: Path) -> str:
    """Where the model's weights are: "fsdp-shards", MEGATRON (also when verl's bridge saved HF weights beside it:
    those are then checked against it) or "hf-weights". Raises ExportError when there are none."""
    if _model_shards(role_dir):
        return "fsdp-shards"
    if _megatron_dist(role_dir) is not None:
        return MEGATRON
    if _hf_weights(hf_dir):
        return "hf-weights"
    raise ExportError(NO_WEIGHTS.format(role_dir=role_dir, hf_dir=hf_dir))


def plan_source(role_dir: Path, hf_dir: Path, config: dict, *, weights: str | None = None):
    """The seam between a source and the stream engine: an export_stream.Plan of the model's tensors, whatever the
    trainer's layout. `weights`: `role_dir` is a DeepSpeed tag, planned by export_zero. Raises ExportError, or
    export_stream.StreamError / StreamUnsupported."""
    from ckpt_audit.lifecycle import export_stream as es

    if weights is not None:
        from ckpt_audit.export.zero import plan_zero

        try:
            return plan_zero(role_dir, weights)
        except es.StreamUnsupported as exc:  # no torch engine to fall back to
            raise es.StreamError(str(exc)) from None
    kind = source_kind(role_dir, hf_dir)
    if kind == "fsdp-shards":
        by_w = _model_shards(role_dir)
        world = _world_size(role_dir, by_w)
        files = by_w[world]
        if missing := sorted(set(range(world)) - set(files)):
            raise ExportError(f"{role_dir}: missing model shard(s) for rank {', '.join(map(str, missing))} of {world}")
        return es.plan_shards(files, world, role_dir)
    if kind == MEGATRON:
        from ckpt_audit.export.megatron_dist import plan_dist_ckpt
        from ckpt_audit.export.megatron_names import NameMapError, arch_of

        if not config:
            raise ExportError(NEEDS_CONFIG.format(hf_dir=hf_dir))
        try:
            arch_of(config)
        except NameMapError as exc:
            if bridge := _hf_weights(hf_dir):  # an architecture the planner does not map: the bridge's weights as is
                why = f"exported from {hf_dir} as saved, not checked against the dist_ckpt: {exc}"
                return replace(es.plan_hf(bridge), warnings=(why,))
        return plan_dist_ckpt(_megatron_dist(role_dir), config)  # type: ignore[arg-type]  # not None: kind
    return es.plan_hf(_hf_weights(hf_dir))


def _megatron_dist(role_dir: Path) -> Path | None:
    """The model's dist_checkpointing directory: model/dist_ckpt (verl's layout v2), else dist_ckpt/ (pre-v2)."""
    for d in (role_dir / "model" / "dist_ckpt", role_dir / "dist_ckpt"):
        if (d / ".metadata").is_file():
            return d
    return None


def _hf_dir_of(role_dir: Path) -> Path:
    """Where HF files sit: the role dir itself (HF Trainer's checkpoint-N), model/huggingface (verl's Megatron v2),
    else huggingface/."""
    if _hf_trainer_dir(role_dir):
        return role_dir
    if (role_dir / "model" / "huggingface").is_dir() or (role_dir / "model" / "dist_ckpt").is_dir():
        return role_dir / "model" / "huggingface"
    return role_dir / "huggingface"


def _config_dir(hf_dir: Path, hf_config: str | Path | None) -> Path:
    """The directory whose config.json describes the model: the checkpoint's, else --hf-config (a dir or its file)."""
    if (hf_dir / "config.json").is_file() or hf_config is None:
        return hf_dir
    p = Path(hf_config).resolve()
    return p.parent if p.name == "config.json" else p


def _check_bridge_weights(plan, bridge: Path, config: dict, role_dir: Path) -> None:
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
            f"{bridge} is not the model in {_megatron_dist(role_dir)}: {report.differences[0]}{more}", about="source"
        )


def check_export(
    step_dir: str | Path,
    hf: str | Path,
    *,
    role: str = "actor",
    hf_config: str | Path | None = None,
    weights: str | None = None,
):
    """`export --check`: is `hf` this checkpoint's model (export_check.compare)? Reads only. Raises ExportError."""
    from ckpt_audit.export.check import CheckError, compare
    from ckpt_audit.lifecycle import export_stream as es

    src = Path(step_dir).resolve()
    zero = _zero_source(src, weights, "auto")
    if zero is not None:
        role_dir, hf_dir, weights = zero.tag_dir, zero.tag_dir.parent, weights or "fp32"
    else:
        role_dir = _role_dir(src, role)
        hf_dir = _hf_dir_of(role_dir)
    out = Path(hf).resolve()
    config = _read_config(_config_dir(hf_dir, hf_config)) or _read_config(out)
    try:
        plan = plan_source(role_dir, hf_dir, config, weights=weights)
        return compare(plan, out, config, source=str(role_dir))
    except (es.StreamError, es.StreamUnsupported, CheckError) as exc:
        raise ExportError(str(exc)) from None


def _hf_trainer_dir(d: Path) -> bool:
    try:
        return hf_trainer.is_checkpoint(os.listdir(d))
    except OSError:
        return False


def _model_shards(d: Path) -> dict[int, dict[int, Path]]:
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


def _hf_weights(hf: Path) -> list[Path]:
    return sorted(hf.glob("*.safetensors")) if hf.is_dir() else []


class _ShardSource:
    kind = "fsdp-shards"

    def __init__(self, role_dir: Path) -> None:
        import logging  # the torch engine only: the stream path does not pay for it

        import torch
        import torch.distributed.tensor  # noqa: F401 - registers DTensor for weights_only loading

        logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)  # "unpickled before PGs"
        by_w = _model_shards(role_dir)
        self.world_size = _world_size(role_dir, by_w)
        files = by_w[self.world_size]
        missing = sorted(set(range(self.world_size)) - set(files))
        if missing:
            raise ExportError(
                f"{role_dir}: missing model shard(s) for rank {', '.join(map(str, missing))} of {self.world_size}"
            )
        first = _load(files[0])
        mesh, names = _mesh_of(first, self.world_size)
        # HSDP: ranks along the leading (replicate) mesh dims hold copies; read the first replica only.
        self.ranks = [int(r) for r in mesh.reshape(-1, mesh.shape[-1])[0].tolist()]
        self.mesh_names = names
        self.states = {0: first} if self.ranks[0] == 0 else {}
        for r in self.ranks:
            if r not in self.states:
                self.states[r] = _load(files[r])
        if 0 not in self.ranks:
            raise ExportError(f"{role_dir}: rank 0 is not in the first replica of mesh {mesh.tolist()}")
        self.warnings: list[str] = []
        self.tensors = self._plan(torch)
        self.ranges = mapped_ranges({str(files[r]) for r in self.ranks})

    def _plan(self, torch) -> list[_Tensor]:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        keys0 = list(self.states[0].keys())
        for r, sd in self.states.items():
            if set(sd.keys()) != set(keys0):
                extra = sorted(set(sd.keys()) ^ set(keys0))[:3]
                raise ExportError(f"rank {r} and rank 0 hold different keys (e.g. {', '.join(extra)})")
        out = []
        for key in keys0:
            v0 = self.states[0][key]
            if not isinstance(v0, torch.Tensor):
                self.warnings.append(f"{key}: not a tensor ({type(v0).__name__}); skipped")
                continue
            if isinstance(v0, DTensor):
                placements = tuple(v0.placements)
                for r in self.ranks:
                    if tuple(self.states[r][key].placements) != placements:
                        raise ExportError(f"{key}: placements differ between rank 0 and rank {r}")
                if any(not isinstance(p, Replicate) for p in placements[:-1]):
                    raise ExportError(f"{key}: placements {placements} shard a replicate mesh dim; unsupported")
                last = placements[-1]
                t = _Tensor(name=key, shape=tuple(v0.shape), dtype=v0.dtype)
                if isinstance(last, Replicate):
                    t.pieces = [v0._local_tensor]
                elif type(last) is Shard:
                    t.dim = last.dim
                    t.pieces = [self.states[r][key]._local_tensor for r in self.ranks]
                    joined = sum(p.shape[t.dim] for p in t.pieces)
                    if joined != t.shape[t.dim]:
                        raise ExportError(f"{key}: shards join to {joined} along dim {t.dim}, not {t.shape[t.dim]}")
                else:
                    raise ExportError(f"{key}: placement {last} is not supported (only Shard(d) and Replicate)")
            else:  # world size 1 (FSDP NO_SHARD) saves plain tensors
                copies = [self.states[r][key] for r in self.ranks]
                t = _Tensor(name=key, shape=tuple(v0.shape), dtype=v0.dtype, pieces=[v0])
                if len(copies) > 1 and not all(c.shape == v0.shape and torch.equal(c, v0) for c in copies[1:]):
                    t.dim, t.pieces = 0, copies  # what verl's merger does with plain tensors
                    t.shape = (sum(c.shape[0] for c in copies), *v0.shape[1:])
                    self.warnings.append(f"{key}: plain tensor differs across ranks; concatenated on dim 0")
            out.append(t)
        return out


class _HfSource:
    """HF safetensors already in huggingface/ (Megatron with mbridge, or FSDP saved with hf_model)."""

    kind = "hf-weights"
    world_size = None

    def __init__(self, hf: Path) -> None:
        from safetensors import safe_open

        self.warnings: list[str] = []
        self.handles = [safe_open(str(p), framework="pt") for p in _hf_weights(hf)]
        self.tensors = []
        for h in self.handles:
            for key in h.keys():
                sl = h.get_slice(key)
                t = h.get_tensor(key)  # mmap-backed by safetensors
                self.tensors.append(_Tensor(name=key, shape=tuple(sl.get_shape()), dtype=t.dtype, pieces=[t]))


def _world_size(role_dir: Path, by_w: dict[int, dict[int, Path]]) -> int:
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


def _load(path: Path):
    import torch

    try:
        return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as exc:  # a corrupt or unsafe shard is the user's problem, told in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"{path}: cannot load safely ({first[:200]})") from None


def _mesh_of(state: dict, world_size: int):
    import torch
    from torch.distributed.tensor import DTensor

    for key in sorted(state):
        v = state[key]
        if isinstance(v, DTensor):
            mesh = v.device_mesh.mesh.cpu()
            if mesh.numel() != world_size:
                raise ExportError(f"device mesh {mesh.tolist()} does not cover world size {world_size}")
            return mesh, tuple(v.device_mesh.mesh_dim_names or ())
    return torch.arange(world_size).reshape(1, world_size), ("fsdp",)


# ---------------------------------------------------------------------------------------------------- export


def _export(
    source, src: Path, tmp: Path, out: Path, *, target, max_shard_size, verify, progress, hf_dir, torch, ops: OpCounter
):
    warnings = list(source.warnings)
    config = _read_config(hf_dir)
    tensors = source.tensors

    names = {t.name for t in tensors}
    if config.get("tie_word_embeddings") and set(TIED_EMBEDDINGS) <= names:
        lm, emb = (next(t for t in tensors if t.name == n) for n in TIED_EMBEDDINGS)
        if _same(lm, emb, torch):
            tensors = [t for t in tensors if t.name != TIED_EMBEDDINGS[0]]
        else:
            warnings.append("tie_word_embeddings is true but lm_head.weight differs from embed_tokens; kept both")

    base: list[_Tensor] = []
    lora: list[_Tensor] = []
    for t in tensors:
        (lora if "lora_" in t.name else base).append(t)
    if lora:
        for t in base:
            t.name = t.name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        warnings.append(
            f"LoRA adapter ({len(lora)} tensors) exported to lora_adapter/ beside the model; it is "
            "NOT fused into the base weights"
        )

    out_dtype = target or _dominant_float(base, torch)
    total = len(base) + len(lora)
    counter = [0]

    def tick(name: str) -> None:
        ops.tick()  # one tensor written
        counter[0] += 1
        if progress is not None:
            progress(counter[0], total, name)

    ranges = getattr(source, "ranges", [])
    _write_model(tmp, base, target, max_shard_size, tick, ranges, torch)
    lora_dir = None
    if lora:
        (tmp / "lora_adapter").mkdir()
        _write_file(tmp / "lora_adapter" / "adapter_model.safetensors", lora, target, tick, ranges, torch)
        adapter_cfg = hf_dir.parent / "lora_adapter" / "adapter_config.json"  # verl writes it beside actor/
        if adapter_cfg.is_file():
            shutil.copy2(adapter_cfg, tmp / "lora_adapter" / "adapter_config.json")
        lora_dir = str(out / "lora_adapter")

    _copy_hf_files(hf_dir, tmp, out_dtype, torch)
    read_back = False
    if verify:
        _verify(tmp, base + lora, target, ranges, torch, ops)
        read_back = True

    from ckpt_audit.readers.hashing import digest_file

    files = []
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            d = digest_file(str(p))
            files.append(ExportedFile(path=str(out / p.relative_to(tmp)), size_bytes=d.size_bytes, hash=d.hash))
    return ExportResult(
        source=str(src),
        role_dir=str(hf_dir if _hf_trainer_dir(hf_dir) else hf_dir.parent),
        out_dir=str(out),
        source_kind=source.kind,
        world_size=source.world_size,
        dtype=str(out_dtype).removeprefix("torch."),
        tensors=total,
        total_bytes=sum(_nbytes(t, target, torch) for t in base + lora),
        files=tuple(files),
        lora_dir=lora_dir,
        warnings=tuple(warnings),
        read_back=read_back,
    )


def _write_model(tmp: Path, tensors: list[_Tensor], target, max_shard_size: int, tick, ranges, torch) -> None:
    for name, group in output_shards(tensors, lambda t: _nbytes(t, target, torch), max_shard_size, tmp):
        _write_file(tmp / name, group, target, tick, ranges, torch)


def _write_file(path: Path, tensors: list[_Tensor], target, tick, ranges, torch) -> None:
    """Write a safetensors file by hand, so tensors stream in one at a time (save_file wants them all)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        n = _nbytes(t, target, torch)
        dt = str(_out_dtype(t, target, torch)).removeprefix("torch.")
        header[t.name] = {"dtype": SAFETENSORS_DTYPE[dt], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format asks for an 8-byte aligned start of data
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for t in tensors:
            for chunk in _chunks(t, target, torch):
                fh.write(_bytes_view(chunk, torch))
            _release(t, ranges)
            tick(t.name)


def _chunks(t: _Tensor, target, torch) -> Iterator:
    dtype = _out_dtype(t, target, torch)
    if t.dim is None:
        yield t.pieces[0].to(dtype).contiguous()
    elif t.dim == 0:  # the bytes of a dim-0 concatenation are the pieces' bytes in order: no full buffer
        for p in t.pieces:
            if p.numel():
                yield p.to(dtype).contiguous()
    else:
        buf = torch.empty(t.shape, dtype=dtype)
        start = 0
        for p in t.pieces:
            n = p.shape[t.dim]
            buf.narrow(t.dim, start, n).copy_(p)  # copy_ casts
            start += n
        yield buf


def _verify(tmp: Path, tensors: list[_Tensor], target, ranges, torch, ops: OpCounter) -> None:
    """Every tensor read back (safetensors' own reader) equals torch.cat of its shards, as cast, bit for bit."""
    from safetensors import safe_open

    files = sorted(tmp.glob("*.safetensors")) + sorted((tmp / "lora_adapter").glob("*.safetensors"))
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {key: h for h in handles for key in h.keys()}
    out_paths = {str(f) for f in files}
    expected = {t.name for t in tensors}
    if set(where) != expected:
        raise ExportError(f"export check failed: keys differ ({sorted(set(where) ^ expected)[:3]})")
    for t in tensors:  # one tensor at a time: reading back must not cost the model's size either
        got = where[t.name].get_tensor(t.name)
        dtype = _out_dtype(t, target, torch)
        want = (t.pieces[0] if t.dim is None else torch.cat(list(t.pieces), dim=t.dim)).to(dtype)
        if (
            got.dtype != want.dtype
            or tuple(got.shape) != tuple(want.shape)
            or not torch.equal(_bytes_of(got, torch), _bytes_of(want, torch))
        ):
            raise ExportError(f"export check failed: {t.name} differs from the concatenation of its shards")
        del got, want
        _release(t, ranges)
        _drop(mapped_ranges(out_paths))  # safetensors maps the files it reads back
        ops.tick()  # one tensor read back


def _same(a: _Tensor, b: _Tensor, torch) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.dim != b.dim or len(a.pieces) != len(b.pieces):
        return False
    return all(torch.equal(_bytes_of(x, torch), _bytes_of(y, torch)) for x, y in zip(a.pieces, b.pieces))


def _bytes_of(t, torch):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _bytes_view(t, torch) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _out_dtype(t: _Tensor, target, torch):
    return target if target is not None and t.dtype.is_floating_point else t.dtype


def _nbytes(t: _Tensor, target, torch) -> int:
    n = 1
    for s in t.shape:
        n *= s
    return n * _out_dtype(t, target, torch).itemsize


def _dominant_float(tensors: list[_Tensor], torch):
    sizes: dict = {}
    for t in tensors:
        if t.dtype.is_floating_point:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + _nbytes(t, None, torch)
    return max(sizes, key=sizes.__getitem__) if sizes else torch.float32


def _read_config(hf: Path) -> dict:
    try:
        return bounded_json.load_file(str(hf / "config.json"))
    except (OSError, ValueError):
        return {}


def _copy_hf_files(hf: Path, tmp: Path, out_dtype, torch) -> None:
    """config, generation config, tokenizer and custom code; never the weights (we just wrote those)."""
    if not hf.is_dir():
        return
    for p in sorted(hf.iterdir()):
        if p.is_file() and _model_file(p.name):
            shutil.copy2(p, tmp / p.name)
    cfg = tmp / "config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text())
        name = str(out_dtype).removeprefix("torch.")
        data["torch_dtype" if "torch_dtype" in data and "dtype" not in data else "dtype"] = name
        cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _model_file(name: str) -> bool:
    """A non-weight file of the model (config, tokenizer, code): never the weights, nor HF Trainer's resume state."""
    return not WEIGHT_FILE_RE.search(name) and not hf_trainer.is_resume_state(name)


def _sync_tree(tmp: Path) -> None:
    """One fsync per file written under `tmp` (weights, index, config, tokenizer, adapter) and per subdirectory,
    after the read-back: the data is on disk before the marker says the export is complete (the marker then syncs
    `tmp` itself)."""
    for p in sorted(tmp.rglob("*")):
        if p.is_dir():
            fsync_dir(str(p))
        elif p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _write_marker(tmp: Path, result: ExportResult) -> None:
    """What makes this directory recognisable as an export (and so replaceable by a later --force)."""
    files = [(os.path.relpath(f.path, result.out_dir), f.size_bytes, f.hash) for f in result.files]
    doc = marker_document(
        source=result.source,
        created_ns=time.time_ns(),
        source_check=result.source_check,
        override=result.override,
        model_check=result.model_check,
        verified=result.verified,
        files=files,
    )
    with open(tmp / MARKER, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(doc, indent=2) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(str(tmp))


def _swap_into_place(tmp: Path, out: Path, ops: OpCounter) -> None:
    """Put the finished `tmp` at `out` by one rename; an earlier export there is swapped out atomically where the
    kernel can (renameat2 RENAME_EXCHANGE), so `out` never goes missing, and only then removed."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        ops.tick()  # in place
        fsync_dir(str(out.parent))
        return
    if not _exchange(tmp, out):  # older kernel or filesystem: a moment with nothing at `out`, never a half export
        old = out.parent / tmp.name.replace(".ckpt-audit-tmp-", ".ckpt-audit-old-")
        os.rename(out, old)
        os.rename(tmp, out)
        tmp = old
    ops.tick()  # in place; the earlier export now sits at `tmp`
    fsync_dir(str(out.parent))
    _remove(tmp)
    ops.tick()  # the earlier export removed


def _exchange(a: Path, b: Path) -> bool:
    fn = getattr(_libc, "renameat2", None) if _libc is not None else None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove(path: Path) -> None:
    """Remove a work directory of ours; a link is unlinked, never followed."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _reclaim_leftovers(out: Path) -> None:
    """Remove the work dirs a killed export to the same `out` left beside it (named by its pid, now dead)."""
    pattern = re.compile(LEFTOVER_RE.format(name=re.escape(out.name)))
    try:
        names = os.listdir(out.parent)
    except OSError:
        return
    for name in names:
        if (m := pattern.fullmatch(name)) and not _alive(int(m[1])):
            _remove(out.parent / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


# ---------------------------------------------------------------------------------------------------- memory

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        _libc = None


def mapped_ranges(paths: set[str]) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from `paths` (Linux /proc/self/maps; empty elsewhere)."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() in paths:
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return ranges


def _drop(ranges: list[tuple[int, int]]) -> None:
    """Drop whole read-only file mappings' pages (see _release for why this is safe)."""
    if _libc is not None:
        for lo, hi in ranges:
            _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


def _release(t: _Tensor, ranges: list[tuple[int, int]]) -> None:
    """Drop the pages of `t`'s source pieces from this process. Only pages inside a mapping of a shard file
    are touched: those are clean pages of a private read-only-used mapping, and touching them again simply
    re-reads the file (on anonymous memory MADV_DONTNEED would zero data, so nothing else is ever passed).
    Without this the mapped pages of every shard stay resident and RSS grows to the model's size."""
    if _libc is None or not ranges:
        return
    for p in t.pieces:
        try:
            storage = p.untyped_storage()
            ptr, n = storage.data_ptr(), storage.nbytes()
        except Exception:  # noqa: BLE001 - best effort: memory accounting only
            continue
        lo, hi = -(-ptr // _PAGE) * _PAGE, (ptr + n) // _PAGE * _PAGE  # whole pages inside the piece
        for mlo, mhi in ranges:
            a, b = max(lo, mlo), min(hi, mhi)
            if b > a:
                _libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED)
