"""`ckpt-audit export`: one checkpoint -> a verified HuggingFace model directory (streaming, recorded)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ckpt_audit.cli.common import CommandError, catalog_option, emit_json, resolve_catalog
from ckpt_audit.exitcodes import ExitCode


@click.command("export")
@click.argument("step_dir", type=click.Path(path_type=Path))
@click.option("--to", "to", required=True, type=click.Path(path_type=Path), help="Output directory (must not exist).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Cast floating tensors (default: the checkpoint's own dtype).")
@click.option("--force", is_flag=True, help="Replace --to if it exists (atomically, once the export is complete).")
@click.option("--role", default="actor", show_default=True, help="Which role of the checkpoint (actor, critic).")
@click.option("--max-shard-size", default="5GB", show_default=True, metavar="SIZE",
              help="Split the safetensors past this size, with model.safetensors.index.json.")
@click.option("--no-verify", is_flag=True, help="Skip reading the export back and comparing it with the shards.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document to stdout.")
@catalog_option
@click.pass_context
def export_command(ctx, step_dir, to, dtype, force, role, max_shard_size, no_verify, as_json, catalog) -> None:
    """Merge a checkpoint's FSDP shards into a HuggingFace model directory.

    Handles Shard(0)/Shard(1) DTensors, uneven and empty shards, HSDP (one replica is read), world size 1
    plain tensors and tied embeddings; copies config, generation config and tokenizer from huggingface/.
    LoRA adapters go to lora_adapter/ beside the model, NOT fused. Megatron checkpoints export from the HF
    weights in huggingface/. Streams one tensor at a time from memory-mapped shards, writes into a temporary
    directory and renames it into place, then reads every tensor back and compares it with the concatenation
    of its shards. The export (file hashes, source checkpoint) is recorded in the catalog.

    Exit codes: 0 exported and verified, 2 usage, 3 error (unreadable or unsupported checkpoint, --to exists
    without --force, verification failed, catalog unusable), 130 interrupted.

    \b
    Example:
        ckpt-audit export /ckpts/p/e/global_step_400 --to ./hf-step400
        ckpt-audit export /ckpts/p/e/global_step_400 --to ./hf --dtype bf16 --max-shard-size 2GB --force
    """
    from ckpt_audit.catalog.manifest import CatalogError, probe
    from ckpt_audit.export import ExportError, export_checkpoint, parse_size

    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-shard-size") from None
    cat_path = resolve_catalog(catalog)
    try:
        probe(cat_path)
    except CatalogError as exc:
        raise CommandError(str(exc)) from None

    bar = _Progress(enabled=not as_json)
    try:
        result = export_checkpoint(step_dir, to, dtype=dtype, force=force, role=role, max_shard_size=shard_bytes,
                                   verify=not no_verify, progress=bar.update)
    except ExportError as exc:
        raise CommandError(str(exc)) from None
    finally:
        bar.close()

    from ckpt_audit.catalog import open_catalog
    from ckpt_audit.catalog.lifecycle import LifecycleLog

    try:
        with open_catalog(cat_path) as cat:
            export_id = LifecycleLog(cat.db).record_export(result)
    except CatalogError as exc:
        raise CommandError(str(exc)) from None

    for w in result.warnings:
        click.echo(f"ckpt-audit: warning: {w}", err=True)
    if as_json:
        emit_json({"command": "export", "export_id": export_id, **result.to_dict()})
    else:
        from ckpt_audit.models import format_size

        click.echo(f"exported {result.tensors} tensors ({format_size(result.total_bytes)}, {result.dtype}) from "
                   f"{result.role_dir} to {result.out_dir}" + ("; verified against the shards" if result.verified else ""))
        for f in result.files:
            click.echo(f"  {f.hash}  {format_size(f.size_bytes):>10}  {f.path}")
    ctx.exit(int(ExitCode.OK))


class _Progress:
    """Tensor count on stderr, only when stderr is a terminal."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.shown = False

    def update(self, done: int, total: int, name: str) -> None:
        if self.enabled:
            click.echo(f"\r{done}/{total} {name[:60]:<60}", err=True, nl=False)
            self.shown = True

    def close(self) -> None:
        if self.shown:
            click.echo("", err=True)
