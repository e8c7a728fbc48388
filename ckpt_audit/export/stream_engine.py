"""The stream engine as the orchestrator runs it: the source planned (sources.plan_source), its tensor bytes copied
without torch (stream_copy, stream_write), then the model's other files and the list of what was written."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from ckpt_audit.export.guard import ExportError
from ckpt_audit.export.result import ExportedFile, ExportResult
from ckpt_audit.export.sources import (
    MEGATRON,
    ExportInput,
    check_bridge_weights,
    copy_hf_files,
    plan_source,
    read_config,
)


def export_streamed(
    inp: ExportInput,
    tmp: Path,
    out: Path,
    *,
    target: str | None,
    check_crc,
    max_shard_size,
    verify,
    progress,
    hf_dir,
    ops,
    jobs: int = 1,
    run_files: Callable | None = None,
    weights: str | None = None,
) -> ExportResult:
    """Tensor bytes copied from the shards in blocks, no torch; `target`: the torch dtype name floating tensors are
    cast to, None to keep theirs. `weights`: the DeepSpeed tag's weights to plan (export.zero)."""
    from ckpt_audit.export.stream_plan import StreamError
    from ckpt_audit.export.stream_write import export_tensors
    from ckpt_audit.readers.hashing import digest_file

    try:
        config = read_config(hf_dir)
        plan = plan_source(inp, config, weights=weights)
        if plan.kind == MEGATRON and inp.hf_weights:
            check_bridge_weights(plan, inp, config)
        total = len(plan.tensors)  # minus a dropped tied head, corrected as the ticks come
        counter = [0]

        def tick(name: str) -> None:
            ops.tick()  # one tensor written
            counter[0] += 1
            if progress is not None:
                progress(counter[0], max(total, counter[0]), name)

        outcome = export_tensors(
            plan,
            tmp,
            target=target,
            max_shard_size=max_shard_size,
            verify=verify,
            tie=bool(config.get("tie_word_embeddings")) and plan.kind != MEGATRON,  # the planner already decided
            check_crc=check_crc,
            tick=tick,
            read_tick=ops.tick,  # one tensor read back
            jobs=jobs,
            run_files=run_files,
        )
    except StreamError as exc:
        raise ExportError(str(exc)) from None
    lora_dir = None
    if outcome.lora:
        if inp.lora_config is not None:  # beside actor/
            shutil.copy2(inp.lora_config, tmp / "lora_adapter" / "adapter_config.json")
        lora_dir = str(out / "lora_adapter")
    copy_hf_files(inp, hf_dir, tmp, outcome.dtype)
    exported: list[ExportedFile] = []
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(tmp))
            size, digest = outcome.hashes[rel] if rel in outcome.hashes else _digest(digest_file, p)
            exported.append(ExportedFile(path=str(out / rel), size_bytes=size, hash=digest))
    return ExportResult(
        source=str(inp.src),
        role_dir=str(inp.role_dir),
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
