"""Export a checkpoint to a HuggingFace model directory: the orchestrator (`export_checkpoint`, `check_export`).

Two engines. The default ("stream", stream_engine over stream_plan, stream_copy and stream_write) needs no torch:
tensor bytes are copied from the shards' stored zip entries in fixed-size blocks, cast by numpy, CRC-checked and
hashed in the same pass; peak memory is a block budget whatever the model's size. The torch engine (torch_engine)
is the oracle it is tested against byte for byte, and the fallback for what streaming cannot do exactly. Where the
weights are and how they are planned is the sources module's; the guards, marker, swap and kill points below are the
same for both.

The shards themselves are re-read in full while they are copied (guard.check_source on its own thread: CRCs, and
each file's hash against the catalog's manifest; before the copy when the catalog already refuses the checkpoint or
with --allow-corrupt), and the export is put in place only once that check passed, so "verified" means equal to
content that was checked, not only to itself. A failed check, or a failed copy, removes the hidden directory.

Nothing is written before guard says `--to` is clear of every checkpoint, run and scanned root. The export is built
in a hidden sibling directory, every file fsynced once after the read-back, marked as an export (MARKER, with its
file hashes), and only then put in place by one rename (placement: an atomic exchange when it replaces an earlier
export), so `--to` is at every moment absent, the earlier export, or the complete new one. Kill points for the crash
test (the killpoints seam, CKPT_AUDIT_TEST_KILL_AFTER_OPS), in order: one per tensor written, one per tensor read
back, the marker written, the rename into place, the earlier export removed (only when there was one), then inside
the catalog transaction.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpt_audit.export import placement
from ckpt_audit.export.guard import (
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
    refusal,
    step_and_run,
)
from ckpt_audit.export.model import (
    Load,
    check_config,
    config_unusable,
    load_with_transformers,
    source_config_problem,
)
from ckpt_audit.export.result import ExportResult
from ckpt_audit.export.sources import (
    MEGATRON,
    NEEDS_CONFIG,
    config_dir_of,
    export_input,
    files_to_read,
    plan_source,
    read_config,
    source_kind,
)
from ckpt_audit.export.stream_engine import export_streamed
from ckpt_audit.export.stream_plan import StreamUnsupported
from ckpt_audit.export.torch_engine import TORCH_EXTRA, export_torch, torch_available
from ckpt_audit.killpoints import OpCounter

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_MAX_SHARD = 5 * 10**9
DEFAULT_MAX_LOAD = 16 * 10**9  # tensor bytes up to which transformers' load (all in memory) is part of "verified"
ENGINES = ("auto", "stream", "torch")


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
    run_files: Callable | None = None,
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
    (export.model). Otherwise ExportRefused (about "model"), unless `allow_unverified`: then it is written, not
    verified, and the findings are in the result and its marker.

    `engine`: "stream" copies tensor bytes without torch (stream_copy); "torch" loads the shards with torch (the
    oracle); "auto" streams and falls back to torch only for what streaming cannot do exactly. A Megatron dist_ckpt
    is streamed only (export.megatron_dist). `hf_config`: the HF model directory whose config.json (and tokenizer) the
    export takes when the checkpoint holds none (verl's Megatron saves without a bridge).

    `weights` ("fp32" | "module"): a DeepSpeed ZeRO checkpoint (a tag dir, or a dir whose `latest` names one) exports
    its fp32 master weights (the default) or the module's own weights (export.zero); an HF Trainer checkpoint with
    HF weights exports those unless `weights` is given.

    `jobs`: the stream engine writes and reads back that many output files at once, one worker process each
    (stream_write._in_workers); the files are the same bytes as with 1. `run_files`: the executor that writes
    them instead (export --ray: cluster.ray_export), with _in_workers' signature.
    """
    if engine not in ENGINES:
        raise ExportError(f"unknown engine {engine!r} (use {', '.join(ENGINES)})")
    if dtype and dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r} (use bf16, fp16 or fp32)")
    # what it reads, from the scan's walk of the run through the layouts' names (export.sources)
    inp = export_input(Path(step_dir).resolve(), role, weights, engine)
    src, role_dir, zero = inp.src, inp.role_dir, inp.zero  # zero: a DeepSpeed tag to export from, or None
    cfg_dir = config_dir_of(inp, hf_config)
    ckpt, run = step_and_run(str(src))
    places = [("checkpoint", ckpt), ("run", run), *(("scanned root", r) for r in protected_roots)]
    if catalog is not None:
        places += catalog.known_places()
    dest = check_destination(to, protected=places, force=force)
    kind = source_kind(inp)
    if kind == MEGATRON and not (cfg_dir / "config.json").is_file():  # the names and the split need it
        raise ExportError(NEEDS_CONFIG.format(hf_dir=cfg_dir))
    if kind == MEGATRON and (unusable := config_unusable(cfg_dir)) is not None:  # was "has no config.json"
        raise ExportError(f"{unusable}: the Megatron names and split are read from it")
    if kind == MEGATRON and engine == "torch" and not inp.hf_weights:
        raise ExportError(f"{role_dir}: the torch engine does not read a Megatron dist_ckpt (use --engine stream)")
    if not allow_unverified and (no_config := source_config_problem(cfg_dir)) is not None:
        raise ExportRefused(_MODEL_REFUSAL.format(head=no_config), about="model")
    status, manifest, status_findings = catalog.export_source(str(src)) if catalog is not None else (None, {}, ())
    reading = files_to_read(inp, cfg_dir, weights)
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
    made = placement.missing_dirs(out.parent)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        placement.reclaim_leftovers(out)
        tmp = placement.work_dir(out)
        tmp.mkdir()
        args: dict[str, Any] = dict(
            target=DTYPES[dtype] if dtype else None,
            max_shard_size=max_shard_size,
            verify=verify,
            progress=progress,
            hf_dir=cfg_dir,
            ops=ops,
        )
        streamed: dict[str, Any] = dict(jobs=jobs, run_files=run_files)
        fallback = ""
        result = None
        if zero is not None:  # streamed only: the torch engine has no DeepSpeed source
            crc = refused is None
            result = export_streamed(inp, tmp, out, check_crc=crc, **streamed, **args, weights=weights or "fp32")
        elif engine != "torch":
            try:
                # --allow-corrupt: the CRCs already failed and the user took the bytes as they are
                crc = refused is None
                result = export_streamed(inp, tmp, out, check_crc=crc, **streamed, **args)
            except StreamUnsupported as why:
                if kind == MEGATRON:
                    raise ExportError(f"{why}: not supported (the torch engine reads no dist_ckpt either)") from None
                if engine == "stream" or not torch_available():
                    raise ExportError(f"{why}: this checkpoint needs the torch engine ({TORCH_EXTRA})") from None
                fallback = f"exported with torch: {why}"
                placement.remove_work_dir(tmp)
                tmp.mkdir()
        if result is None:
            result = export_torch(inp, tmp, out, **args)
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
        placement.sync_tree(tmp)
        placement.write_marker(tmp, result)
        ops.tick()  # complete and marked: right before the rename
        if (moved := changed_since(check, inp.listed)) is not None:
            raise ExportError(f"{moved} changed while it was exported; nothing was replaced (export again)")
        # what --to holds may have changed during a long export (a file added to the earlier one, a directory
        # made there): judge it again, as it is now, right before it is replaced
        if check_destination(to, protected=places, force=force) != dest:
            raise ExportError(f"{out} changed while the export was written; nothing was replaced (export again)")
        placement.swap_into_place(tmp, out, ops)
    except BaseException as exc:
        if tmp is not None and os.path.lexists(tmp):
            placement.remove_work_dir(tmp)
        placement.remove_empty(made)
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
    """The model check (export.model) of the finished work directory: config.json first, then transformers' load."""
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


def check_export(
    step_dir: str | Path,
    hf: str | Path,
    *,
    role: str = "actor",
    hf_config: str | Path | None = None,
    weights: str | None = None,
):
    """`export --check`: is `hf` this checkpoint's model (export.check.compare)? Reads only. Raises ExportError."""
    from ckpt_audit.export.check import CheckError, compare
    from ckpt_audit.export.stream_plan import StreamError, StreamUnsupported

    inp = export_input(Path(step_dir).resolve(), role, weights, "auto")
    out = Path(hf).resolve()
    config = read_config(config_dir_of(inp, hf_config), source=True) or read_config(out)
    try:
        plan = plan_source(inp, config, weights=weights)
        return compare(plan, out, config, source=str(inp.role_dir))
    except (StreamError, StreamUnsupported, CheckError) as exc:
        raise ExportError(str(exc)) from None


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
