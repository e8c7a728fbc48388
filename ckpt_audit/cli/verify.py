"""`ckpt-audit verify`: scan plus deep checks across ranks; recorded in the catalog like scan."""

from __future__ import annotations

from pathlib import Path

import click

from ckpt_audit.cli.scan import run_scan, scan_options


@click.command("verify")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@scan_options
@click.option(
    "--trust-cache",
    is_flag=True,
    help="Reuse the recorded hash and CRC verdict of files whose stat is unchanged instead of re-reading "
    "them (faster; blind to bit rot under an unchanged stat).",
)
@click.pass_context
def verify_command(ctx: click.Context, paths, trust_cache, rehash, **options) -> None:
    """Deep-check checkpoints under PATH... (step directories, runs or roots) and record them in the catalog.

    Everything `scan` does, plus: every rank's shards are loaded with torch.load(weights_only=True,
    map_location="cpu"; mmap for zip files, not for legacy ones) after the restricted unpickler has vetted their
    globals (a file asking for anything else is an unsafe-pickle error and is never loaded), and compared across
    ranks: key sets, DTensor placements and
    meshes against fsdp_config.json, local shapes tiling each global shape, HSDP replicas, tied embeddings,
    optimizer state against the parameters, step and param_groups, lr_scheduler.last_epoch against the step, RNG
    streams, data.pt. Megatron dist_ckpt and plain DCP directories: .metadata files, byte ranges and chunk tiling.
    safetensors headers anywhere in a checkpoint.

    Every file is re-read by content (hash and CRC-32, as `restic check --read-data` does), whatever its stat says:
    content that changed under an unchanged stat is hash-drift. `--trust-cache` reuses the catalog's verdicts for
    unchanged files instead.

    Exit codes: 0 clean, 1 findings at/above --fail-on, 2 usage, 3 error (bad path or catalog), 4 another run holds
    the catalog lock.

    \b
    Example:
        ckpt-audit verify /ckpts/proj/exp/global_step_40
        ckpt-audit verify --json /ckpts/proj/exp | jq '.runs[].checkpoints[].findings'
        ckpt-audit verify -q --fail-on warning /ckpts      # cron: mail only when something is wrong
        ckpt-audit verify --trust-cache /ckpts/proj/exp    # deep checks only; reuse the cached hashes
        ckpt-audit verify --junit-xml verify.xml /ckpts/proj/exp   # CI: one test case per checkpoint
    """
    if trust_cache and rehash:
        raise click.UsageError("--trust-cache and --rehash contradict each other: pick one")
    run_scan(ctx, paths, deep=True, rehash=not trust_cache, **options)
