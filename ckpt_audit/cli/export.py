"""`ckpt-audit export`: one checkpoint -> a verified HuggingFace model directory (streaming, recorded)."""

from __future__ import annotations

from pathlib import Path

import click

from ckpt_audit.cli.common import Bar, CommandError, catalog_option, emit_json, ray_option, session
from ckpt_audit.exitcodes import ExitCode


@click.command("export")
@click.argument("step_dir", type=click.Path(path_type=Path))
@click.option(
    "--to",
    "to",
    type=click.Path(path_type=Path),
    help="Output directory: new, or (with --force) an earlier export or an empty directory; never in a "
    "checkpoint, run or scanned root.",
)
@click.option(
    "--check",
    "check_dir",
    type=click.Path(path_type=Path),
    help="Write nothing: compare the HF directory CHECK with the checkpoint (keys, tied lm_head and expert count "
    "against the config, shapes, dtypes, every tensor bit for bit); exit 1 naming the first differences.",
)
@click.option(
    "--hf-config",
    type=click.Path(path_type=Path),
    help="The HF model directory the run started from (verl's model.path): its config.json and tokenizer, for a "
    "checkpoint that holds none (verl's Megatron saves without a bridge).",
)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    default=None,
    help="Cast floating tensors (default: the checkpoint's own dtype).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace an earlier export (or an empty directory) at --to, atomically, "
    "once the new export is complete. Anything else is refused.",
)
@click.option("--role", default="actor", show_default=True, help="Which role of the checkpoint (actor, critic).")
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    metavar="SIZE",
    help="Split the safetensors past this size, with model.safetensors.index.json.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Write (and read back) this many output shards at once, one local process each; the files are the same "
    "as with 1. Useful with several shards (--max-shard-size) on a machine with spare cores and disk.",
)
@ray_option(
    "Write (and read back) each output shard in a Ray task on the cluster's nodes; --to and the checkpoint "
    "must be on a store every node mounts at the same path (checked first, else exit 2). --jobs caps the tasks at "
    "once (default: Ray's CPUs decide). Stream engine only (docs/lifecycle.md; needs the extra: pip install "
    "'ckpt-audit[ray]', else exit 2)."
)
@click.option("--no-verify", is_flag=True, help="Skip reading the export back and comparing it with the shards.")
@click.option(
    "--allow-corrupt",
    is_flag=True,
    help="Export a source that fails its check (CRC, hash against the catalog, or a corrupt/unsafe/unknown "
    "verdict) anyway; recorded as an override, and the export is not called verified.",
)
@click.option(
    "--allow-unverified",
    is_flag=True,
    help="Write an export that is not the model its config.json describes (no config.json, sizes, names, dtype or "
    "tied embeddings that disagree with the tensors, or a failed transformers load) anyway; marked unverified.",
)
@click.option(
    "--max-load-size",
    default="16GB",
    show_default=True,
    metavar="SIZE",
    help="Where transformers is installed, load the export with it (a child process, on CPU, the whole model in "
    "memory) as part of verifying it, up to this size of tensors; 0: never.",
)
@click.option(
    "--engine",
    type=click.Choice(["auto", "stream", "torch"]),
    default="auto",
    show_default=True,
    help="stream: copy tensor bytes from the shards without torch; torch: load them with torch (needs the torch "
    "extra); auto: stream, falling back to torch for what streaming cannot do exactly.",
)
@click.option(
    "--weights",
    type=click.Choice(["fp32", "module"]),
    default=None,
    help="DeepSpeed ZeRO checkpoints: the fp32 master weights from the optimizer partitions, what zero_to_fp32 "
    "rebuilds (the default), or the module's own (16-bit) weights from the model states (ZeRO 1/2 only). An HF "
    "Trainer checkpoint exports its HF weights unless this is given.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document to stdout.")
