"""`ckpt-audit verify`: scan plus deep checks across ranks; recorded in the catalog like scan."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ckpt_audit.cli.common import CommandError, catalog_option, emit_json, resolve_catalog
from ckpt_audit.exitcodes import ExitCode


@click.command("verify")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (with schema_version) to stdout.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing when clean; else only the failing findings.")
@click.option("--fail-on", type=click.Choice(["info", "warning", "error"]), default="error", show_default=True,
              help="Exit 1 when a finding at or above this severity is present.")
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True, help="Reader threads.")
@click.option("--in-progress-window", type=click.FloatRange(0), default=300.0, show_default=True, metavar="SECONDS",
              help="An uncommitted checkpoint written this recently is in-progress, not broken.")
@catalog_option
@click.pass_context
def verify_command(ctx: click.Context, paths, as_json, quiet, fail_on, workers, in_progress_window, catalog) -> None:
    """Deep-check checkpoints under PATH... (step directories, runs or roots) and record them in the catalog.

    Everything `scan` does, plus: every rank's shards are loaded with torch.load(weights_only=True, mmap=True,
    map_location="cpu") after the restricted unpickler has vetted their globals (a file asking for anything else is
    an unsafe-pickle finding and is never loaded), and compared across ranks: key sets, DTensor placements and
    meshes against fsdp_config.json, local shapes tiling each global shape, HSDP replicas, tied embeddings,
    optimizer state against the parameters, step and param_groups, lr_scheduler.last_epoch against the step, RNG
    streams, data.pt. Megatron dist_ckpt and plain DCP directories: .metadata files, byte ranges and chunk tiling.
    safetensors headers anywhere in a checkpoint. Per-file cost: tensor bytes are not read.

    Exit codes: 0 clean, 1 findings at/above --fail-on, 2 usage, 3 error (bad path or catalog), 4 another run holds
    the catalog lock.

    \b
    Example:
        ckpt-audit verify /ckpts/proj/exp/global_step_40
        ckpt-audit verify --json /ckpts/proj/exp | jq '.runs[].checkpoints[].findings'
        ckpt-audit verify -q --fail-on warning /ckpts      # cron: mail only when something is wrong
    """
    from ckpt_audit import lock, report, scanner
    from ckpt_audit.catalog.manifest import CatalogError, probe, read_previous
    from ckpt_audit.cli.scan import _progress
    from ckpt_audit.verify import verify

    threshold = report.FAIL_ON[fail_on]
    try:
        for p in paths:
            scanner.check_root(p)
    except scanner.ScanError as exc:
        raise CommandError(str(exc)) from None
    cat_path = resolve_catalog(catalog)
    try:
        probe(cat_path)
        with lock.hold(lock.lock_path_for(cat_path)):
            previous = read_previous(cat_path)
            with _progress(enabled=not as_json and not quiet) as progress:
                result = verify(list(paths), workers=workers, previous=previous, progress=progress,
                                in_progress_window_s=in_progress_window)
            from ckpt_audit.catalog import open_catalog

            with open_catalog(cat_path) as cat:
                scan_id = cat.record_scan(result)
    except CatalogError as exc:
        raise CommandError(str(exc)) from None
    except scanner.ScanError as exc:
        raise CommandError(str(exc)) from None
    except lock.Locked as exc:
        click.echo(f"ckpt-audit: {exc}", err=True)
        ctx.exit(int(ExitCode.LOCKED))
    code = ExitCode.FINDINGS if report.failing(result, threshold) else ExitCode.OK
    if as_json:
        doc = report.scan_document(result, scan_id=scan_id, catalog=os.fspath(cat_path), exit_code=int(code))
        emit_json({**doc, "command": "verify", "deep": True})
    else:
        for line in report.render_text(result, quiet=quiet, fail_on=threshold):
            click.echo(line)
    ctx.exit(int(code))