@catalog_option
@click.pass_context
def export_command(
    ctx,
    step_dir,
    to,
    dtype,
    force,
    role,
    max_shard_size,
    no_verify,
    allow_corrupt,
    allow_unverified,
    max_load_size,
    engine,
    weights,
    check_dir,
    hf_config,
    jobs,
    ray_address,
    as_json,
    catalog,
) -> None:
    """Merge a checkpoint's FSDP shards or Megatron dist_ckpt into a HuggingFace model directory.

    Handles Shard(0)/Shard(1) DTensors, uneven and empty shards, HSDP (one replica is read), world size 1
    plain tensors and tied embeddings; copies config, generation config and tokenizer from huggingface/.
    LoRA adapters go to lora_adapter/ beside the model, NOT fused. A Megatron dist_ckpt (verl's model/dist_ckpt,
    or the pre-v2 dist_ckpt/) is merged by its chunks' global offsets (any TP/PP/EP layout), its fused QKV and
    gate/up split and its experts renamed for the architecture config.json names (Llama, Mistral, Qwen2, Qwen3,
    Qwen2-MoE, Qwen3-MoE, Mixtral); lm_head is kept or dropped as config.json ties the embeddings, and a
    checkpoint that disagrees is refused. HF weights verl's bridge saved beside it must equal it. DeepSpeed ZeRO
    1/2/3 checkpoints (a global_stepN tag dir, or a save dir or HF Trainer checkpoint whose `latest` names one)
    export what zero_to_fp32 rebuilds, without torch or DeepSpeed (--weights).

    --check HF_DIR writes nothing: the HF directory is compared with the checkpoint (what `export` would write)
    and the command exits 0 when they are the same model, 1 naming the first differences.

    Before writing anything: --to must not be, contain or sit inside a checkpoint, run or scanned root (the
    source's, the catalog's, or one found inside an existing --to). Copies tensor bytes from the shards in
    fixed-size blocks (no torch; each storage checked against its CRC-32 as it is copied) into a hidden sibling
    directory while the source's files are re-read in full beside it (CRCs, and hashes against the catalog's
    manifest), reads every tensor back and compares it with what was written, writes the marker
    .ckpt-audit-export.json and, only once the source check passed, renames it into place. The export (file hashes,
    source checkpoint, how the source was checked, any override) is recorded in the catalog. --engine torch is the
    torch-based merge the stream is tested against.

    The export must be the model its config.json describes, checked without torch: config.json present, every
    tensor the config implies there with its shape, none it does not, no floating tensor the config's dtype would round,
    lm_head.weight present iff the embeddings are not tied. Where transformers is installed, the export is also
    loaded with it (from_pretrained on CPU, in a child process; up to --max-load-size) and its weights compared with
    the exported tensors; the output says whether that load ran. Otherwise it is refused, or with
    --allow-unverified written and marked unverified.

    Exit codes: 0 exported, 1 refused: the source failed its check (see --allow-corrupt) or the export is not the
    model its config.json describes (see --allow-unverified), 2 usage, or --to
    refused (would touch a checkpoint, run or root; exists without --force; --force onto something that is not
    an earlier export or an empty directory; with --ray: a node does not see --to or the checkpoint as this
    process does, or the ray extra is missing), 3 error (unreadable or unsupported checkpoint, verification
    failed, catalog unusable, the export could not be written, a Ray task failed or died, the Ray cluster
    cannot be reached), 4 another run holds the catalog lock, 130
    interrupted. Nothing is left written when it refuses or fails.

    \b
    Example:
        ckpt-audit export /ckpts/p/e/global_step_400 --to ./hf-step400
        ckpt-audit export /ckpts/p/e/global_step_400 --to ./hf --dtype bf16 --max-shard-size 2GB --force
        ckpt-audit export ./out/checkpoint-500 --weights fp32 --to ./hf-fp32
        ckpt-audit export /shared/ckpts/p/e/global_step_400 --to /shared/hf --max-shard-size 2GB --ray
    """
    from ckpt_audit.session.export_terms import ExportError, ExportRefused
    from ckpt_audit.units import parse_size

    if check_dir is not None:
        if ray_address is not None:
            raise click.UsageError("--check reads only; it takes no --ray")
        if to is not None:
            raise click.UsageError("--check compares an existing directory; it takes no --to")
        _check(ctx, step_dir, check_dir, role=role, hf_config=hf_config, weights=weights, as_json=as_json)
        return
    if to is None:
        raise click.UsageError("Missing option '--to' (or --check HF_DIR)")

    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-shard-size") from None
    try:
        load_bytes = parse_size(max_load_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-load-size") from None
    runner = None
    if ray_address is not None:
        if engine == "torch":
            raise click.UsageError("--ray writes with the stream engine; it takes no --engine torch")
        engine = "stream"  # a fallback to torch would run here, not on the cluster
        explicit = ctx.get_parameter_source("jobs") is not click.core.ParameterSource.DEFAULT
        runner = _ray_runner(ctx, ray_address, jobs if explicit else None)
    bar = Bar("exporting", enabled=not as_json)
    try:
        with session(ctx, (), catalog) as s:  # the catalog's lock, as every other command that writes it
            result = s.export(
                step_dir,
                to,
                dtype=dtype,
                force=force,
                role=role,
                max_shard_size=shard_bytes,
                verify=not no_verify,
                allow_corrupt=allow_corrupt,
                allow_unverified=allow_unverified,
                max_load_size=load_bytes,
                progress=bar,
                engine=engine,
                weights=weights,
                hf_config=hf_config,
                jobs=jobs,
                run_files=runner,
            )
    except ExportRefused as exc:
        bar.close()
        click.echo(f"ckpt-audit: error: {exc}", err=True)
        ctx.exit(int(ExitCode.USAGE if exc.about == "destination" else ExitCode.FINDINGS))
    except ExportError as exc:
        raise CommandError(str(exc)) from None
    finally:
        bar.close()

    for w in result.warnings:
        click.echo(f"ckpt-audit: warning: {w}", err=True)
    ray = {} if runner is None else {"ray": {"nodes": dict(sorted(runner.nodes.items()))}}  # files each node wrote
    if as_json:
        emit_json({"command": "export", **result.to_dict(), "export_id": result.export_id, **ray})
    else:
        from ckpt_audit.models import format_size

        click.echo(
            f"exported {result.tensors} tensors ({format_size(result.total_bytes)}, {result.dtype}) from "
            f"{result.role_dir} to {result.out_dir}; {_checked(result)}"
        )
        for f in result.files:
            click.echo(f"  {f.hash}  {format_size(f.size_bytes):>10}  {f.path}")
        if ray:
            nodes = ", ".join(f"{n[:8]} ({k})" for n, k in ray["ray"]["nodes"].items())
            click.echo(f"weight files written on Ray nodes: {nodes}")
    ctx.exit(int(ExitCode.OK))


def _ray_runner(ctx, address: str, jobs: int | None):
    """export --ray's writer, connected before the catalog is touched: the extra missing is one line, exit 2; the
    cluster unreachable one line, exit 3."""
    from ckpt_audit.session import SessionError
    from ckpt_audit.session.cluster import RayUnavailable, export_runner

    try:
        return export_runner(address, jobs=jobs)
    except RayUnavailable as exc:
        click.echo(f"ckpt-audit: export {exc}", err=True)
        ctx.exit(int(ExitCode.USAGE))
    except SessionError as exc:
        raise CommandError(str(exc)) from None


def _check(ctx, step_dir, hf_dir, *, role, hf_config, weights, as_json) -> None:
    """`export --check`: reads only, so no catalog lock."""
    from ckpt_audit.session.export_terms import ExportError, check_export

    try:
        report = check_export(step_dir, hf_dir, role=role, hf_config=hf_config, weights=weights)
    except ExportError as exc:
        raise CommandError(str(exc)) from None
    if as_json:
        emit_json({"command": "export-check", **report.to_dict()})
    elif report.same:
        click.echo(f"{report.hf_dir} is the model in {report.source}: {report.tensors} tensors equal bit for bit")
    else:
        click.echo(f"{report.hf_dir} differs from the model in {report.source}:")
        for line in report.differences[:20]:
            click.echo(f"  {line}")
        if len(report.differences) > 20:
            click.echo(f"  ... and {len(report.differences) - 20} more")
    ctx.exit(int(ExitCode.OK if report.same else ExitCode.FINDINGS))


def _checked(result) -> str:
    """What "verified" rests on, in words (the JSON says it as read_back, source_check and override)."""
    source = {
        "manifest": "source re-read and equal to the catalog's manifest",
        "crc-only": "source re-read, checked by CRC only (not in the catalog, or changed since its last "
        "scan: scan it first)",
        "none": "source NOT checked (no catalog manifest and no CRCs to check)",
    }[result.source_check]
    if result.override:
        source = f"source FAILED its check, exported with --{result.override}"
    back = "read back equal to the shards" if result.read_back else "not read back (--no-verify)"
    if result.model_check == "failed":
        model = "NOT the model config.json describes, exported with --allow-unverified"
    else:
        model = "config.json agrees with the tensors"
    return f"{back}; {source}; {model}; {result.model_load}"
